"""A region drops and training goes on (training.quorum, torchft): regions of one rank each
on loopback, a Lighthouse in the test process, workers killed with -9 and restarted."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from training.quorum import advertised, start_lighthouse
from training.spec import CheckpointSpec, DilocoSpec, FaultToleranceSpec
from training.testing import make_spec

ROOT = Path(__file__).resolve().parents[2]


def _free_base(n: int) -> int:
    """A port p with p .. p + n - 1 free on loopback (the regions' stores)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n < 65535 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Run:
    """A spec on disk, a Lighthouse, and one worker process per region."""

    def __init__(self, tmp: Path, regions: int, steps: int, min_replicas: int, **kw: Any):
        ft = FaultToleranceSpec(
            lighthouse="127.0.0.1:0",
            min_replicas=min_replicas,
            store_port=_free_base(regions),
            join_timeout_s=0.5,
            heartbeat_timeout_s=8.0,
            timeout_s=10.0,
            quorum_timeout_s=kw.pop("quorum_timeout_s", 60.0),
        )
        every = kw.pop("checkpoint_every", 1000)
        self.lighthouse = start_lighthouse(ft)
        addr = advertised(ft, self.lighthouse)
        key = tmp / "run.key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        self.spec = make_spec(
            regions,
            1,
            steps=steps,
            batch_size=2,
            seq_len=32,
            key_file=str(key),
            metrics_port=0,
            checkpoint=CheckpointSpec(
                dir=str(tmp / "ckpt"), interval_steps=every, interval_minutes=60
            ),
            fault_tolerance=replace(ft, lighthouse=addr),
            **kw,
        )
        self.path = tmp / "spec.json"
        self.path.write_text(self.spec.to_json())
        self.tmp = tmp
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, region: int) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "GEOTRAIN_EVENTS": str(self.events(region)),
            "OMP_NUM_THREADS": "1",
        }
        env.pop("WORLD_SIZE", None)
        cmd = [sys.executable, "-m", "training.worker", "--spec", str(self.path)]
        self.procs[region] = subprocess.Popen(
            [*cmd, "--node", f"n{region}", "--local-rank", "0"],
            env=env,
            cwd=self.tmp,
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / f"err{region}.log", "ab"),  # noqa: SIM115
        )

    def events(self, region: int) -> Path:
        return self.tmp / f"events{region}.jsonl"

    def log(self, region: int) -> list[dict[str, Any]]:
        p = self.events(region)
        if not p.exists():
            return []
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]

    def wait(self, what: str, ok: Callable[[], bool], seconds: float = 90) -> None:
        deadline = time.monotonic() + seconds
        while not ok():
            dead = {r: p.returncode for r, p in self.procs.items() if p.poll() not in (None, 0)}
            if time.monotonic() > deadline or dead:
                errs = {r: (self.tmp / f"err{r}.log").read_text()[-1500:] for r in self.procs}
                raise AssertionError(f"waiting for {what}; exited {dead}; stderr {errs}")
            time.sleep(0.05)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        self.lighthouse.shutdown()


def _steps(log: list[dict[str, Any]]) -> list[int]:
    return [e["step"] for e in log if e["event"] == "step"]


def _done(log: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in log if e["event"] == "done")


@pytest.fixture
def run_factory(tmp_path: Path) -> Any:
    runs: list[Run] = []

    def make(**kw: Any) -> Run:
        runs.append(Run(tmp_path, **kw))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def _after_exclusion(log: list[dict[str, Any]]) -> int:
    """Steps the survivor committed after a quorum that left frankfurt out."""
    at = [i for i, e in enumerate(log) if e["event"] == "quorum" and e["excluded"] == ["frankfurt"]]
    return len(_steps(log[at[-1] :])) if at else 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sync", ["allreduce", "diloco"])
def test_a_region_killed_mid_run_is_left_out_then_heals_and_ends_bitwise_equal(
    run_factory: Any, sync: str
) -> None:
    steps = 24
    kw: dict[str, Any] = {"sync": sync}
    if sync == "diloco":
        kw["diloco"] = DilocoSpec(every_steps=3, outer_lr=0.7)
    run = run_factory(regions=2, steps=steps, min_replicas=1, **kw)
    for r in (0, 1):
        run.start(r)
    run.wait("both regions at step 5", lambda: min(len(_steps(run.log(r))) for r in (0, 1)) >= 5)
    os.kill(run.procs[1].pid, signal.SIGKILL)
    run.procs.pop(1).wait()
    run.wait("steps without frankfurt", lambda: _after_exclusion(run.log(0)) >= 3)
    # hold the survivor while the region restarts (a process start takes seconds; the
    # survivor would finish first), then let both meet at the Lighthouse
    os.kill(run.procs[0].pid, signal.SIGSTOP)
    try:
        run.start(1)
        run.wait("frankfurt back", lambda: [e["event"] for e in run.log(1)].count("start") == 2)
    finally:
        os.kill(run.procs[0].pid, signal.SIGCONT)
    done = lambda: all(any(e["event"] == "done" for e in run.log(r)) for r in (0, 1))  # noqa: E731
    run.wait("both regions done", done)
    survivor, log1 = run.log(0), run.log(1)
    back = log1[[i for i, e in enumerate(log1) if e["event"] == "start"][1] :]
    # the survivor never restarted and lost no step
    assert [e["event"] for e in survivor].count("start") == 1
    s = _steps(survivor)
    assert s == list(range(s[0], steps + 1))
    # the returning region healed from its peer, then both ended on the same weights
    assert [e["phase"] for e in back if e["event"] == "healed"] == [
        "merge" if sync == "diloco" else "step"
    ]
    quorums = [e for e in survivor if e["event"] == "quorum"]
    assert quorums[-1]["members"] == ["beijing", "frankfurt"]
    assert _done(survivor)["digest"] == _done(back)["digest"]
    assert _done(survivor)["step"] == _done(back)["step"] == steps


@pytest.mark.timeout(150)
def test_losing_the_majority_stops_the_survivor_and_the_job_resumes_from_checkpoints(
    run_factory: Any,
) -> None:
    steps = 12
    run = run_factory(
        regions=2,
        steps=steps,
        min_replicas=2,
        quorum_timeout_s=3.0,
        checkpoint_every=3,
    )
    for r in (0, 1):
        run.start(r)
    run.wait("a committed checkpoint", lambda: any(e["event"] == "committed" for e in run.log(0)))
    run.wait("both regions at step 5", lambda: min(len(_steps(run.log(r))) for r in (0, 1)) >= 5)
    os.kill(run.procs[1].pid, signal.SIGKILL)
    run.procs.pop(1).wait()
    survivor = run.procs.pop(0)
    assert survivor.wait(timeout=60) == 3  # QuorumLost: the launcher restarts the whole job
    assert "no quorum of 2 regions" in (run.tmp / "err0.log").read_text()
    for r in (0, 1):  # the whole job, as a launcher restarts it
        run.start(r)
    done = lambda: all(any(e["event"] == "done" for e in run.log(r)) for r in (0, 1))  # noqa: E731
    run.wait("both regions done", done)
    logs = [run.log(r) for r in (0, 1)]
    for log in logs:
        assert [e["event"] for e in log].count("start") == 2
        assert next(e["step"] for e in log if e["event"] == "resume") % 3 == 0
    assert _done(logs[0])["digest"] == _done(logs[1])["digest"]
    assert _done(logs[0])["step"] == steps
