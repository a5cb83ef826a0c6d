"""Pure renderers: Plan -> artifacts. The single source of truth for every file geotrain
delivers; the Pulumi components, the offline CLI, the lab and the tests all call these."""

from infra.render.artifacts import Artifact, render_all
from infra.render.k8s import render_k8s
from infra.render.monitoring import (
    alert_rules,
    alert_windows,
    monitoring_files,
    render_alert_rules,
    render_alert_tests,
    render_alertmanager,
    render_dashboard,
    render_grafana_dashboards,
    render_grafana_datasource,
    render_grafana_unit,
    render_prometheus,
    secret_files,
)
from infra.render.network import render_frr, render_sysctl, render_wireguard
from infra.render.packages import host_services
from infra.render.runtime import render_launch_spec, render_worker_unit

__all__ = [
    "Artifact",
    "alert_rules",
    "alert_windows",
    "host_services",
    "monitoring_files",
    "render_alert_rules",
    "render_alert_tests",
    "render_alertmanager",
    "render_all",
    "render_dashboard",
    "render_frr",
    "render_grafana_dashboards",
    "render_grafana_datasource",
    "render_grafana_unit",
    "render_k8s",
    "render_launch_spec",
    "render_prometheus",
    "render_sysctl",
    "render_wireguard",
    "render_worker_unit",
    "secret_files",
]
