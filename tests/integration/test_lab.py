"""The lab with real daemons: namespaces, wireguard-go, FRR bgpd + bfdd (root only)."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import lab
from infra.model import load_stack
from infra.plan import Plan, build_plan

MISSING = [
    c for c in ("ip", "wg", "wireguard-go", "vtysh", "nft", "nsenter") if not shutil.which(c)
]
pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(bool(MISSING), reason=f"missing {', '.join(MISSING)} (.ci/run installs)"),
]


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plan]:
    p = build_plan(load_stack("lab"))
    state = tmp_path_factory.mktemp("lab")
    lab.lab_up(p, state)
    yield p
    lab.lab_down(p, state)


def _in(ns: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "infra.probe", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


def _ready(p: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """Wait until an echo server has bound its socket (its first line)."""
    assert p.stdout is not None
    line = p.stdout.readline()
    assert '"ready"' in line, line
    return p


def _out(p: subprocess.Popen[str]) -> Any:
    out, _ = p.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def test_every_bgp_session_establishes(plan: Plan) -> None:
    assert lab.bgp_established(plan) == 2 * len(plan.tunnels)
    for r in plan.regions:
        peers = lab.vtysh(plan, r.gateway, "show bfd peers brief")
        assert peers.count(" up ") >= 2, peers


def test_every_region_reaches_every_other_regions_subnet_over_wireguard(plan: Plan) -> None:
    for src in plan.regions:
        for dst in plan.regions:
            if src is dst:
                continue
            target = next(n for n in dst.nodes if not n.is_gateway)
            route = lab.sh("ip", "-n", str(src.gateway.netns), "route", "get", target.private_ip)
            assert " dev wg-" in route, route
            echo = _ready(_in(str(target.netns), "echo", target.private_ip, "7001", "2"))
            worker = next(n for n in src.nodes if not n.is_gateway)
            probe = _in(str(worker.netns), "probe", target.private_ip, "7001", "0.5")
            assert _out(probe)["replies"], f"{src.name} -> {dst.name}: no reply"
            _out(echo)


def test_plaintext_between_regions_never_appears_on_the_underlay(plan: Plan) -> None:
    marker = "GEOTRAIN-PLAINTEXT-" + secrets.token_hex(8)
    bj, fra = plan.region("beijing"), plan.region("frankfurt")
    dst = next(n for n in fra.nodes if not n.is_gateway)
    src = next(n for n in bj.nodes if not n.is_gateway)
    uplink = _uplink(plan, "beijing", "frankfurt")
    cap_under = _ready(_in(str(bj.gateway.netns), "capture", uplink, "3", marker))
    cap_lan = _ready(_in(str(dst.netns), "capture", "eth0", "3", marker))
    echo = _ready(_in(str(dst.netns), "echo", dst.private_ip, "7002", "3"))
    lab.sh(
        "ip",
        "netns",
        "exec",
        str(src.netns),
        sys.executable,
        "-c",
        "import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
        f"for i in range(20): s.sendto(b'{marker}', ('{dst.private_ip}', 7002)); "
        "time.sleep(0.05)",
    )
    under, lan, got = _out(cap_under), _out(cap_lan), _out(echo)
    assert got["count"] > 0 and marker in got["received"][0]
    assert lan["marker_frames"] > 0  # the capture works: it sees the plaintext in the region
    assert under["frames"] >= 20  # the traffic crossed this underlay link ...
    assert under["marker_frames"] == 0  # ... but only encrypted


def test_each_link_adds_its_latency_to_the_round_trip_over_the_overlay(plan: Plan) -> None:
    """The relay in the middle of each cable delays every datagram by latency_ms each way:
    a round trip between two regions' workers over their (cheapest, direct) link takes
    2 x latency, plus what the tunnels and the relay cost here."""
    for t in plan.tunnels:
        if t.cost > 10:  # costlier links may lose to a two-hop path: not a direct RTT
            continue
        src = next(n for n in plan.region(t.a).nodes if not n.is_gateway)
        dst = next(n for n in plan.region(t.b).nodes if not n.is_gateway)
        echo = _ready(_in(str(dst.netns), "echo", dst.private_ip, "7004", "8"))
        rtts = sorted(_out(_in(str(src.netns), "rtt", dst.private_ip, "7004", "9"))["rtts"])
        echo.kill()
        echo.wait()
        assert len(rtts) >= 8, f"{t.a}-{t.b}: lost probes {rtts}"
        median, want = rtts[len(rtts) // 2], 2 * t.latency_ms / 1000
        assert want <= median <= want + 0.05, f"{t.a}-{t.b}: median RTT {median:.3f} s"


def _uplink(plan: Plan, src: str, dst: str) -> str:
    """`src` gateway's cable towards `dst` (the underlay the tunnel runs over)."""
    t = next(t for t in plan.tunnels if {t.a, t.b} == {src, dst})
    return t.a_uplink if t.a == src else t.b_uplink


def _tunnel(plan: Plan, src: str, dst: str) -> str:
    """`src` gateway's WireGuard interface towards `dst`."""
    t = next(t for t in plan.tunnels if {t.a, t.b} == {src, dst})
    return t.side(src).ifname


def _route_dev(plan: Plan, src: str, dst_ip: str) -> str:
    out = lab.sh("ip", "-n", str(plan.region(src).gateway.netns), "route", "get", dst_ip)
    return out.split(" dev ")[1].split()[0]


def test_cutting_beijing_frankfurt_reroutes_via_silicon_valley_and_back(plan: Plan) -> None:
    fra_w = next(n for n in plan.region("frankfurt").nodes if not n.is_gateway)
    bj_w = next(n for n in plan.region("beijing").nodes if not n.is_gateway)
    bj_gw = str(plan.region("beijing").gateway.netns)
    cable = _uplink(plan, "beijing", "frankfurt")
    assert _route_dev(plan, "beijing", fra_w.private_ip) == _tunnel(plan, "beijing", "frankfurt")
    echo = _ready(_in(str(fra_w.netns), "echo", fra_w.private_ip, "7003", "12"))
    probe = _in(str(bj_w.netns), "probe", fra_w.private_ip, "7003", "8")
    time.sleep(2.0)  # the scenario: 2 s of steady traffic, then the cut (not a sync wait)
    lab.sh("ip", "-n", bj_gw, "link", "set", cable, "down")
    try:
        replies = _out(probe)["replies"]
        via_sv = _tunnel(plan, "beijing", "silicon-valley")
        assert _route_dev(plan, "beijing", fra_w.private_ip) == via_sv
        gaps = [b - a for a, b in itertools.pairwise(replies)]
        assert replies[-1] > 6.0, "traffic did not resume over the alternate path"
        assert max(gaps) < 3.0, f"failover took {max(gaps):.2f} s"
    finally:
        lab.sh("ip", "-n", bj_gw, "link", "set", cable, "up")
        _out(echo)
    deadline = time.monotonic() + 40
    while _route_dev(plan, "beijing", fra_w.private_ip) != _tunnel(plan, "beijing", "frankfurt"):
        assert time.monotonic() < deadline, "the restored link was not used again"
        time.sleep(0.5)


def test_a_gateway_sends_to_other_regions_from_its_own_region_address(plan: Plan) -> None:
    """A gateway that also runs workers opens connections to other regions itself. Its
    BGP routes carry its region address as source, not the tunnel's /31 (which only the
    tunnel's peer routes back to, so a path across a third region would lose the
    replies)."""
    for r in plan.regions:
        for other in plan.regions:
            if other.name == r.name:
                continue
            dst = next(n for n in other.nodes if not n.is_gateway).private_ip
            out = lab.sh("ip", "-n", str(r.gateway.netns), "route", "get", dst)
            assert f" src {r.router_id} " in f"{out} ", f"{r.name} -> {other.name}: {out}"


def test_lab_down_leaves_nothing_behind_even_after_a_failed_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = build_plan(load_stack(_copy_stack(tmp_path, "labfail")))
    # lab_up fails half way: hosts booted, bundles uploaded, the agent's apply fails
    monkeypatch.setattr(
        lab,
        "_apply_node",
        lambda h, bundle, keys: (_ for _ in ()).throw(lab.LabError("injected failure")),
    )
    state = tmp_path / "state"
    with pytest.raises(lab.LabError, match="injected failure"):
        lab.lab_up(p, state)
    assert lab.leftovers(p, state) == []


def _copy_stack(tmp: Path, name: str) -> str:
    """The lab stack under another name: its namespaces (gt-<stack>-<node>) differ, so it
    can be built next to the module's lab."""
    path = tmp / f"Pulumi.{name}.yaml"
    shutil.copyfile(Path(__file__).resolve().parents[2] / "stacks" / "Pulumi.lab.yaml", path)
    return str(path)


def test_lab_builds_every_path_it_needs_on_a_fresh_run(tmp_path: Path) -> None:
    """A machine where wireguard-go, FRR and the lab never ran: a private mount namespace
    whose /run is an empty tmpfs (no /run/wireguard, /run/frr, /run/netns, /run/lock)."""
    stack = _copy_stack(tmp_path, "labfresh")
    cli = f"{shlex.quote(sys.executable)} -m geotrain lab"
    script = (
        "set -e; mount --make-rprivate /; mount -t tmpfs tmpfs /run; "
        f"{cli} up --stack {stack}; ls /run; {cli} down --stack {stack}"
    )
    r = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "BGP sessions established" in r.stdout
    assert "lab down: removed" in r.stdout
    assert lab.leftovers(build_plan(load_stack(stack))) == []
