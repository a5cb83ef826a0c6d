"""TrainingDeployment: the launch spec, the run key, and the workers' service per node.

The run key (SM4/AES key of every cross-region payload and checkpoint manifest) is made
on the first node and travels only as a Pulumi secret to the other nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra.components.delivery import run, write_file
from infra.components.targets import node_target
from infra.facts import training_facts
from infra.plan import Plan
from infra.render import render_launch_spec, render_worker_unit
from infra.render.runtime import REMOTE_SPEC_PATH

TOKEN = "geotrain:training:TrainingDeployment"


@dataclass
class TrainingDeploymentArgs:
    plan: Plan
    """The stack plan."""
    depends_on: list[pulumi.Resource]
    """Pools (and the network) that must exist before workers start."""


class TrainingDeployment(pulumi.ComponentResource):
    launch_spec: pulumi.Output[str]

    def __init__(
        self, name: str, args: TrainingDeploymentArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__(TOKEN, name, {"facts": training_facts(args.plan)}, opts)
        plan = args.plan
        spec = render_launch_spec(plan)
        spec_json = spec.to_json()
        after = pulumi.ResourceOptions(parent=self, depends_on=args.depends_on)
        first = plan.nodes[0]
        if first.kind in ("local", "lab"):
            write_file(
                f"{name}-spec",
                node_target(plan.model, first),
                f".geotrain/{plan.stack}/launch-spec.json",
                spec_json,
                after,
            )
            run(
                f"{name}-key",
                node_target(plan.model, first),
                f"geotrain keygen --out {spec.key_file}",
                after,
            )
        elif first.kind == "ssh":
            self._ssh(name, plan, spec_json, spec.key_file, after)
        self.launch_spec = pulumi.Output.from_input(spec_json)
        self.register_outputs(
            {"launch_spec": self.launch_spec, "run_id": plan.run_id, "world_size": plan.world_size}
        )

    def _ssh(
        self, name: str, plan: Plan, spec_json: str, key_file: str, after: pulumi.ResourceOptions
    ) -> None:
        first = plan.nodes[0]
        keygen = run(
            f"{name}-{first.name}-runkey",
            node_target(plan.model, first),
            f"test -s {key_file} || (umask 077; od -An -N32 -tx1 /dev/urandom | "
            f"tr -d ' \\n' > {key_file}); cat {key_file}",
            after,
        )
        # the run key is a secret in state: never shown by preview, encrypted at rest
        key: pulumi.Output[str] = pulumi.Output.secret(keygen.stdout)
        for n in plan.nodes:
            target = node_target(plan.model, n)
            node_opts = pulumi.ResourceOptions(parent=self, depends_on=[keygen])
            files = [
                write_file(f"{name}-{n.name}-spec", target, REMOTE_SPEC_PATH, spec_json, node_opts),
                write_file(
                    f"{name}-{n.name}-unit",
                    target,
                    "/etc/systemd/system/geotrain-worker.service",
                    render_worker_unit(plan, n),
                    node_opts,
                ),
            ]
            if n is not first:
                files.append(
                    write_file(
                        f"{name}-{n.name}-key", target, key_file, key, node_opts, mode="0600"
                    )
                )
            run(
                f"{name}-{n.name}-start",
                target,
                f"chown geotrain {key_file} && systemctl daemon-reload && "
                "systemctl enable geotrain-worker && systemctl restart geotrain-worker",
                pulumi.ResourceOptions(parent=self, depends_on=files),
                delete="systemctl disable --now geotrain-worker",
                triggers=[f.triggers for f in files],
            )
