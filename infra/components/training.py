"""TrainingDeployment: the run key and, per region, what its backend delivers so workers
start (ssh: the host agent with each node's bundle; local/lab: the spec and key here).

The run key (SM4/AES key of every cross-region payload and checkpoint manifest) is made
by the engine for hosts (a random.RandomBytes secret: encrypted in state, never in a
command line, stdout or log) and by `geotrain keygen` on single-machine stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi

from infra import tokens
from infra.backends import BackendContext, Parent, backend_for, backends_of
from infra.facts import training_facts
from infra.render.k8s import worker_spec

TOKEN = tokens.TRAINING


@dataclass
class TrainingDeploymentArgs:
    ctx: BackendContext
    """The stack plan and what backends share while the program is built."""
    depends_on: list[pulumi.Resource]
    """Pools, the network and monitoring: what must exist before workers start."""


class TrainingDeployment(pulumi.ComponentResource):
    launch_spec: pulumi.Output[str]

    def __init__(
        self, name: str, args: TrainingDeploymentArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        ctx = args.ctx
        plan = ctx.plan
        super().__init__(TOKEN, name, {"facts": training_facts(plan)}, opts)
        parent = Parent(name, self, tuple(args.depends_on))
        keys = [b.run_key(ctx, Parent(name, self)) for b, _ in backends_of(plan.regions)]
        run_key = next((k for k in keys if k is not None), None)
        self.resources = [
            res for r in plan.regions for res in backend_for(r).deliver(ctx, r, run_key, parent)
        ]
        self.launch_spec = pulumi.Output.from_input(worker_spec(plan).to_json())
        self.register_outputs(
            {"launch_spec": self.launch_spec, "run_id": plan.run_id, "world_size": plan.world_size}
        )
