"""Run-time commands: `geotrain train` (a whole single-machine stack), `geotrain launch`
(one node's workers, what SSH hosts and pods run), `geotrain check` (the policy pack over
what `pulumi up` would create) and `geotrain top`."""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import click

from geotrain.options import STACK, friendly
from training.errors import ConfigError, OutputError, SpecError
from training.spec import LaunchSpec

if TYPE_CHECKING:
    from geotrain.monitoring import PrometheusProcess
    from infra.model.schema import StackModel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_run_dir(model: StackModel) -> Path:
    """Where `geotrain train` keeps a stack's spec, key, events, logs and report."""
    return Path(".geotrain") / model.stack


def prepare_local_run(model: StackModel, fresh: bool) -> tuple[LaunchSpec, Path, Path]:
    """Render the spec of a single-machine stack into its run dir with a key. The caller
    holds the run dir's lock (this rewrites the spec and the event log)."""
    from infra.model.checks import SINGLE_MACHINE_KINDS
    from infra.plan import build_plan
    from infra.render import render_launch_spec
    from training.errors import KeyFileError
    from training.spec import node_root, record_path
    from training.state.checkpoint import has_steps, remove_checkpoints
    from training.state.keys import create_key_file

    plan = build_plan(model)
    kinds = {r.kind for r in plan.regions}
    if not kinds <= set(SINGLE_MACHINE_KINDS):
        raise SpecError(
            f"stack {model.stack} runs on {sorted(kinds)} pools; `geotrain train` "
            "runs single-machine stacks (local, lab). For ssh/kubernetes use "
            "`pulumi up`, which starts `geotrain launch` on every node"
        )
    if "lab" in kinds:  # workers talk across regions only over the lab's overlay
        from infra.lab import not_running

        down = not_running(plan)
        if down:
            raise SpecError(
                f"the lab of stack {model.stack} is not up ({', '.join(down[:3])} not "
                f"running); build it first with `sudo geotrain lab up --stack {model.stack}`"
            )
    spec = render_launch_spec(plan)
    run_dir = local_run_dir(model)
    roots = {
        n.name: node_root(spec.checkpoint.dir, spec.stack, n.name, r.name)
        for r in spec.regions
        for n in r.nodes
    }
    if fresh:  # every node's root (the dir may hold {node} or {region}): only the
        # checkpointers' files go, whatever else the root holds stays; and the nodes'
        # high-water records, or a root left with other files would read as a rollback
        remove_checkpoints(roots.values(), spec.stack)  # every root checked first
        for node in roots:
            record_path(run_dir, node).unlink(missing_ok=True)
    key = Path(spec.key_file)
    if not key.exists() and not key.is_symlink():
        kept = sorted({str(root) for root in roots.values() if has_steps(root)})
        if kept:  # a new key would verify none of them: training would start over
            raise KeyFileError(
                f"the run key {key} is gone but checkpoints signed with it remain in "
                f"{', '.join(kept)}; put the key file back to resume, or start over with "
                "--fresh (it deletes them)"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    # the rendezvous port is chosen now: a fixed port may be taken on a shared machine
    spec = dataclasses.replace(spec, master_port=free_port())
    spec_path = run_dir / "launch-spec.json"
    spec_path.write_text(spec.to_json())
    create_key_file(Path(spec.key_file))
    (run_dir / "events.jsonl").unlink(missing_ok=True)
    return spec, spec_path, run_dir


@click.command()
@STACK
@click.option("--fresh", is_flag=True, help="Delete this run's checkpoints first.")
@click.option("--steps", type=int, default=None, help="Override the stack's step count.")
@friendly
def train(stack: str, fresh: bool, steps: int | None) -> None:
    """Train on a single-machine stack (local, lab): every region's workers start here."""
    from infra.model import load_stack
    from infra.model.load import with_steps
    from training.launch.launcher import run_lock

    model = load_stack(stack)
    if steps is not None:  # checked with the stack before anything is deleted or written
        model = with_steps(model, steps)
    # before anything is written: a second launcher must not touch the first one's run
    with run_lock(local_run_dir(model), f"stack {model.stack}"):
        _train(stack, *prepare_local_run(model, fresh))


def _train(stack: str, spec: LaunchSpec, spec_path: Path, run_dir: Path) -> None:
    from training.launch.launcher import launch
    from training.observe.plot import INSTALL_HINT, available, write_run_plot
    from training.observe.report import EventLog, Progress, print_report, summarize

    nodes = [n for r in spec.regions for n in r.nodes]
    click.echo(
        f"run {spec.run_id}: {spec.world_size} workers in {len(spec.regions)} regions "
        f"({', '.join(r.name for r in spec.regions)}), {spec.sync}, codec "
        f"{'adaptive' if spec.codec.adaptive else spec.codec.quantize}+zstd+{spec.codec.cipher}; "
        f"logs in {run_dir}/logs"
    )
    log = EventLog(run_dir / "events.jsonl")
    progress = Progress(log, spec.steps)

    def restarted(a: object) -> None:
        who = str(getattr(a, "failed", "?"))
        how = "restarting from the newest checkpoint"
        if spec.fault_tolerance is not None:  # torchrun restarts that region alone
            node = who.split("/")[0]
            region = next((r.name for r in spec.regions for n in r.nodes if n.name == node), "?")
            how = f"restarting region {region} alone; it heals from a live peer"
        progress.say(f"worker {who} exited with {getattr(a, 'rc', '?')}; {how}")

    prom = _start_monitoring(stack, spec.metrics_port, run_dir)
    try:
        with progress:
            result = launch(
                spec, spec_path, nodes, run_dir, on_poll=progress.update, on_restart=restarted
            )
    finally:
        if prom:
            prom.stop()
    report = summarize(log, spec.steps)
    try:
        (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    except OSError as e:  # the run dir removed or its disk full while training
        raise OutputError(
            f"the run's report {run_dir / 'report.json'} cannot be written "
            f"({e.strerror or e}); its checkpoints stay where they are"
        ) from None
    if not result.ok:
        last = result.attempts[-1]
        tail = _log_tail(run_dir / "logs", last.failed)
        raise SpecError(
            f"training failed: worker {last.failed} exited with {last.rc} after "
            f"{len(result.attempts)} attempt(s); {tail}"
        )
    print_report(progress.out, report)
    click.echo(f"report saved to {run_dir / 'report.json'}")
    picture = write_run_plot(log.events, run_dir / "run.png") if available() else None
    click.echo(f"picture of the run: {picture}" if picture else INSTALL_HINT)


def _start_monitoring(stack: str, metrics_port: int, run_dir: Path) -> PrometheusProcess | None:
    """A real Prometheus on the rendered config when it is installed; else say how."""
    from geotrain.monitoring import INSTALL_HINT, start_prometheus
    from infra.model import load_stack
    from infra.plan import build_plan

    if not metrics_port:
        return None
    prom = start_prometheus(build_plan(load_stack(stack)), run_dir)
    if prom:
        click.echo(f"prometheus: {prom.url} (config and alert rules in {run_dir}/prometheus)")
    else:
        click.echo(f"metrics on port {metrics_port}+ per rank; {INSTALL_HINT}")
    return prom


def _log_tail(log_dir: Path, worker: str | None) -> str:
    if not worker:
        return "see the logs"
    node, rank = worker.split("/")
    path = log_dir / f"{node}-{rank}.log"
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"see {path}"
    return f"its last line: {lines[-1] if lines else '(empty)'} ({path})"


@click.command("launch")
@click.option(
    "--spec",
    "spec_file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Launch spec JSON (the stack's launch_spec output).",
)
@click.option("--node", required=True, help="This node's name in the spec.")
@click.option(
    "--run-dir",
    default=".geotrain/run",
    show_default=True,
    help="Where events, logs and the final weights go.",
)
@friendly
def launch_node(spec_file: str, node: str, run_dir: str) -> None:
    """Start one node's workers (what SSH hosts and Kubernetes pods run)."""
    from training.launch.launcher import launch, run_lock
    from training.spec import LaunchSpec

    spec = LaunchSpec.load(spec_file)
    _, n = spec.node(node)
    rd = Path(run_dir)
    with run_lock(rd, f"node {node} (run dir {rd})"):
        result = launch(spec, Path(spec_file), [n], rd)
    if not result.ok:
        last = result.attempts[-1]
        raise SpecError(
            f"node {node}: worker {last.failed} exited with {last.rc} after "
            f"{len(result.attempts)} attempt(s); {_log_tail(rd / 'logs', last.failed)}"
        )
    click.echo(f"node {node}: done")


@click.command()
@STACK
@click.option("--json", "as_json", is_flag=True, help="Print violations as JSON.")
@click.option(
    "--policy-config",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Pack config JSON (as for `pulumi preview --policy-pack-config`); "
    "default: the stack's geotrain:policy settings.",
)
@click.option(
    "--emit-config",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the pack config for this stack to FILE and exit.",
)
@friendly
def check(stack: str, as_json: bool, policy_config: str | None, emit_config: str | None) -> None:
    """Run the policy pack over what `pulumi up` would create (mocks, no engine)."""
    import sys

    from infra.mocks import run_under_mocks
    from infra.model import load_stack
    from policies.rules import config_from_policy_settings
    from policies.runner import check_config, resources_from_recording, run_policies

    model = load_stack(stack)
    if policy_config:
        try:
            raw = json.loads(Path(policy_config).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(policy_config, "-", f"cannot read it as JSON: {e}") from None
        config = check_config(raw, policy_config)
    else:
        config = config_from_policy_settings(model.policy.model_dump())
    if emit_config:
        Path(emit_config).write_text(json.dumps(config, indent=2) + "\n")
        click.echo(f"wrote {emit_config}")
        return
    resources = resources_from_recording(run_under_mocks(model).resources)
    violations = run_policies(resources, config)
    if as_json:
        click.echo(json.dumps([v.__dict__ for v in violations], indent=2))
    else:
        for level in ("mandatory", "advisory"):
            group = [v for v in violations if v.level == level]
            if group:
                click.echo(f"{level} violations ({len(group)}):")
                for v in group:
                    click.echo(f"  {v.message}")
        if not violations:
            click.echo(f"{model.stack}: {len(resources)} resources pass every policy")
    if any(v.level == "mandatory" for v in violations):
        sys.exit(1)


@click.command()
@STACK
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option(
    "--interval",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0.1, max=3600),
    help="Seconds between refreshes.",
)
@friendly
def top(stack: str, once: bool, interval: float) -> None:
    """Live per-region view from the runtime's metrics endpoints (no Grafana needed).
    With --once, exits 1 when no endpoint answered."""
    import sys
    import time

    from geotrain.monitoring import format_top, scrape
    from infra.model import load_stack
    from infra.model.checks import SINGLE_MACHINE_KINDS
    from infra.plan import build_plan

    if interval != interval:  # NaN passes FloatRange's comparisons
        raise click.BadParameter("nan is not a number of seconds", param_hint="--interval")
    plan = build_plan(load_stack(stack))
    single_machine = all(r.kind in SINGLE_MACHINE_KINDS for r in plan.regions)  # train's
    while True:
        views = scrape(plan)
        text = format_top(views, stack, single_machine)
        if once:
            click.echo(text)
            if not any(v.up for v in views.values()):
                sys.exit(1)  # scripts: nothing answered
            return
        click.clear()
        click.echo(f"geotrain top - {plan.stack} (Ctrl-C to quit)\n{text}")
        time.sleep(interval)


@click.command("plan")
@STACK
@click.option("--mfu", default=0.4, show_default=True, help="Model FLOPs utilisation, (0, 1].")
@click.option(
    "--tokens",
    type=float,
    default=None,
    help="Tokens of the whole run (default: steps x the stack's tokens per step).",
)
@click.option(
    "--target",
    default=0.9,
    show_default=True,
    help="Utilisation to recommend codec, H and tau for, (0, 1).",
)
@click.option("--max-h", default=100, show_default=True, help="Largest DiLoCo H to recommend.")
@friendly
def plan_cmd(stack: str, mfu: float, tokens: float | None, target: float, max_h: int) -> None:
    """Days, cross-region TB/day and GPU cost of the stack's run per sync mode, with the
    formulas, then the codec, H and tau that reach --target utilisation, with what the
    committed parity results say of them (infra/planner.py)."""
    from infra.model import load_stack
    from infra.plan import build_plan
    from infra.planner import (
        estimate,
        format_plan,
        format_recommendation,
        inputs_from_plan,
        recommend,
    )

    inputs = inputs_from_plan(build_plan(load_stack(stack)), mfu, tokens)
    rows = estimate(inputs)
    click.echo(format_plan(inputs, rows))
    if inputs.regions == 1:
        click.echo("\none region: nothing crosses regions, no codec or H to recommend")
        return
    rec = recommend(inputs, target, max_h)
    click.echo("\n" + format_recommendation(inputs, rec, max_h))
