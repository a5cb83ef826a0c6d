"""RegionPool: a region's compute, per backend.

local: run directories on this machine. lab: one network namespace per node.
ssh: each host bootstrapped (dirs, a check that it has the GPUs the stack declares).
kubernetes: a Provider for the region's cluster plus the rendered manifests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from infra.components.delivery import run
from infra.components.targets import node_target
from infra.facts import pool_facts
from infra.model.pulumi_config import secret
from infra.plan import Plan, PlanRegion
from infra.render import render_k8s, render_launch_spec

TOKEN = "geotrain:pool:RegionPool"


@dataclass
class RegionPoolArgs:
    plan: Plan
    """The stack plan."""
    region: PlanRegion
    """The region this pool serves."""


class RegionPool(pulumi.ComponentResource):
    workers: pulumi.Output[int]

    def __init__(
        self, name: str, args: RegionPoolArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__(TOKEN, name, {"facts": pool_facts(args.plan, args.region)}, opts)
        r, plan = args.region, args.plan
        child = pulumi.ResourceOptions(parent=self)
        self.resources: list[pulumi.Resource] = []
        build = {
            "local": self._local,
            "lab": self._lab,
            "ssh": self._ssh,
            "kubernetes": self._kubernetes,
        }[r.kind]
        build(name, plan, r, child)
        self.workers = pulumi.Output.from_input(sum(n.gpus for n in r.nodes))
        self.register_outputs(
            {
                "workers": self.workers,
                "region": r.name,
                "jurisdiction": r.jurisdiction,
                "kind": r.kind,
            }
        )

    def _local(self, name: str, plan: Plan, r: PlanRegion, opts: pulumi.ResourceOptions) -> None:
        ckpt = plan.path(plan.model.training.checkpoint.dir)
        for n in r.nodes:
            self.resources.append(
                run(
                    f"{name}-{n.name}-dirs",
                    node_target(plan.model, n),
                    f"mkdir -p {ckpt} .geotrain/{plan.stack}/logs/{n.name}",
                    opts,
                    # the checkpoints are the run's only copy of its progress: delete keeps them
                    delete=f"rm -rf .geotrain/{plan.stack}/logs/{n.name}",
                )
            )

    def _lab(self, name: str, plan: Plan, r: PlanRegion, opts: pulumi.ResourceOptions) -> None:
        for n in r.nodes:
            self.resources.append(
                run(
                    f"{name}-{n.name}-netns",
                    node_target(plan.model, n),
                    f"ip netns add {n.netns} && ip -n {n.netns} link set lo up",
                    opts,
                    delete=f"ip netns pids {n.netns} | xargs -r kill; ip netns del {n.netns}",
                )
            )

    def _ssh(self, name: str, plan: Plan, r: PlanRegion, opts: pulumi.ResourceOptions) -> None:
        ckpt = plan.path(plan.model.training.checkpoint.dir)
        for n in r.nodes:
            check = (
                (
                    f'n=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true); [ "$n" -ge {n.gpus} ]'
                    f' || {{ echo "{n.name}: found $n GPUs, stack declares {n.gpus} '
                    f'x {n.gpu_type}" >&2; exit 1; }}'
                )
                if n.device == "cuda"
                else "true"
            )
            self.resources.append(
                run(
                    f"{name}-{n.name}-bootstrap",
                    node_target(plan.model, n),
                    f"id -u geotrain >/dev/null 2>&1 || useradd --system --create-home geotrain; "
                    f"install -d -o geotrain -m 0750 /etc/geotrain {ckpt} && {check}",
                    opts,
                    triggers=[n.gpus, n.gpu_type],
                )
            )

    def _kubernetes(
        self, name: str, plan: Plan, r: PlanRegion, opts: pulumi.ResourceOptions
    ) -> None:
        pool = plan.model.region(r.name).pool
        provider = k8s.Provider(
            f"{name}-provider",
            kubeconfig=secret(pool.kubernetes.kubeconfig_config),
            context=pool.kubernetes.context,
            opts=opts,
        )
        # every manifest goes to this region's cluster, never the ambient kubeconfig
        kopts = pulumi.ResourceOptions(parent=self, provider=provider)
        spec_json = render_launch_spec(plan).to_json()
        ctors = {
            "Namespace": k8s.core.v1.Namespace,
            "ConfigMap": k8s.core.v1.ConfigMap,
            "Service": k8s.core.v1.Service,
            "StatefulSet": k8s.apps.v1.StatefulSet,
        }
        made: dict[str, pulumi.Resource] = {}
        for doc in render_k8s(plan, r, spec_json):
            kind = doc["kind"]
            body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
            # namespaced objects wait for the namespace
            dep = [made["Namespace"]] if "Namespace" in made else []
            made[kind] = ctors[kind](
                f"{name}-{kind.lower()}",
                **body,
                opts=pulumi.ResourceOptions.merge(kopts, pulumi.ResourceOptions(depends_on=dep)),
            )
        self.resources += [provider, *made.values()]
