"""Token shards written by `geotrain data prepare` (training.data.prepare), read back for
training: the shard uri `tokens:<dir>` names a prepared directory on the region's hosts.

The manifest and every shard are verified when opened (size, and sha256 read in chunks);
the shards are then memory-mapped read-only, never read whole. `TokenLoader` and
`MixtureLoader` have ByteLoader's interface (`next() -> (B, T+1) int64`, `drawn`, `gen`,
Position's state_dict), so they plug into the loop and its checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.data.loader import Position
from training.data.prepare import FORMAT, VERSION
from training.errors import DataError, clip

URI_PREFIX = "tokens:"
"""A data shard uri naming a prepared directory: `tokens:/data/eu-corpus`."""
DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""manifest.json's dtype -> the shards' little-endian item type."""
_SHARD_NAME = re.compile(r"(train|eval)-\d{5,}\.bin")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RERUN = "rerun geotrain data prepare"


def prepared_path(uri: str | Path) -> Path:
    """The directory a `tokens:<dir>` uri (or a plain path) names."""
    text = str(uri)
    return Path(text[len(URI_PREFIX) :] if text.startswith(URI_PREFIX) else text)


@dataclass(frozen=True)
class Shard:
    """One shard file as the manifest records it."""

    path: Path
    tokens: int
    sha256: str


@dataclass(frozen=True)
class Prepared:
    """A prepared directory: its manifest, checked, and its shards."""

    root: Path
    manifest: dict[str, Any]
    dtype: np.dtype[Any]
    train: list[Shard]
    eval: list[Shard]

    @property
    def digest(self) -> str:
        """The tokenizer's digest the data was prepared with."""
        return str(self.manifest["tokenizer"]["digest"])

    @staticmethod
    def open(uri: str | Path, verify: bool = True) -> Prepared:
        root = prepared_path(uri)
        body = _read_manifest(root)
        where = f"{root / 'manifest.json'}"
        try:
            dtype = DTYPES[body["dtype"]]
            train = [_shard(root, s) for s in body["shards"]]
            held = [_shard(root, s) for s in body["eval"]]
            tok = body["tokenizer"]
            if not isinstance(tok["digest"], str) or not isinstance(tok["vocab_size"], int):
                raise TypeError("tokenizer")
            for split, shards in (("train", train), ("eval", held)):
                if body["tokens"][split] != sum(s.tokens for s in shards):
                    raise ValueError(f"tokens.{split} is not the sum of its shards")
                if not isinstance(body["documents"][split], int):
                    raise TypeError(f"documents.{split}")
            if not isinstance(body["inputs"], list):
                raise TypeError("inputs")
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: malformed ({clip(str(e), 40)}); {_RERUN}") from None
        if not train:
            raise DataError(f"{where}: lists no training shards; {_RERUN}")
        prepared = Prepared(root, body, dtype, train, held)
        if verify:
            for shard in train + held:
                verify_shard(shard, dtype)
        return prepared


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / "manifest.json"
    if not path.is_file():
        raise DataError(f"{root} holds no manifest.json; {_RERUN} --out {root} first")
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable or not JSON ({clip(str(e), 60)}); {_RERUN}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} manifest; {_RERUN}")
    if body.get("version") != VERSION:
        raise DataError(
            f"{path}: version {_short(body.get('version'))}, this geotrain reads "
            f"{VERSION}; {_RERUN}"
        )
    return body


def _short(value: object) -> str:
    return clip(repr(value), 20)


def _shard(root: Path, entry: Any) -> Shard:
    name, tokens, digest = entry["file"], entry["tokens"], entry["sha256"]
    # a name, never a path: a manifest must not point outside its directory
    if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name):
        raise ValueError(f"shard file {_short(name)}")
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"{name} tokens {_short(tokens)}")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ValueError(f"{name} sha256")
    return Shard(root / name, tokens, digest)


def verify_shard(shard: Shard, dtype: np.dtype[Any]) -> None:
    """The shard's size is tokens x itemsize and its sha256 the manifest's (read in 1 MiB
    chunks)."""
    want = shard.tokens * dtype.itemsize
    h = hashlib.sha256()
    try:
        size = shard.path.stat().st_size
        if size != want:
            raise DataError(
                f"shard {shard.path} is {size} bytes, the manifest says {shard.tokens} tokens "
                f"x {dtype.itemsize} = {want}; it is truncated or replaced, copy it again or "
                f"{_RERUN}"
            )
        with open(shard.path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise DataError(
            f"shard {shard.path}: cannot read it ({e.strerror or e}); {_RERUN}"
        ) from None
    if h.hexdigest() != shard.sha256:
        raise DataError(
            f"shard {shard.path}: sha256 {h.hexdigest()[:12]}…, the manifest says "
            f"{shard.sha256[:12]}…; it is corrupt, copy it again or {_RERUN}"
        )


class TokenLoader(Position):
    """Random windows of T+1 tokens from a prepared directory's training shards; a window
    never crosses a shard boundary. Every valid window is equally likely."""

    def __init__(
        self, uri: str | Path, batch: int, seq_len: int, seed: int, *, verify: bool = True
    ) -> None:
        self.data = Prepared.open(uri, verify)
        self.uri, self.batch, self.seq_len, self.seed = str(uri), batch, seq_len, seed
        self.drawn = 0
        self.gen = torch.Generator()
        self.gen.manual_seed(seed)
        # mode "r": read-only pages, loaded on touch; a shard is never read whole
        self.maps = [np.memmap(s.path, dtype=self.data.dtype, mode="r") for s in self.data.train]
        starts = np.array([max(0, s.tokens - seq_len) for s in self.data.train], dtype=np.int64)
        self._ends = np.cumsum(starts)  # window k lies in the first shard whose end exceeds k
        self._starts = starts
        if not self._ends[-1]:
            longest = max(self.data.train, key=lambda s: s.tokens)
            raise DataError(
                f"shard {longest.path} holds {longest.tokens} tokens, fewer than a window of "
                f"seq_len + 1 = {seq_len + 1} (and it is the longest); lower seq_len or "
                "prepare more data"
            )

    def check_tokenizer(self, digest: str, vocab_size: int | None = None) -> None:
        """Refuse a model whose tokenizer is not the one the data was prepared with."""
        have = self.data.digest
        if digest != have:
            raise DataError(
                f"{self.uri}: prepared with tokenizer {have[:16]}, the model's is "
                f"{digest[:16]}; {_RERUN} with --tokenizer <the model's tokenizer>"
            )
        vocab = int(self.data.manifest["tokenizer"]["vocab_size"])
        if vocab_size is not None and vocab_size < vocab:
            raise DataError(
                f"{self.uri}: token ids reach {vocab - 1} but the model's vocab is "
                f"{vocab_size}; give the model a vocab of at least {vocab}"
            )

    def next(self) -> torch.Tensor:
        """(B, T+1) int64."""
        self.drawn += 1
        return self.windows(self.batch, self.gen)

    def windows(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """(n, T+1) int64 windows drawn with `gen`."""
        total = int(self._ends[-1])
        picks = torch.randint(0, total, (n,), generator=gen).numpy()
        shards = np.searchsorted(self._ends, picks, side="right")  # (n,)
        offsets = picks - (self._ends[shards] - self._starts[shards])
        rows = [
            self.maps[s][o : o + self.seq_len + 1] for s, o in zip(shards, offsets, strict=True)
        ]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def eval_batches(self, batch: int | None = None) -> Iterator[torch.Tensor]:
        """The eval split in order, as (<=B, T+1) int64 batches of windows that overlap by
        one token, so each token is a target once."""
        yield from _eval_batches(self, batch or self.batch)


def _eval_batches(loader: TokenLoader, batch: int) -> Iterator[torch.Tensor]:
    held, t = loader.data.eval, loader.seq_len
    if not held:
        raise DataError(f"{loader.uri} has no eval split; {_RERUN} with --eval-fraction above 0")
    if all(s.tokens < t + 1 for s in held):
        longest = max(held, key=lambda s: s.tokens)
        raise DataError(
            f"eval shard {longest.path} holds {longest.tokens} tokens, fewer than a window of "
            f"seq_len + 1 = {t + 1}; lower seq_len or raise --eval-fraction"
        )
    rows: list[np.ndarray] = []
    for shard in held:
        if shard.tokens < t + 1:
            continue
        mm = np.memmap(shard.path, dtype=loader.data.dtype, mode="r")
        for start in range(0, shard.tokens - t, t):  # window [start, start + T + 1)
            rows.append(np.asarray(mm[start : start + t + 1], dtype=np.int64))
            if len(rows) == batch:
                yield torch.from_numpy(np.stack(rows))
                rows = []
    if rows:
        yield torch.from_numpy(np.stack(rows))


class MixtureLoader(Position):
    """Batches mixing several prepared directories: each sequence's source is drawn by
    weight, and its window from that source, all with this loader's one generator (the
    sources' own generators are not used), so the position is `drawn` and `gen` alone."""

    def __init__(self, sources: Sequence[tuple[TokenLoader, float]], batch: int, seed: int):
        if not sources:
            raise DataError("a data mixture needs at least one source")
        weights = [float(w) for _, w in sources]
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(
                f"mixture weights {clip(str(weights), 60)} must be finite, >= 0 and not all 0"
            )
        first = sources[0][0]
        for src, _ in sources:
            if src.seq_len != first.seq_len or src.data.digest != first.data.digest:
                raise DataError(
                    f"mixture sources {first.uri} and {src.uri} differ in seq_len or tokenizer; "
                    "prepare every source with the model's tokenizer"
                )
        self.sources = [src for src, _ in sources]
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.batch, self.seq_len, self.seed = batch, first.seq_len, seed
        self.drawn = 0
        self.gen = torch.Generator()
        self.gen.manual_seed(seed)

    def check_tokenizer(self, digest: str, vocab_size: int | None = None) -> None:
        for src in self.sources:
            src.check_tokenizer(digest, vocab_size)

    def next(self) -> torch.Tensor:
        """(B, T+1) int64."""
        pick = torch.multinomial(self.weights, self.batch, replacement=True, generator=self.gen)
        out = torch.empty(self.batch, self.seq_len + 1, dtype=torch.int64)
        for i, src in enumerate(self.sources):
            rows = (pick == i).nonzero().flatten()
            if rows.numel():
                out[rows] = src.windows(rows.numel(), self.gen)
        self.drawn += 1
        return out

    def eval_batches(self, batch: int | None = None) -> Iterator[torch.Tensor]:
        """Each source's eval split in turn (sources without one are skipped)."""
        held = [src for src in self.sources if src.data.eval]
        if not held:
            raise DataError(
                f"no mixture source has an eval split; {_RERUN} with --eval-fraction above 0"
            )
        for src in held:
            yield from src.eval_batches(batch or self.batch)
