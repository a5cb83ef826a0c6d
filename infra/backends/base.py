"""The backend protocol: what each pool kind does for the five concerns of a stack.

- pool: the region's compute (directories, a cluster's workloads, nothing for hosts that
  already exist);
- overlay: the encrypted mesh between regions; returns each gateway's WireGuard public
  key (an Output) where the backend makes keys;
- routing: BGP + BFD over the overlay (for agent backends it travels in the gateways'
  bundles, so there is nothing to add);
- delivery: the launch spec, the run key and everything else a node needs (for agent
  backends: the host agent with the node's bundle);
- shaping: tc on the tunnels, rendered into the WireGuard configs (Tunnel.shape_mbps),
  so it needs no method of its own.

The protocol imports no backend: the kind -> backend table is `registry.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import pulumi

from infra.plan import Plan, PlanRegion
from infra.render.bundle import Bundle


@dataclass(frozen=True)
class Parent:
    """The component a backend adds resources to: children are named `<name>-<role>`."""

    name: str
    """The component's name."""
    resource: pulumi.ComponentResource
    """The component (every child gets parent=resource)."""
    depends_on: tuple[pulumi.Resource, ...] = ()
    """What the children must wait for."""

    def opts(self, *more: pulumi.Resource) -> pulumi.ResourceOptions:
        return pulumi.ResourceOptions(
            parent=self.resource, depends_on=[*self.depends_on, *more] or None
        )


@dataclass
class BackendContext:
    """What the components share with backends while the program is built."""

    plan: Plan
    """The stack plan."""
    public_keys: dict[str, pulumi.Output[str]] = field(default_factory=dict)
    """Gateway node -> WireGuard public key, filled by overlay()."""
    copies: dict[str, pulumi.Resource] = field(default_factory=dict)
    """Node -> the resource that put its bundle on the host (agent backends)."""
    bundles: dict[str, Bundle] = field(default_factory=dict)
    """Node -> its bundle (agent backends)."""
    addresses: dict[str, pulumi.Input[str]] = field(default_factory=dict)
    """Node -> the address its agent is reached on and peers connect to, for hosts whose
    address exists only once deployed (cloud instances: their public IP). Hosts listed in
    the stack use their `address`."""
    host_keys: dict[str, pulumi.Input[str]] = field(default_factory=dict)
    """Node -> the SSH host key (`TYPE BASE64`, ed25519 or ecdsa) that every connection to
    it pins. A backend that makes a host's key (clouds) puts it here before the ssh
    backend's pool() runs; pool() fills in the rest from the stack (`pool.ssh.host_keys`,
    `known_hosts`), else from a first-contact scan recorded in state."""
    grafana_password: pulumi.Output[str] | None = None
    """Grafana's admin password when the engine made it (a secret stack output)."""
    secret: Callable[[str], pulumi.Output[str] | None] = lambda _key: None
    """Reads a secret config key such as `geotrain:sshPrivateKey` (None when unset); the
    program passes the engine's reader, so backends and components never read config."""


class Backend(Protocol):
    kind: str
    """The pool kind (stack key geotrain:regions[].pool.kind)."""

    def pool(
        self, ctx: BackendContext, region: PlanRegion, parent: Parent
    ) -> list[pulumi.Resource]:
        """The region's compute."""
        ...

    def overlay(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        """The overlay for `regions` (all of this kind); fills ctx.public_keys."""
        ...

    def routing(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        """BGP + BFD between `regions`' gateways."""
        ...

    def monitoring(self, ctx: BackendContext, parent: Parent) -> list[pulumi.Resource]:
        """Prometheus' config and rules, when this backend hosts the monitoring host."""
        ...

    def run_key(self, ctx: BackendContext, parent: Parent) -> pulumi.Output[str] | None:
        """The run key as a Pulumi secret, or None when the backend makes it itself."""
        ...

    def deliver(
        self,
        ctx: BackendContext,
        region: PlanRegion,
        run_key: pulumi.Output[str] | None,
        parent: Parent,
    ) -> list[pulumi.Resource]:
        """Put the spec, the run key and the rest on the region's nodes; start workers."""
        ...
