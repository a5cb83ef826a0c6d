"""A region cut off in the lab (root): `geotrain train` with fault_tolerance on three
regions of one worker each (a majority survives), beijing's cables to the others set down
with `ip link set down` mid-run, then up again.

What it shows: the other two vote the round in flight down after `timeout_s`, form a
quorum without beijing and train on (no restart, no step lost); beijing's workers lose
the Lighthouse, stop with QuorumLost (exit 3), and beijing's torchrun (each region is its
own torchrun job) restarts that region alone;
once its links are up it resumes, heals from a live peer and every region ends on the
same weights."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from infra import lab
from infra.model import load_stack
from infra.plan import Plan, build_plan
from tests.integration.helpers import STACKS, events, of, region_steps, start, trained_on_and_healed

MISSING = [
    c for c in ("ip", "wg", "wireguard-go", "vtysh", "nft", "nsenter") if not shutil.which(c)
]
pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(bool(MISSING), reason=f"missing {', '.join(MISSING)} (.ci/run installs)"),
]
STACK = "ftcut"
CUT, OTHERS = "beijing", ("frankfurt", "silicon-valley")
STEPS = 8


def _stack(tmp: Path) -> Path:
    """The lab stack cut down for 2 cores: one node (the gateway, one worker) per region,
    links without the latency relay (a process per link), a tiny run, short timeouts."""
    doc = yaml.safe_load((STACKS / "Pulumi.lab.yaml").read_text())
    cfg = doc["config"]
    for r in cfg["geotrain:regions"]:
        r["pool"]["nodes"] = r["pool"]["nodes"][:1]
    for link in cfg["geotrain:network"]["links"]:
        link.pop("latency_ms", None)
        link["bandwidth_mbps"] = 1000
    cfg["geotrain:training"].update(
        steps=STEPS,
        batch_size=2,
        seq_len=32,
        max_restarts=2,
        compression={"quantize": "int4", "zstd_level": 1, "cipher": "sm4-gcm"},
        checkpoint={"interval_steps": 2, "keep": 2},
        fault_tolerance={
            "lighthouse": "frankfurt",  # on a survivor's node: the cut region loses it
            "heartbeat_timeout_s": 2,
            "timeout_s": 5,  # the round in flight fails after this
            "quorum_timeout_s": 8,  # the cut region gives up after this: QuorumLost
            "join_timeout_s": 6,  # below quorum_timeout_s (validate)
        },
    )
    cfg["geotrain:monitoring"]["metrics_port"] = 0
    path = tmp / f"Pulumi.{STACK}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture
def cut_lab(tmp_path: Path) -> Iterator[tuple[Path, Plan]]:
    path = _stack(tmp_path)
    plan = build_plan(load_stack(str(path)))
    state = tmp_path / "lab"
    lab.lab_up(plan, state)
    try:
        yield path, plan
    finally:
        lab.lab_down(plan, state)


def _set_links(plan: Plan, region: str, state: str) -> None:
    """`ip link set <state>` on every cable of `region`'s gateway: its WireGuard tunnels
    run over them, so the region is cut off from every other (its LAN stays up)."""
    ns = str(plan.region(region).gateway.netns)
    for t in plan.tunnels:
        if region in (t.a, t.b):
            lab.sh(
                "ip", "-n", ns, "link", "set", t.a_uplink if t.a == region else t.b_uplink, state
            )


def _wait(what: str, run: Path, proc: subprocess.Popen[str], ok: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 90
    while not ok():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0] if proc.poll() is not None else ""
            raise AssertionError(f"waiting for {what}; train exited {proc.poll()}: {out[-2000:]}")
        time.sleep(0.1)


def test_a_region_cut_off_is_left_out_restarts_alone_and_heals_bitwise_equal(
    tmp_path: Path, cut_lab: tuple[Path, Plan]
) -> None:
    path, plan = cut_lab
    run = tmp_path / ".geotrain" / STACK
    proc = start("train", "--stack", str(path), cwd=tmp_path)
    stopped: list[int] = []
    try:
        _wait("beijing at step 2", run, proc, lambda: len(region_steps(events(run), CUT)) >= 2)
        _set_links(plan, CUT, "down")
        t_cut = time.time()

        def without_cut() -> int:
            """Steps frankfurt committed in a quorum without beijing formed after the cut
            (beijing may also have been left out at the start, until it healed)."""
            log = [e for e in events(run) if e["t"] > t_cut]
            out = [e for e in of(log, "quorum", OTHERS[0]) if e["excluded"] == [CUT]]
            return len([e for e in region_steps(log, OTHERS[0]) if out and e > out[0]["step"]])

        _wait("two steps without beijing", run, proc, lambda: without_cut() >= 2)
        # hold the others while beijing gives up and restarts (the run would end first);
        # their heartbeats stop meanwhile, so nobody forms a quorum without them: a
        # scenario step, not a synchronisation
        stopped = [of(events(run), "start", r)[-1]["pid"] for r in OTHERS]
        t_held = time.time()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        bj_log = run / "logs" / f"{plan.region(CUT).gateway.name}-0.log"
        _wait("beijing's QuorumLost", run, proc, lambda: "no quorum of 2" in bj_log.read_text())
        _set_links(plan, CUT, "up")
        t_up = time.time()
        _wait("beijing restarted", run, proc, lambda: len(of(events(run), "start", CUT)) == 2)
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
    healed = trained_on_and_healed(log, CUT, OTHERS, STEPS, held=(t_held, t_woke))
    after_cut = [e for e in of(log, "step", OTHERS[0]) if e["t"] > t_cut]
    print(f"stall after the cut {after_cut[0]['t'] - t_cut:.1f} s")
    left_out = [e for e in of(log, "quorum", OTHERS[0]) if e["t"] > t_cut]
    assert left_out and left_out[0]["members"] == list(OTHERS)
    print(f"healed {healed['t'] - t_up:.1f} s after the links came up")
    assert of(log, "quorum", CUT)[-1]["members"] == [CUT, *OTHERS]
