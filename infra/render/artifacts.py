"""Every artifact of a stack, as (path, content) pairs: what `geotrain render` writes and
what the components deliver."""

from __future__ import annotations

import json
from dataclasses import dataclass

from infra.plan import Plan
from infra.render.host import render_host, role_for
from infra.render.k8s import render_k8s, worker_spec
from infra.render.monitoring import monitoring_files


@dataclass(frozen=True)
class Artifact:
    path: str
    """Relative path under the render directory (node/<name>/... for per-node files)."""
    content: str
    node: str | None = None
    """Node that receives the file (None: the operator's machine / all)."""


def render_all(plan: Plan) -> list[Artifact]:
    """The launch spec; per node that runs the host agent its host files (`nodes/<node>/`,
    the text of its bundle: host.json and what it installs); Kubernetes manifests; the
    monitoring files."""
    kube = all(r.kind == "kubernetes" for r in plan.regions)
    # pods get node addresses they can use (their DNS names; see infra/render/k8s.py)
    spec_json = worker_spec(plan).to_json()
    out = [Artifact("launch-spec.json", spec_json)]
    for r in plan.regions:
        role = role_for(r.kind)
        if role is not None:
            for n in r.nodes:
                host, files = render_host(plan, n, role)
                out.append(Artifact(f"nodes/{n.name}/host.json", host.to_json(), n.name))
                out += [
                    Artifact(f"nodes/{n.name}/{rel}", text, n.name)
                    for rel, text in sorted(files.items())
                ]
        if r.kind == "kubernetes":  # secrets as placeholders; kube-prometheus-stack objects
            docs = render_k8s(plan, r)
            out.append(Artifact(f"kubernetes/{r.name}.json", json.dumps(docs, indent=2) + "\n"))
    if plan.monitoring.enabled and not kube:
        # Prometheus, its rules and their promtool tests, Alertmanager and Grafana on the
        # monitoring host; exporter settings on ssh nodes (host paths: monitoring_files)
        out += [Artifact(f.artifact, f.content, f.node) for f in monitoring_files(plan)]
    return out
