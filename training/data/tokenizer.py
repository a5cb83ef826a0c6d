"""Text tokenizers for `geotrain data prepare`: UTF-8 bytes, or a Hugging Face tokenizer.json.

A tokenizer is known by its digest (sha256 of the tokenizer.json bytes; "bytes" for the
byte tokenizer): a prepared directory records it, and training refuses a model whose
tokenizer's digest differs (training.data.tokens.TokenLoader.check_tokenizer).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

from training.errors import DataError, clip

BYTES = "bytes"
"""The reference and the digest of the byte tokenizer."""
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""End-of-document tokens looked for, in order, when no tokenizer_config.json names one."""
_FIX = "give --tokenizer bytes, a tokenizer.json, or a model directory holding one"


class TextTokenizer(Protocol):
    """What prepare needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def digest(self) -> str: ...
    @property
    def eos_id(self) -> int | None: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocab 256, no end-of-document token)."""

    vocab_size = 256
    digest = BYTES
    eos_id: int | None = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json. Documents are encoded without the
    post-processor's special tokens (no BOS per document); prepare separates documents with
    `eos_id` instead."""

    def __init__(self, path: Path, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer

        try:
            raw = path.read_bytes()
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except OSError as e:
            raise DataError(
                f"tokenizer {path}: cannot read it ({e.strerror or e}); {_FIX}"
            ) from None
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise DataError(
                f"tokenizer {path} is not a Hugging Face tokenizer.json "
                f"({clip(str(e), 80)}); {_FIX}"
            ) from None
        self.path = path
        self.digest = hashlib.sha256(raw).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._find_eos(eos_token)

    def _find_eos(self, name: str | None) -> int | None:
        if name is not None:
            found = self._tok.token_to_id(name)
            if found is None:
                raise DataError(
                    f"tokenizer {self.path} has no token {name!r} (its eos_token); fix "
                    "tokenizer_config.json or the tokenizer"
                )
            return int(found)
        for candidate in EOS_CANDIDATES:
            found = self._tok.token_to_id(candidate)
            if found is not None:
                return int(found)
        return None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encoded = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encoded]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))


def tokenizer_for(model: str, tokenizer: str | None) -> str:
    """The tokenizer a run uses: the one it names; unset, an `hf:` model directory's
    tokenizer.json when it has one, else bytes (what the presets embed)."""
    if tokenizer is not None:
        return tokenizer
    if model.startswith("hf:") and (Path(model[3:]) / "tokenizer.json").is_file():
        return model[3:]
    return BYTES


def load_tokenizer(ref: str | Path | None) -> TextTokenizer:
    """None or "bytes": the byte tokenizer; a tokenizer.json file; or a directory holding
    tokenizer.json (a Hugging Face model directory, whose tokenizer_config.json may name
    the eos_token)."""
    if ref is None or str(ref) == BYTES:
        return ByteTokenizer()
    path = Path(ref)
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise DataError(f"tokenizer directory {path} holds no tokenizer.json; {_FIX}")
        return HFTokenizer(file, _configured_eos(path / "tokenizer_config.json"))
    if not path.exists():
        raise DataError(f"tokenizer {path}: no such file or directory; {_FIX}")
    return HFTokenizer(path)


def _configured_eos(config: Path) -> str | None:
    """The eos_token a model directory's tokenizer_config.json names, if any."""
    if not config.is_file():
        return None
    try:
        body = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(
            f"tokenizer config {config} is unreadable or not JSON ({clip(str(e), 60)}); "
            "fix or remove it"
        ) from None
    eos = body.get("eos_token") if isinstance(body, dict) else None
    if isinstance(eos, dict):  # {"content": "</s>", "lstrip": false, ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None
