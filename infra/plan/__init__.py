"""Pure: StackModel -> Plan (nodes, ranks, addresses, ASNs, tunnels, ports, paths).

Everything derived lives here once, so renderers, components and the lab agree on every
address and port. No I/O, no pulumi.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from typing import NamedTuple

from infra.model.gpus import GPU_TYPES
from infra.model.schema import Link, StackModel

GATEWAY_HOST_INDEX = 1
"""Gateway's private IP is the subnet's first host; worker j gets host 10 + j."""
WORKER_HOST_OFFSET = 10
IFNAME_MAX = 15  # Linux IFNAMSIZ - 1


@dataclass(frozen=True)
class PlanNode:
    name: str
    region: str
    kind: str
    address: str
    """Management/underlay address the operator reaches (ssh) or 127.0.0.1 (local)."""
    private_ip: str
    """Address inside the region subnet; workers bind here (local: 127.0.0.1)."""
    gpu_type: str
    gpus: int
    first_rank: int
    is_gateway: bool
    netns: str | None
    """lab: the node's network namespace."""

    @property
    def device(self) -> str:
        return "cpu" if GPU_TYPES[self.gpu_type].vendor == "none" else "cuda"


@dataclass(frozen=True)
class PlanRegion:
    name: str
    jurisdiction: str
    asn: int
    subnet: str
    kind: str
    nodes: tuple[PlanNode, ...]
    gateway: PlanNode
    router_id: str
    """BGP router id: the gateway's private IP."""


@dataclass(frozen=True)
class Tunnel:
    """One WireGuard tunnel + eBGP/BFD session between two region gateways."""

    index: int
    a: str
    b: str
    a_ip: str
    """a's tunnel address (/31)."""
    b_ip: str
    a_port: int
    """a's WireGuard listen port for this tunnel."""
    b_port: int
    a_ifname: str
    """a's interface towards b."""
    b_ifname: str
    a_underlay: str
    """lab: a's address on the simulated internet (/30); ssh: a's gateway address."""
    b_underlay: str
    bandwidth_mbps: int
    cost: int
    prepend: int
    """AS-path prepends that turn link cost into BGP preference."""

    def side(self, region: str) -> TunnelEnd:
        """The tunnel as seen from `region`'s gateway."""
        if region == self.a:
            return TunnelEnd(
                self.a_ip,
                self.b_ip,
                self.a_port,
                self.b_port,
                self.a_ifname,
                self.b,
                self.a_underlay,
                self.b_underlay,
            )
        return TunnelEnd(
            self.b_ip,
            self.a_ip,
            self.b_port,
            self.a_port,
            self.b_ifname,
            self.a,
            self.b_underlay,
            self.a_underlay,
        )


class TunnelEnd(NamedTuple):
    ip: str
    peer_ip: str
    port: int
    peer_port: int
    ifname: str
    peer: str
    underlay: str
    peer_underlay: str


@dataclass(frozen=True)
class Plan:
    stack: str
    model: StackModel
    regions: tuple[PlanRegion, ...]
    tunnels: tuple[Tunnel, ...]
    world_size: int
    master_addr: str
    master_port: int
    monitoring_host: PlanNode
    run_id: str

    @property
    def nodes(self) -> tuple[PlanNode, ...]:
        return tuple(n for r in self.regions for n in r.nodes)

    def region(self, name: str) -> PlanRegion:
        return next(r for r in self.regions if r.name == name)

    def node(self, name: str) -> PlanNode:
        return next(n for n in self.nodes if n.name == name)

    def tunnels_of(self, region: str) -> tuple[Tunnel, ...]:
        return tuple(t for t in self.tunnels if region in (t.a, t.b))

    def path(self, template: str) -> str:
        return template.replace("{stack}", self.stack)


def build_plan(m: StackModel) -> Plan:
    regions = []
    rank = 0
    for r in m.regions:
        nodes = []
        subnet = r.subnet
        gw_name = r.pool.gateway or r.pool.nodes[0].name
        for j, n in enumerate(r.pool.nodes):
            is_gw = n.name == gw_name
            host = GATEWAY_HOST_INDEX if is_gw else WORKER_HOST_OFFSET + j
            private = "127.0.0.1" if r.pool.kind == "local" else str(subnet[host])
            nodes.append(
                PlanNode(
                    name=n.name,
                    region=r.name,
                    kind=r.pool.kind,
                    address=str(n.address),
                    private_ip=private,
                    gpu_type=n.gpu_type,
                    gpus=n.gpus,
                    first_rank=rank,
                    is_gateway=is_gw,
                    netns=f"gt-{n.name}" if r.pool.kind == "lab" else None,
                )
            )
            rank += n.gpus
        gateway = next(n for n in nodes if n.is_gateway)
        regions.append(
            PlanRegion(
                name=r.name,
                jurisdiction=r.jurisdiction,
                asn=r.asn,
                subnet=str(subnet),
                kind=r.pool.kind,
                nodes=tuple(nodes),
                gateway=gateway,
                router_id=str(subnet[GATEWAY_HOST_INDEX]),
            )
        )
    tunnels = _tunnels(m, regions)
    first = regions[0].nodes[0]
    mon = m.monitoring.host
    mon_node = next((n for r in regions for n in r.nodes if n.name == mon), regions[0].gateway)
    return Plan(
        stack=m.stack,
        model=m,
        regions=tuple(regions),
        tunnels=tunnels,
        world_size=rank,
        master_addr=first.private_ip,
        master_port=m.training.rendezvous_port,
        monitoring_host=mon_node,
        run_id=_run_id(m),
    )


def _tunnels(m: StackModel, regions: list[PlanRegion]) -> tuple[Tunnel, ...]:
    net = m.network
    index = {r.name: i for i, r in enumerate(regions)}
    by_name = {r.name: r for r in regions}
    transfer = list(net.transfer_cidr.subnets(new_prefix=31))
    underlay = list(net.underlay_cidr.subnets(new_prefix=30))
    out = []
    for i, link in enumerate(net.links):
        t31 = transfer[i]
        ua, ub = _underlay(m, link, by_name, underlay[i] if i < len(underlay) else None)
        out.append(
            Tunnel(
                index=i,
                a=link.a,
                b=link.b,
                a_ip=str(t31[0]),
                b_ip=str(t31[1]),
                # each gateway listens on base + peer's region index: unique per tunnel
                a_port=net.wireguard_port + index[link.b],
                b_port=net.wireguard_port + index[link.a],
                a_ifname=ifname(link.b),
                b_ifname=ifname(link.a),
                a_underlay=ua,
                b_underlay=ub,
                bandwidth_mbps=link.bandwidth_mbps,
                cost=link.cost,
                prepend=link.cost // 10 - 1 if link.cost >= 10 else 0,
            )
        )
    return tuple(out)


def _underlay(
    m: StackModel,
    link: Link,
    regions: dict[str, PlanRegion],
    net30: ipaddress.IPv4Network | None,
) -> tuple[str, str]:
    kind = regions[link.a].kind
    if kind == "lab":
        assert net30 is not None  # checks.py bounds links by transfer_cidr; underlay is larger
        hosts = list(net30.hosts())
        return str(hosts[0]), str(hosts[1])
    return regions[link.a].gateway.address, regions[link.b].gateway.address


def ifname(peer: str) -> str:
    """Interface towards `peer`: 'wg-' + name, cut to Linux's 15-character limit."""
    return ("wg-" + peer)[:IFNAME_MAX]


def _run_id(m: StackModel) -> str:
    """Stable across renders of the same stack: binds payloads and checkpoints to it."""
    digest = hashlib.sha256(m.model_dump_json().encode()).hexdigest()[:10]
    return f"{m.stack}-{digest}"
