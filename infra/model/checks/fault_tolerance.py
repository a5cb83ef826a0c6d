"""`geotrain:training.fault_tolerance`: where the Lighthouse runs, quorum sizes, timeouts,
what fault tolerance cannot be combined with, and its ports against the other services on
its nodes."""

from __future__ import annotations

from infra.model.checks.common import err
from infra.model.gpus import GPU_TYPES
from infra.model.schema import StackModel
from training.errors import ConfigError
from training.spec import fault_tolerance_conflict

HEARTBEAT_INTERVAL_S = 0.1
"""torchft's Manager heartbeat interval (its default, which training.ft.quorum keeps)."""
MIN_HEARTBEAT_TIMEOUT_S = 5 * HEARTBEAT_INTERVAL_S


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


def quorum_ports(m: StackModel, span: range, source: str) -> None:
    """fault_tolerance's Lighthouse (on its node) and region stores (store_port + i on
    region i's first node) against what else listens on that node: the runtime metrics
    ports (`span` on every node; on the local stack's one host, one per rank), and with
    monitoring on, Prometheus, Alertmanager and Grafana on the monitoring host and the
    node exporter on ssh and cloud nodes (local and lab run no exporters; dcgm-exporter
    runs on GPU nodes, which fault tolerance refuses)."""
    from infra.model.clouds import CLOUD_KINDS

    ft, mon = m.training.fault_tolerance, m.monitoring
    if ft is None:
        return
    try:
        li, lj = m.lighthouse_node()
    except KeyError:  # check() names it
        return
    if span and all(r.pool.kind == "local" for r in m.regions):
        world = sum(n.gpus for r in m.regions for n in r.pool.nodes)
        span = range(span.start, span.start + world)
    first = m.regions[0]
    mon_host = mon.host or first.pool.gateway or first.pool.nodes[0].name
    where = "training.fault_tolerance"
    on_nodes = [("port", ft.port, m.regions[li], m.regions[li].pool.nodes[lj].name)]
    on_nodes += [
        ("store_port", ft.store_port + i, r, r.pool.nodes[0].name) for i, r in enumerate(m.regions)
    ]
    for key, port, region, node in on_nodes:
        services: dict[int, str] = {}
        if mon.enabled and node == mon_host:
            services[mon.prometheus_port] = "prometheus_port"
            services[mon.alertmanager_port] = "alertmanager_port"
            if mon.grafana:
                services[mon.grafana_port] = "grafana_port"
        if mon.enabled and (region.pool.kind == "ssh" or region.pool.kind in CLOUD_KINDS):
            services[mon.node_exporter_port] = "node_exporter_port"
        other = (
            f"the runtime metrics ports {span.start}-{span.stop - 1}"
            if port in span
            else f"monitoring.{services[port]}"
            if port in services
            else None
        )
        if other is not None:
            raise err(
                source,
                f"{where}.{key}",
                f"{port} on {node} collides with {other} there; move one of them "
                "(the defaults are 29510 for the Lighthouse, 29520 for the stores)",
            )
