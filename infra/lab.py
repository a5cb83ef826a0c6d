"""The `lab` backend: a stack's nodes as simulated hosts on one Linux machine (root),
configured by the same host agent and bundles that `pulumi up` delivers to SSH hosts.

The lab builds only what a datacenter would give a real host, then runs the agent:
- per node a host (`infra.hosts.Host`): its own network namespace `gt-<stack>-<node>`,
  a private root (overlayfs over `/`) and a real systemd as PID 1;
- per region a LAN: a bridge in the lab's switch namespace `gt-<stack>-sw`, with each
  host's `eth0` plugged in;
- per link a cable between the two gateways (the "internet"): a veth pair `u-<peer>`
  with a /30 from network.underlay_cidr; when the link has a latency, two cables to a
  relay namespace `gt-<stack>-r<i>` whose user-space relay (infra/relay.py) delays every
  datagram by the link's latency_ms each way.
Then, per host, the agent (`geotrain node prepare/apply`, entered with nsenter instead of
SSH) installs the rest from the node's bundle: the region address on eth0, the route to
the overlay, WireGuard tunnels (wg-quick; wireguard-go where the kernel has no module)
shaped with tc to the link's bandwidth, FRR bgpd + bfdd, the nftables firewall.

`lab_down` removes every namespace, process, cgroup and file of the lab, also after a
failed `lab_up`; it finds them from the plan, not from state a failed run may not have
written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from geotrain.agent.bootstrap import missing_packages
from geotrain.agent.hostspec import HostSpec
from infra.hosts import (
    Host,
    find_systemd,
    remove_cgroups,
    runtime_binds,
    runtime_venv,
    stop_netns_processes,
)
from infra.plan import Plan, PlanNode, Tunnel
from infra.render.bundle import REPO_ROOT, render_bundle, runtime_wheel
from infra.render.host import ROLES
from training.errors import LabError

ROLE = ROLES["lab"]
"""Lab hosts get the network, firewall and monitoring parts of their bundle; their
workers are started by `geotrain train` (with its restarts and report)."""
VENVS = REPO_ROOT / ".geotrain" / "venvs"
BUNDLE_IN_HOST = "/root/.geotrain/bundles"
NEEDS = {
    "ip": "iproute2",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "tar": "tar",
    "wg": "wireguard-tools",
    "wireguard-go": "wireguard-go",
    "vtysh": "frr",
    "nft": "nftables",
}


def sh(*args: str, check: bool = True, input: str | None = None) -> str:
    r = subprocess.run(list(args), capture_output=True, text=True, input=input)
    if check and r.returncode != 0:
        raise LabError(f"`{' '.join(args)}` failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def switch_netns(plan: Plan) -> str:
    return f"gt-{plan.stack}-sw"


def preflight(plan: Plan | None = None) -> None:
    import os

    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces); run it as root or with sudo")
    missing = [f"{cmd} (package {pkg})" for cmd, pkg in NEEDS.items() if not shutil.which(cmd)]
    if not Path("/lib/systemd/systemd").exists():
        missing.append("/lib/systemd/systemd (package systemd)")
    if missing:
        raise LabError(
            f"missing {', '.join(missing)}; install with `apt-get install -y iproute2 "
            "util-linux wireguard-tools wireguard-go frr nftables systemd`"
        )
    if plan is not None:
        packages: set[str] = set()
        for n in plan.nodes:
            packages |= set(_host_spec(plan, n).packages)
        need = missing_packages(
            HostSpec(
                stack=plan.stack, node="lab", region="", run_id="", packages=tuple(sorted(packages))
            )
        )
        if need:
            raise LabError(
                f"lab hosts have no network to install packages: install "
                f"{' '.join(need)} on this machine first (`apt-get install -y {' '.join(need)}`)"
            )


def fingerprint(plan: Plan) -> str:
    """Digest of everything the lab's hosts are given (changes when a rendered file of any
    host changes); the Pulumi lab resource is rebuilt when it does."""
    from infra.render.host import render_host

    h = hashlib.sha256()
    for n in plan.nodes:
        spec, files = render_host(plan, n, ROLE)
        h.update(spec.to_json().encode())
        for rel in sorted(files):
            h.update(rel.encode() + files[rel].encode())
    return h.hexdigest()


def _host_spec(plan: Plan, node: PlanNode) -> HostSpec:
    from infra.render.host import render_host

    return render_host(plan, node, ROLE)[0]


def hosts(plan: Plan, state_dir: Path, venv: Path) -> dict[str, Host]:
    """The lab's hosts (attached to their running systemd when they are up), sharing the
    runtime venv `venv` read-only."""
    out = {}
    for n in plan.nodes:
        h = Host(
            name=n.name,
            netns=str(n.netns),
            state_dir=state_dir / "hosts" / n.name,
            binds=runtime_binds(venv),
        )
        h.pid = find_systemd(h.netns)
        out[n.name] = h
    return out


def lab_up(plan: Plan, state_dir: Path, wait_s: float = 60.0) -> dict[str, object]:
    """Build the lab; returns a summary. On failure everything made is removed."""
    preflight(plan)
    if any(r.kind != "lab" for r in plan.regions):
        raise LabError(
            f"stack {plan.stack} has non-lab pools; `geotrain lab` builds lab stacks only"
        )
    t0 = time.monotonic()
    lab_down(plan, state_dir)  # a previous failed or forgotten lab
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        _wire(plan)
        _relays(plan, state_dir)
        venv = runtime_venv(runtime_wheel(), VENVS)
        fleet = hosts(plan, state_dir, venv)
        for h in fleet.values():
            h.start()
        keys = {}
        bundles = _bundles(plan, state_dir)
        for n in plan.nodes:
            path = _upload(fleet[n.name], bundles[n.name])
            if n.is_gateway:
                keys[n.name] = _prepare(fleet[n.name], path)
        for n in plan.nodes:
            _apply_node(fleet[n.name], f"{BUNDLE_IN_HOST}/{bundles[n.name].name}", keys)
        sessions = wait_for_bgp(plan, wait_s, fleet)
    except BaseException:
        lab_down(plan, state_dir)
        raise
    summary = {
        "stack": plan.stack,
        "namespaces": [n.netns for n in plan.nodes],
        "bgp_sessions": sessions,
        "seconds": round(time.monotonic() - t0, 2),
    }
    (state_dir / "lab.json").write_text(json.dumps(summary, indent=2))
    return summary


def _wire(plan: Plan) -> None:
    """The physical world: namespaces, region LANs (bridges in the switch namespace) and
    the gateways' cables (veth pairs with /30s)."""
    sw = switch_netns(plan)
    sh("ip", "netns", "add", sw)
    sh("ip", "-n", sw, "link", "set", "lo", "up")
    for i, r in enumerate(plan.regions):
        br = f"br{i}"
        sh("ip", "-n", sw, "link", "add", br, "type", "bridge")
        sh("ip", "-n", sw, "link", "set", br, "up")
        for k, n in enumerate(r.nodes):
            ns = str(n.netns)
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            port = f"p{i}-{k}"
            sh(
                "ip",
                "-n",
                sw,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            sh("ip", "-n", sw, "link", "set", port, "master", br, "up")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
    for t in plan.tunnels:
        _cable(plan, t)


def _cable(plan: Plan, t: Tunnel) -> None:
    """The link's cable: a veth pair between the gateways, or, when the link has a latency,
    two cables to a relay namespace in the middle (infra/relay.py delays every datagram)."""
    ga, gb = plan.region(t.a).gateway, plan.region(t.b).gateway
    na, nb = str(ga.netns), str(gb.netns)
    if t.relay_netns is None:
        _veth(na, t.a_uplink, nb, t.b_uplink)
        ends = [(na, t.a_uplink, t.a_underlay), (nb, t.b_uplink, t.b_underlay)]
    else:
        r = t.relay_netns
        sh("ip", "netns", "add", r)
        sh("ip", "-n", r, "link", "set", "lo", "up")
        _veth(na, t.a_uplink, r, "to-a")
        _veth(nb, t.b_uplink, r, "to-b")
        ends = [
            (na, t.a_uplink, t.a_underlay),
            (nb, t.b_uplink, t.b_underlay),
            (r, "to-a", str(t.a_relay)),
            (r, "to-b", str(t.b_relay)),
        ]
    for ns, dev, addr in ends:
        sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")


def _veth(ns: str, name: str, peer_ns: str, peer_name: str) -> None:
    sh("ip", "-n", ns, "link", "add", name, "type", "veth", "peer", "name", peer_name,
       "netns", peer_ns)  # fmt: skip


def _relays(plan: Plan, state_dir: Path) -> None:
    for t in plan.tunnels:
        if t.relay_netns is not None:
            start_relay(t, state_dir)


RELAY = ("-m", "infra.relay")
"""What the lab runs as a link's relay (benchmarks/lab_network.py runs others to compare)."""


def relay_argv(t: Tunnel) -> list[str]:
    """The relay's arguments for link `t`, in infra/relay.py's order."""
    return [
        str(t.a_relay), str(t.b_port), t.a_underlay, str(t.a_port),
        str(t.b_relay), t.b_underlay, str(t.latency_ms),
    ]  # fmt: skip


def start_relay(t: Tunnel, state_dir: Path, program: Sequence[str] = RELAY) -> None:
    """The relay of a link with latency (`python *program ARGV`, in its namespace); it
    lives until `lab down` kills its namespace."""
    assert t.relay_netns is not None
    log_path = state_dir / f"relay-{t.index}.log"
    cmd = ["ip", "netns", "exec", t.relay_netns, sys.executable, *program, *relay_argv(t)]
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT,
            start_new_session=True,
        )  # fmt: skip
    assert p.stdout is not None
    if p.stdout.readline().strip() != "ready":
        raise LabError(f"the delay relay of link {t.a}-{t.b} did not start; see {log_path}")


def _bundles(plan: Plan, state_dir: Path) -> dict[str, Path]:
    wheel = runtime_wheel()
    out = {}
    for n in plan.nodes:
        b = render_bundle(plan, n, ROLE, wheel)
        out[n.name] = b.write(state_dir / "bundles" / b.digest)
    return out


def _upload(h: Host, bundle: Path) -> str:
    path = f"{BUNDLE_IN_HOST}/{bundle.name}"
    h.upload(bundle, path)
    return path


def _agent(h: Host, bundle: str, *args: str, input: str | None = None) -> str:
    r = h.exec(
        [
            "python3",
            "-I",
            f"{bundle}/agent.py",
            *args,
            "--bundle",
            bundle,
            "--digest",
            Path(bundle).name,
        ],
        input=input,
        check=False,
    )
    if r.returncode != 0:
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        raise LabError(err[-1] if err else f"host {h.name}: agent exited {r.returncode}")
    return r.stdout


def _prepare(h: Host, bundle: str) -> str:
    return _agent(h, bundle, "prepare").strip().splitlines()[-1]


def _apply_node(h: Host, bundle: str, keys: dict[str, str]) -> None:
    _agent(h, bundle, "apply", "--secrets-stdin", input=json.dumps({"wireguard": keys}))


def vtysh(plan: Plan, node: PlanNode, command: str, state_dir: Path | None = None) -> str:
    h = Host(node.name, str(node.netns), Path("/nonexistent"))
    h.pid = find_systemd(h.netns)
    return h.exec(["vtysh", "-c", command]).stdout


def bgp_established(plan: Plan) -> int:
    up = 0
    for r in plan.regions:
        try:
            peers = json.loads(vtysh(plan, r.gateway, "show bgp summary json") or "{}")
        except (LabError, ValueError):
            continue
        for p in peers.get("ipv4Unicast", {}).get("peers", {}).values():
            up += p.get("state") == "Established"
    return up


def bfd_up(plan: Plan) -> int:
    up = 0
    for r in plan.regions:
        try:
            peers = json.loads(vtysh(plan, r.gateway, "show bfd peers json") or "[]")
        except (LabError, ValueError):
            continue
        up += sum(p.get("status") == "up" for p in peers)
    return up


def wait_for_bgp(plan: Plan, wait_s: float, fleet: dict[str, Host] | None = None) -> int:
    """Until every BGP session is established, every BFD session up (failover is armed
    only then) and every gateway has a route to every other region."""
    want = 2 * len(plan.tunnels)
    deadline = time.monotonic() + wait_s
    while True:
        up = bgp_established(plan)
        routes = all(_has_routes(plan, r.name) for r in plan.regions)
        if up == want and routes and bfd_up(plan) == want:
            return up // 2
        if time.monotonic() > deadline:
            gw = plan.regions[0].gateway
            raise LabError(
                f"{up // 2} of {want // 2} BGP sessions established and "
                f"{bfd_up(plan) // 2} BFD sessions up after {wait_s:.0f} s; see "
                f"`nsenter -t $(pgrep -f 'unit=geotrain-host' -n) -a -r vtysh -c 'show bgp "
                f"summary'` in {gw.netns}"
            )
        time.sleep(0.5)


def _has_routes(plan: Plan, region: str) -> bool:
    table = sh("ip", "-n", str(plan.region(region).gateway.netns), "route", check=False)
    return all(o.subnet in table for o in plan.regions if o.name != region)


def _namespaces(plan: Plan) -> list[str]:
    """Every namespace of the lab: hosts, the switch, the relays."""
    relays = [str(t.relay_netns) for t in plan.tunnels if t.relay_netns]
    return [str(n.netns) for n in plan.nodes] + [switch_netns(plan), *relays]


def not_running(plan: Plan) -> list[str]:
    """Lab hosts whose systemd is not running (all of them when the lab is down)."""
    return [str(n.netns) for n in plan.nodes if find_systemd(str(n.netns)) is None]


def lab_down(plan: Plan, state_dir: Path) -> list[str]:
    """Remove every namespace, process, cgroup and file of this stack's lab; returns what
    went."""
    removed = []
    existing = set(sh("ip", "netns", "list", check=False).split())
    for ns in _namespaces(plan):
        if ns in existing:
            stop_netns_processes(ns)
            remove_cgroups(ns)
            sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    if state_dir.exists():
        shutil.rmtree(state_dir, ignore_errors=True)
        removed.append(str(state_dir))
    return removed


def leftovers(plan: Plan, state_dir: Path | None = None) -> list[str]:
    """What of this stack's lab still exists (for `lab down` verification and tests)."""
    names = set(_namespaces(plan))
    out = [ns for ns in sh("ip", "netns", "list", check=False).split() if ns in names]
    out += [str(p) for ns in names for p in _cgroups_of(ns) if p.exists()]
    if state_dir is not None and state_dir.exists():
        out.append(str(state_dir))
    with contextlib.suppress(OSError):
        out += [
            f"process {pid}"
            for ns in names
            for pid in sh("ip", "netns", "pids", ns, check=False).split()
        ]
    return out


def _cgroups_of(ns: str) -> list[Path]:
    from infra.hosts import cgroup_dirs

    return cgroup_dirs(ns)
