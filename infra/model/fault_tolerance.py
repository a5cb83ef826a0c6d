"""`geotrain:training.fault_tolerance`: regions as torchft replica groups (training.quorum).

The stack places the Lighthouse on a region (its first node) or on a named node, and the
plan advertises it on that node's private (overlay) address; the launch spec carries the
resolved `host:port` (infra.render.runtime)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from infra.model.gpus import GPU_TYPES
from training.errors import ConfigError
from training.spec import fault_tolerance_conflict

if TYPE_CHECKING:
    from infra.model.schema import StackModel


class FaultTolerance(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lighthouse: str
    """Region (its first node) or node that runs the Lighthouse; a neutral host is a
    region of its own."""
    min_replicas: int | None = Field(default=None, ge=1)
    """Regions a quorum needs (default: a majority); fewer and the job restarts."""
    port: int = Field(default=29510, ge=1024, le=65000)
    """Port of the Lighthouse on its node."""
    store_port: int = Field(default=29520, ge=1024, le=65000)
    """Region i's rendezvous store listens on its first node at store_port + i."""
    heartbeat_timeout_s: float = Field(default=5.0, gt=0)
    """A region silent this long is left out of the next quorum."""
    join_timeout_s: float = Field(default=30.0, gt=0)
    """How long the Lighthouse waits for a live (heartbeating) region before a smaller
    quorum. At least a round plus a heal: torchft counts it from the first region that
    asks, so when a left-out region waits longer, the next quorum forms the moment a second
    region asks, leaving out the third, which is then behind and heals, every round. A
    dead or cut-off region's heartbeat stops: nobody waits for it."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Cross-region collectives and heals: a dead peer fails a round after at most this."""
    quorum_timeout_s: float = Field(default=600.0, gt=0)
    """How long a region waits for a quorum; with diloco, longer than a merge interval."""

    def replicas(self, regions: int) -> int:
        """min_replicas, or a majority of `regions`."""
        return self.min_replicas if self.min_replicas is not None else regions // 2 + 1


HEARTBEAT_INTERVAL_S = 0.1
"""torchft's Manager heartbeat interval (its default, which training.quorum keeps)."""
MIN_HEARTBEAT_TIMEOUT_S = 5 * HEARTBEAT_INTERVAL_S


def lighthouse_node(m: StackModel) -> tuple[int, int]:
    """(region index, node index) the Lighthouse runs on."""
    ft = m.training.fault_tolerance
    assert ft is not None
    for i, r in enumerate(m.regions):
        if r.name == ft.lighthouse:
            return i, 0
        for j, n in enumerate(r.pool.nodes):
            if n.name == ft.lighthouse:
                return i, j
    raise KeyError(ft.lighthouse)


def _gpu(gpu_type: str) -> bool:
    t = GPU_TYPES.get(gpu_type)
    return t is not None and t.vendor != "none"


def check(m: StackModel, source: str) -> None:
    """ConfigErrors for `training.fault_tolerance` (nothing when it is off)."""
    ft = m.training.fault_tolerance
    if ft is None:
        return
    where = "geotrain:training.fault_tolerance"
    R = len(m.regions)
    names = [r.name for r in m.regions] + [n.name for r in m.regions for n in r.pool.nodes]
    if ft.lighthouse not in names:
        raise ConfigError(
            source,
            f"{where}.lighthouse",
            f"'{ft.lighthouse}' is no region or node; use one of {', '.join(names)}",
        )
    places = [
        (i, j)
        for i, r in enumerate(m.regions)
        for j, n in enumerate(r.pool.nodes)
        if n.name == ft.lighthouse or (r.name == ft.lighthouse and j == 0)
    ]
    if len(places) > 1:
        nodes = [m.regions[i].pool.nodes[j].name for i, j in places]
        raise ConfigError(
            source,
            f"{where}.lighthouse",
            f"'{ft.lighthouse}' names a region and a node of another place "
            f"(it could run on {' or '.join(nodes)}); name the node itself, "
            "or rename the node so no node is called like a region",
        )
    if ft.replicas(R) > R:
        raise ConfigError(
            source,
            f"{where}.min_replicas",
            f"{ft.min_replicas} exceeds the stack's {R} "
            f"regions; use {R // 2 + 1} (a majority) or leave it unset",
        )
    stores = range(ft.store_port, ft.store_port + R)
    if ft.port in stores or m.training.rendezvous_port in stores:
        raise ConfigError(
            source,
            f"{where}.store_port",
            f"ports {stores.start}-{stores.stop - 1} (one per "
            "region) overlap the lighthouse or rendezvous port; move store_port",
        )
    if ft.heartbeat_timeout_s < MIN_HEARTBEAT_TIMEOUT_S:
        raise ConfigError(
            source,
            f"{where}.heartbeat_timeout_s",
            f"{ft.heartbeat_timeout_s:g} s is under {MIN_HEARTBEAT_TIMEOUT_S:g} s: torchft's "
            f"Managers beat every {HEARTBEAT_INTERVAL_S:g} s, so live regions would count as "
            "dead between beats and every quorum would change; use 2 or more",
        )
    if ft.join_timeout_s >= ft.quorum_timeout_s:
        raise ConfigError(
            source,
            f"{where}.join_timeout_s",
            f"{ft.join_timeout_s:g} s is not below quorum_timeout_s {ft.quorum_timeout_s:g}: "
            "regions waiting for a live straggler would give up (QuorumLost, a restart from "
            "checkpoints) before the Lighthouse forms a quorum without it; lower "
            "join_timeout_s or raise quorum_timeout_s",
        )
    if ft.quorum_timeout_s <= ft.heartbeat_timeout_s:
        raise ConfigError(
            source,
            f"{where}.quorum_timeout_s",
            f"{ft.quorum_timeout_s:g} must exceed heartbeat_timeout_s "
            f"{ft.heartbeat_timeout_s:g} (a restarted job waits for stale members to expire)",
        )
    t = m.training
    conflict = fault_tolerance_conflict(
        secure_aggregation=t.compression.secure_aggregation,
        privacy=[r.name for r in m.regions if r.privacy],
        timed_merges=t.sync == "diloco" and t.diloco.interval_minutes is not None,
        streaming=t.sync == "diloco" and (t.diloco.fragments > 1 or t.diloco.tau > 0),
        adaptive=t.compression.adaptive is not None,
        balance=t.balance == "throughput",
        workers={r.name: sum(n.gpus for n in r.pool.nodes) for r in m.regions},
        cuda=[r.name for r in m.regions if any(_gpu(n.gpu_type) for n in r.pool.nodes)],
        kubernetes=any(r.pool.kind == "kubernetes" for r in m.regions),
        topology=t.exchange == "topology",
    )
    if conflict:
        raise ConfigError(source, where, conflict)
