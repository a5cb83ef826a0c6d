"""Monitoring: Prometheus config, alert rules and the Grafana dashboard, delivered.

ssh: Debian's prometheus and prometheus-node-exporter on the monitoring host, node-exporter
on every node. local/lab: the files under .geotrain/<stack>/monitoring; `geotrain train`
starts Prometheus there when it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra.components.delivery import run, write_file
from infra.components.targets import node_target
from infra.facts import monitoring_facts
from infra.plan import Plan
from infra.render import render_alert_rules, render_dashboard, render_prometheus

TOKEN = "geotrain:monitoring:Monitoring"
REMOTE_DIR = "/etc/prometheus"
DASHBOARD_DIR = "/var/lib/grafana/dashboards"


@dataclass
class MonitoringArgs:
    plan: Plan
    """The stack plan."""


class Monitoring(pulumi.ComponentResource):
    prometheus_url: pulumi.Output[str]

    def __init__(
        self, name: str, args: MonitoringArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__(TOKEN, name, {"facts": monitoring_facts(args.plan)}, opts)
        plan = args.plan
        mon = plan.model.monitoring
        host = plan.monitoring_host
        target = node_target(plan.model, host)
        remote = host.kind in ("ssh",)
        base = REMOTE_DIR if remote else f".geotrain/{plan.stack}/monitoring"
        dash_dir = DASHBOARD_DIR if remote else f"{base}/grafana"
        child = pulumi.ResourceOptions(parent=self)
        files = [
            write_file(
                f"{name}-prometheus-yml",
                target,
                f"{base}/prometheus.yml",
                render_prometheus(plan),
                child,
            ),
            write_file(
                f"{name}-rules",
                target,
                f"{base}/rules/geotrain.rules.yml",
                render_alert_rules(plan),
                child,
            ),
            write_file(
                f"{name}-dashboard",
                target,
                f"{dash_dir}/geotrain.json",
                render_dashboard(plan),
                child,
            ),
        ]
        if remote:
            run(
                f"{name}-prometheus",
                target,
                "DEBIAN_FRONTEND=noninteractive apt-get install -y prometheus && "
                f"promtool check config {base}/prometheus.yml && systemctl restart prometheus",
                pulumi.ResourceOptions(parent=self, depends_on=files),
                triggers=[f.triggers for f in files],
            )
            for n in plan.nodes:
                run(
                    f"{name}-{n.name}-node-exporter",
                    node_target(plan.model, n),
                    "DEBIAN_FRONTEND=noninteractive apt-get install -y "
                    "prometheus-node-exporter && systemctl enable --now prometheus-node-exporter",
                    child,
                )
        self.prometheus_url = pulumi.Output.from_input(
            f"http://{host.private_ip}:{mon.prometheus_port}"
        )
        self.register_outputs(
            {"prometheus_url": self.prometheus_url, "targets": sum(n.gpus for n in plan.nodes)}
        )
