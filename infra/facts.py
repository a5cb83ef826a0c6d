"""Pure: the policy-relevant facts of each component, from the plan.

Each component registers `{"facts": ...}` as its props, so the policy pack sees the same
facts under `pulumi preview --policy-pack policies` and under `geotrain check` (mocks).
"""

from __future__ import annotations

from typing import Any

from infra.model.clouds import CLOUD_KINDS, CLOUDS
from infra.plan import Plan, PlanRegion
from infra.render.k8s import worker_spec
from training.spec import listeners


def tags(plan: Plan, jurisdiction: str | None = None) -> dict[str, str]:
    t = dict(plan.tags)
    if jurisdiction:
        t["jurisdiction"] = jurisdiction
    return t


def pool_facts(plan: Plan, r: PlanRegion) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "region": r.name,
        "jurisdiction": r.jurisdiction,
        "kind": r.kind,
        "nodes": [
            {"name": n.name, "gpu_type": n.gpu_type, "gpus": n.gpus, "address": n.address}
            for n in r.nodes
        ],
        "tags": tags(plan, r.jurisdiction),
    }
    if r.kind in CLOUD_KINDS:
        facts.update(_cloud_pool(plan, r, facts["nodes"]))
    return facts


def _cloud_pool(plan: Plan, r: PlanRegion, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Cloud pools: each node's instance type and its list price in the cloud region (the
    budget rule's numbers), and where SSH may come from (the firewall rule's)."""
    s, cloud = r.pool.cloud, CLOUDS[r.kind]
    for n in nodes:
        t = cloud.instance(n["gpu_type"], n["gpus"])
        offer = t.offers.get(str(s.region)) if t else None
        n["instance_type"] = t.name if t else None
        n["usd_per_hour"] = offer.usd_per_hour if offer else None
    return {
        "cloud": {
            "provider": r.kind,
            "region": s.region,
            "zone": s.zone,
            "spot": s.spot,
            "admin_cidrs": [str(c) for c in plan.network.admin_cidrs],
        }
    }


def overlay_facts(plan: Plan) -> dict[str, Any]:
    single_host = plan.regions[0].kind == "local"
    facts: dict[str, Any] = {
        "links": [
            {
                "a": t.a,
                "b": t.b,
                "transport": "loopback" if single_host else "wireguard",
                "ifnames": [t.a_ifname, t.b_ifname],
            }
            for t in plan.tunnels
        ],
        "tags": tags(plan),
    }
    if plan.regions[0].kind == "kubernetes":
        facts.update(_kubernetes_overlay(plan))
    return facts


def _kubernetes_overlay(plan: Plan) -> dict[str, Any]:
    """Kubernetes regions: links are WireGuard tunnels between the regions' gateway pods
    (one region: no links, no gateway); pods reach them over the cluster network."""
    from infra.render import k8s

    gateways = {
        r.name: f"{k8s.names(plan, r).gateway} (Deployment, hostNetwork)"
        for r in plan.regions
        if k8s.multi_region(plan)
    }
    links = [
        {
            **link,
            "transport": k8s.TRANSPORT,
            "endpoints": [gateways[link["a"]], gateways[link["b"]]],
        }
        for link in overlay_links(plan)
    ]
    return {"links": links, "gateways": gateways}


def overlay_links(plan: Plan) -> list[dict[str, Any]]:
    return [{"a": t.a, "b": t.b, "ifnames": [t.a_ifname, t.b_ifname]} for t in plan.tunnels]


def routing_facts(plan: Plan) -> dict[str, Any]:
    return {
        "asns": {r.name: r.asn for r in plan.regions},
        "subnets": {r.name: r.subnet for r in plan.regions},
        "links": [[t.a, t.b] for t in plan.tunnels],
        "bfd": True,
        "tags": tags(plan),
    }


def monitoring_facts(plan: Plan) -> dict[str, Any]:
    mon = plan.monitoring
    host = plan.monitoring_host.private_ip
    endpoints = [
        {"service": "prometheus", "bind": host, "port": mon.prometheus_port},
        {"service": "grafana", "bind": host, "port": mon.grafana_port},
    ]
    # every worker's metrics endpoint, from the function the worker binds with
    endpoints += [e for e in listeners(worker_spec(plan)) if e["service"] == "metrics"]
    return {"endpoints": endpoints, "tags": tags(plan)}


def training_facts(plan: Plan) -> dict[str, Any]:
    spec = worker_spec(plan)
    return {
        "sync": spec.sync,
        "cipher": spec.codec.cipher,
        "quantize": spec.codec.quantize,
        "regions": {r.name: r.jurisdiction for r in plan.regions},
        # each region's DP-SGD budget as the workers run it (None: no DP)
        "privacy": {
            r.name: {"target_epsilon": r.privacy.target_epsilon, "delta": r.privacy.delta}
            if r.privacy
            else None
            for r in spec.regions
        },
        "shards": [
            {"name": s.name, "jurisdiction": s.jurisdiction, "region": s.region}
            for s in plan.training.data_shards
        ],
        # what the runtime sends across borders; raw data never is
        "cross_region_flows": ["pseudo-gradients" if spec.sync == "diloco" else "gradients"],
        "checkpoint": {
            "interval_minutes": spec.checkpoint.interval_minutes,
            "keep": spec.checkpoint.keep,
        },
        # what the runtime listens on, as it binds it (training.spec.listeners): the
        # rendezvous store on the master address, every worker's gloo on its node's
        "endpoints": [e for e in listeners(spec) if e["service"] != "metrics"],
        "tags": tags(plan),
    }
