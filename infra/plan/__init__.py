"""Pure: StackModel -> Plan (nodes, ranks, addresses, ASNs, tunnels, ports, paths).

Everything derived lives here once, so renderers, components and the lab agree on every
address and port. No I/O, no pulumi.

Renderers read the plan only: the validated settings sections it carries keep their model
types, which this module names for them (`from infra.plan import KubernetesSettings`), so
no renderer imports the model.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from dataclasses import dataclass
from typing import NamedTuple

from infra.model.clouds import CLOUD_GATEWAY_HOST, CLOUD_KINDS
from infra.model.gpus import GPU_TYPES
from infra.model.names import GATEWAY_HOST_INDEX, WORKER_HOST_OFFSET, ifname, lab_netns
from infra.model.schema import (
    Adaptive,
    CloudSettings,
    DataShard,
    KubernetesSettings,
    Link,
    Monitoring,
    Network,
    Policy,
    Pool,
    Privacy,
    StackModel,
    Training,
)
from training.spec import Device

__all__ = [  # the plan, and the settings sections it carries (for renderers' annotations)
    "Adaptive",
    "CloudSettings",
    "KubernetesSettings",
    "Monitoring",
    "Network",
    "Plan",
    "PlanNode",
    "PlanRegion",
    "Policy",
    "Pool",
    "Privacy",
    "Training",
    "Tunnel",
    "TunnelEnd",
    "build_plan",
]


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
    interface: str | None = None
    """The interface for the private address, when the stack names one."""

    @property
    def device(self) -> Device:
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
    pool: Pool
    """The pool's settings (ssh login, Kubernetes cluster, cloud)."""
    privacy: Privacy | None = None
    """The region's DP-SGD budget (None: no DP)."""


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
    a_uplink: str
    """lab: a's underlay interface towards b (u-<peer>)."""
    b_uplink: str
    bandwidth_mbps: int
    shape_mbps: int | None
    """Rate both tunnel ends are shaped to with tc (None: not shaped)."""
    cost: int
    prepend: int
    """AS-path prepends that turn link cost into BGP preference."""
    latency_ms: float = 0.0
    """One-way latency of the link (the lab delays it with a relay: infra/relay.py)."""
    a_relay: str | None = None
    """lab with latency: the relay's address on a's cable (a's endpoint for b)."""
    b_relay: str | None = None
    """lab with latency: the relay's address on b's cable (b's endpoint for a)."""
    relay_netns: str | None = None
    """lab with latency: the namespace the relay runs in."""

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
                self.a_relay or self.b_underlay,
            )
        return TunnelEnd(
            self.b_ip,
            self.a_ip,
            self.b_port,
            self.a_port,
            self.b_ifname,
            self.a,
            self.b_underlay,
            self.b_relay or self.a_underlay,
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
    """Where this gateway sends the tunnel's datagrams (the peer, or the lab's relay)."""


@dataclass(frozen=True)
class Plan:
    stack: str
    model: StackModel
    """The model the plan was built from (being retired: read the sections below)."""
    regions: tuple[PlanRegion, ...]
    tunnels: tuple[Tunnel, ...]
    world_size: int
    master_addr: str
    master_port: int
    monitoring_host: PlanNode
    run_id: str
    network: Network
    """Overlay, tunnels, routing and admin settings (validated stack settings)."""
    training: Training
    """The training job's settings."""
    monitoring: Monitoring
    """Metrics, alerting and dashboard settings."""
    policy: Policy
    """Guardrail settings."""
    tags: dict[str, str]
    """Tags on every resource."""
    lighthouse: PlanNode | None = None
    """The node the fault-tolerance Lighthouse runs on (None: fault tolerance is off)."""

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
        cloud = r.pool.kind in CLOUD_KINDS
        # clouds keep a subnet's first addresses for themselves (clouds.py)
        gw_host = CLOUD_GATEWAY_HOST if cloud else GATEWAY_HOST_INDEX
        for j, n in enumerate(r.pool.nodes):
            is_gw = n.name == gw_name
            host = gw_host if is_gw else WORKER_HOST_OFFSET + j
            private = "127.0.0.1" if r.pool.kind == "local" else str(subnet[host])
            nodes.append(
                PlanNode(
                    name=n.name,
                    region=r.name,
                    kind=r.pool.kind,
                    # a cloud instance's address exists only once it is made
                    address="" if cloud else str(n.address),
                    private_ip=private,
                    gpu_type=n.gpu_type,
                    gpus=n.gpus,
                    first_rank=rank,
                    is_gateway=is_gw,
                    netns=lab_netns(m.stack, n.name) if r.pool.kind == "lab" else None,
                    interface=n.interface,
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
                router_id=str(subnet[gw_host]),
                pool=r.pool,
                privacy=r.privacy,
            )
        )
    tunnels = _tunnels(m, regions)
    lighthouse = None
    if m.training.fault_tolerance is not None:
        i, j = m.lighthouse_node()
        lighthouse = regions[i].nodes[j]
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
        network=m.network,
        training=m.training,
        monitoring=m.monitoring,
        policy=m.policy,
        tags=dict(m.tags),
        lighthouse=lighthouse,
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
        lab = by_name[link.a].kind == "lab"
        # lab cables: two /30s per link, gateway a - relay - gateway b (one used when the
        # link has no latency and the gateways are joined directly)
        cable_a = underlay[2 * i] if lab and 2 * i + 1 < len(underlay) else None
        cable_b = underlay[2 * i + 1] if lab and 2 * i + 1 < len(underlay) else None
        relay = lab and link.latency_ms > 0
        ra: str | None = None
        rb: str | None = None
        if relay:
            assert cable_a is not None and cable_b is not None  # checks: room for both
            ha, hb = list(cable_a.hosts()), list(cable_b.hosts())
            ua, ub, ra, rb = str(ha[0]), str(hb[1]), str(ha[1]), str(hb[0])
        else:
            ua, ub = _underlay(m, link, by_name, cable_a)
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
                a_ifname=ifname("wg-", link.b),
                b_ifname=ifname("wg-", link.a),
                a_underlay=ua,
                b_underlay=ub,
                a_uplink=ifname("u-", link.b),
                b_uplink=ifname("u-", link.a),
                bandwidth_mbps=link.bandwidth_mbps,
                shape_mbps=link.bandwidth_mbps if _shaped(link, by_name[link.a].kind) else None,
                latency_ms=link.latency_ms,
                a_relay=ra,
                b_relay=rb,
                relay_netns=f"gt-{m.stack}-r{i}" if relay else None,
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
        assert net30 is not None  # the checks bound links by transfer_cidr; underlay is larger
        hosts = list(net30.hosts())
        return str(hosts[0]), str(hosts[1])
    a, b = regions[link.a], regions[link.b]
    if _peered(a, b):  # the native peering is the underlay: tunnels use private addresses
        return a.gateway.private_ip, b.gateway.private_ip
    return a.gateway.address, b.gateway.address


def _peered(a: PlanRegion, b: PlanRegion) -> bool:
    """Two regions of the same cloud that both ask for native peering (the checks allow it
    on aws and alicloud only): their gateways reach each other on private addresses."""
    cloud = a.kind in CLOUD_KINDS and a.kind == b.kind
    return cloud and a.pool.cloud.peering and b.pool.cloud.peering


def _shaped(link: Link, kind: str) -> bool:
    return link.shape if link.shape is not None else kind == "lab"


def _shard_identity(s: DataShard) -> dict[str, object]:
    """A shard's fields for the run id; `weight` and `source` (added later) only when set."""
    out = s.model_dump(mode="json", exclude={"weight", "source"})
    if s.weight != 1.0:
        out["weight"] = s.weight
    if s.source is not None:
        out["source"] = s.source
    return out


def _run_id(m: StackModel) -> str:
    """Names the training run: the same for every render of what a checkpoint depends on,
    so a change of codec, cadence, links, tags or ports resumes the run where it was,
    and a change of model, data, seed, sync mode, buckets or layout starts a new one."""
    t = m.training
    fsdp = t.parallel.shard == "fsdp"
    identity: dict[str, object] = {
        "stack": m.stack,
        "model": t.model,
        "sync": t.sync,
        "seed": t.seed,
        "bucket_mb": t.bucket_mb,
        "error_feedback": t.compression.error_feedback,
        # fields added later count only when set, so an older stack keeps its run id
        "shards": [_shard_identity(s) for s in t.data_shards],
        "layout": [
            # FSDP's checkpoints reshard: a region's worker count may change within a run
            [r.name, [[n.name, n.gpu_type] + ([] if fsdp else [n.gpus]) for n in r.pool.nodes]]
            for r in m.regions
        ],
    }
    if t.tokenizer is not None:
        identity["tokenizer"] = t.tokenizer
    if fsdp:
        identity["parallel"] = "fsdp"
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    return f"{m.stack}-{digest}"
