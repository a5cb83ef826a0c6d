"""Monitoring: Prometheus config, alert rules and the Grafana dashboard, from the
monitoring host's backend.

ssh: they travel in the monitoring host's bundle (the agent installs Prometheus and
node-exporter from Debian and restarts Prometheus when they change). local/lab: the files
under .geotrain/<stack>/monitoring; `geotrain train` starts Prometheus there when it is
installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra import tokens
from infra.backends import BackendContext, Parent, backend_for
from infra.facts import monitoring_facts
from infra.render.host import monitoring_urls

TOKEN = tokens.MONITORING


@dataclass
class MonitoringArgs:
    ctx: BackendContext
    """The stack plan and what backends share while the program is built."""


class Monitoring(pulumi.ComponentResource):
    prometheus_url: pulumi.Output[str]
    grafana_url: pulumi.Output[str]

    def __init__(
        self, name: str, args: MonitoringArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        plan = args.ctx.plan
        super().__init__(TOKEN, name, {"facts": monitoring_facts(plan)}, opts)
        host = plan.monitoring_host
        self.resources = (
            backend_for(plan.region(host.region)).monitoring(args.ctx, Parent(name, self))
            if plan.monitoring.enabled
            else []
        )
        prometheus, grafana = monitoring_urls(plan)
        self.prometheus_url = pulumi.Output.from_input(prometheus)
        self.grafana_url = pulumi.Output.from_input(grafana)
        self.register_outputs(
            {
                "prometheus_url": self.prometheus_url,
                "grafana_url": self.grafana_url,
                "targets": sum(n.gpus for n in plan.nodes),
            }
        )
