"""The `lab` backend: a stack's regions as network namespaces on one Linux host (root).

Per node a namespace `gt-<node>`. Per region a bridge `br0` in the gateway's namespace
(the region subnet's .1) with a veth to every worker. Per link a veth pair between the two
gateways (the "internet", a /30 from network.underlay_cidr) shaped with `tc tbf` to the
link's bandwidth. Over it, one wireguard-go interface per peer and FRR (zebra, bgpd, bfdd)
per gateway, configured by the same renderers `pulumi up` uses for SSH hosts.

wireguard-go's control sockets live in /run/wireguard, shared by all namespaces, and every
gateway has an interface named after its peer: so each gateway's commands run with its
own directory bind-mounted there (inside `ip netns exec`'s private mount namespace).

`lab_down` removes every namespace, process and file the lab made, also after a failed
`lab_up`; it finds them from the plan, not from state the failed run may not have written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from infra.plan import Plan, PlanRegion, Tunnel
from infra.render import render_frr, render_wireguard
from infra.render.network import strip_wg_quick
from training.errors import LabError

WG_RUN = Path("/run/geotrain-wg")
FRR_ETC, FRR_RUN = Path("/etc/frr"), Path("/var/run/frr")
FRR_DAEMONS = ("zebra", "bfdd", "bgpd")
FRR_BIN = Path("/usr/lib/frr")
NEEDS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "wg": "wireguard-tools",
    "wireguard-go": "wireguard-go",
    "vtysh": "frr",
}


def sh(*args: str, check: bool = True, input: str | None = None) -> str:
    r = subprocess.run(list(args), capture_output=True, text=True, input=input)
    if check and r.returncode != 0:
        raise LabError(f"`{' '.join(args)}` failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def ns_sh(ns: str, script: str, check: bool = True, input: str | None = None) -> str:
    """A shell script in namespace `ns`, with ns's own wireguard socket directory."""
    wg = WG_RUN / ns
    return sh(
        "ip",
        "netns",
        "exec",
        ns,
        "sh",
        "-c",
        f"mount --bind {wg} /run/wireguard && {script}",
        check=check,
        input=input,
    )


def preflight() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces); run it as root or with sudo")
    missing = [f"{cmd} (package {pkg})" for cmd, pkg in NEEDS.items() if not shutil.which(cmd)]
    if not (FRR_BIN / "bgpd").exists():
        missing.append("/usr/lib/frr/bgpd (package frr)")
    if missing:
        raise LabError(
            f"missing {', '.join(missing)}; install with `apt-get install -y "
            "iproute2 wireguard-tools wireguard-go frr`"
        )


def veth_short(peer: str) -> str:
    return ("u-" + peer)[:15]


def lab_up(plan: Plan, state_dir: Path, wait_s: float = 45.0) -> dict[str, object]:
    """Build the lab; returns a summary. On failure everything made is removed."""
    preflight()
    if any(r.kind != "lab" for r in plan.regions):
        raise LabError(
            f"stack {plan.stack} has non-lab pools; `geotrain lab` builds lab stacks only"
        )
    t0 = time.monotonic()
    lab_down(plan, state_dir)  # a previous failed or forgotten lab
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        for r in plan.regions:
            _region(r)
        for i, t in enumerate(plan.tunnels):
            _underlay(plan, t, i)
        keys = {r.gateway.name: _wg_key(r, state_dir) for r in plan.regions}
        for t in plan.tunnels:
            for region in (t.a, t.b):
                _tunnel(plan, plan.region(region), t, keys, state_dir)
        for r in plan.regions:
            _frr(plan, r)
        sessions = wait_for_bgp(plan, wait_s)
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


def _region(r: PlanRegion) -> None:
    gw = r.gateway.netns
    assert gw is not None  # lab nodes always have a namespace (plan)
    for n in r.nodes:
        sh("ip", "netns", "add", str(n.netns))
        sh("ip", "-n", str(n.netns), "link", "set", "lo", "up")
        (WG_RUN / str(n.netns)).mkdir(parents=True, exist_ok=True)
    prefix = r.subnet.split("/")[1]
    sh("ip", "-n", gw, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", gw, "addr", "add", f"{r.gateway.private_ip}/{prefix}", "dev", "br0")
    sh("ip", "-n", gw, "link", "set", "br0", "up")
    for k, n in enumerate(x for x in r.nodes if not x.is_gateway):
        a, b = f"gtl{os.getpid() % 1000}{k}a", f"gtl{os.getpid() % 1000}{k}b"
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        sh("ip", "link", "set", a, "netns", gw)
        sh("ip", "link", "set", b, "netns", str(n.netns))
        sh("ip", "-n", gw, "link", "set", a, "name", f"lan-{k}", "master", "br0", "up")
        sh("ip", "-n", str(n.netns), "link", "set", b, "name", "eth0", "up")
        sh("ip", "-n", str(n.netns), "addr", "add", f"{n.private_ip}/{prefix}", "dev", "eth0")
        sh("ip", "-n", str(n.netns), "route", "add", "default", "via", r.gateway.private_ip)
    for key in (
        "net.ipv4.ip_forward=1",
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
    ):
        sh("ip", "netns", "exec", gw, "sysctl", "-qw", key)


def tbf_args(mbps: int) -> list[str]:
    """tc tbf for a link: burst must hold at least one timer tick of traffic
    (rate / HZ with HZ up to 1000) and one MTU; latency bounds the queue (50 ms)."""
    burst = max(32 * 1024, mbps * 1_000_000 // 8 // 250)
    return ["tbf", "rate", f"{mbps}mbit", "burst", str(burst), "latency", "50ms"]


def _underlay(plan: Plan, t: Tunnel, i: int) -> None:
    ga, gb = plan.region(t.a).gateway, plan.region(t.b).gateway
    a, b = f"gtu{os.getpid() % 1000}{i}a", f"gtu{os.getpid() % 1000}{i}b"
    sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
    for dev, gw, name, addr in (
        (a, ga, veth_short(t.b), t.a_underlay),
        (b, gb, veth_short(t.a), t.b_underlay),
    ):
        ns = str(gw.netns)
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "link", "set", dev, "name", name, "up")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", name)
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            name,
            "root",
            *tbf_args(t.bandwidth_mbps),
        )


def _wg_key(r: PlanRegion, state_dir: Path) -> str:
    """The gateway's private key, made here and kept in the lab's state dir (0600)."""
    key = state_dir / f"{r.gateway.name}.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(sh("wg", "genkey"))
    return sh("wg", "pubkey", input=key.read_text()).strip()


def _tunnel(plan: Plan, r: PlanRegion, t: Tunnel, keys: dict[str, str], state: Path) -> None:
    end = t.side(r.name)
    ns, gw = str(r.gateway.netns), r.gateway.name
    conf = strip_wg_quick(render_wireguard(plan, r.name, t, keys))
    conf_path = state / f"{gw}-{end.ifname}.conf"
    conf_path.write_text(conf)
    ns_sh(
        ns,
        f"WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD=1 wireguard-go {end.ifname} >/dev/null 2>&1",
    )
    ns_sh(
        ns,
        f"wg setconf {end.ifname} {conf_path} && "
        f"wg set {end.ifname} private-key {state / (gw + '.key')}",
    )
    sh("ip", "-n", ns, "addr", "add", f"{end.ip}/31", "dev", end.ifname)
    sh("ip", "-n", ns, "link", "set", end.ifname, "mtu", str(plan.model.network.mtu), "up")


def _frr(plan: Plan, r: PlanRegion) -> None:
    ns = str(r.gateway.netns)
    etc, run = FRR_ETC / ns, FRR_RUN / ns
    for path in (etc, run):
        path.mkdir(parents=True, exist_ok=True)
        shutil.chown(path, "frr", "frr")
    (etc / "frr.conf").write_text(render_frr(plan, r.name))
    (etc / "vtysh.conf").write_text("service integrated-vtysh-config\n")
    for f in etc.iterdir():
        shutil.chown(f, "frr", "frr")
    for d in FRR_DAEMONS:
        sh(
            "ip",
            "netns",
            "exec",
            ns,
            str(FRR_BIN / d),
            "-d",
            "-N",
            ns,
            "-A",
            "127.0.0.1",
            "-f",
            str(etc / "frr.conf"),
        )


def vtysh(ns: str, command: str) -> str:
    return sh("ip", "netns", "exec", ns, "vtysh", "-N", ns, "-c", command)


def bgp_established(plan: Plan) -> int:
    up = 0
    for r in plan.regions:
        ns = str(r.gateway.netns)
        try:
            peers = json.loads(vtysh(ns, "show bgp summary json") or "{}")
        except (LabError, ValueError):
            continue
        for p in peers.get("ipv4Unicast", {}).get("peers", {}).values():
            up += p.get("state") == "Established"
    return up


def bfd_up(plan: Plan) -> int:
    up = 0
    for r in plan.regions:
        try:
            peers = json.loads(vtysh(str(r.gateway.netns), "show bfd peers json") or "[]")
        except (LabError, ValueError):
            continue
        up += sum(p.get("status") == "up" for p in peers)
    return up


def wait_for_bgp(plan: Plan, wait_s: float) -> int:
    """Until every BGP session is established, every BFD session up (failover is armed
    only then) and every gateway has a route to every other region."""
    want = 2 * len(plan.tunnels)
    deadline = time.monotonic() + wait_s
    while True:
        up = bgp_established(plan)
        routes = all(_has_routes(plan, r) for r in plan.regions)
        if up == want and routes and bfd_up(plan) == want:
            return up // 2
        if time.monotonic() > deadline:
            raise LabError(
                f"{up // 2} of {want // 2} BGP sessions established and "
                f"{bfd_up(plan) // 2} BFD sessions up after {wait_s:.0f} s; see "
                "`ip netns exec GW vtysh -N GW -c 'show bgp summary'`"
            )
        time.sleep(0.5)


def _has_routes(plan: Plan, r: PlanRegion) -> bool:
    table = sh("ip", "-n", str(r.gateway.netns), "route", check=False)
    return all(o.subnet in table for o in plan.regions if o.name != r.name)


def lab_down(plan: Plan, state_dir: Path) -> list[str]:
    """Remove every namespace, process and file of this stack's lab; returns what went."""
    removed = []
    existing = set(sh("ip", "netns", "list", check=False).split())
    for n in plan.nodes:
        ns = str(n.netns)
        if ns in existing:
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            _wait_gone(ns)
            sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
        for path in (WG_RUN / ns, FRR_ETC / ns, FRR_RUN / ns):
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
    if state_dir.exists():
        shutil.rmtree(state_dir, ignore_errors=True)
        removed.append(str(state_dir))
    return removed


def _wait_gone(ns: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while sh("ip", "netns", "pids", ns, check=False).split() and time.monotonic() < deadline:
        time.sleep(0.05)


def leftovers(plan: Plan) -> list[str]:
    """What of this stack's lab still exists (for `lab down` verification and tests)."""
    names = {str(n.netns) for n in plan.nodes}
    out = [ns for ns in sh("ip", "netns", "list", check=False).split() if ns in names]
    out += [str(p) for ns in names for p in (WG_RUN / ns, FRR_ETC / ns, FRR_RUN / ns) if p.exists()]
    return out
