"""Starting workers: one node (`geotrain launch`, what SSH hosts and pods run) or every
node of a single-machine stack (`geotrain train`), with torchrun-style restarts.

A failed worker takes its whole group down (a collective cannot finish without it); the
group restarts up to `max_restarts` times and every rank resumes from the newest
committed checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from training.spec import LaunchSpec, NodeSpec

POLL_S = 0.2


@dataclass
class Attempt:
    rc: int
    """0 when every worker finished; else the first failing worker's exit code."""
    failed: str | None = None
    """Which worker failed first (node/local rank)."""
    seconds: float = 0.0


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
            log = open(log_dir / f"{n.name}-{i}.log", "ab")  # noqa: SIM115 (closed by the child)
            procs[f"{n.name}/{i}"] = subprocess.Popen(
                worker_command(spec_path, n, i),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
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
    for restart in range(spec.max_restarts + 1):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "GEOTRAIN_RESTART": str(restart),
            "GEOTRAIN_EVENTS": str(run_dir / "events.jsonl"),
            "GEOTRAIN_RUN_DIR": str(run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        attempt = run_group(spec_path, nodes, env, run_dir / "logs", on_poll)
        result.attempts.append(attempt)
        if attempt.rc == 0 or attempt.rc == 2:  # 2: bad input; restarting cannot help
            break
        if on_restart and restart < spec.max_restarts:
            on_restart(attempt)
    return result
