"""The `geotrain` command line: the group, the offline stack commands (validate, render,
graph, keygen), and the other command modules added to it. Expected failures
(GeotrainError) become one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from geotrain import commands, data_commands, export_command, host_commands, ledger_commands
from geotrain.options import STACK, friendly
from training.errors import OutputError


@click.group()
def cli() -> None:
    """Train one model across regions: validate, render, graph, train, check, lab."""


@cli.command()
@STACK
@friendly
def validate(stack: str) -> None:
    """Parse and check a stack file."""
    from infra.model import load_stack
    from infra.plan import build_plan

    m = load_stack(stack)
    plan = build_plan(m)
    gpus = sum(n.gpus for n in plan.nodes)
    click.echo(
        f"{m.stack}: ok - {len(plan.regions)} regions, {len(plan.nodes)} nodes, "
        f"{gpus} workers, {len(plan.tunnels)} links, run {plan.run_id}"
    )
    from training.spec import quantize_hint  # not training.sync.codec: validate stays torch-free

    t = m.training
    hints = [quantize_hint(t.compression.quantize, t.sync, t.diloco.drift_correction)]
    if t.sync == "diloco":
        from training.sync.diloco import outer_hint

        d = t.diloco
        hints.append(outer_hint(len(plan.regions), d.outer_lr, d.outer_momentum))
    from infra.model.checks import idle_settings

    for hint in [*hints, *idle_settings(m)]:
        if hint:
            click.echo(hint)


@cli.command()
@STACK
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    required=True,
    help="Directory to write the artifacts into.",
)
@friendly
def render(stack: str, out: str) -> None:
    """Write every artifact the Pulumi program would deliver, and per host the bundle its
    agent applies (DIR/bundles/<node>: `geotrain node apply --bundle` takes it). What the
    last render into DIR wrote and this one does not (a node dropped) is removed."""
    from infra.model import load_stack
    from infra.plan import build_plan
    from infra.render import output, render_all
    from infra.render.bundle import render_bundle, runtime_wheel
    from infra.render.host import role_for

    if not out.strip():
        raise click.BadParameter(
            "is empty; name the directory to write into (--out . for this one)",
            param_hint="--out",
        )
    plan = build_plan(load_stack(stack))
    arts = render_all(plan)
    root = Path(out)
    try:
        bundles = {}
        for n in plan.nodes:
            role = role_for(n.kind)
            if role is not None:
                bundles[n.name] = render_bundle(plan, n, role, runtime_wheel())
        removed = output.write(root, plan.stack, arts, bundles)
    except OSError as e:  # a path under --out is a file, read-only, ...
        where = e.filename or root
        raise OutputError(
            f"cannot write {where}: {e.strerror or e}; give --out a directory you can write"
        ) from None
    click.echo(f"wrote {len(arts)} artifacts and {len(bundles)} host bundles to {root}")
    if removed:
        click.echo(f"removed {len(removed)} left from the last render: {', '.join(removed)}")


@cli.command()
@STACK
@friendly
def graph(stack: str) -> None:
    """Run the Pulumi program under mocks and print the resource tree `pulumi up` would
    create (no engine, no cloud)."""
    from infra.mocks import run_under_mocks
    from infra.model import load_stack

    rec = run_under_mocks(load_stack(stack))
    children: dict[str | None, list[Any]] = {}
    urns = {r.urn for r in rec.resources}
    for r in rec.resources:
        parent = r.parent if r.parent in urns else None
        children.setdefault(parent, []).append(r)

    def show(parent: str | None, depth: int) -> None:
        for r in sorted(children.get(parent, []), key=lambda r: (r.type, r.name)):
            click.echo(f"{'  ' * depth}{r.type}  {r.name}")
            show(r.urn, depth + 1)

    click.echo(f"pulumi:pulumi:Stack  geotrain-{stack}")
    show(None, 1)
    click.echo(f"{len(rec.resources)} resources; outputs: {', '.join(sorted(rec.outputs))}")


@cli.command()
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False),
    required=True,
    help="Key file to create (kept if it exists).",
)
@friendly
def keygen(out: str) -> None:
    """Create a run key file (32 random bytes, hex) unless it exists."""
    from training.state.keys import create_key_file

    created = create_key_file(Path(out))
    click.echo(f"{'created' if created else 'kept existing'} {out}")


for command in (
    commands.train,
    commands.launch_node,
    commands.check,
    commands.top,
    commands.plan_cmd,
):
    cli.add_command(command)
cli.add_command(host_commands.lab)
cli.add_command(host_commands.node)
cli.add_command(ledger_commands.ledger)
cli.add_command(data_commands.data)
cli.add_command(export_command.export_cmd)


def main() -> None:
    cli()
