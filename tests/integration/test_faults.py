"""Runtime faults on real processes (issue #11 part 4, issue #12 item 5): each ends with
the run finishing bitwise equal to an uninterrupted one, or with one line saying what to do.

Most runs use the two-node stack (bj-0, fra-0; two CPU workers each, real gloo).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.helpers import committed, events, geotrain, start, two_node_stack
from training.state.checkpoint import MANIFEST, QUARANTINE, REASON

pytestmark = pytest.mark.timeout(600)
NODES = ("bj-0", "fra-0")
SEPARATE = ".geotrain/{stack}/hosts/{node}/checkpoints"
"""A checkpoint dir per node, as on hosts without a shared filesystem."""


def _final(cwd: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(cwd / ".geotrain" / name / "final.pt")


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _wait_for(what: str, ok: Callable[[], bool], seconds: float = 120) -> None:
    """Poll `ok` until it holds; fail naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Final weights of an uninterrupted 8-step run of the two-node stack."""
    cwd = tmp_path_factory.mktemp("reference")
    _ok(geotrain("train", "--stack", str(two_node_stack(cwd, "faults")), cwd=cwd))
    return _final(cwd, "faults")


# -- 1. a committed but corrupt newest checkpoint ---------------------------------------
def _flip_byte(node_dir: Path) -> None:
    f = max(node_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _truncate_manifest(node_dir: Path) -> None:
    m = node_dir / MANIFEST
    m.write_bytes(m.read_bytes()[:100])


def _swap_manifest(node_dir: Path) -> None:
    """An authentic manifest of the same node, but of the previous step."""
    older = node_dir.parent.parent / "step-3" / node_dir.name / MANIFEST
    shutil.copy(older, node_dir / MANIFEST)


CORRUPTIONS = {
    "flipped-byte": (_flip_byte, "is corrupt (digest mismatch)"),
    "truncated-manifest": (_truncate_manifest, "manifest missing or unreadable"),
    "swapped-manifest": (_swap_manifest, "manifest is of step 3"),
}


def _run_corrupt_then_resume(
    cwd: Path, ckpt_root: Callable[[str], Path], corrupt: Callable[[Path], None]
) -> str:
    """Train 7 steps (commits 3 and 6), corrupt fra-0's step 6, train to 8 from there.
    `ckpt_root(node)` is the node's checkpoint root."""
    stack = str(cwd / "Pulumi.faults.yaml")
    _ok(geotrain("train", "--stack", stack, "--steps", "7", cwd=cwd))
    assert all(committed(ckpt_root(n), n) == {3, 6} for n in NODES)
    corrupt(ckpt_root("fra-0") / "step-6" / "fra-0")
    return _ok(geotrain("train", "--stack", stack, cwd=cwd))


@pytest.fixture(scope="module")
def seven_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dir where the two-node stack trained 7 steps (commits 3 and 6): each corruption
    case starts from a copy of it (stack, run key, high-water marks, checkpoints)."""
    cwd = tmp_path_factory.mktemp("seven")
    _ok(geotrain("train", "--stack", str(two_node_stack(cwd, "faults")), "--steps", "7", cwd=cwd))
    return cwd


def test_steps_at_or_before_the_newest_checkpoint_stop_with_one_line_and_keep_the_weights(
    tmp_path: Path, seven_steps: Path
) -> None:
    """7 steps trained (commits 3 and 6, final.pt at 7), then `--steps 6`: resuming at
    step 6 leaves nothing to train, and writing its weights as final.pt would replace
    step 7's, which exist nowhere else (the last step is not checkpointed)."""
    shutil.copytree(seven_steps, tmp_path, dirs_exist_ok=True)
    final = tmp_path / ".geotrain/faults/final.pt"
    before = final.read_bytes()
    stack = str(tmp_path / "Pulumi.faults.yaml")
    r = geotrain("train", "--stack", stack, "--steps", "6", cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out
    assert "is at step 6, not before the run's last step 6" in out and "--fresh" in out
    assert final.read_bytes() == before
    root = tmp_path / ".geotrain/faults/checkpoints"
    assert all(committed(root, n) == {3, 6} for n in NODES)


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_newest_checkpoint_is_quarantined_reported_and_the_run_ends_bitwise_equal(
    tmp_path: Path, case: str, reference: dict[str, torch.Tensor], seven_steps: Path
) -> None:
    corrupt, words = CORRUPTIONS[case]
    shutil.copytree(seven_steps, tmp_path, dirs_exist_ok=True)
    root = tmp_path / ".geotrain/faults/checkpoints"
    assert all(committed(root, n) == {3, 6} for n in NODES)
    corrupt(root / "step-6" / "fra-0")
    out = _ok(geotrain("train", "--stack", str(tmp_path / "Pulumi.faults.yaml"), cwd=tmp_path))
    run_dir = tmp_path / ".geotrain/faults"
    assert {e["step"] for e in events(run_dir) if e["event"] == "resume"} == {3}
    # the fallback and its reason, in the terminal and in the report
    line = next(ln for ln in out.splitlines() if "checkpoint step 6 on node fra-0" in ln)
    assert words in line and "moved to" in line, out
    report = json.loads((run_dir / "report.json").read_text())
    skipped = {(f["node"], f["step"]): f for f in report["checkpoint_fallbacks"]}
    assert words in skipped[("fra-0", 6)]["reason"] and ("bj-0", 6) in skipped
    assert "checkpoint fallbacks" in out
    # moved aside with its reason; step 6 was saved again when training got there
    reasons = [(d / REASON).read_text() for d in (root / QUARANTINE).iterdir()]
    assert any(words in r for r in reasons), reasons
    assert all(committed(root, n) == {3, 6} for n in NODES)
    _assert_bitwise_equal(_final(tmp_path, "faults"), reference)


# -- 2. separate checkpoint dirs per host -----------------------------------------------
def test_corrupt_newest_step_on_one_host_makes_every_rank_resume_from_the_previous_common_step(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    two_node_stack(tmp_path, "faults", checkpoint={"dir": SEPARATE})
    hosts = tmp_path / ".geotrain/faults/hosts"
    _run_corrupt_then_resume(tmp_path, lambda n: hosts / n / "checkpoints", _flip_byte)
    resumed = [e for e in events(tmp_path / ".geotrain/faults") if e["event"] == "resume"]
    assert len(resumed) == 4 and {e["step"] for e in resumed} == {3}  # every rank
    for n in NODES:  # each host's own dir holds only its own node
        assert [p.name for p in (hosts / n / "checkpoints" / "step-6").iterdir()] == [n]
    _assert_bitwise_equal(_final(tmp_path, "faults"), reference)


def test_hosts_with_separate_checkpoint_dirs_resume_from_the_newest_step_both_committed(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """kill -9 of a worker mid-run; the hosts may have committed different steps."""
    proc = start(
        "train",
        "--stack",
        str(two_node_stack(tmp_path, "faults", checkpoint={"dir": SEPARATE})),
        cwd=tmp_path,
    )
    run_dir = tmp_path / ".geotrain/faults"
    kill_at = random.Random(os.getpid()).randint(4, 7)
    victim = None

    def killed() -> bool:
        nonlocal victim
        ev = events(run_dir)
        step = max((e["step"] for e in ev if e["event"] == "step"), default=0)
        done = [
            {e["step"] for e in ev if e["event"] == "committed" and e["node"] == n} for n in NODES
        ]
        if step >= kill_at and set.intersection(*done):
            victim = random.Random(kill_at).choice([e["pid"] for e in ev if e["event"] == "start"])
            os.kill(victim, signal.SIGKILL)
        return victim is not None or proc.poll() is not None

    _wait_for("a step to kill at", killed, 300)
    out, _ = proc.communicate(timeout=300)
    assert victim is not None and proc.returncode == 0, out
    ev = events(run_dir)
    resume_at = min(i for i, e in enumerate(ev) if e["event"] == "resume")
    before = ev[:resume_at]  # the attempt that was killed
    done = [
        {e["step"] for e in before if e["event"] == "committed" and e["node"] == n} for n in NODES
    ]
    resumed = {e["step"] for e in ev[resume_at:] if e["event"] == "resume"}
    assert resumed == {max(set.intersection(*done))}, (resumed, done, out)
    _assert_bitwise_equal(_final(tmp_path, "faults"), reference)


# -- 3. a launcher killed with -9 takes its workers along ------------------------------
def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def _kill_left(pids: list[int]) -> None:
    """A failed test must not leave workers behind."""
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_launcher_killed_with_sigkill_takes_its_workers_along(tmp_path: Path) -> None:
    stack = str(two_node_stack(tmp_path, "faults", steps=500))
    proc = start("train", "--stack", stack, cwd=tmp_path)
    run_dir = tmp_path / ".geotrain/faults"
    _wait_for("every worker to start", lambda: len(_starts(run_dir)) == 4)
    pids = [e["pid"] for e in _starts(run_dir)]
    proc.kill()
    proc.wait()
    try:
        _wait_for("the orphaned workers to die", lambda: all(map(_gone, pids)), 30)
    finally:
        _kill_left(pids)
    # the run dir is free again: a rerun trains, alone
    _ok(geotrain("train", "--stack", stack, "--steps", "2", cwd=tmp_path))
    assert {e["pid"] for e in _starts(run_dir)}.isdisjoint(pids)


def _starts(run_dir: Path) -> list[dict[str, object]]:
    return [e for e in events(run_dir) if e["event"] == "start"]


NETNS_LAUNCHER = """
import subprocess, sys
from pathlib import Path
from training.launch.launcher import spawn
cmd = ["ip", "netns", "exec", sys.argv[1], sys.executable, "-c",
       "import os, time; print(os.getpid(), flush=True); time.sleep(300)"]
p = spawn(cmd, {}, Path(sys.argv[2]))
print(p.pid, flush=True)
p.wait()
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip"), reason="needs root for a network namespace"
)
def test_a_worker_started_through_ip_netns_exec_dies_with_its_launcher(tmp_path: Path) -> None:
    ns = f"gtf{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    log = tmp_path / "worker.log"
    try:
        launcher = subprocess.Popen(
            [sys.executable, "-c", NETNS_LAUNCHER, ns, str(log)],
            cwd=Path(__file__).resolve().parents[2],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        _wait_for("the worker to start", lambda: log.exists() and log.read_text().strip() != "")
        assert int(log.read_text()) == child  # ip netns exec execs: the worker is the child
        launcher.kill()
        launcher.wait()
        try:
            _wait_for("the worker to die", lambda: _gone(child), 30)
        finally:
            _kill_left([child])
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


# -- 4. two launchers of one run -------------------------------------------------------
def test_second_launcher_of_a_stack_is_refused_with_one_line_and_the_first_finishes(
    tmp_path: Path,
) -> None:
    stack = str(two_node_stack(tmp_path, "faults", steps=20))
    first = start("train", "--stack", stack, cwd=tmp_path)
    run_dir = tmp_path / ".geotrain/faults"
    _wait_for("every worker to start", lambda: len(_starts(run_dir)) == 4)
    second = geotrain("train", "--stack", stack, cwd=tmp_path)
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
    assert f"stack faults is already training (launcher pid {first.pid}, started at " in (
        second.stderr
    )
    assert f"stop it with kill {first.pid}" in second.stderr
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0 and "Traceback" not in out, out


def test_second_launch_of_a_node_on_one_run_dir_is_refused(tmp_path: Path) -> None:
    from training.state.keys import create_key_file

    stack = two_node_stack(tmp_path, "faults")
    _ok(geotrain("render", "--stack", str(stack), "--out", str(tmp_path / "r"), cwd=tmp_path))
    spec_path = tmp_path / "r" / "launch-spec.json"
    spec = json.loads(spec_path.read_text())
    create_key_file(tmp_path / spec["key_file"])
    args = ("launch", "--spec", str(spec_path), "--node", "bj-0", "--run-dir", "run")
    first = start(*args, cwd=tmp_path)  # waits for fra-0, which never comes
    try:
        lock = tmp_path / "run" / "launcher.lock"
        _wait_for("the first launcher's lock", lambda: lock.exists() and lock.read_text() != "")
        second = geotrain(*args, cwd=tmp_path)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"node bj-0 (run dir run) is already training (launcher pid {first.pid}" in (
            second.stderr
        )
    finally:
        first.terminate()  # SIGTERM: the launcher stops its workers on the way out
        first.communicate(timeout=60)


def test_event_log_reader_skips_partial_and_garbled_lines_and_survives_truncation(
    tmp_path: Path,
) -> None:
    from training.observe.report import EventLog

    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "start"}\n{"event": "st')
    log = EventLog(path)
    assert [e["event"] for e in log.poll()] == ["start"]  # the partial line waits
    with open(path, "a") as f:
        f.write('ep"}\nnot json\n\x00\x00\n')
    assert [e["event"] for e in log.poll()] == ["step"] and log.unreadable == 2
    path.write_text('{"event": "done"}\n')  # truncated and rewritten under the reader
    assert [e["event"] for e in log.poll()] == ["done"]


# -- 5. settings that validate must run, or be rejected by validate ---------------------
RUNS = {
    "diloco-scaffold-growing-h": {  # the checkpoint at step 2 lands mid-round
        "sync": "diloco",
        "diloco": {
            "inner_steps": 3,
            "inner_steps_start": 1,
            "drift_correction": "scaffold",
            "outer_momentum": 0.0,  # and outer SGD without momentum (once a crash)
        },
    },
    "seq-len-past-the-presets-context": {"seq_len": 600, "batch_size": 1},
    "int4-with-an-odd-block-size": {"compression": {"quantize": "int4", "block_size": 17}},
    "tiny-buckets": {"bucket_mb": 0.001},
}


@pytest.mark.parametrize("case", sorted(RUNS))
def test_a_setting_that_validates_runs(tmp_path: Path, case: str) -> None:
    settings = {"steps": 4, "checkpoint": {"interval_steps": 2, "keep": 2}, **RUNS[case]}
    stack = two_node_stack(tmp_path, "ok", workers=1, **settings)
    _ok(geotrain("validate", "--stack", str(stack), cwd=tmp_path))
    _ok(geotrain("train", "--stack", str(stack), cwd=tmp_path))
    # and resumes: a longer run loads the step-2 checkpoint of these settings
    _ok(geotrain("train", "--stack", str(stack), "--steps", "5", cwd=tmp_path))
    resumed = [e["step"] for e in events(tmp_path / ".geotrain/ok") if e["event"] == "resume"]
    assert resumed == [2, 2]


REJECTED = {
    "unknown-placeholder-in-checkpoint-dir": (
        {"training": {"checkpoint": {"dir": "/ckpt/{rank}"}}},
        "training.checkpoint.dir",
    ),
    "seed-past-64-bits": ({"training": {"seed": 2**60}}, "training.seed"),
    "local-metrics-ports-over-prometheus": (
        {"monitoring": {"metrics_port": 9088, "prometheus_port": 9090}},
        "monitoring.prometheus_port",
    ),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_a_setting_the_runtime_cannot_run_is_rejected_by_validate(
    tmp_path: Path, case: str
) -> None:
    from infra.model import load_stack
    from training.errors import ConfigError

    changes, key = REJECTED[case]
    path = Path(__file__).resolve().parents[2] / "stacks" / "Pulumi.local.yaml"
    doc = yaml.safe_load(path.read_text())
    for section, values in changes.items():
        target = doc["config"][f"geotrain:{section}"]
        for k, v in values.items():
            target[k] = {**target[k], **v} if isinstance(v, dict) else v
    stack = tmp_path / "Pulumi.bad.yaml"
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_stack(str(stack))
    assert e.value.path == f"geotrain:{key}", str(e.value)


def test_region_data_shorter_than_one_sequence_fails_once_with_one_clear_line(
    tmp_path: Path,
) -> None:
    for name in ("cn", "eu"):
        (tmp_path / f"{name}.txt").write_text("a short corpus. " * 320)  # 5120 bytes
    shards = [
        {"name": "cn", "jurisdiction": "CN", "region": "beijing", "uri": f"file:{tmp_path}/cn.txt"},
        {
            "name": "eu",
            "jurisdiction": "EU",
            "region": "frankfurt",
            "uri": f"file:{tmp_path}/eu.txt",
        },
    ]
    stack = two_node_stack(tmp_path, "short", workers=1, seq_len=6000, data_shards=shards)
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "after 1 attempt(s)" in r.stderr
    assert "5120 bytes, too short for one sequence of seq_len 6000" in r.stderr, r.stderr
