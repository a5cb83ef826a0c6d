"""One torchrun per node (training.launch.launcher): its command line, and how a worker under c10d
tells who it is. The runs themselves: tests/unit/test_security.py (real agents, a stub
worker) and tests/integration/test_train_local.py (kill -9, job-wide restart)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from training.errors import GeotrainError, SpecError
from training.launch import launcher as launch
from training.launch import torchrun
from training.spec import FaultToleranceSpec
from training.testing import make_spec


def test_each_node_runs_torchrun_with_c10d_at_the_launchers_store_and_names_its_node() -> None:
    spec = make_spec(2, [2, 3], master_port=29555, max_restarts=4)
    node = spec.regions[1].nodes[0]
    argv = launch.torchrun_command(spec, Path("s.json"), node)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    for arg in (
        "--nnodes=2",
        "--nproc-per-node=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29555",
        "--rdzv-conf=is_host=false,read_timeout=600",  # the launcher hosts the store
        f"--local-addr={node.host}",
        "--max-restarts=4",
    ):
        assert arg in argv, argv
    assert argv[-5:] == ["-m", "training.worker", "--torchrun=n1", "--spec", "s.json"]
    [job] = launch.rdzv_jobs(spec)
    assert launch.store_command(job)[-2:] == ["127.0.0.1", "29555"]


def test_in_the_lab_torchrun_and_the_store_run_in_their_nodes_namespace() -> None:
    spec = make_spec(2, 1)
    lab = [dataclasses.replace(r.nodes[0], netns=f"ns-{r.name}") for r in spec.regions]
    regions = [dataclasses.replace(r, nodes=[n]) for r, n in zip(spec.regions, lab, strict=True)]
    spec = dataclasses.replace(spec, regions=regions)
    argv = launch.torchrun_command(spec, Path("s.json"), lab[1])
    assert argv[:4] == ["ip", "netns", "exec", "ns-frankfurt"]
    assert launch.store_command(launch.rdzv_jobs(spec)[0])[:4] == [
        "ip",
        "netns",
        "exec",
        "ns-beijing",
    ]


C10D = {
    "RANK": "0",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "GROUP_RANK": "0",
    "TORCHELASTIC_RESTART_COUNT": "1",
}
"""c10d numbered the second node 0 (nodes are numbered in the order they join)."""


def test_under_c10d_the_worker_is_the_node_the_launcher_named_whatever_torchrun_numbered() -> None:
    spec = make_spec(2, 2)
    t = torchrun.from_env(spec, C10D, "n1")
    assert (t.node, t.local_rank, t.restart) == ("n1", 1, 1)
    assert t.fields() == {"torchrun_restart": 1, "torchrun_rank": 0, "torchrun_group_rank": 0}
    with pytest.raises(SpecError, match="WORLD_SIZE 6 is not the spec's 4"):
        torchrun.from_env(spec, {**C10D, "WORLD_SIZE": "6"}, "n1")
    with pytest.raises(SpecError, match="n7"):
        torchrun.from_env(spec, C10D, "n7")


def test_under_fault_tolerance_each_region_is_its_own_torchrun_job_at_its_own_store() -> None:
    """A region's torchruns meet only each other: torchrun restarts a failed region alone."""
    ft = FaultToleranceSpec(lighthouse="127.0.0.1:29510", min_replicas=2, store_port=29700)
    spec = make_spec(3, [2, 3, 1], fault_tolerance=ft)
    jobs = launch.rdzv_jobs(spec)
    assert [(j.name, j.port, j.rdzv_id) for j in jobs] == [
        ("beijing", 29700, "test-run-beijing"),
        ("frankfurt", 29701, "test-run-frankfurt"),
        ("silicon-valley", 29702, "test-run-silicon-valley"),
    ]
    argv = launch.torchrun_command(spec, Path("s.json"), spec.regions[1].nodes[0])
    for arg in ("--nnodes=1", "--nproc-per-node=3", "--rdzv-endpoint=127.0.0.1:29701"):
        assert arg in argv, argv
    assert "--rdzv-id=test-run-frankfurt" in argv
    assert launch.store_command(jobs[2])[-2:] == ["127.0.0.1", "29702"]
    # the worker's torchrun world is its region's
    env = {**C10D, "WORLD_SIZE": "3", "LOCAL_RANK": "2"}
    assert torchrun.from_env(spec, env, "n1").local_rank == 2
    with pytest.raises(SpecError, match="WORLD_SIZE 6 is not region frankfurt's 3"):
        torchrun.from_env(spec, {**env, "WORLD_SIZE": "6"}, "n1")


def test_a_node_waits_for_a_store_it_can_reach_from_its_own_address_then_names_it() -> None:
    """Before its torchrun starts (training.launch.launcher.reach_store): a store another launcher
    hosts, reached from the node's own address; unreachable, one clear line."""
    import socket

    from training.errors import RendezvousTimeout

    spec = make_spec(2, 1)
    node = spec.regions[1].nodes[0]
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        job = dataclasses.replace(launch.rdzv_jobs(spec)[0], port=port)
        launch.reach_store(job, node)  # returns: the store accepts
    with pytest.raises(RendezvousTimeout, match=rf"node n1 cannot reach .*127.0.0.1:{port} "):
        launch.reach_store(job, node, wait_s=0.5)


@pytest.mark.parametrize("where", ["afile", "afile/sub"])
def test_a_run_dir_that_cannot_be_one_is_one_line_not_a_traceback(
    tmp_path: Path, where: str
) -> None:
    (tmp_path / "afile").write_text("mine")
    lock = launch.run_lock(tmp_path / where, "stack x")
    with pytest.raises(GeotrainError, match=r"cannot use .* as the run directory of stack x"):
        lock.__enter__()
    assert (tmp_path / "afile").read_text() == "mine"  # nothing of the user's touched


def test_a_rendezvous_store_that_exits_fails_the_launch_at_once_with_its_last_line(
    tmp_path: Path,
) -> None:
    """Its torchruns would otherwise wait out their 600 s rendezvous timeout."""
    import subprocess
    import sys

    spec = make_spec(2, 1, max_restarts=0)
    sup = launch.Supervisor(spec, tmp_path / "spec.json", [], tmp_path, launch.LaunchResult())
    log = tmp_path / "rendezvous-store-run.log"
    fail = "print('RuntimeError: Address already in use'); raise SystemExit(1)"
    proc = launch.spawn([sys.executable, "-c", fail], dict(os.environ), log)
    proc.wait()
    sup.stores.append((sup.jobs[0], log, 0, proc))
    with pytest.raises(SpecError, match=r"rendezvous store of run on .* exited with 1 \(Runt"):
        sup._check_stores(None)
    sleeper = subprocess.Popen(["sleep", "30"])
    sup.stores[0] = (sup.jobs[0], log, 0, sleeper)
    assert sup._check_stores(None) is None  # serving: nothing to say
    sleeper.kill()
    sleeper.wait()
    end = sup._check_stores(None)  # killed, no restart left: the run ends, not bad input
    assert end is not None and (end.rc, end.failed) == (-9, "n0/rendezvous-store")


def test_a_rendezvous_store_killed_by_a_signal_starts_again_on_its_port_within_max_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    spec = make_spec(2, 1, max_restarts=1)
    sup = launch.Supervisor(spec, tmp_path / "spec.json", [], tmp_path, launch.LaunchResult())
    started: list[launch.RdzvJob] = []

    def store(job: launch.RdzvJob) -> list[str]:
        started.append(job)
        return ["sleep", "30"]

    monkeypatch.setattr(launch, "store_command", store)
    log = tmp_path / "rendezvous-store-run.log"
    log.write_text("rendezvous store on 127.0.0.1:1\n")
    killed = subprocess.Popen(["sleep", "30"])
    killed.kill()
    killed.wait()
    sup.stores.append((sup.jobs[0], log, 0, killed))
    said: list[launch.Attempt] = []
    assert sup._check_stores(said.append) is None  # started again: the run goes on
    job, _, at, again = sup.stores[0]
    try:
        assert started == [sup.jobs[0]] and job == sup.jobs[0] and again.poll() is None
        assert at == log.stat().st_size  # its own lines from here on
        assert [(a.rc, a.failed) for a in said] == [(-9, "n0/rendezvous-store")]
        assert sup.result.attempts == said
    finally:
        again.kill()
        again.wait()
    end = sup._check_stores(said.append)  # killed once more than max_restarts
    assert end is not None and end.rc == -9 and len(said) == 1 and len(started) == 1


def test_an_agent_counts_as_having_lost_its_store_only_by_its_own_last_line(
    tmp_path: Path,
) -> None:
    """The agents of a store that was started again end on RendezvousConnectionError
    (exit 1) and are started again; any other exit of an agent is the run's end."""
    log = tmp_path / "bj-0-torchrun.log"
    lost = (
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection"
        " to the C10d store has failed. See inner exception for details.\n"
    )
    log.write_text("Traceback (most recent call last):\n" + lost + "\n")
    assert launch._lost_store(log, 0)
    since = log.stat().st_size  # an agent started after it, which failed otherwise
    with open(log, "a") as f:
        f.write("ValueError: bad --rdzv-conf\n")
    assert not launch._lost_store(log, since) and not launch._lost_store(log, 0)
    log.write_text(lost)
    assert not launch._lost_store(log, log.stat().st_size)  # nothing of its own yet
    assert not launch._lost_store(tmp_path / "missing.log", 0)


def test_this_launchs_bad_input_counts_by_log_position_not_by_clock(tmp_path: Path) -> None:
    """A clock stepped back (NTP) gives this launch's events earlier times than its start:
    they must still stop the restarts; an earlier launch's must not."""
    import json

    spec = make_spec(2, 1)
    nodes = [n for r in spec.regions for n in r.nodes]
    log = tmp_path / "events.jsonl"

    def failed(t: float) -> str:
        e = {"event": "failed", "exit_code": 2, "rank": 1, "t": t, "region": "r1"}
        return json.dumps(e) + "\n"

    log.write_text(failed(2000.0))  # the launch before, at a later wall-clock time
    since = log.stat().st_size
    assert launch._final(log, nodes, since) is None
    with open(log, "a") as f:
        f.write(failed(1000.0))  # this launch, after the clock went back
    end = launch._final(log, nodes, since)
    assert end is not None and end.rc == 2 and end.failed == f"{nodes[1].name}/0"
    log.write_text(failed(5.0))  # the log replaced (shorter than the offset): all of it
    assert launch._final(log, nodes, since) is not None


def test_cpu_workers_get_the_runtimes_allocator_setting_unless_the_operator_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.launch.launcher import CPU_MALLOC, worker_env

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert (
        worker_env(tmp_path, cpu=True)["MALLOC_MMAP_THRESHOLD_"]
        == "4194304"
        == (CPU_MALLOC["MALLOC_MMAP_THRESHOLD_"])
    )
    assert "MALLOC_MMAP_THRESHOLD_" not in worker_env(tmp_path, cpu=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert worker_env(tmp_path, cpu=True)["MALLOC_MMAP_THRESHOLD_"] == "131072"
