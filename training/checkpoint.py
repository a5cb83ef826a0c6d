"""Checkpoints with torch.distributed.checkpoint (DCP), committed and verified.

Layout: <root>/step-<N>/ holds DCP's files, then `manifest.json` (SHA-256 of every file,
the run id and step, HMAC-SHA256 under a key derived from the run key), then `COMMITTED`
(written last, by atomic rename). A directory without a valid marker is torn and never
loaded. DCP's metadata is a pickle: nothing is handed to DCP before the manifest verifies.

Saves are asynchronous. `save` only deep-copies the state's plain values and hands its
tensors to a writer thread, which first copies them into CPU buffers kept from the
previous save (a `Snapshot`: no allocation), then runs DCP (its planning is a collective
on a dedicated gloo group, where ranks wait for each other) and the writes. The training
loop calls `fence` before it next changes any state tensor (the gradient sync, the
optimizer step), so the copy overlaps the next forward and backward pass; the loop waits
only if the copy is not done by then. Rank 0 commits when every rank's write is done and
then prunes to `keep` committed checkpoints. Never overwrites a committed step.
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import hmac
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from training.codec import derive_key
from training.errors import CheckpointError

# DCP reports write failures as OSError, torch.save's RuntimeError, or its own
# CheckpointException (a BaseException subclass)
WRITE_ERRORS = (OSError, RuntimeError, CheckpointException)
MARKER = "COMMITTED"
MANIFEST = "manifest.json"
PREFIX = "step-"


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def _digest_files(d: Path) -> dict[str, str]:
    out = {}
    for f in sorted(d.rglob("*")):
        if f.is_file() and f.name not in (MARKER, MANIFEST) and not f.name.endswith(".tmp"):
            out[str(f.relative_to(d))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Checkpointer:
    root: Path
    run_id: str
    run_key: bytes
    keep: int
    rank: int
    group: Any = None
    """Process group for DCP's collectives (a dedicated gloo group)."""
    pending: concurrent.futures.Future[Any] | None = None
    pending_dir: Path | None = None
    log: list[str] = field(default_factory=list)
    """Human-readable notes (torn checkpoints skipped, ...), for the launcher's report."""

    def __post_init__(self) -> None:
        # the state's structure never changes between saves: plan once, reuse
        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        self._snapshot = Snapshot()
        self._staged: tuple[threading.Event, int, float] | None = None
        """(copy taken, step, seconds save() took) of the save the loop has not fenced."""
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt")
        self._mac_key = derive_key(self.run_key, "checkpoint-manifest", 32)
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / ".write-probe"
                probe.write_text("ok")
                probe.unlink()
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint dir {self.root} is not writable "
                    f"({e.strerror}); fix its permissions or set "
                    "geotrain:training.checkpoint.dir"
                ) from None

    # -- save ---------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start an async save of `state` at `step`. Its tensors must not change until
        `fence()` returns."""
        t0 = time.perf_counter()
        self.wait()
        d = self.root / f"{PREFIX}{step}"
        if (d / MARKER).exists():
            raise CheckpointError(f"{d} is already committed; refusing to overwrite it")
        # no barrier: torn attempts were removed at startup (remove_torn), so every rank
        # can create the directory itself; DCP's planning is the only synchronisation
        d.mkdir(parents=True, exist_ok=True)
        snap, fill = self._snapshot.stage(state)
        copied = threading.Event()
        self.pending_dir = d
        self.pending = self._writer.submit(self._write, d, step, snap, fill, copied)
        self._staged = (copied, step, time.perf_counter() - t0)

    def fence(self) -> tuple[int, float] | None:
        """Block until the last save has its copy of the state; call before changing any
        state tensor. Returns, once per save, (its step, the seconds the caller waited for
        it: in save() and here); None when there is nothing to wait for."""
        if self._staged is None:
            return None
        copied, step, save_s = self._staged
        t0 = time.perf_counter()
        copied.wait()
        self._staged = None
        return step, save_s + time.perf_counter() - t0

    def _write(
        self,
        d: Path,
        step: int,
        snap: dict[str, Any],
        fill: Callable[[], None],
        staged: threading.Event,
    ) -> None:
        """On the writer thread: copy the state, DCP's collective planning and the file
        writes, then (rank 0, after every rank's write is done) manifest and marker."""
        try:
            fill()
        finally:
            staged.set()  # an error surfaces from wait(); the fence must not hang
        dcp.save(snap, checkpoint_id=str(d), process_group=self.group, planner=self._planner)
        if self.rank == 0:
            self._commit(d, step)

    def remove_torn(self) -> list[str]:
        """Rank 0, at startup: delete step directories without a commit marker (a save that
        died), so a later save of the same step starts clean. Returns what went."""
        gone = []
        if self.rank == 0:
            for p in self._dirs():
                if not (p / MARKER).exists():
                    shutil.rmtree(p, ignore_errors=True)
                    gone.append(p.name)
        dist.barrier(group=self.group)
        return gone

    def saving(self) -> bool:
        """Whether a save is still being written in the background."""
        return self.pending is not None and not self.pending.done()

    def wait(self) -> None:
        """Block until the in-flight save (and its commit on rank 0) is done."""
        if self.pending is not None:
            self._staged = None
            fut, self.pending = self.pending, None
            try:
                fut.result()
            except WRITE_ERRORS as e:
                raise self._write_error(self.pending_dir or self.root, e) from None

    def _write_error(self, where: Path, e: BaseException) -> CheckpointError:
        if self.rank == 0 and where.name.startswith(PREFIX) and not (where / MARKER).exists():
            shutil.rmtree(where, ignore_errors=True)  # the torn attempt only wastes space
        free = shutil.disk_usage(self.root).free if self.root.exists() else 0
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        full = " (disk full)" if free < 1 << 20 else ""
        return CheckpointError(
            f"checkpoint write under {where} failed{full}: {first}; "
            f"{free / 2**20:.1f} MiB free; the previous committed "
            "checkpoint is intact"
        )

    def _commit(self, d: Path, step: int) -> None:
        files = _digest_files(d)
        body = {"run_id": self.run_id, "step": step, "files": files}
        canon = json.dumps(body, sort_keys=True).encode()
        body["hmac"] = hmac.new(self._mac_key, canon, hashlib.sha256).hexdigest()
        _write_atomic(d / MANIFEST, json.dumps(body, indent=1, sort_keys=True))
        _write_atomic(d / MARKER, hashlib.sha256(canon).hexdigest() + "\n")
        self._prune()

    def _prune(self) -> None:
        committed = sorted((p for p in self._dirs() if (p / MARKER).exists()), key=step_of)
        for old in committed[: max(0, len(committed) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    # -- load ---------------------------------------------------------------------------
    def _dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [
            p
            for p in self.root.iterdir()
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
        ]

    def verify(self, d: Path) -> None:
        """Raise CheckpointError unless `d` is committed, authentic, of this run, complete."""
        if not (d / MARKER).exists():
            raise CheckpointError(f"{d} has no commit marker (torn save)")
        try:
            body = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
            mac = body.pop("hmac")
        except (OSError, ValueError, KeyError):
            raise CheckpointError(f"{d}: manifest missing or unreadable") from None
        canon = json.dumps(body, sort_keys=True).encode()
        good = hmac.new(self._mac_key, canon, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(good, mac):
            raise CheckpointError(
                f"{d}: manifest does not verify under this run's key (another run, or tampered)"
            )
        if body.get("run_id") != self.run_id:
            raise CheckpointError(
                f"{d} belongs to run {body.get('run_id')}, not "
                f"{self.run_id}; move it away or use that run's stack"
            )
        actual = _digest_files(d)
        for name, digest in body["files"].items():
            if name not in actual:
                raise CheckpointError(f"{d}: file {name} is missing")
            if actual[name] != digest:
                raise CheckpointError(f"{d}: file {name} is corrupt (digest mismatch)")
        extra = set(actual) - set(body["files"])
        if extra:
            raise CheckpointError(f"{d}: unexpected files {sorted(extra)}")

    def latest(self) -> Path | None:
        """Newest committed, verified checkpoint; torn or corrupt newer ones are reported
        in `log` and skipped."""
        for d in sorted(self._dirs(), key=step_of, reverse=True):
            try:
                self.verify(d)
                return d
            except CheckpointError as e:
                self.log.append(f"skipped {e}")
        return None

    def load(self, d: Path, state: dict[str, Any]) -> None:
        """Load verified `d` into `state` in place (tensors are filled, not replaced)."""
        self.verify(d)
        dcp.load(state, checkpoint_id=str(d), process_group=self.group)


class Snapshot:
    """A CPU copy of a nested state dict (dicts, lists, tuples; tensors and plain values)
    that reuses the previous copy's buffers while the structure is unchanged, so a save
    allocates nothing and copies each tensor once."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def stage(self, state: dict[str, Any]) -> tuple[dict[str, Any], Callable[[], None]]:
        """(the snapshot, with plain values copied now and the buffers in place of the
        tensors; the function that fills the buffers from the live tensors). The previous
        snapshot must no longer be in use."""
        tensors: list[torch.Tensor] = []
        _collect(state, tensors)

        def shapes(ts: list[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype]]:
            return [(t.shape, t.dtype) for t in ts]

        if shapes(tensors) != shapes(self._buffers):
            self._buffers = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        pairs = list(zip(self._buffers, tensors, strict=True))

        def fill() -> None:
            with torch.no_grad():
                for buf, t in pairs:
                    buf.copy_(t)

        return _rebuild(state, iter(self._buffers)), fill


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect(v, out)


def _rebuild(obj: Any, bufs: Any) -> Any:
    """`obj` with every tensor replaced by the next buffer (same walk order as _collect)
    and every other leaf copied, so later changes to the live state cannot leak in."""
    if isinstance(obj, torch.Tensor):
        return next(bufs)
    if isinstance(obj, dict):
        return {k: _rebuild(v, bufs) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_rebuild(v, bufs) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return copy.deepcopy(obj)
