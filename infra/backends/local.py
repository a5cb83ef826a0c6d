"""`local`: one machine, each region a group of processes (`geotrain train`). No root,
no cloud; the overlay is loopback and there is nothing to route."""

from __future__ import annotations

import shlex

import pulumi

from infra.backends.base import BackendContext, Parent
from infra.components.delivery import Target, run, write_file
from infra.plan import PlanRegion
from infra.render import (
    render_alert_rules,
    render_dashboard,
    render_launch_spec,
    render_prometheus,
)
from infra.render.monitoring import RULES_FILE
from training.spec import node_root

HERE = Target(connection=None)


class LocalBackend:
    kind = "local"

    def pool(
        self, ctx: BackendContext, region: PlanRegion, parent: Parent
    ) -> list[pulumi.Resource]:
        plan = ctx.plan
        ckpt = render_launch_spec(plan).checkpoint.dir
        roots = {n.name: str(node_root(ckpt, plan.stack, n.name, n.region)) for n in region.nodes}
        return [
            run(
                f"{parent.name}-{n.name}-dirs",
                HERE,
                f"mkdir -p {shlex.quote(roots[n.name])} .geotrain/{plan.stack}/logs/{n.name}",
                parent.opts(),
                # the checkpoints are the run's only copy of its progress: delete keeps them
                delete=f"rm -rf .geotrain/{plan.stack}/logs/{n.name}",
            )
            for n in region.nodes
        ]

    def overlay(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        return []  # regions share loopback

    def routing(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        return []

    def monitoring(self, ctx: BackendContext, parent: Parent) -> list[pulumi.Resource]:
        return monitoring_here(ctx, parent)

    def run_key(self, ctx: BackendContext, parent: Parent) -> pulumi.Output[str] | None:
        return None  # `geotrain keygen` makes it on this machine; it never enters state

    def deliver(
        self,
        ctx: BackendContext,
        region: PlanRegion,
        run_key: pulumi.Output[str] | None,
        parent: Parent,
    ) -> list[pulumi.Resource]:
        return spec_and_key_here(ctx, region, parent)


def spec_and_key_here(
    ctx: BackendContext, region: PlanRegion, parent: Parent
) -> list[pulumi.Resource]:
    """Single-machine stacks: the spec and the run key once, on this machine (with the
    first region, since every region runs here)."""
    plan = ctx.plan
    if region.name != plan.regions[0].name:
        return []
    spec = render_launch_spec(plan)
    return [
        write_file(
            f"{parent.name}-spec",
            HERE,
            f".geotrain/{plan.stack}/launch-spec.json",
            spec.to_json(),
            parent.opts(),
        ),
        run(f"{parent.name}-key", HERE, f"geotrain keygen --out {spec.key_file}", parent.opts()),
    ]


def monitoring_here(ctx: BackendContext, parent: Parent) -> list[pulumi.Resource]:
    """Prometheus' config, rules and the dashboard under .geotrain/<stack>/monitoring;
    `geotrain train` runs Prometheus on them when it is installed."""
    plan = ctx.plan
    base = f".geotrain/{plan.stack}/monitoring"
    files = {
        "prometheus-yml": (f"{base}/prometheus.yml", render_prometheus(plan)),
        "rules": (f"{base}/{RULES_FILE}", render_alert_rules(plan)),
        "dashboard": (f"{base}/grafana/geotrain.json", render_dashboard(plan)),
    }
    return [
        write_file(f"{parent.name}-{role}", HERE, path, text, parent.opts())
        for role, (path, text) in files.items()
    ]
