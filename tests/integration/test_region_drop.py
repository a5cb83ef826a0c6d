"""A region drops and training goes on (training.ft.quorum, torchft): regions of one rank each
on loopback, a Lighthouse in the test process, workers killed with -9 and restarted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from training.ft.testing import RegionRun, done_of, steps_of
from training.spec import DilocoSpec

_steps, _done = steps_of, done_of


def _wildcard_listeners(pids: list[int]) -> list[str]:
    """TCP listeners of `pids` on every interface (0.0.0.0, ::, *): the ManagerServer, heal
    server, stores and gloo groups must each bind the node's address."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    mine = [line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]
    assert mine, out  # the workers' listeners are visible at all
    return [line for line in mine if re.search(r"\s(0\.0\.0\.0|\[::\]|\*):\d+\s", line)]


@pytest.fixture
def run_factory(tmp_path: Path) -> Any:
    runs: list[RegionRun] = []

    def make(**kw: Any) -> RegionRun:
        runs.append(RegionRun(tmp_path, **kw))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def _after_exclusion(log: list[dict[str, Any]]) -> int:
    """Steps the survivor committed after a quorum that left frankfurt out."""
    at = [i for i, e in enumerate(log) if e["event"] == "quorum" and e["excluded"] == ["frankfurt"]]
    return len(_steps(log[at[-1] :])) if at else 0


@pytest.mark.timeout(150)
# allreduce: through geotrain train, below
@pytest.mark.parametrize("case", ["diloco", "diloco-scaffold", "diloco-allgather"])
def test_a_region_killed_mid_run_is_left_out_then_heals_and_ends_bitwise_equal(
    run_factory: Any, case: str
) -> None:
    steps = 16
    sync = case.split("-")[0]
    kw: dict[str, Any] = {"sync": sync}
    if sync == "diloco":  # scaffold: the heal carries c and restarts the healer's c_i
        drift = "scaffold" if case.endswith("scaffold") else "none"
        kw["diloco"] = DilocoSpec(every_steps=3, outer_lr=0.7, drift_correction=drift)
    if case.endswith("allgather"):  # the quorum's syncs exchange whole values, one round
        kw["exchange"] = "allgather"
    run = run_factory(regions=2, steps=steps, min_replicas=1, **kw)
    for r in (0, 1):
        run.start(r)
    run.wait("both regions at step 5", lambda: min(len(_steps(run.log(r))) for r in (0, 1)) >= 5)
    assert _wildcard_listeners([p.pid for p in run.procs.values()]) == []
    os.kill(run.procs[1].pid, signal.SIGKILL)
    run.procs.pop(1).join()
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
    steps = 9
    run = run_factory(
        regions=2,
        steps=steps,
        min_replicas=2,
        quorum_timeout_s=20.0,  # > heartbeat_timeout_s: a stale member must expire first
        checkpoint_every=3,
    )
    for r in (0, 1):
        run.start(r)
    # each region must hold a committed checkpoint before the kill, or a restarted region
    # with none heals from the other instead of resuming (its writer commits off the loop)
    committed = lambda r: any(e["event"] == "committed" for e in run.log(r))  # noqa: E731
    run.wait("a committed checkpoint in each region", lambda: committed(0) and committed(1))
    run.wait("both regions at step 5", lambda: min(len(_steps(run.log(r))) for r in (0, 1)) >= 5)
    os.kill(run.procs[1].pid, signal.SIGKILL)
    run.procs.pop(1).join()
    survivor = run.procs.pop(0)
    survivor.join(timeout=60)
    assert survivor.exitcode == 3  # QuorumLost: the launcher restarts the whole job
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


# -- through the launcher: each region its own torchrun job ----------------------------------
KILLED, SURVIVORS = "beijing", ("frankfurt", "silicon-valley")
LOCAL_STEPS = 10


@pytest.mark.timeout(240)
def test_geotrain_train_a_region_killed_is_restarted_by_its_torchrun_alone_and_heals(
    tmp_path: Path,
) -> None:
    """`geotrain train` on the local stack with fault_tolerance: beijing's worker is killed
    with -9; frankfurt and silicon-valley train on; beijing's torchrun (its region is its
    own torchrun job) restarts it, it heals from a live peer and all end bitwise equal."""
    import time

    import yaml

    from tests.integration.helpers import (
        events,
        of,
        region_steps,
        small_stack,
        start,
        trained_on_and_healed,
    )

    path = small_stack(
        tmp_path,
        "ftkill",
        steps=LOCAL_STEPS,
        checkpoint={"interval_steps": 2, "keep": 2},
        fault_tolerance={
            "lighthouse": "frankfurt",
            "heartbeat_timeout_s": 2,
            "timeout_s": 5,
            "quorum_timeout_s": 30,
            "join_timeout_s": 20,
        },
    )
    doc = yaml.safe_load(path.read_text())
    for r in doc["config"]["geotrain:regions"]:
        r["pool"]["nodes"][0]["gpus"] = 1  # one worker per region: 2 cores
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = tmp_path / ".geotrain" / "ftkill"
    proc = start("train", "--stack", str(path), cwd=tmp_path)
    stopped: list[int] = []

    def wait(what: str, ok: Any) -> None:
        deadline = time.monotonic() + 90
        while not ok():
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.communicate()[0] if proc.poll() is not None else ""
                raise AssertionError(f"waiting for {what}; train exited {proc.poll()}: {out}")
            time.sleep(0.1)

    try:
        wait("beijing at step 2", lambda: len(region_steps(events(run), KILLED)) >= 2)
        wait(
            "every region started",
            lambda: len([e for e in events(run) if e["event"] == "start"]) == 3,
        )
        workers = [of(events(run), "start", r)[-1]["pid"] for r in (KILLED, *SURVIVORS)]
        assert _wildcard_listeners(workers) == []
        # beijing's torchrun agent (the worker's parent) is held while the survivors show
        # steps without beijing: restarted at once, it could rejoin the very next quorum
        agent = int(Path(f"/proc/{workers[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert "torch.distributed.run" in Path(f"/proc/{agent}/cmdline").read_text()
        os.kill(agent, signal.SIGSTOP)
        stopped = [agent]
        os.kill(workers[0], signal.SIGKILL)
        t_kill = time.time()

        def without_killed() -> int:
            log = [e for e in events(run) if e["t"] > t_kill]
            out = [e for e in of(log, "quorum", SURVIVORS[0]) if e["excluded"] == [KILLED]]
            return len([s for s in region_steps(log, SURVIVORS[0]) if out and s > out[0]["step"]])

        wait("two steps without beijing", lambda: without_killed() >= 2)
        # hold the survivors while torchrun restarts beijing (the run would end first)
        held = [of(events(run), "start", r)[-1]["pid"] for r in SURVIVORS]
        stopped += held
        t_held = time.time()
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        os.kill(agent, signal.SIGCONT)
        wait("beijing restarted", lambda: len(of(events(run), "start", KILLED)) == 2)
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        t_woke = time.time()
        stopped = []
        out, _ = proc.communicate(timeout=150)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    log = events(run)
    trained_on_and_healed(log, KILLED, SURVIVORS, LOCAL_STEPS, held=(t_held, t_woke))
    assert "restarting region beijing alone" in out  # the launcher reported it
