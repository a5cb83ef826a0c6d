"""Overlay (WireGuard mesh) and Routing (FRR bgpd + bfdd) between region gateways.

ssh: each gateway generates its WireGuard private key on the host (it never leaves);
the public key comes back as the command's stdout and flows into the peers' configs.
lab: the whole fabric (namespaces' links, wireguard-go, FRR) is `geotrain lab up`, built
from the same renderers. local: regions share loopback; there is nothing to build.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import pulumi

from infra.components.delivery import run, write_file
from infra.components.targets import node_target
from infra.facts import overlay_facts, routing_facts
from infra.plan import Plan, Tunnel
from infra.render import render_frr, render_sysctl, render_wireguard
from infra.render.network import WG_KEY_DIR, frr_daemons

OVERLAY_TOKEN = "geotrain:network:Overlay"
ROUTING_TOKEN = "geotrain:routing:Routing"


@dataclass
class OverlayArgs:
    plan: Plan
    """The stack plan."""


class Overlay(pulumi.ComponentResource):
    public_keys: pulumi.Output[dict[str, str]]

    def __init__(
        self, name: str, args: OverlayArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__(OVERLAY_TOKEN, name, {"facts": overlay_facts(args.plan)}, opts)
        plan = args.plan
        child = pulumi.ResourceOptions(parent=self)
        kind = plan.regions[0].kind
        keys: dict[str, pulumi.Output[str]] = {}
        if kind == "lab":
            # one resource: the lab builds namespaces' links, tunnels and FRR together
            run(
                f"{name}-lab",
                node_target(plan.model, plan.nodes[0]),
                f"geotrain lab up --stack {plan.stack}",
                child,
                delete=f"geotrain lab down --stack {plan.stack}",
                triggers=[plan.run_id],
            )
        elif kind == "ssh":
            keys = self._ssh(name, plan, child)
        self.public_keys = pulumi.Output.all(**keys) if keys else pulumi.Output.from_input({})
        self.register_outputs(
            {"public_keys": self.public_keys, "kind": kind, "tunnels": len(plan.tunnels)}
        )

    def _ssh(
        self, name: str, plan: Plan, opts: pulumi.ResourceOptions
    ) -> dict[str, pulumi.Output[str]]:
        keys: dict[str, pulumi.Output[str]] = {}
        gens = {}
        for r in plan.regions:
            gw = r.gateway
            gens[r.name] = run(
                f"{name}-{gw.name}-wgkey",
                node_target(plan.model, gw),
                # generated once on the host; only the public half is printed
                f"install -d -m 0700 {WG_KEY_DIR} && (test -s {WG_KEY_DIR}/private.key || "
                f"(umask 077; wg genkey > {WG_KEY_DIR}/private.key)) && "
                f"wg pubkey < {WG_KEY_DIR}/private.key",
                opts,
            )
            keys[gw.name] = gens[r.name].stdout
        all_keys = pulumi.Output.all(**keys)
        for r in plan.regions:
            gw = r.gateway
            target = node_target(plan.model, gw)
            write_file(
                f"{name}-{gw.name}-sysctl",
                target,
                "/etc/sysctl.d/90-geotrain.conf",
                render_sysctl(),
                opts,
            )
            for t in plan.tunnels_of(r.name):
                ifname = t.side(r.name).ifname
                conf: pulumi.Output[str] = all_keys.apply(
                    functools.partial(_wg_conf, plan, r.name, t)
                )
                f = write_file(
                    f"{name}-{gw.name}-{ifname}-conf",
                    target,
                    f"/etc/wireguard/{ifname}.conf",
                    conf,
                    pulumi.ResourceOptions(parent=self, depends_on=[gens[r.name]]),
                    mode="0600",
                )
                run(
                    f"{name}-{gw.name}-{ifname}-up",
                    target,
                    f"sysctl --system >/dev/null && systemctl enable wg-quick@{ifname} && "
                    f"systemctl restart wg-quick@{ifname}",
                    pulumi.ResourceOptions(parent=self, depends_on=[f]),
                    delete=f"systemctl disable --now wg-quick@{ifname}",
                    triggers=[f.triggers],
                )
        return keys


def _wg_conf(plan: Plan, region: str, tunnel: Tunnel, keys: Mapping[str, str]) -> str:
    return render_wireguard(plan, region, tunnel, keys)


@dataclass
class RoutingArgs:
    plan: Plan
    """The stack plan."""
    overlay: Overlay
    """Routing runs over the overlay's tunnels."""


class Routing(pulumi.ComponentResource):
    def __init__(
        self, name: str, args: RoutingArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__(ROUTING_TOKEN, name, {"facts": routing_facts(args.plan)}, opts)
        plan = args.plan
        sessions = sum(len(plan.tunnels_of(r.name)) for r in plan.regions)
        if plan.regions[0].kind == "ssh":
            # BGP sessions need the tunnels up first
            after = pulumi.ResourceOptions(parent=self, depends_on=[args.overlay])
            for r in plan.regions:
                gw, target = r.gateway, node_target(plan.model, r.gateway)
                conf = write_file(
                    f"{name}-{gw.name}-frr-conf",
                    target,
                    "/etc/frr/frr.conf",
                    render_frr(plan, r.name),
                    after,
                    mode="0640",
                )
                daemons = write_file(
                    f"{name}-{gw.name}-frr-daemons",
                    target,
                    "/etc/frr/daemons",
                    frr_daemons(),
                    after,
                )
                run(
                    f"{name}-{gw.name}-frr-reload",
                    target,
                    "chown frr:frr /etc/frr/frr.conf && systemctl enable frr && "
                    "systemctl restart frr",
                    pulumi.ResourceOptions(parent=self, depends_on=[conf, daemons]),
                    triggers=[conf.triggers, daemons.triggers],
                )
        self.register_outputs(
            {
                "bgp_sessions": sessions // 2 if sessions else 0,
                "asns": {r.name: r.asn for r in plan.regions},
            }
        )
