"""Pure renderers: Plan -> artifacts. The single source of truth for every file geotrain
delivers; the Pulumi components, the offline CLI, the lab and the tests all call these."""

from infra.render.artifacts import Artifact, render_all
from infra.render.monitoring import render_alert_rules, render_dashboard, render_prometheus
from infra.render.network import render_frr, render_sysctl, render_wireguard
from infra.render.runtime import render_k8s, render_launch_spec, render_worker_unit

__all__ = [
    "Artifact",
    "render_alert_rules",
    "render_all",
    "render_dashboard",
    "render_frr",
    "render_k8s",
    "render_launch_spec",
    "render_prometheus",
    "render_sysctl",
    "render_wireguard",
    "render_worker_unit",
]
