"""Every artifact of a stack, as (path, content) pairs: what `geotrain render` writes and
what the components deliver."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from infra.plan import Plan
from infra.render.monitoring import monitoring_files
from infra.render.network import frr_daemons, render_frr, render_sysctl, render_wireguard
from infra.render.runtime import render_k8s, render_launch_spec, render_worker_unit


@dataclass(frozen=True)
class Artifact:
    path: str
    """Relative path under the render directory (node/<name>/... for per-node files)."""
    content: str
    node: str | None = None
    """Node that receives the file (None: the operator's machine / all)."""


def render_all(plan: Plan, pubkeys: Mapping[str, str] | None = None) -> list[Artifact]:
    spec_json = render_launch_spec(plan).to_json()
    out = [Artifact("launch-spec.json", spec_json)]
    for r in plan.regions:
        gw = r.gateway.name
        if r.kind != "local":
            for t in plan.tunnels_of(r.name):
                ifname = t.side(r.name).ifname
                out.append(
                    Artifact(
                        f"nodes/{gw}/wireguard/{ifname}.conf",
                        render_wireguard(plan, r.name, t, pubkeys),
                        gw,
                    )
                )
            out.append(Artifact(f"nodes/{gw}/frr/frr.conf", render_frr(plan, r.name), gw))
            out.append(Artifact(f"nodes/{gw}/frr/daemons", frr_daemons(), gw))
            out.append(Artifact(f"nodes/{gw}/sysctl.d/90-geotrain.conf", render_sysctl(), gw))
        if r.kind == "ssh":
            for n in r.nodes:
                out.append(
                    Artifact(
                        f"nodes/{n.name}/systemd/geotrain-worker.service",
                        render_worker_unit(plan, n),
                        n.name,
                    )
                )
        if r.kind == "kubernetes":
            docs = render_k8s(plan, r, spec_json)
            out.append(Artifact(f"kubernetes/{r.name}.json", json.dumps(docs, indent=2) + "\n"))
    if plan.model.monitoring.enabled:
        # Prometheus, its rules and their promtool tests, Alertmanager and Grafana on the
        # monitoring host; exporter settings on ssh nodes (host paths: monitoring_files)
        out += [Artifact(f.artifact, f.content, f.node) for f in monitoring_files(plan)]
    return out
