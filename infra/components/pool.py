"""RegionPool: a region's compute, from the region's backend (infra/backends).

local: run directories on this machine. lab: nothing of its own (the lab's hosts come with
`lab up`). ssh: each host's bundle, copied to it. kubernetes: a strict Provider for the
region's cluster plus the workload manifests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra import tokens
from infra.backends import BackendContext, Parent, backend_for
from infra.facts import pool_facts
from infra.plan import PlanRegion

TOKEN = tokens.POOL


@dataclass
class RegionPoolArgs:
    ctx: BackendContext
    """The stack plan and what backends share while the program is built."""
    region: PlanRegion
    """The region this pool serves."""


class RegionPool(pulumi.ComponentResource):
    workers: pulumi.Output[int]

    def __init__(
        self, name: str, args: RegionPoolArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        r, plan = args.region, args.ctx.plan
        super().__init__(TOKEN, name, {"facts": pool_facts(plan, r)}, opts)
        self.resources = backend_for(r).pool(args.ctx, r, Parent(name, self))
        self.workers = pulumi.Output.from_input(sum(n.gpus for n in r.nodes))
        self.register_outputs(
            {
                "workers": self.workers,
                "region": r.name,
                "jurisdiction": r.jurisdiction,
                "kind": r.kind,
            }
        )
