"""The launcher's worker group under fault_tolerance (training.quorum): a region whose
worker dies is restarted alone while the others train on.

Without fault tolerance, torchrun supervises each node (training.launch) and a failed
worker restarts the whole job. With regions as replica groups, the launcher still starts
the workers itself (`training.worker --node --local-rank`, not through torchrun): only
the failed worker's region is stopped and started again (up to `max_restarts` times per
region); it rejoins and heals from a live peer. That includes exit 3 (QuorumLost): a
region cut off from the others (or from the Lighthouse) loses its quorum while the
majority trains on, and one launcher may run every region (`geotrain train` on a lab
stack), so the others must not stop with it; it restarts from its checkpoints and heals
once it reaches a quorum again. When the majority is gone every region loses its quorum
and restarts alike, which is the whole-job restart from checkpoints. Exit 2 (bad input,
a hostile reject) still ends the attempt for the whole group.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from training import launch
from training.spec import LaunchSpec, NodeSpec

WHOLE_GROUP = (2,)
"""Exit codes that end the attempt of every region (bad input or hostile)."""
FINISH_GRACE_S = 30.0
"""Once a region finished the run, the others get this long to finish too. A region that
is still running after it, or fails, came back too late to rejoin (nobody is left to heal
from): it is stopped rather than restarted, and the run is done."""


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
    return launch.in_netns(node, cmd)


def attempts(
    spec: LaunchSpec,
    spec_path: Path,
    nodes: list[NodeSpec],
    run_dir: Path,
    result: launch.LaunchResult,
    on_poll: Callable[[], None] | None,
    on_restart: Callable[[launch.Attempt], None] | None,
) -> None:
    """The whole group, restarted from the checkpoints up to max_restarts times."""
    for restart in range(spec.max_restarts + 1):
        started = time.time()
        env = {**launch.worker_env(run_dir), "GEOTRAIN_RESTART": str(restart)}
        attempt = run_regions(spec, spec_path, nodes, env, run_dir / "logs", on_poll)
        if attempt.rc != 0:
            final = launch._final(run_dir / "events.jsonl", nodes, started)
            attempt = final or attempt
        result.attempts.append(attempt)
        if attempt.rc == 0 or attempt.rc == 2:  # 2: bad input or hostile; restarting cannot help
            break
        if on_restart and restart < spec.max_restarts:
            on_restart(attempt)


def run_regions(
    spec: LaunchSpec,
    spec_path: Path,
    nodes: list[NodeSpec],
    env: dict[str, str],
    log_dir: Path,
    on_poll: Callable[[], None] | None = None,
) -> launch.Attempt:
    log_dir.mkdir(parents=True, exist_ok=True)
    regions: dict[str, list[NodeSpec]] = {}
    for n in nodes:
        regions.setdefault(spec.node(n.name)[0].name, []).append(n)
    procs = {r: _start(spec_path, ns, env, log_dir) for r, ns in regions.items()}
    restarts = dict.fromkeys(regions, 0)
    t0 = time.monotonic()
    ended: float | None = None
    try:
        while True:
            if on_poll:
                on_poll()
            if ended is None and any(_finished(ps) for ps in procs.values()):
                ended = time.monotonic()
            if ended is not None and (
                time.monotonic() - ended > FINISH_GRACE_S
                or all(p.poll() is not None for ps in procs.values() for p in ps.values())
            ):
                return launch.Attempt(0, None, time.monotonic() - t0)
            for r, ps in procs.items():
                failed = _failed(ps)
                if failed is None or ended is not None:
                    continue
                who, rc = failed
                if rc in WHOLE_GROUP or restarts[r] >= spec.max_restarts:
                    return launch.Attempt(rc, who, time.monotonic() - t0)
                launch._stop(ps.values())  # the region's other ranks cannot go on alone
                restarts[r] += 1
                procs[r] = _start(spec_path, regions[r], env, log_dir)
            if all(p.poll() == 0 for ps in procs.values() for p in ps.values()):
                return launch.Attempt(0, None, time.monotonic() - t0)
            time.sleep(launch.POLL_S)
    finally:
        for ps in procs.values():
            launch._stop(ps.values())


def _start(
    spec_path: Path, nodes: list[NodeSpec], env: dict[str, str], log_dir: Path
) -> dict[str, subprocess.Popen[bytes]]:
    return {
        f"{n.name}/{i}": launch.spawn(
            worker_command(spec_path, n, i), env, log_dir / f"{n.name}-{i}.log"
        )
        for n in nodes
        for i in range(n.nprocs)
    }


def _finished(procs: dict[str, subprocess.Popen[bytes]]) -> bool:
    return all(p.poll() == 0 for p in procs.values())


def _failed(procs: dict[str, subprocess.Popen[bytes]]) -> tuple[str, int] | None:
    for k, p in procs.items():
        rc = p.poll()
        if rc is not None and rc != 0:
            return k, rc
    return None
