"""The Pulumi program as a function, so `__main__.py`, `geotrain graph/check` and the tests
run the same wiring."""

from __future__ import annotations

import json
from typing import Any

import pulumi

from infra import outputs
from infra.backends import BackendContext
from infra.components.monitoring import Monitoring, MonitoringArgs
from infra.components.network import Overlay, OverlayArgs, Routing, RoutingArgs
from infra.components.pool import RegionPool, RegionPoolArgs
from infra.components.training import TrainingDeployment, TrainingDeploymentArgs
from infra.model.pulumi_config import secret
from infra.model.schema import StackModel
from infra.plan import build_plan


def program(model: StackModel) -> dict[str, Any]:
    """Wire the components for `model`; export and return the stack outputs."""
    # backends read secret config through ctx.secret: the engine's reader, passed in here
    ctx = BackendContext(build_plan(model), secret=secret)
    pools = [RegionPool(f"{r.name}-pool", RegionPoolArgs(ctx, r)) for r in ctx.plan.regions]
    overlay = Overlay("overlay", OverlayArgs(ctx), pulumi.ResourceOptions(depends_on=pools))
    routing = Routing("routing", RoutingArgs(ctx, overlay))
    monitoring = Monitoring("monitoring", MonitoringArgs(ctx))
    training = TrainingDeployment(
        "training", TrainingDeploymentArgs(ctx, [*pools, overlay, routing, monitoring])
    )
    plan = ctx.plan
    exports: dict[str, Any] = {
        outputs.LAUNCH_SPEC: training.launch_spec,
        outputs.RUN_ID: plan.run_id,
        outputs.WORLD_SIZE: plan.world_size,
        outputs.REGIONS: json.dumps({r.name: r.jurisdiction for r in plan.regions}),
        outputs.WIREGUARD_PUBLIC_KEYS: overlay.public_keys,
        outputs.PROMETHEUS_URL: monitoring.prometheus_url,
        outputs.GRAFANA_URL: monitoring.grafana_url,
        outputs.GRAFANA_ADMIN_PASSWORD: ctx.grafana_password or "",
        outputs.HOSTS: hosts(ctx),
    }
    for key, value in exports.items():
        pulumi.export(key, value)
    return exports


def hosts(ctx: BackendContext) -> dict[str, Any]:
    """The HOSTS output: where the operator (and `ssh`) reaches each host, and its private
    address, for the host pools; the public IPs of cloud instances are outputs of theirs."""
    return {
        n.name: {
            "region": r.name,
            "public_ip": ctx.addresses.get(n.name) or n.address,
            "private_ip": n.private_ip,
        }
        for r in ctx.plan.regions
        if r.kind not in ("local", "lab", "kubernetes")
        for n in r.nodes
    }
