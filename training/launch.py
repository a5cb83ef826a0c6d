"""Starting workers: one node (`geotrain launch`, what SSH hosts and pods run) or every
node of a single-machine stack (`geotrain train`), with torchrun-style restarts.

A failed worker takes its whole group down (a collective cannot finish without it); the
group restarts up to `max_restarts` times and every rank resumes from the newest
committed checkpoint. Two failures are final: bad input (exit code 2) and a hostile
reject, which the rejecting worker records in the event log before it exits (an
authentic payload out of place: a replay, or a key holder that misbehaves; restarting
would only meet it again). A transient reject (corruption in transit) restarts.

Workers never outlive their launcher: a SIGTERM stops their process groups, and a launcher
killed outright (SIGKILL, OOM) takes them along through the kernel's parent-death signal.
One run directory has one launcher at a time (`run_lock`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from training.errors import GeotrainError
from training.spec import LaunchSpec, NodeSpec, node_root, record_path

POLL_S = 0.2
LOCK = "launcher.lock"
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child must not import


@dataclass
class Attempt:
    rc: int
    """0 when every worker finished; else the first failing worker's exit code."""
    failed: str | None = None
    """Which worker failed first (node/local rank); the rejecting one after a hostile
    reject."""
    seconds: float = 0.0
    hostile: str | None = None
    """Why the group stopped for good: a worker's hostile reject (from the event log)."""


@dataclass
class LaunchResult:
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].rc == 0


def worker_command(spec_path: Path, node: NodeSpec, local_rank: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "training.worker",
        "--spec",
        str(spec_path),
        "--node",
        node.name,
        "--local-rank",
        str(local_rank),
    ]
    if node.netns:  # lab: the worker lives in its node's namespace, on the overlay only
        cmd = ["ip", "netns", "exec", node.netns, *cmd]
    return cmd


def die_with(launcher: int) -> Callable[[], None]:
    """preexec_fn: the kernel sends SIGKILL to the child when the launcher dies. The
    setting survives exec, including `ip netns exec`'s (which execs the worker in place);
    a launcher that died before it was set is caught by the parent check."""

    def arm() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:
            os._exit(1)

    return arm


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start one worker in its own process group (so SIGTERM reaches its children) that
    dies with this process."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # preexec_fn is safe here: the launcher runs no other threads while it forks
            preexec_fn=die_with(os.getpid()),
        )


def run_group(
    spec_path: Path,
    nodes: list[NodeSpec],
    env: dict[str, str],
    log_dir: Path,
    on_poll: Callable[[], None] | None = None,
) -> Attempt:
    """Start every worker of `nodes`, wait; on the first failure stop the rest."""
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    t0 = time.monotonic()
    for n in nodes:
        for i in range(n.nprocs):
            procs[f"{n.name}/{i}"] = spawn(
                worker_command(spec_path, n, i), env, log_dir / f"{n.name}-{i}.log"
            )
    try:
        while True:
            if on_poll:
                on_poll()
            failed = next(
                (
                    (k, p.returncode)
                    for k, p in procs.items()
                    if p.poll() is not None and p.returncode != 0
                ),
                None,
            )
            if failed:
                return Attempt(failed[1], failed[0], time.monotonic() - t0)
            if all(p.poll() is not None for p in procs.values()):
                return Attempt(0, None, time.monotonic() - t0)
            time.sleep(POLL_S)
    finally:
        _stop(procs.values())


def _stop(procs: object) -> None:
    alive = [p for p in procs if p.poll() is None]  # type: ignore[attr-defined]
    for p in alive:
        os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in alive:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def launch(
    spec: LaunchSpec,
    spec_path: Path,
    nodes: list[NodeSpec],
    run_dir: Path,
    on_poll: Callable[[], None] | None = None,
    on_restart: Callable[[Attempt], None] | None = None,
) -> LaunchResult:
    """Run `nodes`' workers with up to spec.max_restarts restarts."""
    # SIGTERM (systemd stop, kill) must run the cleanup below, not leave workers behind
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    result = LaunchResult()
    forget_records_of_fresh_roots(spec, nodes, run_dir)
    with _lighthouse(spec, spec_path, nodes):
        _attempts(spec, spec_path, nodes, run_dir, result, on_poll, on_restart)
    return result


def _lighthouse(
    spec: LaunchSpec, spec_path: Path, nodes: list[NodeSpec]
) -> contextlib.AbstractContextManager[object]:
    """fault_tolerance: the Lighthouse, hosted by the launcher of the node it is placed on."""
    if spec.fault_tolerance is None:
        return contextlib.nullcontext()
    # torchft's Lighthouse logs every quorum request at INFO into the launcher's output
    os.environ.setdefault("RUST_LOG", "warn")
    from training.quorum import lighthouse_for  # imports torchft: only when it is on

    return lighthouse_for(spec, nodes, spec_path)


def _attempts(
    spec: LaunchSpec,
    spec_path: Path,
    nodes: list[NodeSpec],
    run_dir: Path,
    result: LaunchResult,
    on_poll: Callable[[], None] | None,
    on_restart: Callable[[Attempt], None] | None,
) -> None:
    for restart in range(spec.max_restarts + 1):
        started = time.time()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "GEOTRAIN_RESTART": str(restart),
            "GEOTRAIN_EVENTS": str(run_dir / "events.jsonl"),
            "GEOTRAIN_RUN_DIR": str(run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        if spec.fault_tolerance is None:
            attempt = run_group(spec_path, nodes, env, run_dir / "logs", on_poll)
        else:  # a failed region restarts alone (training.ft_launch)
            from training.ft_launch import run_regions

            attempt = run_regions(spec, spec_path, nodes, env, run_dir / "logs", on_poll)
        if attempt.rc != 0:
            attempt = _hostile(attempt, run_dir / "events.jsonl", nodes, started)
        result.attempts.append(attempt)
        if attempt.rc == 0 or attempt.rc == 2:  # 2: bad input or hostile; restarting cannot help
            break
        if on_restart and restart < spec.max_restarts:
            on_restart(attempt)


def _hostile(attempt: Attempt, events: Path, nodes: list[NodeSpec], since: float) -> Attempt:
    """The attempt as a hostile stop when a worker of `nodes` recorded a hostile reject
    since `since` (its peers may have exited first, with a plain collective error)."""
    for e in _events(events):
        if e.get("event") != "rejected" or e.get("kind") != "hostile":
            continue
        if float(str(e.get("t", 0))) < since:
            continue
        rank = int(str(e.get("rank")))
        for n in nodes:
            if n.first_rank <= rank < n.first_rank + n.nprocs:
                who = f"{n.name}/{rank - n.first_rank}"
                return Attempt(2, who, attempt.seconds, str(e.get("reason", "")))
    return attempt


def _events(path: Path) -> list[dict[str, object]]:
    out = []
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if isinstance(e, dict):
                out.append(e)
    return out


def forget_records_of_fresh_roots(spec: LaunchSpec, nodes: list[NodeSpec], run_dir: Path) -> None:
    """A node whose checkpoint root does not exist starts over (`geotrain train --fresh`
    removed it, or it is a new root): its high-water record in the run dir goes too, or
    resume would call the empty root a rollback. Checked before any worker starts."""
    for n in nodes:
        region, _ = spec.node(n.name)
        if not node_root(spec.checkpoint.dir, spec.stack, n.name, region.name).exists():
            record_path(run_dir, n.name).unlink(missing_ok=True)


@contextlib.contextmanager
def run_lock(run_dir: Path, what: str) -> Iterator[None]:
    """Hold <run_dir>/launcher.lock (flock) for the block: one launcher per run directory,
    since two would share its event log and checkpoints. The kernel releases the lock when
    the process dies, however it dies. `what` names the run in the error ("stack local")."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by workers
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        pid = holder.get("pid", "?")
        raise GeotrainError(
            f"{what} is already training (launcher pid {pid}, started at "
            f"{holder.get('started', '?')}); wait for it or stop it with kill {pid}"
        ) from None
    try:
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, json.dumps({"pid": os.getpid(), "started": started}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a waiter)


def _holder(fd: int) -> dict[str, object]:
    try:
        return dict(json.loads(os.pread(fd, 4096, 0) or b"{}"))
    except ValueError:  # the holder has the lock but has not written its pid yet
        return {}
