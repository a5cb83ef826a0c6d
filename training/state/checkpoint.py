"""Checkpoints with torch.distributed.checkpoint (DCP), per node, committed and verified.

Layout: <root>/step-<N>/<node>/ holds DCP's files for that node's ranks, then
`manifest.json` (SHA-256 of every file, the run id, step and node, HMAC-SHA256 under a key
derived from the run key), then `COMMITTED` (written last, by atomic rename). A directory
without a valid marker is torn and never loaded. DCP's metadata is a pickle: nothing is
handed to DCP before the manifest verifies.

Each node saves and loads over its own gloo group (`node_group`). The group's rank 0 (the
node's local rank 0, its *leader*) is DCP's coordinator and writes the manifest and the
marker, so a value replicated across ranks is stored once per node, and a node never reads
another node's files: nodes may share a filesystem (the local stack) or not (SSH hosts,
where `root` is node-local; it may contain `{node}` and `{region}`, see `node_root`).

Resume (`latest`, a collective): each leader lists the steps its node committed; every
rank takes the newest step that every node committed and whose files verify on every node.
A node's directory that is skipped (torn, corrupt, forged, of another run, or of a step
some node lacks) is never left in place, where it would block the save of that step when
training reaches it again. Its node's leader, and only it, deletes it when it holds
nothing of use (a torn save; a step whose save was cut short on another node) and else
moves it to <root>/quarantine/step-N-<node>-<reason>-<time>/ with a REASON file.
Pruning to `keep` runs on every node by its leader, and only once every node has committed
the new step, so the newest common step always survives; a step-N/ directory
goes when its last node directory does.

Loads read exactly the bytes that were verified: `load` checks the manifest (MAC, run,
node, and that its step is the directory's), then DCP reads through a `VerifiedReader`
that reads each file once into memory, checks its SHA-256 against the manifest and only
then hands those bytes to DCP, so a file swapped after the check is never read and
nothing unverified is unpickled. Every value the nodes exchange to agree (resume, commit
confirmation) is JSON under a per-rank MAC (training.comm.session.Control), never a pickle.

Rollback: each node keeps a MAC'd record (`high-water-<node>.json` in `state_dir`: the
run dir under the launcher, else the root) of the highest step it started to commit
(written before the marker) and of the launch epoch. Resume refuses, on every rank, to
go back past a node's high-water mark unless that step was seen and set aside with a
reason (quarantined): a renamed or deleted newer checkpoint, or a deleted record, is a
RollbackError unless the operator allows it (GEOTRAIN_ALLOW_ROLLBACK=1). A step at or
below the mark without its commit marker was committed: when its manifest and files
verify, resume writes the marker again (a commit cut short between the mark and the
marker, or a marker deleted to roll back, which then gains nothing); when they do not, it
is quarantined and the resume is a rollback, refused unless allowed. Deleting a
node's whole checkpoint root together with its record starts over, like `--fresh`.

Saves are asynchronous. `save` only deep-copies the state's plain values and hands its
tensors to a writer thread, which first copies them into CPU buffers kept from the
previous save (a `Snapshot`: no allocation), then runs DCP (its planning is a collective
on the node's group, where its ranks wait for each other) and the writes. The training
loop calls `fence` before it next changes any state tensor (the gradient sync, the
optimizer step), so the copy overlaps the next forward and backward pass; the loop waits
only if the copy is not done by then. Never overwrites a committed step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import hashlib
import hmac
import io
import json
import os
import pickle
import shutil
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.tensor import DTensor
from torch.futures import Future

from training.comm import gloo
from training.comm.session import Control, Session, derive
from training.errors import CheckpointError, RollbackError
from training.spec import node_root as node_root  # re-exported: callers fill in roots here
from training.spec import record_path

# DCP reports write failures as OSError, torch.save's RuntimeError, or its own
# CheckpointException (a BaseException subclass)
WRITE_ERRORS = (OSError, RuntimeError, CheckpointException)
MARKER = "COMMITTED"
MANIFEST = "manifest.json"
PREFIX = "step-"
QUARANTINE = "quarantine"
REASON = "REASON"
OWNER = "STACK"
"""<root>/STACK names the stack whose checkpoints the root holds (`claim`)."""
ALLOW_ROLLBACK_ENV = "GEOTRAIN_ALLOW_ROLLBACK"
"""Set to 1 to resume behind a node's high-water mark (the operator's explicit choice)."""


def step_of(path: Path) -> int:
    """The step of `<root>/step-N` or of a node directory `<root>/step-N/<node>`."""
    name = path.name if path.name.startswith(PREFIX) else path.parent.name
    return int(name[len(PREFIX) :])


def claim(root: Path, stack: str) -> None:
    """Mark `root` as `stack`'s (<root>/STACK), or refuse a root another stack marked: two
    stacks sharing a root would quarantine, prune and (`--fresh`) delete each other's
    steps. Runs of one stack share it by design (a new run sets the old one's aside)."""
    f = root / OWNER
    try:
        owner = f.read_text(encoding="utf-8").strip()
    except FileNotFoundError:  # nodes sharing the root may race here: a temp file each
        tmp = root / f".{OWNER}.{socket.gethostname()}.{os.getpid()}.tmp"
        tmp.write_text(stack + "\n", encoding="utf-8")
        os.replace(tmp, f)
        return
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"cannot read {f} ({e}); remove it if {root} is this stack's"
        ) from None
    if owner != stack:
        raise CheckpointError(
            f"checkpoint dir {root} holds stack {owner}'s checkpoints ({f}); give each stack "
            "its own (put {stack} in geotrain:training.checkpoint.dir), or, if the stack "
            f"was renamed from {owner} or its checkpoints are not needed, delete {f}"
        )


def is_step_dir(path: Path) -> bool:
    """Whether `path` is a checkpoint step directory, `<root>/step-N`."""
    digits = path.name[len(PREFIX) :]
    return path.name.startswith(PREFIX) and digits.isdigit() and path.is_dir()


def has_steps(root: Path) -> bool:
    """Whether `root` holds a checkpoint step directory."""
    return root.is_dir() and any(map(is_step_dir, root.iterdir()))


def remove_checkpoints(roots: Iterable[Path], stack: str) -> list[Path]:
    """`geotrain train --fresh`: delete what checkpointers wrote under each of `roots`
    (step-N/ and quarantine/ directories, high-water records, write probes, the STACK
    mark), then the root itself if that left it empty. Anything else there is the user's
    and stays, so a root set to a directory that holds other files (the launch directory,
    a home) loses none of them. Every root is checked before any is touched: if another
    stack marked one (`claim`), that raises and nothing is deleted. Returns what was
    deleted."""
    present = [r for r in dict.fromkeys(roots) if r.is_dir()]  # nodes may share a root
    for root in present:  # all, or none
        if (root / OWNER).exists():
            claim(root, stack)  # raises for another stack's root
    return [p for root in present for p in _remove_ours(root)]


def _remove_ours(root: Path) -> list[Path]:
    """`remove_checkpoints` for one root, already checked: what it deleted."""
    gone = []
    for p in sorted(root.iterdir()):
        ours_dir = p.name == QUARANTINE or is_step_dir(p)
        ours_file = (
            (p.name.startswith("high-water-") and p.name.endswith(".json"))
            or p.name.startswith(".write-probe-")
            or p.name == OWNER
            or (p.name.startswith(f".{OWNER}.") and p.name.endswith(".tmp"))
        )
        if ours_dir and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif ours_file and (p.is_file() or p.is_symlink()):
            p.unlink()
        else:
            continue
        gone.append(p)
    with contextlib.suppress(OSError):  # not empty: the user's files stay with it
        root.rmdir()
    return gone


def node_group(ranks_by_node: list[list[int]]) -> Any:
    """This rank's node group (gloo), for DCP. Every rank must call this with the same
    lists in the same order: each creates every node's group (a c10d rule)."""
    group, _ = dist.new_subgroups_by_enumeration(ranks_by_node, backend=gloo.backend())
    return group


Problem = tuple[str, str]
"""Why a directory cannot be loaded: (a slug for its quarantine name, the reason)."""


@dataclass(frozen=True)
class Fallback:
    """A node directory that resume did not use, and what became of it."""

    step: int
    node: str
    reason: str
    moved_to: str | None
    """Its quarantine directory; None when it was deleted (a torn save holds nothing)."""


def _because(problem: Problem | None) -> str:
    return f" ({problem[1]})" if problem is not None else " (the marker could not be written)"


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
    """This node's checkpoint root (placeholders already filled in)."""
    node: str
    """This node's name: its directory in every step-N/."""
    run_id: str
    run_key: bytes
    keep: int
    group: Any = None
    """The node's gloo group, for DCP (None: the default group is the only node)."""
    world: Any = None
    """A gloo group of every rank, dedicated to checkpoints (agreeing on the resume step,
    confirming commits from the writer thread); None when this node is the whole world."""
    on_commit: Callable[[int], None] | None = None
    """Called on the leader's writer thread once its node's step is committed (other nodes
    may not have committed it yet)."""
    state_dir: Path | None = None
    """Where the node's high-water record lives (None: the root)."""
    allow_rollback: bool = False
    """Resume behind the high-water mark instead of refusing (ALLOW_ROLLBACK_ENV)."""
    session: Session | None = None
    """The launch's session (`start`); None: an unagreed one (tests and tools)."""
    stack: str | None = None
    """The stack the root belongs to (`claim`; None: not checked, for tests and tools)."""
    pending: concurrent.futures.Future[Any] | None = None
    pending_dir: Path | None = None
    fallbacks: list[Fallback] = field(default_factory=list)
    """What the last `latest()` skipped, on every node, with reasons (same on every rank)."""

    def __post_init__(self) -> None:
        # DCP's coordinator is rank 0 of its group: that rank commits the node's directory
        self.leader = dist.get_rank(self.group) == 0
        # the state's structure never changes between saves: plan once, reuse
        self._planner = DefaultSavePlanner(enable_plan_caching=True)
        self._snapshot = Snapshot()
        self._staged: tuple[threading.Event, int, float] | None = None
        """(copy taken, step, seconds save() took) of the save the loop has not fenced."""
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt")
        # manifests and records outlive sessions, and name their run in their body (so a
        # checkpoint of another run under the same key is reported as such): keyed by the
        # run key and purpose alone
        self._mac_key = derive(self.run_key, b"", "checkpoint-manifest", 32)
        self._record_key = derive(self.run_key, b"", "node-record", 32)
        self._record_file = record_path(self.state_dir or self.root, self.node)
        self._control = Control(
            self.run_key, self.session or Session.unagreed(self.run_id), "checkpoint", self.world
        )
        self._record: dict[str, Any] = {}
        self._record_problem: str | None = None
        if self.leader:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                probe = self.root / f".write-probe-{self.node}"
                probe.write_text("ok")
                probe.unlink()
                if self.stack is not None:
                    claim(self.root, self.stack)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint dir {self.root} is not writable "
                    f"({e.strerror}); fix its permissions or set "
                    "geotrain:training.checkpoint.dir"
                ) from None
            self._record, self._record_problem = self._read_record()

    @property
    def stored_epoch(self) -> int:
        """The epoch this node recorded at its last launch (-1: none; not a leader)."""
        return int(self._record.get("epoch", -1))

    def start(self, session: Session) -> None:
        """Adopt the launch's agreed session: the leader records its epoch (a record that
        does not verify is left for `latest` to report)."""
        self.session = session
        self._control = Control(self.run_key, session, "checkpoint", self.world)
        if self.leader and self._record_problem is None:
            self._write_record(epoch=session.epoch)

    # -- the high-water record --------------------------------------------------------------
    def _read_record(self) -> tuple[dict[str, Any], str | None]:
        """(this run's record, or {}; why a record present could not be used)."""
        try:
            body = json.loads(self._record_file.read_text(encoding="utf-8"))
            mac = body.pop("mac")
            canon = json.dumps(body, sort_keys=True).encode()
        except FileNotFoundError:
            return {}, None
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            return {}, f"its high-water record {self._record_file} is unreadable"
        good = hmac.new(self._record_key, canon, hashlib.sha256).hexdigest()
        if not isinstance(mac, str) or not hmac.compare_digest(good, mac):
            return {}, f"its high-water record {self._record_file} does not verify"
        if (body.get("run_id"), body.get("node")) != (self.run_id, self.node):
            return {}, None  # another run's record: nothing of this run was committed
        return body, None

    def _write_record(self, **changes: Any) -> None:
        """Leader: update this node's record (atomic replace)."""
        body = {"epoch": -1, "high_water": None, **self._record, **changes}
        body.update(run_id=self.run_id, node=self.node)
        canon = json.dumps(body, sort_keys=True).encode()
        mac = hmac.new(self._record_key, canon, hashlib.sha256).hexdigest()
        self._record_file.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(self._record_file, json.dumps({**body, "mac": mac}, sort_keys=True))
        self._record, self._record_problem = body, None

    def dir_of(self, step: int) -> Path:
        """This node's directory of `step`."""
        return self.root / f"{PREFIX}{step}" / self.node

    # -- save ---------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start an async save of `state` at `step`. Its tensors must not change until
        `fence()` returns."""
        t0 = time.perf_counter()
        self.wait()
        d = self.dir_of(step)
        if (d / MARKER).exists():
            raise CheckpointError(
                f"{d} is already committed and resume did not move it aside; "
                "move it out of the checkpoint dir and restart"
            )
        # no barrier: torn attempts were removed at resume (latest), so every rank can
        # create the directory itself; DCP's planning is the only synchronisation
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
        writes, then (the leader, after every rank of the node is done) manifest and
        marker; then, once every node has committed, prune."""
        try:
            fill()
        finally:
            staged.set()  # an error surfaces from wait(); the fence must not hang
        failed: BaseException | None = None
        try:
            dcp.save(snap, checkpoint_id=str(d), process_group=self.group, planner=self._planner)
            if self.leader:
                self._commit(d, step)
                if self.on_commit:
                    self.on_commit(step)
        except WRITE_ERRORS as e:
            failed = e  # still join the confirmation below, or the other nodes would hang
        # every rank, every save, in order: the step counts as committed everywhere only
        # when every rank says so; pruning earlier could delete the newest common step
        if self._everywhere(step if failed is None else -1) == step and self.leader:
            self._prune()
        if failed is not None:
            raise failed

    def _everywhere(self, value: int) -> int:
        """The minimum of `value` over every rank (on `world`, authenticated)."""
        if self.world is None:
            return value
        return min(int(v) for v in self._control.gather(value))

    def saving(self) -> bool:
        """Whether a save is still being written in the background."""
        return self.pending is not None and not self.pending.done()

    def wait(self) -> None:
        """Block until the in-flight save (and its commit) is done."""
        if self.pending is not None:
            self._staged = None
            fut, self.pending = self.pending, None
            try:
                fut.result()
            except WRITE_ERRORS as e:
                raise self._write_error(self.pending_dir or self.root, e) from None

    def _write_error(self, where: Path, e: BaseException) -> CheckpointError:
        # the torn attempt only wastes space; but not at the high-water mark (its marker
        # write failed after the mark went up): resume finishes that commit when its
        # manifest and files verify, while a vanished one reads as a rollback (and
        # lowering the mark needs the space a full disk does not have)
        mark = self._record.get("high_water")
        if (
            self.leader
            and where.parent.name.startswith(PREFIX)
            and not (where / MARKER).exists()
            and step_of(where) != mark
        ):
            self._remove(where)
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
        body = {"run_id": self.run_id, "step": step, "node": self.node, "files": files}
        canon = json.dumps(body, sort_keys=True).encode()
        body["hmac"] = hmac.new(self._mac_key, canon, hashlib.sha256).hexdigest()
        _write_atomic(d / MANIFEST, json.dumps(body, indent=1, sort_keys=True))
        # the high-water mark first: a committed step is never above it (a kill between
        # the two leaves a torn directory, which resume sees and sets aside)
        if step > (self._record.get("high_water") or -1) or self._record_problem:
            self._write_record(high_water=step)
        _write_atomic(d / MARKER, hashlib.sha256(canon).hexdigest() + "\n")

    def _prune(self) -> None:
        committed = self._committed()
        for old in committed[: max(0, len(committed) - self.keep)]:
            self._remove(self.dir_of(old))

    def _remove(self, d: Path) -> None:
        """Delete node directory `d`, and its step directory once no node's is left."""
        shutil.rmtree(d, ignore_errors=True)
        self._drop_empty(d.parent)

    @staticmethod
    def _drop_empty(step_dir: Path) -> None:
        with contextlib.suppress(OSError):  # only when empty: other nodes may share it
            step_dir.rmdir()

    # -- resume ---------------------------------------------------------------------------
    def _steps(self) -> list[int]:
        """Steps this node has a directory of, oldest first."""
        if not self.root.is_dir():
            return []
        steps = []
        for p in self.root.iterdir():
            if is_step_dir(p) and (p / self.node).is_dir():
                steps.append(step_of(p))
        return sorted(steps)

    def _committed(self) -> list[int]:
        return [s for s in self._steps() if (self.dir_of(s) / MARKER).exists()]

    def _gather(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able `obj` (authenticated, no pickle)."""
        if self.world is None:
            return [json.loads(json.dumps(obj))]  # the same shapes as over the wire
        return self._control.gather(obj)

    def latest(self) -> Path | None:
        """This node's directory of the newest step that every node has committed and
        verified, or None. A collective: every rank calls it. Every node directory that is
        not used and newer than the one chosen is moved aside (see the module docstring),
        and `fallbacks` says which and why."""
        torn: list[Fallback] = []
        mine: list[int] | None = None
        record: dict[str, Any] = {}
        if self.leader:
            mark = self._record.get("high_water")
            for s in self._steps():
                d = self.dir_of(s)
                if (d / MARKER).exists():
                    continue
                if mark is None or s > mark:  # a save that died before the mark went up
                    self._remove(d)
                    torn.append(Fallback(s, self.node, "no commit marker (torn save)", None))
                elif not self._finish_commit(d):
                    # at or below the mark the step was committed: a marker that is gone
                    # and a manifest or file that no longer verifies is a rollback (the
                    # step stays out of `torn`, so resume refuses unless allowed)
                    why = self._manifest_problem(d)
                    reason = f"no commit marker at or below the high-water mark{_because(why)}"
                    self._quarantine(s, "no-marker", reason)
            mine = self._committed()
            record = {"high_water": self._record.get("high_water"), "why": self._record_problem}
        views = [
            (node, steps, [Fallback(**f) for f in t], rec)
            for node, steps, t, rec in self._gather(
                [self.node, mine, [dataclasses.asdict(f) for f in torn], record]
            )
            if steps is not None
        ]
        have = {node: set(steps) for node, steps, _, _ in views}
        problems: dict[tuple[int, str], Problem] = {}
        chosen = None
        for step in sorted(set.intersection(*have.values()) if have else set(), reverse=True):
            problem = self._problem(self.dir_of(step)) if self.leader else None
            found = [(n, tuple(p)) for n, p in self._gather([self.node, problem]) if p]
            if not found:
                chosen = step
                break
            problems.update({(step, n): p for n, p in found})
        torn_at = {(f.step, f.node) for _, _, t, _ in views for f in t}
        behind = self._behind_high_water(chosen, views, torn_at)  # raises unless allowed
        moved = self._set_aside(chosen, have, problems, torn_at) if self.leader else []
        if self.leader and (behind or (self._record.get("high_water") or -1) > (chosen or -1)):
            # every step past `chosen` was set aside with a reason, or the operator allowed
            # going back: the mark follows, so the next resume does not refuse again
            self._write_record(high_water=chosen)
        self.fallbacks = [f for _, _, t, _ in views for f in t] + behind
        for part in self._gather([dataclasses.asdict(f) for f in moved]):  # also the barrier
            self.fallbacks += [Fallback(**f) for f in part]
        self.fallbacks.sort(key=lambda f: (-f.step, f.node))
        return None if chosen is None else self.dir_of(chosen)

    def _behind_high_water(
        self,
        chosen: int | None,
        views: list[tuple[str, list[int], list[Fallback], dict[str, Any]]],
        torn: set[tuple[int, str]],
    ) -> list[Fallback]:
        """Refuse (RollbackError, the same on every rank) to resume behind a node's
        high-water mark when that step vanished without a trace, or from a node that has
        no valid record; with allow_rollback, the fallbacks that say so."""
        issues: list[Fallback] = []
        for node, steps, _, rec in views:
            mark = rec.get("high_water")
            if mark is None and chosen is not None:
                why = rec.get("why") or "it has no high-water record"
                issues.append(Fallback(chosen, node, f"{why} (deleted or replaced?)", None))
            elif (
                mark is not None
                and mark > (chosen if chosen is not None else -1)
                and mark not in steps
                and (mark, node) not in torn
            ):
                why = f"step {mark} (its high-water mark) was committed and is gone"
                issues.append(Fallback(mark, node, f"{why} (deleted, renamed or altered)", None))
        if issues and not self.allow_rollback:
            first = issues[0]
            raise RollbackError(
                f"checkpoint rollback refused: node {first.node}: {first.reason}; resume "
                f"would go back to step {chosen if chosen is not None else 0}"
                f"{f' ({len(issues) - 1} more node(s) alike)' if len(issues) > 1 else ''}. "
                f"If that is intended, restart with {ALLOW_ROLLBACK_ENV}=1, or delete the "
                "whole checkpoint dir to start over"
            )
        return [dataclasses.replace(f, reason=f"{f.reason}; allowed") for f in issues]

    def _set_aside(
        self,
        chosen: int | None,
        have: dict[str, set[int]],
        problems: dict[tuple[int, str], Problem],
        torn: set[tuple[int, str]],
    ) -> list[Fallback]:
        """Leader: move this node's committed steps newer than `chosen` out of the way.
        Quarantined, not deleted: a node that lists nothing may only have lost its mount.
        The exception is the usual aftermath of a kill mid-save: this node committed a step
        whose save was cut short on other nodes; that copy is deleted like a torn one."""
        out = []
        for step in sorted(have[self.node]):
            if chosen is not None and step <= chosen:
                continue
            missing = sorted(n for n, steps in have.items() if step not in steps)
            other = sorted((n, p) for (s, n), p in problems.items() if s == step)
            if (step, self.node) in problems:
                slug, reason = problems[(step, self.node)]
            elif missing:
                slug, reason = "incomplete", f"not committed on node {', '.join(missing)}"
                if all((step, n) in torn for n in missing):
                    reason += " (its save was cut short)"
                    self._remove(self.dir_of(step))
                    out.append(Fallback(step, self.node, reason, None))
                    continue
            else:  # in every node's list, and checked: some other node's copy is bad
                slug, reason = (
                    "unusable-elsewhere",
                    f"unusable on node {other[0][0]} ({other[0][1][1]})",
                )
            dest = self._quarantine(step, slug, reason)
            out.append(Fallback(step, self.node, reason, str(dest)))
        return out

    def _quarantine(self, step: int, slug: str, reason: str) -> Path:
        """Move this node's directory of `step` to <root>/quarantine/ with a REASON file."""
        src = self.dir_of(step)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        base = self.root / QUARANTINE / f"{PREFIX}{step}-{self.node}-{slug}-{stamp}"
        dest, n = base, 1
        while dest.exists():
            dest, n = base.with_name(f"{base.name}-{n}"), n + 1
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, dest)  # same filesystem (under root): atomic
        (dest / REASON).write_text(
            f"step {step} of node {self.node} of run {self.run_id}: {reason}\n"
        )
        self._drop_empty(src.parent)
        return dest

    def _problem(self, d: Path) -> Problem | None:
        """Why `d` must not be loaded, or None when it is committed, authentic, of this run,
        this step and this node, and complete."""
        if not (d / MARKER).exists():
            return "torn", "no commit marker (torn save)"
        return self._manifest_problem(d)

    def _finish_commit(self, d: Path) -> bool:
        """Write the marker of a step at or below the high-water mark whose manifest and
        files all verify: a commit cut short between the mark and the marker (a kill, a
        full disk), or a marker deleted to roll the run back, which then gains nothing.
        False when the step does not verify or the marker cannot be written."""
        if self._manifest_problem(d) is not None:
            return False
        body = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
        body.pop("hmac")
        canon = json.dumps(body, sort_keys=True).encode()
        try:
            _write_atomic(d / MARKER, hashlib.sha256(canon).hexdigest() + "\n")
        except OSError:
            return False
        return True

    def _manifest_problem(self, d: Path) -> Problem | None:
        """Why `d`'s manifest or files do not verify (its marker aside), or None."""
        try:
            body = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
            mac = body.pop("hmac")
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            return "unreadable-manifest", "manifest missing or unreadable"
        canon = json.dumps(body, sort_keys=True).encode()
        good = hmac.new(self._mac_key, canon, hashlib.sha256).hexdigest()
        if not isinstance(mac, str) or not hmac.compare_digest(good, mac):
            return (
                "bad-mac",
                "manifest does not verify under this run's key (another run, or tampered)",
            )
        if body.get("run_id") != self.run_id:
            return "other-run", (
                f"belongs to run {body.get('run_id')}, not {self.run_id}; "
                "use that run's stack to resume it"
            )
        if (body.get("step"), body.get("node")) != (step_of(d), self.node):
            return "copied-manifest", (
                f"manifest is of step {body.get('step')} on node {body.get('node')} "
                "(a manifest copied from another directory)"
            )
        actual = _digest_files(d)
        for name, digest in body["files"].items():
            if name not in actual:
                return "missing-file", f"file {name} is missing"
            if actual[name] != digest:
                return "digest-mismatch", f"file {name} is corrupt (digest mismatch)"
        extra = set(actual) - set(body["files"])
        if extra:
            return "unexpected-files", f"unexpected files {sorted(extra)}"
        return None

    def verify(self, d: Path) -> None:
        """Raise CheckpointError unless `d` is committed, authentic, of this run, this step
        and this node, and complete."""
        problem = self._problem(d)
        if problem is not None:
            raise CheckpointError(f"{d}: {problem[1]}")

    def load(self, d: Path, state: dict[str, Any]) -> None:
        """Load `d` into `state` in place (tensors are filled, not replaced), over the
        node's group: every rank reads only its own node's directory, and DCP gets exactly
        the bytes that were checked against the manifest (VerifiedReader)."""
        reader = VerifiedReader(d, self._verified_manifest(d))
        try:
            dcp.load(state, storage_reader=reader, process_group=self.group)
        except (CheckpointException, AssertionError, RuntimeError):
            if reader.refused is not None:  # DCP rewraps it; say what the reader refused
                raise reader.refused from None
            raise

    def stored(self, d: Path) -> dict[str, Any]:
        """`d`'s DCP metadata by flattened key (`rank3.loader.drawn`), read through the
        verified reader: what the node saved, to fit a template to it before `load`."""
        reader = VerifiedReader(d, self._verified_manifest(d))
        return dict(reader.read_metadata().state_dict_metadata)

    def _verified_manifest(self, d: Path) -> dict[str, str]:
        """The manifest's file digests, read once; raises unless it is committed,
        authentic, of this run, this node and the step of its directory."""
        where = f"{d}: not loaded"
        if not (d / MARKER).exists():
            raise CheckpointError(f"{where}: no commit marker (torn save)")
        try:
            body = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
            mac = body.pop("hmac")
            canon = json.dumps(body, sort_keys=True).encode()
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            raise CheckpointError(f"{where}: manifest missing or unreadable") from None
        good = hmac.new(self._mac_key, canon, hashlib.sha256).hexdigest()
        if not isinstance(mac, str) or not hmac.compare_digest(good, mac):
            raise CheckpointError(f"{where}: manifest does not verify under this run's key")
        if (body.get("run_id"), body.get("step"), body.get("node")) != (
            self.run_id,
            step_of(d),
            self.node,
        ):
            raise CheckpointError(
                f"{where}: manifest is of run {body.get('run_id')} step {body.get('step')} "
                f"node {body.get('node')}, the directory of run {self.run_id} step "
                f"{step_of(d)} node {self.node}"
            )
        return dict(body["files"])


class VerifiedReader(FileSystemReader):
    """DCP's file reader over verified bytes: each file DCP asks for is read from disk
    once, its SHA-256 compared with the (already verified) manifest, and only those bytes
    are served, so a file changed or swapped after the check is never read. The metadata
    pickle is unpickled from verified bytes only; a rank fetches and checks every file its
    load plan needs before it reads any of them, so a bad file loads nothing there."""

    def __init__(self, path: Path, digests: dict[str, str]) -> None:
        super().__init__(path)
        self._dir = path
        self._digests = digests
        self._bytes: dict[str, bytes] = {}
        self.fs = _Served(self._dir, self._bytes)
        self.refused: CheckpointError | None = None
        """The first file refused (DCP reports it wrapped in its own exceptions)."""

    def _verified(self, name: str) -> bytes:
        want = self._digests.get(name)
        if want is None:
            why = f"DCP asked for {name}, which the manifest does not list"
        else:
            data = (self._dir / name).read_bytes()
            if hmac.compare_digest(hashlib.sha256(data).hexdigest(), want):
                return data
            why = f"file {name} changed after it was verified (digest mismatch)"
        self.refused = self.refused or CheckpointError(f"{self._dir}: {why}; not loaded")
        raise self.refused

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = pickle.loads(self._verified(name))  # verified bytes: written by this run
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        names = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
        try:
            for name in names:  # all of them checked before DCP reads any
                self._bytes[name] = self._verified(name)
            return super().read_data(plan, planner)
        finally:
            self._bytes.clear()


class _Served(FileSystem):
    """The file system DCP's reader sees: only the verified bytes of `served`."""

    def __init__(self, root: Path, served: dict[str, bytes]) -> None:
        self._root = root
        self._served = served

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        name = str(Path(path).relative_to(self._root))
        if mode != "rb" or name not in self._served:
            raise CheckpointError(f"{self._root}: {name} was not verified; not loaded")
        yield io.BytesIO(self._served[name])


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
        # a DTensor (FSDP's shards) is copied as its local shard and rebuilt around the
        # copy with its mesh and placement, so DCP still sees which part of what it is
        shards = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

        def shapes(ts: list[torch.Tensor]) -> list[tuple[torch.Size, torch.dtype]]:
            return [(t.shape, t.dtype) for t in ts]

        if shapes(shards) != shapes(self._buffers):
            self._buffers = [torch.empty(t.shape, dtype=t.dtype) for t in shards]
        pairs = list(zip(self._buffers, shards, strict=True))

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
    if isinstance(obj, DTensor):
        return DTensor.from_local(
            next(bufs),
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        return next(bufs)
    if isinstance(obj, dict):
        return {k: _rebuild(v, bufs) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_rebuild(v, bufs) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return copy.deepcopy(obj)
