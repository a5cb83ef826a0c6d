"""WireGuard, FRR (bgpd + bfdd) and sysctl renderers for region gateways."""

from __future__ import annotations

from collections.abc import Mapping

from infra.model.paths import WG_KEY_DIR
from infra.plan import Plan, Tunnel

BFD_PROFILE = "geotrain"


def pubkey_placeholder(node: str) -> str:
    return f"<public key of {node}>"


def address_placeholder(node: str) -> str:
    """Where a host's address is known only at deploy time (a cloud instance's public IP):
    the agent fills it in from the addresses Pulumi passes on its stdin."""
    return f"<address of {node}>"


def underlay_of(plan: Plan, node: str, known: str) -> str:
    return known or address_placeholder(node)


def render_wireguard(
    plan: Plan,
    region: str,
    tunnel: Tunnel,
    pubkeys: Mapping[str, str] | None = None,
    key_dir: str = WG_KEY_DIR,
) -> str:
    """wg-quick config of `region`'s end of `tunnel`.

    `Table = off`: BGP, not wg-quick, owns routes. AllowedIPs is 0.0.0.0/0 because each
    tunnel has its own interface; the routing table picks the interface, WireGuard only
    authenticates the peer. The private key is read from a file on the host (PostUp).
    """
    end = tunnel.side(region)
    peer, local_ip, port = end.peer, end.ip, end.port
    peer_gw = plan.region(peer).gateway.name
    key = (pubkeys or {}).get(peer_gw, pubkey_placeholder(peer_gw))
    mtu = plan.network.mtu
    return (
        f"# geotrain {plan.stack}: {region} <-> {peer} (link {tunnel.index}, "
        f"{tunnel.bandwidth_mbps} Mbit/s, cost {tunnel.cost})\n"
        "[Interface]\n"
        f"Address = {local_ip}/31\n"
        f"ListenPort = {port}\n"
        f"MTU = {mtu}\n"
        "Table = off\n"
        f"PostUp = wg set %i private-key {key_dir}/private.key\n"
        + (
            f"PostUp = tc qdisc replace dev %i root {tbf(tunnel.shape_mbps)}\n"
            if tunnel.shape_mbps
            else ""
        )
        + "\n[Peer]\n"
        f"# {peer_gw}\n"
        f"PublicKey = {key}\n"
        f"Endpoint = {underlay_of(plan, peer_gw, end.peer_underlay)}:{end.peer_port}\n"
        "AllowedIPs = 0.0.0.0/0\n"
        "PersistentKeepalive = 15\n"
    )


def tbf(mbps: int) -> str:
    """A tc tbf shaping a tunnel to its link's rate: the burst holds at least one timer
    tick of traffic (rate / HZ with HZ up to 250) and one MTU; latency bounds the queue."""
    burst = max(32 * 1024, mbps * 1_000_000 // 8 // 250)
    return f"tbf rate {mbps}mbit burst {burst} latency 50ms"


def strip_wg_quick(conf: str) -> str:
    """The `wg setconf` subset of a wg-quick file (what `wg-quick strip` prints)."""
    quick_only = (
        "Address",
        "MTU",
        "Table",
        "PostUp",
        "PostDown",
        "PreUp",
        "PreDown",
        "DNS",
        "SaveConfig",
    )
    keep = []
    for line in conf.splitlines():
        key = line.split("=", 1)[0].strip()
        if key not in quick_only:
            keep.append(line)
    return "\n".join(keep) + "\n"


def render_frr(plan: Plan, region: str) -> str:
    """frr.conf of a region gateway: eBGP per tunnel with BFD, the region subnet announced,
    link cost turned into AS-path prepends so the cheapest healthy path wins."""
    r = plan.region(region)
    net = plan.network
    lines = [
        f"! geotrain {plan.stack}: gateway {r.gateway.name} of {region} (AS{r.asn})",
        "frr defaults datacenter",
        f"hostname {r.gateway.name}",
        "log stdout informational",
        "service integrated-vtysh-config",
        "!",
        f"ip prefix-list GT-OVERLAY seq 5 permit {net.overlay_cidr} le 32",
        f"ip prefix-list GT-OWN seq 5 permit {r.subnet}",
        "!",
    ]
    for t in plan.tunnels_of(region):
        peer_ip, peer = t.side(region).peer_ip, t.side(region).peer
        lines += [f"route-map GT-OUT-{peer} permit 10", " match ip address prefix-list GT-OVERLAY"]
        if t.prepend:
            lines.append(" set as-path prepend " + " ".join([str(r.asn)] * t.prepend))
        lines += [
            "!",
            f"route-map GT-IN-{peer} permit 10",
            " match ip address prefix-list GT-OVERLAY",
            "!",
        ]
    lines += [
        # routes learnt over BGP leave from the gateway's own region address: without it
        # the kernel picks the tunnel's /31 address, which only the tunnel's peer can
        # route back to, so the gateway's own workers could not reach a region whose best
        # path crosses a third region (their SYNs went unanswered)
        "route-map GT-SRC permit 10",
        f" set src {r.router_id}",
        "!",
        "ip protocol bgp route-map GT-SRC",
        "!",
        f"router bgp {r.asn}",
        f" bgp router-id {r.router_id}",
        " no bgp ebgp-requires-policy",
        " no bgp network import-check",
        # fast keepalives as a backstop; BFD detects failure in interval x multiplier
        " timers bgp 3 9",
    ]
    for t in plan.tunnels_of(region):
        end = t.side(region)
        peer_ip, peer, ifname = end.peer_ip, end.peer, end.ifname
        lines += [
            f" neighbor {peer_ip} remote-as {plan.region(peer).asn}",
            f" neighbor {peer_ip} description {peer} via {ifname}",
            f" neighbor {peer_ip} bfd profile {BFD_PROFILE}",
            # retry a dropped session every 5 s (default 120): a restored link is used
            # again within seconds
            f" neighbor {peer_ip} timers connect 5",
        ]
    lines += [" !", " address-family ipv4 unicast", f"  network {r.subnet}"]
    for t in plan.tunnels_of(region):
        peer_ip, peer = t.side(region).peer_ip, t.side(region).peer
        lines += [
            f"  neighbor {peer_ip} route-map GT-IN-{peer} in",
            f"  neighbor {peer_ip} route-map GT-OUT-{peer} out",
        ]
    lines += [
        " exit-address-family",
        "exit",
        "!",
        "bfd",
        f" profile {BFD_PROFILE}",
        f"  transmit-interval {net.bfd_interval_ms}",
        f"  receive-interval {net.bfd_interval_ms}",
        f"  detect-multiplier {net.bfd_multiplier}",
        " exit",
        "exit",
        "!",
    ]
    return "\n".join(lines) + "\n"


def frr_daemons() -> str:
    """/etc/frr/daemons: only bgpd and bfdd (zebra and mgmtd always run)."""
    return "bgpd=yes\nbfdd=yes\nospfd=no\nisisd=no\nvtysh_enable=yes\n"


def render_sysctl() -> str:
    """Gateways forward between tunnels and the region subnet; rp_filter off because with
    BGP failover a reply may arrive on another tunnel than its request left on."""
    return (
        "# geotrain gateway\n"
        "net.ipv4.ip_forward = 1\n"
        "net.ipv4.conf.all.rp_filter = 0\n"
        "net.ipv4.conf.default.rp_filter = 0\n"
    )
