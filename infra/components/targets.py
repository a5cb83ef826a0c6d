"""How each node is reached by the components: a `Target` per node from the plan.

The ssh private key comes in as an argument (the program reads secret config, nothing
below it does)."""

from __future__ import annotations

import functools

import pulumi
from pulumi_command import remote

from infra.components.delivery import Target
from infra.plan import Plan, PlanNode


def node_target(plan: Plan, node: PlanNode, key: pulumi.Input[str] | None) -> Target:
    """`key`: the ssh private key (secret config `pool.ssh.private_key_config`); None
    when unset, which previews allow."""
    if node.kind in ("local", "lab"):
        return Target(connection=None)
    pool = plan.region(node.region).pool
    if key is None:
        _warn_unset(pool.ssh.private_key_config)
    conn = remote.ConnectionArgs(
        host=node.address, port=pool.ssh.port, user=pool.ssh.user, private_key=key
    )
    return Target(connection=conn, sudo=True)


@functools.cache
def _warn_unset(key: str) -> None:
    # Previews and `geotrain graph` still work; `pulumi up` would fail at connect time,
    # so say once, now, what to set.
    pulumi.log.warn(
        f"{key} is not set: set it with `pulumi config set --secret {key} "
        "< KEYFILE` before `pulumi up`"
    )
