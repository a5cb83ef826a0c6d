"""Overlay (WireGuard mesh) and Routing (FRR bgpd + bfdd) between region gateways, from
each region's backend (infra/backends).

ssh: each gateway makes its WireGuard key on the host (it never leaves); the public key
comes back as the agent's `prepare` output and flows into the peers' agent input; the
tunnels, their tc shaping and FRR travel in the gateways' bundles. lab: the whole fabric
is `geotrain lab up`. local: regions share loopback; there is nothing to build.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra import tokens
from infra.backends import BackendContext, Parent, backends_of
from infra.facts import overlay_facts, routing_facts

OVERLAY_TOKEN = tokens.OVERLAY
ROUTING_TOKEN = tokens.ROUTING


@dataclass
class OverlayArgs:
    ctx: BackendContext
    """The stack plan and what backends share while the program is built."""


class Overlay(pulumi.ComponentResource):
    public_keys: pulumi.Output[dict[str, str]]

    def __init__(
        self, name: str, args: OverlayArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        ctx = args.ctx
        super().__init__(OVERLAY_TOKEN, name, {"facts": overlay_facts(ctx.plan)}, opts)
        self.resources = [
            res
            for backend, regions in backends_of(ctx.plan.regions)
            for res in backend.overlay(ctx, regions, Parent(name, self))
        ]
        keys = ctx.public_keys
        self.public_keys = pulumi.Output.all(**keys) if keys else pulumi.Output.from_input({})
        self.register_outputs(
            {
                "public_keys": self.public_keys,
                "kinds": sorted({r.kind for r in ctx.plan.regions}),
                "tunnels": len(ctx.plan.tunnels),
            }
        )


@dataclass
class RoutingArgs:
    ctx: BackendContext
    """The stack plan and what backends share while the program is built."""
    overlay: Overlay
    """Routing runs over the overlay's tunnels."""


class Routing(pulumi.ComponentResource):
    def __init__(
        self, name: str, args: RoutingArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        plan = args.ctx.plan
        super().__init__(ROUTING_TOKEN, name, {"facts": routing_facts(plan)}, opts)
        # BGP sessions need the tunnels up first
        parent = Parent(name, self, (args.overlay,))
        self.resources = [
            res
            for backend, regions in backends_of(plan.regions)
            for res in backend.routing(args.ctx, regions, parent)
        ]
        self.register_outputs(
            {
                "bgp_sessions": len(plan.tunnels),
                "asns": {r.name: r.asn for r in plan.regions},
            }
        )
