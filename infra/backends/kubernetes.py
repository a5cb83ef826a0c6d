"""`kubernetes`: an existing cluster per region, reached through one strict Provider per
region (the region's kubeconfig secret and context; never the ambient kubeconfig).

What each concern adds to the region's cluster (manifests: infra/render/k8s.py):
- pool: the Provider, the Namespace, the workers' headless Service, their NetworkPolicy;
- overlay (more than one region): a WireGuard key per gateway made by the engine
  (random.RandomBytes, a secret; the public key derived here with X25519 and handed to
  the peers' configs), the gateway's Secret, ConfigMap, Service, Deployment and the
  route DaemonSet; routing (FRR) travels in the gateway's ConfigMap;
- monitoring: PodMonitor, PrometheusRule, the dashboard ConfigMap, dcgm ServiceMonitor;
- run key: random.RandomBytes, a secret, as for ssh hosts;
- delivery: the run key's Secret, the spec's ConfigMap, the StatefulSet or JobSet.
"""

from __future__ import annotations

import base64
import functools
import re
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import pulumi_random as random
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from infra.backends.base import BackendContext, Parent
from infra.plan import Plan, PlanRegion
from infra.render import k8s as render
from training.errors import ConfigError

CORE = {
    "Namespace": k8s.core.v1.Namespace,
    "ConfigMap": k8s.core.v1.ConfigMap,
    "Secret": k8s.core.v1.Secret,
    "Service": k8s.core.v1.Service,
    "StatefulSet": k8s.apps.v1.StatefulSet,
    "Deployment": k8s.apps.v1.Deployment,
    "DaemonSet": k8s.apps.v1.DaemonSet,
    "NetworkPolicy": k8s.networking.v1.NetworkPolicy,
}
WORKLOADS = ("StatefulSet", "JobSet")
DASHBOARD = {"ConfigMap": "dashboard"}


class _Region:
    """A region's Provider and Namespace, shared by the backend's methods."""

    def __init__(self, provider: k8s.Provider, namespace: pulumi.Resource) -> None:
        self.provider = provider
        self.namespace = namespace


_REGIONS: dict[int, tuple[BackendContext, dict[str, _Region]]] = {}
"""Per program run (keyed by its BackendContext): what pool() made for each region."""


def _regions(ctx: BackendContext) -> dict[str, _Region]:
    held = _REGIONS.get(id(ctx))
    if held is None or held[0] is not ctx:
        held = _REGIONS[id(ctx)] = (ctx, {})
    return held[1]


def under_mocks() -> bool:
    """True under `geotrain graph/check` and the tests (pulumi.runtime.set_mocks)."""
    from pulumi.runtime import settings
    from pulumi.runtime.mocks import MockMonitor

    return isinstance(settings.SETTINGS.monitor, MockMonitor)


@functools.cache
def _warn(message: str) -> None:
    pulumi.log.warn(message)


def kubeconfig(ctx: BackendContext, region: PlanRegion) -> pulumi.Output[str]:
    """The region's kubeconfig: its secret, or a clear error under the engine (a
    Provider without one would use the ambient kubeconfig, maybe another cluster)."""
    k = render.settings(ctx.plan, region)
    value = ctx.secret(k.kubeconfig_config)
    if value is not None:
        return value
    fix = (
        f"set it with `pulumi config set --secret {k.kubeconfig_config} < KUBECONFIG` "
        f"(the kubeconfig of region {region.name}'s cluster)"
    )
    if not under_mocks():
        raise ConfigError(
            f"Pulumi config of stack {ctx.plan.stack}", k.kubeconfig_config, f"is not set; {fix}"
        )
    _warn(f"{k.kubeconfig_config} is not set: {fix} before `pulumi up`")
    return pulumi.Output.secret("<unset>")


def _create(doc: dict[str, Any], name: str, opts: pulumi.ResourceOptions) -> pulumi.CustomResource:
    kind = doc["kind"]
    # top-level fields are the SDK's keyword arguments (snake_case); nested dicts pass
    # through in the API's own camelCase
    body = {_snake(k): v for k, v in doc.items() if k not in ("apiVersion", "kind")}
    if kind in CORE:
        return CORE[kind](name, **body, opts=opts)
    return k8s.apiextensions.CustomResource(
        name, api_version=doc["apiVersion"], kind=kind, **body, opts=opts
    )


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", lambda m: "_" + m.group(1).lower(), key)


class KubernetesBackend:
    kind = "kubernetes"

    def _opts(
        self, ctx: BackendContext, region: PlanRegion, parent: Parent, **more: Any
    ) -> pulumi.ResourceOptions:
        r = _regions(ctx)[region.name]
        # every manifest goes to this region's cluster, never the ambient kubeconfig;
        # namespaced objects wait for the namespace
        return pulumi.ResourceOptions.merge(
            parent.opts(r.namespace),
            pulumi.ResourceOptions(provider=r.provider, **more),
        )

    def _apply(
        self,
        ctx: BackendContext,
        region: PlanRegion,
        docs: list[dict[str, Any]],
        parent: Parent,
        role: str,
        roles: dict[str, str] | None = None,
    ) -> list[pulumi.Resource]:
        """One resource per manifest, named `<component>-<role>-<kind or roles[kind]>`
        (stable: never from a name that carries a content hash)."""
        out: list[pulumi.Resource] = []
        for doc in docs:
            what = (roles or {}).get(doc["kind"], doc["kind"].lower())
            name = f"{parent.name}-{role}-{what}"
            if doc["kind"] in WORKLOADS:
                # A training group is a gang: a rolling update would restart one pod with
                # the new spec while the others keep the old one, and none of them could
                # form a group again. A changed pod template replaces the workload, all
                # pods at once (JobSets are immutable anyway). Pulumi waits for a
                # StatefulSet's pods to be ready, i.e. for the whole run to rendezvous.
                opts = self._opts(
                    ctx,
                    region,
                    parent,
                    replace_on_changes=["spec"],
                    delete_before_replace=True,
                    custom_timeouts=pulumi.CustomTimeouts(create="30m", update="30m"),
                )
            else:
                opts = self._opts(ctx, region, parent)
            out.append(_create(doc, name, opts))
        return out

    def pool(
        self, ctx: BackendContext, region: PlanRegion, parent: Parent
    ) -> list[pulumi.Resource]:
        k = render.settings(ctx.plan, region)
        if not k.context:  # the model checks say so at validate time; never the current context
            raise ConfigError(
                "stack", f"regions.{region.name}.pool.kubernetes.context", "is not set"
            )
        provider = k8s.Provider(
            f"{parent.name}-provider",
            kubeconfig=kubeconfig(ctx, region),
            context=k.context,
            opts=parent.opts(),
        )
        docs = render.pool_docs(ctx.plan, region)
        ns_doc, rest = docs[0], docs[1:]
        ns = k8s.core.v1.Namespace(
            f"{parent.name}-namespace",
            metadata=ns_doc["metadata"],
            opts=pulumi.ResourceOptions.merge(
                parent.opts(), pulumi.ResourceOptions(provider=provider)
            ),
        )
        _regions(ctx)[region.name] = _Region(provider, ns)
        return [provider, ns, *self._apply(ctx, region, rest, parent, "workers")]

    def overlay(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        plan = ctx.plan
        if not render.multi_region(plan):
            return []  # one region: no gateway
        out: list[pulumi.Resource] = []
        private: dict[str, pulumi.Output[str]] = {}
        for r in regions:
            key = random.RandomBytes(f"{parent.name}-{r.name}-wgkey", length=32, opts=parent.opts())
            out.append(key)
            private[r.name] = pulumi.Output.secret(key.hex.apply(_wg_private))
            ctx.public_keys[r.gateway.name] = key.hex.apply(_wg_public)
        for r in regions:
            peers = {
                plan.region(t.side(r.name).peer).gateway.name: ctx.public_keys[
                    plan.region(t.side(r.name).peer).gateway.name
                ]
                for t in plan.tunnels_of(r.name)
            }
            files = pulumi.Output.all(**peers).apply(functools.partial(_files, plan, r))
            name = files.apply(functools.partial(render.gateway_config_name, plan, r))
            docs = render.gateway_docs(plan, r, files, name, private[r.name])
            out += self._apply(
                ctx,
                r,
                docs,
                parent,
                f"{r.name}-gateway",
                {"Secret": "key", "ConfigMap": "config", "DaemonSet": "routes"},
            )
        return out

    def routing(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        return []  # frr.conf travels in each gateway's ConfigMap

    def monitoring(self, ctx: BackendContext, parent: Parent) -> list[pulumi.Resource]:
        # every region's cluster has its own kube-prometheus-stack
        return [
            res
            for r in ctx.plan.regions
            for res in self._apply(
                ctx, r, render.monitoring_docs(ctx.plan, r), parent, r.name, DASHBOARD
            )
        ]

    def run_key(self, ctx: BackendContext, parent: Parent) -> pulumi.Output[str] | None:
        # 32 random bytes made by the engine: a secret in state, never printed anywhere
        key = random.RandomBytes(f"{parent.name}-run-key", length=32, opts=parent.opts())
        return pulumi.Output.secret(key.hex)

    def deliver(
        self,
        ctx: BackendContext,
        region: PlanRegion,
        run_key: pulumi.Output[str] | None,
        parent: Parent,
    ) -> list[pulumi.Resource]:
        if run_key is None:
            raise ValueError("kubernetes regions need the run key from run_key()")
        docs = render.delivery_docs(ctx.plan, region, pulumi.Output.secret(run_key))
        return self._apply(
            ctx, region, docs, parent, region.name, {"Secret": "run-key", "ConfigMap": "spec"}
        )


def _files(plan: Plan, region: PlanRegion, pubkeys: dict[str, str]) -> dict[str, str]:
    return render.gateway_files(plan, region, pubkeys)


def _wg_private(hex_key: str) -> str:
    """A WireGuard private key: 32 random bytes, base64 (X25519 clamps them on use)."""
    return base64.b64encode(bytes.fromhex(hex_key)).decode()


def _wg_public(hex_key: str) -> str:
    pub = X25519PrivateKey.from_private_bytes(bytes.fromhex(hex_key)).public_key()
    return base64.b64encode(pub.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()
