"""Host commands: `geotrain lab up/down` (the namespace lab, root) and `geotrain node
prepare/apply/remove` (the host agent, run on a host as root)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from geotrain.options import STACK, friendly
from training.errors import LabError

if TYPE_CHECKING:
    from infra.plan import Plan


@click.group()
def lab() -> None:
    """The network-namespace lab (root): every node a host with its own root filesystem
    and systemd, configured by the host agent from its bundle."""


def _lab_plan(stack: str) -> tuple[Plan, Path]:
    from infra.model import load_stack
    from infra.plan import build_plan

    plan = build_plan(load_stack(stack))
    return plan, Path(".geotrain") / plan.stack / "lab"


@lab.command("up")
@STACK
@friendly
def lab_up_cmd(stack: str) -> None:
    """Build the lab: hosts, LANs and cables, then the agent on every host."""
    from infra.lab import lab_up

    plan, state = _lab_plan(stack)
    s = lab_up(plan, state)
    click.echo(
        f"lab {s['stack']} up in {s['seconds']} s: {len(s['namespaces'])} "  # type: ignore[arg-type]
        f"namespaces, {s['bgp_sessions']} BGP sessions established"
    )


@lab.command("down")
@STACK
@friendly
def lab_down_cmd(stack: str) -> None:
    """Remove every namespace, process, cgroup and file the lab made."""
    from infra.lab import lab_down, leftovers, preflight

    plan, state = _lab_plan(stack)
    preflight()
    removed = lab_down(plan, state)
    left = leftovers(plan, state)
    if left:
        raise LabError(f"lab down left {', '.join(left)}; remove them by hand")
    click.echo(f"lab down: removed {len(removed)} namespaces and directories")


@click.group()
def node() -> None:
    """The host agent, run on a host as root: bring it to a bundle's state and back.

    `pulumi up` runs the same agent from the bundle it copies
    (`sudo python3 -I BUNDLE/agent.py apply ...`); these commands are for a host that
    has geotrain installed."""


BUNDLE = click.option(
    "--bundle",
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="A node's bundle (`geotrain render --out DIR` writes DIR/bundles/<node>).",
)
DIGEST = click.option(
    "--digest", default=None, help="Refuse the bundle unless its digest is this one."
)


@node.command("prepare")
@BUNDLE
@DIGEST
def node_prepare(bundle: str, digest: str | None) -> None:
    """Install packages and make the gateway's WireGuard key; print its public key."""
    from geotrain.agent.bootstrap import main

    main(["prepare", "--bundle", bundle, *(["--digest", digest] if digest else [])])


@node.command("apply")
@BUNDLE
@DIGEST
@click.option(
    "--secrets-stdin",
    is_flag=True,
    help='Read {"run_key": HEX, "wireguard": {NODE: KEY}, "files": {PATH: TEXT}} on stdin.',
)
def node_apply(bundle: str, digest: str | None, secrets_stdin: bool) -> None:
    """Bring this host to the bundle's state (a second apply changes nothing)."""
    from geotrain.agent.bootstrap import main

    main(
        [
            "apply",
            "--bundle",
            bundle,
            *(["--digest", digest] if digest else []),
            *(["--secrets-stdin"] if secrets_stdin else []),
        ]
    )


@node.command("remove")
@click.option("--purge", is_flag=True, help="Also delete kept checkpoint directories.")
def node_remove(purge: bool) -> None:
    """Return this host to how it was before the agent."""
    from geotrain.agent.bootstrap import main

    main(["remove", *(["--purge"] if purge else [])])


@node.command("status")
@click.option(
    "--textfile",
    default=None,
    help="Also write geotrain_node_drift for node-exporter's textfile collector here.",
)
def node_status(textfile: str | None) -> None:
    """What differs on this host from its last apply (files, services, tunnels, address):
    JSON, exit 3 when anything does. `pulumi refresh` cannot see it; run it by hand, from
    a timer, or over SSH from a scheduled check."""
    from geotrain.agent.bootstrap import main

    main(["status", *(["--textfile", textfile] if textfile else [])])
