"""`pulumi up` of an ssh stack against real hosts (root): the Pulumi program runs under
mocks and every command, copy and random resource it registers is carried out over real
SSH against namespace hosts with their own root filesystem, systemd and sshd
(infra/replay.py follows pulumi-command's create/update/replace/delete semantics).

One deployment's life: up, a second up, a codec and tag change, a change that concerns
one host, destroy. The fixture runs it once and records what each phase did; each test
checks one phase's outcome.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from infra.model import load_stack
from infra.model.paths import FIREWALL_PATH
from infra.replay import Deployment, Replay
from tests.integration import fleet as F
from training.observe.report import complete_events

MISSING = [
    c
    for c in ("ip", "nsenter", "sshd", "ssh", "sftp", "sudo", "nft", "vtysh", "wireguard-go")
    if not shutil.which(c) and not os.path.exists(f"/usr/sbin/{c}")
]
pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespace hosts"),
    pytest.mark.skipif(bool(MISSING), reason=f"missing {', '.join(MISSING)} (.ci/run installs)"),
]
GATEWAYS = ("bj-gw", "fra-0", "sv-0")
LEADERS = ("bj-gw", "fra-0", "sv-0")
"""The hosts of each region's local rank 0: they write the region's step and done events."""
TRAIN_TIMEOUT_S = 600


@dataclass
class Life:
    up: Deployment | None = None
    bgp: dict[str, int] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)
    first: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    firewall: dict[str, str] = field(default_factory=dict)
    region_collective: dict[str, str] = field(default_factory=dict)
    verify: list[str] = field(default_factory=list)
    again: Deployment | None = None
    change: Deployment | None = None
    after_change: dict[str, Any] = field(default_factory=dict)
    second: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    one_host: Deployment | None = None
    destroy: Deployment | None = None
    left: dict[str, list[str]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of each phase (printed with -s: where the module's minutes go)."""

    def lap(self, phase: str, t0: list[float]) -> None:
        now = time.monotonic()
        self.seconds[phase] = round(now - t0[0], 1)
        t0[0] = now


def _events(fl: F.Fleet, node: str) -> list[dict[str, Any]]:
    text = fl.hosts[node].sh("cat /var/lib/geotrain/run/events.jsonl 2>/dev/null", check=False)
    return complete_events(text)


def _worker(fl: F.Fleet, node: str) -> dict[str, str]:
    out = fl.hosts[node].sh(
        "systemctl show geotrain-worker -p ActiveState -p Result -p InvocationID", check=False
    )
    return dict(ln.split("=", 1) for ln in out.splitlines() if "=" in ln)


def _logs(fl: F.Fleet) -> str:
    return "\n".join(
        f"--- {n}\n"
        + h.sh("tail -n 4 /var/lib/geotrain/run/logs/*.log 2>&1 | tail -n 12", check=False)
        for n, h in fl.hosts.items()
    )


def _wait_trained(fl: F.Fleet, since: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """Until every host's worker service finished a run it started after `since`
    (InvocationIDs); returns each region leader's events."""
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    while True:
        states = {n: _worker(fl, n) for n in fl.hosts}
        failed = [n for n, s in states.items() if s.get("Result") not in ("success", None)]
        assert not failed, f"worker failed on {failed}: {states}\n{_logs(fl)}"
        done = all(
            s.get("ActiveState") == "inactive" and s.get("InvocationID") != since.get(n)
            for n, s in states.items()
        )
        if done:
            return {n: _events(fl, n) for n in LEADERS}
        assert time.monotonic() < deadline, f"training did not finish: {states}\n{_logs(fl)}"
        time.sleep(2)


def _bgp(fl: F.Fleet, wait_s: float = 60) -> dict[str, int]:
    deadline = time.monotonic() + wait_s
    while True:
        out = {}
        for gw in GATEWAYS:
            raw = fl.hosts[gw].sh("vtysh -c 'show bgp summary json'", check=False) or "{}"
            peers = json.loads(raw).get("ipv4Unicast", {}).get("peers", {})
            # established, and the peer's region routes received (zebra installs them next)
            out[gw] = sum(
                p.get("state") == "Established" and p.get("pfxRcd", 0) > 0 for p in peers.values()
            )
        if all(v == 2 for v in out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(1)


def _route(fl: F.Fleet, gw: str, to: str, wait_s: float = 30) -> str:
    """`ip route get` once the route learned over BGP is in the kernel (zebra installs it
    just after the session counts the prefix), or the last answer after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        route = fl.hosts[gw].sh(f"ip route get {to}")
        if " dev wg-" in route or time.monotonic() > deadline:
            return route
        time.sleep(0.2)


COLLECTIVE = """
import datetime, os, sys
import torch, torch.distributed as dist
from training.comm import iface
rank, private, master, ifname = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
chosen = iface.socket_env(private, "fleet")["GLOO_SOCKET_IFNAME"]
os.environ["GLOO_SOCKET_IFNAME"] = chosen if ifname == "-" else ifname
wait = datetime.timedelta(seconds=10)
store = dist.TCPStore(master, 29555, 2, rank == 0, timeout=wait)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=wait)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(os.environ["GLOO_SOCKET_IFNAME"], t.item())
"""
"""Two ranks on beijing's two hosts, a plain gloo group on the interface the CUDA path
gives NCCL (training/comm/iface.py; gloo advertises that interface's first address the
way NCCL does), the store on bj-gw's private address (a gateway's is .1)."""


def _collective(fl: F.Fleet, ifname: str = "-", wait_s: int = 90) -> str:
    """'ok <iface>' when both ranks summed 1 + 2 within `wait_s`, else 'failed: <last
    line of rank 1>'. Each rank runs under `timeout` inside its host: a blocked rank is
    killed there at `wait_s` (killing nsenter outside would leave it running)."""
    procs = {
        rank: subprocess.Popen(
            [
                *fl.hosts[node].enter_argv(),
                "timeout",
                "-s",
                "KILL",
                str(wait_s),
                "/opt/geotrain/.venv/bin/python",
                "-c",
                COLLECTIVE,
                str(rank),
                private,
                "10.42.1.1",
                ifname,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, (node, private) in enumerate((("bj-gw", "10.42.1.1"), ("bj-w1", "10.42.1.11")))
    }
    outs = {}
    for rank, p in procs.items():
        out, err = p.communicate(timeout=wait_s + 30)
        outs[rank] = (p.returncode, out.strip(), err.strip().splitlines()[-1:] or ["killed"])
    if all(rc == 0 and out.endswith(" 3.0") for rc, out, _ in outs.values()):
        return "ok " + outs[0][1].split()[0]
    return f"failed: {outs[1][2][0][:200]}"


def _region_collective(fl: F.Fleet) -> dict[str, str]:
    """The collective as deployed, with a wrong interface, and with the firewall's region
    rule gone (put back from the rendered file afterwards)."""
    # a collective that works takes seconds; one that cannot is not waited for long
    out = {"deployed": _collective(fl), "interface lo": _collective(fl, "lo", 14)}
    for n in ("bj-gw", "bj-w1"):
        rules = fl.hosts[n].sh("nft -a list chain inet geotrain input")
        handle = next(ln.rsplit(" ", 1)[1] for ln in rules.splitlines() if "@region" in ln)
        fl.hosts[n].sh(f"nft delete rule inet geotrain input handle {handle}")
    out["no region rule"] = _collective(fl, wait_s=14)
    for n in ("bj-gw", "bj-w1"):
        fl.hosts[n].sh(f"nft -f {FIREWALL_PATH}")
    return out


def _changed(doc: dict[str, Any], **training: Any) -> dict[str, Any]:
    d = copy.deepcopy(doc)
    for k, v in training.items():
        d["config"]["geotrain:training"][k] = v
    return d


@pytest.fixture(scope="module")
def life(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Life]:
    root = tmp_path_factory.mktemp("sshfleet")
    doc = F.stack_doc("sshfleet", steps=6)
    stack = F.write_stack(root / "Pulumi.sshfleet.yaml", doc)
    life = Life()
    t0 = [time.monotonic()]
    with F.fleet(root / "fleet", doc) as fl:
        life.lap("fleet", t0)
        baseline = {n: fl.snapshot(n) for n in fl.hosts}
        life.lap("snapshot", t0)
        replay = Replay(
            root / "state.json", fl.executor(), {"geotrain:sshPrivateKey": fl.private_key()}
        )
        life.up = replay.up(load_stack(str(stack)))
        life.lap("up", t0)
        life.bgp = _bgp(fl)
        life.lap("bgp", t0)
        life.routes = {gw: _route(fl, gw, "10.42.1.11") for gw in ("fra-0", "sv-0")}
        life.first = _wait_trained(fl, {})
        life.lap("first training", t0)
        life.firewall = {
            "outsider->bj-w1 node-exporter": fl.can_connect(fl.outsider, "10.42.1.11", 9100),
            "outsider->bj-w1 ssh": fl.can_connect(fl.outsider, "198.18.1.11", 22),
            "bj-gw->bj-w1 node-exporter": fl.can_connect("gt-fl-bj-gw", "10.42.1.11", 9100),
            "operator->bj-w1 ssh": fl.can_connect(fl.operator, "198.18.1.11", 22),
        }
        life.region_collective = _region_collective(fl)
        life.lap("region collective", t0)
        for n in ("bj-gw", "bj-w1"):  # the units the agent installed, as systemd reads them
            r = fl.hosts[n].exec(
                [
                    "systemd-analyze",
                    "verify",
                    "/etc/systemd/system/geotrain-worker.service",
                    "/etc/systemd/system/geotrain-firewall.service",
                ],
                check=False,
            )
            life.verify += [f"{n}: exit {r.returncode}"] if r.returncode else []
            life.verify += [f"{n}: {ln}" for ln in r.stderr.splitlines() if "geotrain" in ln]
        life.again = replay.up(load_stack(str(stack)))
        life.lap("second up", t0)

        # the codec and a tag change: every host's spec changes, no host is replaced
        invocations = {n: _worker(fl, n).get("InvocationID", "") for n in fl.hosts}
        keys = {n: fl.hosts[n].sh("sha256sum /etc/geotrain/run.key") for n in fl.hosts}
        changed = _changed(doc, compression={"quantize": "int4", "cipher": "sm4-gcm"})
        changed["config"]["geotrain:tags"]["owner"] = "fleet-test-2"
        life.change = replay.up(load_stack(str(F.write_stack(stack, changed))))
        life.lap("change up", t0)
        life.after_change = {
            "quantize": {
                n: json.loads(fl.hosts[n].sh("cat /etc/geotrain/launch-spec.json"))["codec"][
                    "quantize"
                ]
                for n in fl.hosts
            },
            "keys_kept": all(
                fl.hosts[n].sh("sha256sum /etc/geotrain/run.key") == keys[n] for n in fl.hosts
            ),
            "bgp": _bgp(fl),
        }
        life.second = _wait_trained(fl, invocations)
        life.lap("second training", t0)

        # a change that concerns the monitoring host only
        one = copy.deepcopy(changed)
        one["config"]["geotrain:monitoring"]["scrape_interval_s"] = 30
        life.one_host = replay.up(load_stack(str(F.write_stack(stack, one))))
        life.lap("one-host up", t0)

        life.destroy = replay.destroy()
        life.lap("destroy", t0)
        life.left = {n: F.diff(baseline[n], fl.snapshot(n)) for n in fl.hosts}
        for n, h in fl.hosts.items():
            extra = h.sh(
                "ip -o link | grep -o 'wg-[^:@]*' ; ip -4 -o addr | grep -o '10\\.42[0-9./]*' ; "
                # [x]yz: the pattern does not match this shell's own command line
                "pgrep -a -f '[t]raining.worker|[g]eotrain launch|[w]ireguard-go|[b]gpd|[b]fdd'; "
                "systemctl list-units --no-legend 'geotrain-*.service' 'wg-quick*'",
                check=False,
            ).split("\n")
            life.left[n] += [f"running: {x}" for x in extra if x.strip()]
        life.lap("leftovers", t0)
        print(f"deployment life, seconds per phase: {life.seconds}")
        yield life


def _ops(d: Deployment | None, op: str, suffix: str) -> list[str]:
    assert d is not None
    return sorted(n for n in d.ops(op) if n.endswith(suffix))


def test_up_copies_each_bundle_and_runs_the_agent_once_per_host(life: Life) -> None:
    assert len(_ops(life.up, "create", "-bundle")) == 4
    assert len(_ops(life.up, "create", "-wgkey")) == 3
    assert len(_ops(life.up, "create", "-agent")) == 4
    assert life.up is not None and life.up.ops("delete") == []


def test_every_bgp_session_establishes_over_wireguard(life: Life) -> None:
    assert life.bgp == {gw: 2 for gw in GATEWAYS}
    own = {"fra-0": "10.42.2.1", "sv-0": "10.42.3.1"}  # the gateways' region addresses
    for gw, route in life.routes.items():
        assert " dev wg-" in route, f"{gw}: {route}"
        # the gateway's own workers reach beijing from an address beijing routes back to
        assert f" src {own[gw]} " in route, f"{gw}: {route}"


def test_a_three_region_training_completes_with_the_codec_and_equal_replicas(life: Life) -> None:
    done = {n: [e for e in ev if e.get("event") == "done"] for n, ev in life.first.items()}
    assert all(done.values()), done
    digests = {d[-1]["digest"] for d in done.values()}
    assert len(digests) == 1, done  # every region ends with the same weights
    steps = [e for e in life.first["bj-gw"] if e.get("event") == "step"]
    assert steps and steps[-1]["cross_wire"] > 0
    assert steps[-1]["cross_wire"] < steps[-1]["cross_raw"]  # compressed across regions


def test_the_firewall_admits_the_region_and_admins_and_drops_everyone_else(life: Life) -> None:
    assert life.firewall == {
        "outsider->bj-w1 node-exporter": "dropped",
        "outsider->bj-w1 ssh": "dropped",
        "bj-gw->bj-w1 node-exporter": "open",
        "operator->bj-w1 ssh": "open",
    }


def test_a_region_collective_runs_on_the_interface_nccl_is_given_through_the_firewall(
    life: Life,
) -> None:
    # the two hosts of beijing: the LAN interface (its first address is the LAN one), the
    # firewall admitting the region's own hosts; a wrong interface or no rule fails
    rc = life.region_collective
    assert rc["deployed"] == "ok eth0", rc
    assert rc["interface lo"].startswith("failed"), rc
    assert rc["no region rule"].startswith("failed"), rc


def test_the_installed_units_pass_systemd_analyze_verify(life: Life) -> None:
    assert life.verify == []


def test_a_second_up_changes_nothing(life: Life) -> None:
    assert life.again is not None
    assert life.again.changed() == []


def test_a_codec_and_tag_change_updates_hosts_in_place_and_restarts_workers(life: Life) -> None:
    d = life.change
    assert d is not None
    assert len(_ops(d, "update", "-agent")) == 4  # applied in place, never re-created
    assert _ops(d, "replace", "-agent") == [] and _ops(d, "delete", "-agent") == []
    assert len(_ops(d, "replace", "-bundle")) == 4  # a new bundle is a new copy
    assert set(life.after_change["quantize"].values()) == {"int4"}
    assert life.after_change["keys_kept"] is True
    assert life.after_change["bgp"] == {gw: 2 for gw in GATEWAYS}
    for node, ev in life.second.items():
        starts = [e for e in ev if e.get("event") == "resume"]
        assert starts, f"{node}: workers did not resume the run on the new spec"
        assert [e for e in ev if e.get("event") == "done"], node


def test_a_change_for_one_host_touches_only_that_host(life: Life) -> None:
    assert life.one_host is not None
    touched = {s.name for s in life.one_host.changed()}
    assert touched and all("fra-0" in name for name in touched), touched


def test_destroy_returns_every_host_to_how_it_was(life: Life) -> None:
    assert life.destroy is not None
    assert len(_ops(life.destroy, "delete", "-agent")) == 4
    assert life.left == {n: [] for n in life.left}
