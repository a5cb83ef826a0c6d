"""`kubernetes`: an existing cluster per region, reached through one strict Provider per
region; workers in a StatefulSet. There is no network between clusters yet, so the
overlay is empty and checks.py keeps these regions out of stacks with other kinds."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from infra.backends.base import BackendContext, Parent
from infra.model.pulumi_config import secret
from infra.plan import PlanRegion
from infra.render import render_k8s, render_launch_spec

CTORS = {
    "Namespace": k8s.core.v1.Namespace,
    "ConfigMap": k8s.core.v1.ConfigMap,
    "Service": k8s.core.v1.Service,
    "StatefulSet": k8s.apps.v1.StatefulSet,
}


class KubernetesBackend:
    kind = "kubernetes"

    def pool(
        self, ctx: BackendContext, region: PlanRegion, parent: Parent
    ) -> list[pulumi.Resource]:
        plan = ctx.plan
        pool = plan.model.region(region.name).pool
        provider = k8s.Provider(
            f"{parent.name}-provider",
            kubeconfig=secret(pool.kubernetes.kubeconfig_config),
            context=pool.kubernetes.context,
            opts=parent.opts(),
        )
        # every manifest goes to this region's cluster, never the ambient kubeconfig
        kopts = pulumi.ResourceOptions(parent=parent.resource, provider=provider)
        spec_json = render_launch_spec(plan).to_json()
        made: dict[str, pulumi.Resource] = {}
        for doc in render_k8s(plan, region, spec_json):
            kind = doc["kind"]
            body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
            # namespaced objects wait for the namespace
            dep = [made["Namespace"]] if "Namespace" in made else []
            made[kind] = CTORS[kind](
                f"{parent.name}-{kind.lower()}",
                **body,
                opts=pulumi.ResourceOptions.merge(kopts, pulumi.ResourceOptions(depends_on=dep)),
            )
        return [provider, *made.values()]

    def overlay(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        return []

    def routing(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        return []

    def monitoring(self, ctx: BackendContext, parent: Parent) -> list[pulumi.Resource]:
        return []

    def run_key(self, ctx: BackendContext, parent: Parent) -> pulumi.Output[str] | None:
        return None

    def deliver(
        self,
        ctx: BackendContext,
        region: PlanRegion,
        run_key: pulumi.Output[str] | None,
        parent: Parent,
    ) -> list[pulumi.Resource]:
        return []  # the spec travels in the pool's ConfigMap
