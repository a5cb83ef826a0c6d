"""`geotrain data prepare`: tokenize a region's corpus, on the region's own hosts, into
token shards that training memory-maps (training.data.tokens).

The corpus streams through: files are read in pieces (a .txt file in ~1 MiB runs of lines,
a .parquet file by record batches), tokenized a batch of documents at a time and appended
to raw little-endian shards, so memory holds one batch, never the corpus. Documents are
separated by the tokenizer's end-of-document token when it has one. A deterministic ~
`eval_fraction` of whole documents (chosen by a seeded hash of their text, so duplicates
land in the same split) goes to the eval split instead.

Everything is written into a sibling temporary directory that is renamed into place at the
end: a failure leaves nothing half-written, and a prepared directory is only replaced when
asked (`overwrite=True`).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from training.data.tokenizer import TextTokenizer
from training.errors import DataError, OutputError, clip

FORMAT = "geotrain-tokens"
"""manifest.json's `format`."""
VERSION = 1
"""manifest.json's `version`; training.data.tokens refuses any other."""
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
"""The input formats, by file name ending."""
SHARD_TOKENS = 1 << 27
"""Tokens per shard: 256 MiB of uint16, small enough to copy and verify one at a time."""
BATCH_DOCS = 512
"""Documents (or .txt pieces) tokenized in one call."""
BATCH_CHARS = 8 << 20
"""...or fewer, once they hold this many characters: bounds the memory of one batch."""
PIECE_CHARS = 1 << 20
"""A .txt file is read in runs of whole lines of about this many characters."""
PARQUET_ROWS = 1024
"""Rows per record batch read from a .parquet file."""
_SUPPORTED = "use .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet"


@dataclass(frozen=True)
class Piece:
    """Text tokenized in one go: a whole document, or a run of lines of a .txt file."""

    text: str
    end: bool
    """Last piece of its document: the end-of-document token follows it."""
    held_out: bool
    """The document belongs to the eval split."""


def dtype_for(vocab_size: int) -> np.dtype[Any]:
    """uint16 while every id fits (vocab_size <= 65536), else uint32; little-endian."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def prepare(
    inputs: Iterable[str | Path],
    out_dir: str | Path,
    tokenizer: TextTokenizer,
    *,
    text_field: str = "text",
    eval_fraction: float = 0.01,
    shard_tokens: int = SHARD_TOKENS,
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize `inputs` (files, or directories searched recursively) into `out_dir` and
    return its manifest (also written as out_dir/manifest.json)."""
    if not 0 <= eval_fraction < 1:
        raise DataError(f"eval_fraction {eval_fraction} is outside [0, 1); use e.g. 0.01")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens {shard_tokens} must be at least 1")
    out = Path(out_dir)
    _check_out(out, overwrite)
    files = find_inputs(inputs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()  # not mkdtemp: its 0700 would hide the data from a worker's user
    except OSError as e:
        raise OutputError(f"cannot create {e.filename or out}: {e.strerror or e}") from None
    try:
        run = _Run(tokenizer, dtype_for(tokenizer.vocab_size), text_field, eval_fraction, seed)
        manifest = run.write(files, tmp, shard_tokens)
        _write_json(tmp / "manifest.json", manifest)
        _install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def find_inputs(inputs: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """(file, name recorded in the manifest) for every input file, directories expanded
    recursively in sorted order; hidden files (.name) inside directories are skipped."""
    found: dict[Path, tuple[Path, str]] = {}
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            base = path.resolve().name
            files = sorted(
                p
                for p in path.rglob("*")
                if not any(part.startswith(".") for part in p.relative_to(path).parts)
                and not p.is_dir()
            )
            if not files:
                raise DataError(f"input directory {path} holds no files; {_SUPPORTED}")
            pairs = [(f, f"{base}/{f.relative_to(path).as_posix()}") for f in files]
        elif path.exists() or path.is_symlink():
            pairs = [(path, path.name)]
        else:
            raise DataError(f"input {path}: no such file or directory; check the path")
        for file, name in pairs:
            if not file.name.endswith(SUFFIXES):
                raise DataError(f"{file}: unsupported file type; {_SUPPORTED}")
            found.setdefault(file.resolve(), (file, name))
    if not found:
        raise DataError(f"no input files given; {_SUPPORTED}")
    return list(found.values())


class ShardWriter:
    """Appends token ids to `<prefix>-00000.bin`, `<prefix>-00001.bin`, ... of at most
    `shard_tokens` tokens each, hashing as it writes."""

    def __init__(self, root: Path, prefix: str, dtype: np.dtype[Any], shard_tokens: int):
        self.root, self.prefix, self.dtype, self.shard_tokens = root, prefix, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.tokens = 0
        self._fh: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            if self._fh is None:
                # open across write() calls, closed by _finish (prepare removes the dir on error)
                name = f"{self.prefix}-{len(self.shards):05d}.bin"
                self._fh = open(self.root / name, "wb")  # noqa: SIM115
                self._hash, self._count = hashlib.sha256(), 0
            take = min(ids.size, self.shard_tokens - self._count)
            raw = ids[:take].astype(self.dtype, copy=False).tobytes()
            self._fh.write(raw)
            self._hash.update(raw)
            self._count += take
            self.tokens += take
            ids = ids[take:]
            if self._count == self.shard_tokens:
                self._finish()

    def close(self) -> list[dict[str, Any]]:
        self._finish()
        return self.shards

    def _finish(self) -> None:
        fh, self._fh = self._fh, None
        if fh is None:
            return
        fh.flush()
        os.fsync(fh.fileno())  # the rename that publishes the dir must not outrun the data
        fh.close()
        name = Path(fh.name).name
        self.shards.append({"file": name, "tokens": self._count, "sha256": self._hash.hexdigest()})


class _Run:
    """One prepare: reads documents, tokenizes them in batches, writes both splits."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        dtype: np.dtype[Any],
        text_field: str,
        eval_fraction: float,
        seed: int,
    ) -> None:
        self.tok, self.dtype, self.field = tokenizer, dtype, text_field
        self.threshold = int(eval_fraction * 2**64)  # held out when hash64 < threshold
        self.salt = hashlib.sha256(str(seed).encode()).digest()[:16]
        self.documents = {"train": 0, "eval": 0}
        self._open = 0  # tokens of the document being written, for its end token

    def write(self, files: list[tuple[Path, str]], root: Path, shard_tokens: int) -> dict[str, Any]:
        self.train = ShardWriter(root, "train", self.dtype, shard_tokens)
        self.eval = ShardWriter(root, "eval", self.dtype, shard_tokens)
        recorded = []
        for path, name in files:
            digest, size = _file_digest(path)
            before = sum(self.documents.values())
            self._tokenize(self._pieces(path, digest))
            docs = sum(self.documents.values()) - before
            recorded.append({"path": name, "sha256": digest, "bytes": size, "documents": docs})
        try:
            shards, held = self.train.close(), self.eval.close()
        except OSError as e:
            raise OutputError(f"cannot write {e.filename or root}: {e.strerror or e}") from None
        if not self.train.tokens:
            names = ", ".join(str(p) for p, _ in files)
            raise DataError(
                f"{clip(names, 120)}: no training tokens (empty corpus, or every document "
                "held out); give inputs with text or lower eval_fraction"
            )
        return self._manifest(recorded, shards, held)

    def _manifest(
        self, inputs: list[dict[str, Any]], shards: list[dict[str, Any]], held: list[Any]
    ) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": {
                "digest": self.tok.digest,
                "vocab_size": self.tok.vocab_size,
                "eos_id": self.tok.eos_id,
            },
            "dtype": self.dtype.name,
            "text_field": self.field,
            "eval_fraction": self.threshold / 2**64,
            "inputs": inputs,
            "shards": shards,
            "eval": held,
            "tokens": {"train": self.train.tokens, "eval": self.eval.tokens},
            "documents": dict(self.documents),
        }

    def _held_out(self, key: bytes) -> bool:
        h = hashlib.blake2b(key, digest_size=8, key=self.salt).digest()
        return int.from_bytes(h, "little") < self.threshold

    def _pieces(self, path: Path, digest: str) -> Iterator[Piece]:
        if path.name.endswith(".txt"):
            held = self._held_out(bytes.fromhex(digest))  # a .txt file is one document
            for text, end in _txt_pieces(path):
                yield Piece(text, end, held)
        else:
            for text in _records(path, self.field):
                yield Piece(text, True, self._held_out(text.encode("utf-8", "surrogatepass")))

    def _tokenize(self, pieces: Iterator[Piece]) -> None:
        batch: list[Piece] = []
        chars = 0
        for piece in pieces:
            batch.append(piece)
            chars += len(piece.text)
            if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                self._flush(batch)
                batch, chars = [], 0
        self._flush(batch)

    def _flush(self, batch: list[Piece]) -> None:
        if not batch:
            return
        encoded = self.tok.encode_batch([p.text for p in batch])
        try:
            for piece, ids in zip(batch, encoded, strict=True):
                self._append(piece, ids)
        except OSError as e:
            raise OutputError(
                f"cannot write {e.filename or 'a shard'}: {e.strerror or e}"
            ) from None

    def _append(self, piece: Piece, ids: list[int]) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.tok.vocab_size):
            raise DataError(
                f"tokenizer {self.tok.digest[:12]} produced id {int(arr.max())} outside its "
                f"vocab of {self.tok.vocab_size}; the tokenizer file is inconsistent"
            )
        writer = self.eval if piece.held_out else self.train
        writer.write(arr)
        self._open += arr.size
        if piece.end and self._open:  # an empty document leaves no trace, not a lone EOS
            if self.tok.eos_id is not None:
                writer.write(np.asarray([self.tok.eos_id], dtype=np.int64))
            self.documents["eval" if piece.held_out else "train"] += 1
            self._open = 0


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Failures to read or decompress `path` as one DataError line naming it."""
    try:
        yield
    except OSError as e:  # missing, permissions, a bad gzip header, a directory
        why = e.strerror or str(e)
        raise DataError(
            f"{path}: cannot read it ({clip(why, 80)}); fix it or leave it out"
        ) from None
    except (EOFError, zlib.error) as e:
        raise DataError(
            f"{path}: truncated or corrupt ({clip(str(e), 60)}); recompress it"
        ) from None
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a chunk); convert it to UTF-8"
        ) from None


def _file_digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with _reading(path), open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _txt_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """(run of whole lines, is the last) of a UTF-8 text file, ~PIECE_CHARS each; a line
    longer than that is cut. Newlines are kept as they are (newline="")."""
    with _reading(path), open(path, encoding="utf-8", newline="") as fh:
        prev = None
        while chunk := fh.read(PIECE_CHARS):
            if not chunk.endswith("\n"):
                chunk += fh.readline(PIECE_CHARS)
            if prev is not None:
                yield prev, False
            prev = chunk
        if prev is not None:
            yield prev, True


def _records(path: Path, field: str) -> Iterator[str]:
    if path.name.endswith(".parquet"):
        yield from _parquet(path, field)
    else:
        yield from _jsonl(path, field)


def _jsonl(path: Path, field: str) -> Iterator[str]:
    fix = f"make each line a JSON object with a string {field!r} (or pass --text-field)"
    with _reading(path), _open_jsonl(path) as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                why = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                raise DataError(f"{path}:{lineno}: not JSON ({clip(why, 60)}); {fix}") from None
            if not isinstance(record, dict) or field not in record:
                raise DataError(f"{path}:{lineno}: no field {field!r}; {fix}")
            text = record[field]
            if not isinstance(text, str):
                kind = type(text).__name__
                raise DataError(
                    f"{path}:{lineno}: field {field!r} is a {kind}, not a string; {fix}"
                )
            yield text


def _open_jsonl(path: Path) -> io.BufferedIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        return io.BufferedReader(_ZstdStream(open(path, "rb"), path), buffer_size=1 << 16)
    return open(path, "rb")


class _ZstdStream(io.RawIOBase):
    """Every frame of a .zst file, decompressed. A file that ends inside a frame is an
    error: zstandard's stream_reader would just stop there, silently dropping the tail."""

    def __init__(self, raw: BinaryIO, path: Path) -> None:
        import zstandard

        self.raw, self.path = raw, path
        self.dctx = zstandard.ZstdDecompressor()
        self.frame = self.dctx.decompressobj()
        self.in_frame = False  # fed part of a frame that has not ended yet
        self.out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not self.out:
            chunk = self.raw.read(1 << 16)
            if not chunk:
                if self.in_frame:
                    raise DataError(
                        f"{self.path}: truncated zstd (its last frame is cut off); recompress it"
                    )
                return 0
            self.out = memoryview(self._decompress(chunk))
        n = min(len(buf), len(self.out))
        buf[:n] = self.out[:n]
        self.out = self.out[n:]
        return n

    def _decompress(self, chunk: bytes) -> bytes:
        import zstandard

        parts = []
        while chunk:
            try:
                parts.append(self.frame.decompress(chunk))
            except zstandard.ZstdError as e:
                raise DataError(
                    f"{self.path}: corrupt zstd ({clip(str(e), 60)}); recompress it"
                ) from None
            self.in_frame = not self.frame.eof
            chunk = b""
            if self.frame.eof:  # the next frame starts in what this one left over
                chunk = self.frame.unused_data
                self.frame = self.dctx.decompressobj()
        return b"".join(parts)

    def close(self) -> None:
        self.raw.close()
        super().close()


def _parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with _reading(path):
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
            if field not in schema.names:
                columns = ", ".join(schema.names) or "none"
                raise DataError(
                    f"{path}: no column {field!r} (columns: {clip(columns, 80)}); pass "
                    "--text-field with the text column"
                )
            kind = schema.field(field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise DataError(
                    f"{path}: column {field!r} is {kind}, not a string; pick a text column"
                )
            row = 0
            for batch in pf.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
                for text in batch.column(0).to_pylist():
                    if text is None:
                        raise DataError(
                            f"{path}: row {row} has no {field!r} (null); drop it or fill it"
                        )
                    row += 1
                    yield text
    except pa.ArrowException as e:
        raise DataError(
            f"{path}: not a readable parquet file ({clip(str(e), 60)}); rewrite it"
        ) from None


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse to write over a file, a directory geotrain did not prepare, or (unless
    `overwrite`) a prepared one."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file; name a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / "manifest.json").is_file():
        raise OutputError(
            f"--out {out} holds files that are not prepared data (no manifest.json); it is "
            "never replaced, name a new or empty directory"
        )
    if not overwrite:
        raise OutputError(
            f"--out {out} already holds prepared data; pass --overwrite to replace it"
        )


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished `tmp` to `out`. A prepared `out` is first renamed aside, then
    removed: a crash in between leaves it whole beside out (as .<name>.old-*)."""
    try:
        if out.is_dir() and any(out.iterdir()):
            _check_out(out, overwrite)  # again: another prepare may have filled it meanwhile
            old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)  # onto an absent or empty directory
    except OSError as e:
        raise OutputError(f"cannot move the prepared data to {out}: {e.strerror or e}") from None


def _write_json(path: Path, body: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(body, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
