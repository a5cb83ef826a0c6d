"""`geotrain train` on real processes: a run, a kill -9 and its recovery, bad input."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import committed, events, geotrain, small_stack, start
from training.audit import ledger

pytestmark = pytest.mark.timeout(600)
NODES = ("bj-0", "fra-0", "sv-0")


def _final(cwd: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(cwd / ".geotrain" / name / "final.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of `small_stack(..., "same")` trained without a fault: the run
    every fault test below must end bitwise equal to (one run for all: CI time)."""
    a = tmp_path_factory.mktemp("uninterrupted")
    ref = geotrain("train", "--stack", str(small_stack(a, "same")), cwd=a)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    return _final(a, "same")


def test_train_runs_three_regions_and_reports(tmp_path: Path) -> None:
    stack = small_stack(tmp_path, "run")
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / ".geotrain/run/report.json").read_text())
    assert report["world"] == 6 and report["regions"] == 3 and report["steps"] == 8
    curve = list(report["loss_curve"].values())
    assert curve[-1] < curve[0]
    assert report["compression_ratio"] > 3  # int8 + zstd
    assert 0 < report["bytes_vs_flat_fp32"] < 1
    assert "cross-region bytes" in r.stdout and "compression ratio" in r.stdout
    # only committed, verified checkpoints remain, at most `keep`, one directory per node
    root = tmp_path / ".geotrain/run/checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["STACK", "step-3", "step-6"]
    assert (root / "STACK").read_text() == "run\n"  # the root is this stack's
    for node in NODES:
        assert committed(root, node) == {3, 6}
    # the signed ledger names those checkpoints and the final weights; one flipped byte in
    # a checkpoint file is refused with the entry that names it
    ok = geotrain("ledger", "verify", "--stack", str(stack), cwd=tmp_path)
    assert ok.returncode == 0 and "6 checkpoints" in ok.stdout, ok.stdout + ok.stderr
    assert "final weights match" in ok.stdout
    shard = sorted((root / "step-6" / "fra-0").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = geotrain("ledger", "verify", "--stack", str(stack), cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert f"checkpoint step-6/fra-0 file {shard.name} differs" in bad.stderr, bad.stderr
    assert "ledger frankfurt entry" in bad.stderr and "Traceback" not in bad.stderr


def test_kill_9_resumes_and_ends_bitwise_equal_to_an_uninterrupted_run(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    b = tmp_path
    proc = start("train", "--stack", str(small_stack(b, "same")), cwd=b)
    kill_at = random.Random(os.getpid()).randint(4, 7)
    run_dir = b / ".geotrain" / "same"
    ckpts = run_dir / "checkpoints"
    deadline = time.monotonic() + 300
    victim, committed_at_kill, step_at_kill = None, 0, 0
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        ev = events(run_dir)
        step = max((e["step"] for e in ev if e["event"] == "step"), default=0)
        common = set.intersection(*(committed(ckpts, n) for n in NODES))
        if step >= kill_at and common:  # kill once there is committed work to lose
            victim = random.Random(kill_at).choice([e["pid"] for e in ev if e["event"] == "start"])
            committed_at_kill, step_at_kill = max(common), step
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    assert victim is not None, out
    assert proc.returncode == 0, out
    assert "restarting from the newest checkpoint" in out
    resumed = [e["step"] for e in events(run_dir) if e["event"] == "resume"]
    # committed work is never lost: the resume uses the newest checkpoint committed at the
    # kill (or one committed just after it); lost work is at most one interval (3 steps)
    # plus the save that was in flight
    assert resumed and min(resumed) >= committed_at_kill, (resumed, committed_at_kill, out)
    assert step_at_kill - min(resumed) <= 2 * 3
    # every worker ran under torchrun, one agent per node; the victim's agent restarted
    # its workers (its restart count), and torchrun restarted the whole job: every rank
    # started again, in a new session, after the kill
    starts = [e for e in events(run_dir) if e["event"] == "start"]
    assert all(
        {"torchrun_restart", "torchrun_rank", "torchrun_group_rank"} <= e.keys() for e in starts
    )
    killed = next(e for e in starts if e["pid"] == victim)
    again = [e for e in starts if e["session"] != killed["session"]]
    assert sorted(e["rank"] for e in again) == list(range(6)), starts
    assert {e["torchrun_restart"] for e in again if e["node"] == killed["node"]} == {1}
    assert f"worker {killed['node']}/" in out and "exited with -9" in out, out
    rb = _final(b, "same")
    for k, v in uninterrupted.items():
        assert torch.equal(v, rb[k]), k


def _rendered_spec(tmp: Path, **changes: object) -> Path:
    r = geotrain(
        "render", "--stack", str(small_stack(tmp, "spec")), "--out", str(tmp / "r"), cwd=tmp
    )
    assert r.returncode == 0, r.stderr
    path = tmp / "r" / "launch-spec.json"
    spec = json.loads(path.read_text())
    spec.update(changes)
    path.write_text(json.dumps(spec))
    return path


@pytest.mark.parametrize("case", ["missing", "world-readable", "not-hex"])
def test_bad_key_file_fails_before_rendezvous_without_restarts(tmp_path: Path, case: str) -> None:
    key = tmp_path / "run.key"
    if case != "missing":
        key.write_text("zz" * 32 if case == "not-hex" else "ab" * 32)
        key.chmod(0o600 if case == "not-hex" else 0o644)
    spec = _rendered_spec(tmp_path, key_file=str(key))
    r = geotrain(
        "launch",
        "--spec",
        str(spec),
        "--node",
        "bj-0",
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "after 1 attempt(s)" in r.stderr and "key file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_spec_world_size_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    from training.errors import SpecError
    from training.setup import preflight
    from training.spec import LaunchSpec

    spec = LaunchSpec.load(_rendered_spec(tmp_path))
    os.environ["WORLD_SIZE"] = "4"
    try:
        with pytest.raises(SpecError, match="WORLD_SIZE=4 but the spec"):
            preflight(spec, "bj-0", 0)
    finally:
        del os.environ["WORLD_SIZE"]


def test_region_without_a_shard_is_a_clear_error(tmp_path: Path) -> None:
    stack = small_stack(
        tmp_path,
        "noshard",
        data_shards=[
            {"name": "cn", "jurisdiction": "CN", "region": "beijing"},
            {"name": "eu", "jurisdiction": "EU", "region": "frankfurt"},
        ],
    )
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "region silicon-valley (regions[2]) has no data shard" in line, r.stderr
    assert "data_shards" in line and not (tmp_path / ".geotrain").exists()  # nothing started
    # a launch spec made by hand without it stops the worker with the same reason
    from types import SimpleNamespace

    from training.data.loader import load_region_text
    from training.errors import DataError

    region = SimpleNamespace(name="silicon-valley", jurisdiction="US", shards=[])
    with pytest.raises(DataError, match="silicon-valley has no data shard"):
        load_region_text(region, 2, 3)  # type: ignore[arg-type]


def test_streaming_ternary_merges_report_their_exchanges_and_end_as_one_model(
    tmp_path: Path,
) -> None:
    """quantize: ternary through the whole path (stack, launch spec, worker, codec) with
    streaming fragments, exchanged whole in one round (exchange: allgather): each
    landing's exchange time reaches the step events and the report, and only the last
    step (every fragment merged) carries the weights' digest, the same in every region."""
    stack = small_stack(
        tmp_path,
        "st",
        sync="diloco",
        steps=9,
        exchange="allgather",
        compression={"quantize": "ternary"},
        diloco={"inner_steps": 4, "fragments": 2, "tau": 1},
        checkpoint={"interval_steps": 9, "keep": 1},
    )
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fragment exchanges" in r.stdout and "tau 1 steps is" in r.stdout, r.stdout
    assert "cross-region exchange: allgather" in r.stdout, r.stdout
    steps = [e for e in events(tmp_path / ".geotrain/st") if e["event"] == "step"]
    landed = [x for e in steps for x in e.get("exchange_s", ())]
    assert len(landed) >= 3 and all(x > 0 for x in landed), landed  # per region leader
    digests = {e["step"]: e["digest"] for e in steps if "digest" in e}
    assert set(digests) == {9}, digests
    assert len({e["digest"] for e in steps if "digest" in e}) == 1
    # each landing signed its own fragment's parameters, the last merge the whole model's,
    # and every region signed the same ones
    run_dir = tmp_path / ".geotrain/st"
    public = ledger.public_from_hex(ledger.pub_path(run_dir, "frankfurt").read_text().strip())
    chain = ledger.read_chain(ledger.chain_path(run_dir, "frankfurt"), "frankfurt", public)
    merges = [e.predicate for e in chain if e.kind == "merge"]
    assert {p.get("fragment") for p in merges} == {0, 1, None}, merges
    assert [p["step"] for p in merges if "fragment" not in p] == [9], merges
    ok = geotrain("ledger", "verify", "--stack", str(stack), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_diloco_regions_hold_identical_weights_after_every_merge(tmp_path: Path) -> None:
    stack = small_stack(tmp_path, "dl", sync="diloco", steps=9, diloco={"inner_steps": 3})
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    merges: dict[int, set[str]] = {}
    for e in events(tmp_path / ".geotrain/dl"):
        if e["event"] == "step" and e["merged"]:
            merges.setdefault(e["step"], set()).add(e["digest"])
    assert sorted(merges) == [3, 6, 9]
    assert all(len(d) == 1 for d in merges.values()), merges
    # every region signed its pseudo-gradient and the same merged parameters at each merge
    ok = geotrain("ledger", "verify", "--stack", str(stack), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "5 launches/merges/syncs cross-checked" in ok.stdout, ok.stdout  # start, 3, end


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_killed_torchrun_agent_is_started_again_and_the_run_ends_bitwise_equal(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """kill -9 of a node's torchrun agent (what the OOM killer does) ended the run with
    exit 2 and no final weights; the launcher now starts the agent again like a worker."""
    b = tmp_path
    proc = start("train", "--stack", str(small_stack(b, "same")), cwd=b)
    run_dir = b / ".geotrain" / "same"
    deadline = time.monotonic() + 300
    agent = None
    while agent is None and time.monotonic() < deadline and proc.poll() is None:
        ev = events(run_dir)
        step = max((e["step"] for e in ev if e["event"] == "step"), default=0)
        common = set.intersection(*(committed(run_dir / "checkpoints", n) for n in NODES))
        if step >= 4 and common:
            worker = next(e["pid"] for e in ev if e["event"] == "start" and e["node"] == "fra-0")
            agent = _parent(worker)
            os.kill(agent, signal.SIGKILL)
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    assert agent is not None, out
    assert proc.returncode == 0, out
    assert "worker fra-0/torchrun exited with -9; restarting from the newest checkpoint" in out
    rb = _final(b, "same")
    for k, v in uninterrupted.items():
        assert torch.equal(v, rb[k]), k


def _children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids]


def test_a_killed_rendezvous_store_is_started_again_and_the_run_ends_bitwise_equal(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """kill -9 of the rendezvous store the launcher hosts ended the run with exit 2 (as
    for a store that could not bind). Its agents lose their connection to it at once
    (torch's store client does not reconnect); the launcher starts the store again on
    its address and port and the agents after it, which meet in a fresh rendezvous and
    resume from the newest checkpoint."""
    b = tmp_path
    proc = start("train", "--stack", str(small_stack(b, "same")), cwd=b)
    run_dir = b / ".geotrain" / "same"
    deadline = time.monotonic() + 300
    store = None
    while store is None and time.monotonic() < deadline and proc.poll() is None:
        ev = events(run_dir)
        step = max((e["step"] for e in ev if e["event"] == "step"), default=0)
        common = set.intersection(*(committed(run_dir / "checkpoints", n) for n in NODES))
        if step >= 4 and common:
            hosted = [p for p in _children(proc.pid) if "rdzv_host" in _cmdline(p)]
            assert len(hosted) == 1, [_cmdline(p) for p in _children(proc.pid)]
            store = hosted[0]
            os.kill(store, signal.SIGKILL)
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    assert store is not None, out
    assert proc.returncode == 0, out
    line = "worker bj-0/rendezvous-store exited with -9; restarting from the newest checkpoint"
    assert out.count(line) == 1 and out.count("restarting") == 1, out  # one line says it
    log = (run_dir / "logs" / "rendezvous-store-run.log").read_text().splitlines()
    assert len(log) == 2 and log[0] == log[1], log  # the same address and port again
    starts = [e for e in events(run_dir) if e["event"] == "start"]
    assert len(starts) == 12, starts  # every worker started again, once
    assert [e["step"] for e in events(run_dir) if e["event"] == "resume"] != []
    rb = _final(b, "same")
    for k, v in uninterrupted.items():
        assert torch.equal(v, rb[k]), k


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""
