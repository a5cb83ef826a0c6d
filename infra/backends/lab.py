"""`lab`: the stack's nodes as simulated hosts on this Linux machine (root), configured by
the host agent (infra/lab.py). The whole fabric (hosts, cables, the agent on each host)
is one resource, `geotrain lab up` / `lab down`, because its hosts and links span every
region; workers run from `geotrain train`, so delivery is the spec and key here."""

from __future__ import annotations

import pulumi

from infra.backends.base import BackendContext, Parent
from infra.backends.local import HERE, monitoring_here, spec_and_key_here
from infra.components.delivery import run
from infra.lab import fingerprint
from infra.plan import PlanRegion


class LabBackend:
    kind = "lab"

    def pool(
        self, ctx: BackendContext, region: PlanRegion, parent: Parent
    ) -> list[pulumi.Resource]:
        return []  # the lab's hosts are built with the overlay (one `lab up`)

    def overlay(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        stack = ctx.plan.stack
        lab = run(
            f"{parent.name}-lab",
            HERE,
            f"geotrain lab up --stack {stack}",
            # a changed lab is torn down, then built again: `lab up` of the replacement
            # and the old one's `lab down` would otherwise race for the same namespaces
            pulumi.ResourceOptions.merge(
                parent.opts(), pulumi.ResourceOptions(delete_before_replace=True)
            ),
            delete=f"geotrain lab down --stack {stack}",
            triggers=[fingerprint(ctx.plan)],
        )
        return [lab]

    def routing(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        return []  # FRR is part of `lab up`

    def monitoring(self, ctx: BackendContext, parent: Parent) -> list[pulumi.Resource]:
        return monitoring_here(ctx, parent)

    def run_key(self, ctx: BackendContext, parent: Parent) -> pulumi.Output[str] | None:
        return None

    def deliver(
        self,
        ctx: BackendContext,
        region: PlanRegion,
        run_key: pulumi.Output[str] | None,
        parent: Parent,
    ) -> list[pulumi.Resource]:
        return spec_and_key_here(ctx, region, parent)
