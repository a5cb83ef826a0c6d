"""Kubernetes manifests of a region: pure dicts from the plan, the one source for the
Pulumi backend (infra/backends/kubernetes.py), `geotrain render` and the tests.

Per region (its own cluster):
- pool: the Namespace, the workers' headless Service (StatefulSet) and a NetworkPolicy;
- delivery: the run key's Secret, the launch spec's ConfigMap (named by its content hash,
  so a changed spec is a new pod template) and the workers: a StatefulSet, or a JobSet
  (jobset.x-k8s.io/v1alpha2). Every pod runs `python -m training.launch.torchrun`, the image's
  CMD, which starts torchrun for the pod's node of the spec;
- overlay: a WireGuard + FRR gateway (a Deployment on hostNetwork, root with exactly the
  capabilities FRR and WireGuard need, built from the same renderers as host gateways)
  and a route DaemonSet that sends the other regions' addresses to the gateway's node;
- monitoring: a PodMonitor, a PrometheusRule (the stack's alert rules), the Grafana
  dashboard as a sidecar ConfigMap and a ServiceMonitor for the GPU Operator's
  dcgm-exporter, all for kube-prometheus-stack.

Addresses. A pod binds and advertises its own DNS name from the headless Service
(`<pod>.<service>.<namespace>.svc.<domain>`, in the pod's /etc/hosts, published before
the pod is ready); gloo then exchanges pod IPs through the store. Other clusters cannot
resolve those names, so with more than one region the rendezvous (`master_addr`) is the
first region's gateway address (its region subnet's first host, on the gateway's node):
the gateway forwards that port to the first pod. Pod CIDRs are announced over BGP; every
packet between regions leaves and enters through a gateway, which rewrites its source to
its own overlay address, so a worker's NetworkPolicy admits other regions from exactly
one address.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from infra.model.paths import GATEWAY_DIR, WG_KEY_DIR
from infra.plan import KubernetesSettings, Plan, PlanRegion
from infra.render.monitoring import DCGM_JOB, RUNTIME_JOB, render_alert_rules, render_dashboard
from infra.render.network import frr_daemons, render_frr, render_wireguard
from infra.render.runtime import render_launch_spec
from training.launch.torchrun import ON_DONE_ENV, REGION_ENV, RUN_DIR, SPEC_DIR, SPEC_PATH, WORKDIR
from training.spec import LaunchSpec

K8S_VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34", "1.35", "1.36", "1.37")
"""Kubernetes versions every manifest is validated against (kubernetes-validate --strict)."""
TRANSPORT = "wireguard"
"""What carries traffic between regions: WireGuard between the regions' gateway pods."""
WORKER_COMMAND = ["python", "-m", "training.launch.torchrun", "--spec", SPEC_PATH]
"""The worker container's command: the Dockerfile's CMD (target runtime)."""
GATEWAY_COMMAND = ["/bin/sh", f"{GATEWAY_DIR}/gateway.sh"]
"""The gateway container's command: the Dockerfile's CMD (target gateway)."""
GATEWAY_READY = "wg show interfaces | grep -q . && vtysh -c 'show bgp summary' >/dev/null"
"""The gateway's readiness: its tunnels are up and bgpd answers."""
ROUTES_COMMAND = ["/bin/sh", f"{GATEWAY_DIR}/routes.sh"]
UID = 10001
"""The runtime image's user (Dockerfile): workers never run as root."""
SECRET_DIR = "/run/geotrain/secret"
"""The run key's Secret, mounted in the init container only."""
KEYS_DIR = "/run/geotrain/keys"
DATA_DIR = "/data"
"""Where kubernetes.data_claim is mounted (read-only)."""
JOBSET_RJOB = "workers"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
MONITORING_API = "monitoring.coreos.com/v1"
DCGM_SELECTOR = {"app": "nvidia-dcgm-exporter"}
"""The GPU Operator's dcgm-exporter Service (port gpu-metrics)."""
DCGM_PORT_NAME = "gpu-metrics"
GLOO_PORTS = (1024, 65535)
"""gloo listens on ephemeral ports: a NetworkPolicy can only name the range."""
GATEWAY_CAPABILITIES = (
    "NET_ADMIN",  # links, addresses, routes, iptables, WireGuard; FRR's zebra and bgpd
    "NET_RAW",  # FRR's zebra, bgpd and bfdd ask for it; iptables-legacy reads its tables
    "SYS_ADMIN",  # FRR's zebra, bgpd and bfdd ask for it (network namespaces)
    "NET_BIND_SERVICE",  # bgpd listens on 179 (bgpd and bfdd ask for it)
    "SETUID",  # FRR's daemons start as root and drop to the frr user
    "SETGID",  # ... and its groups (watchfrr does too)
    "DAC_OVERRIDE",  # root writes the configs into frr's own /etc/frr (0750 frr:frr)
    "CHOWN",  # watchfrr hands its vty socket to frr:frrvty
    "KILL",  # frrinit.sh stop signals the daemons, which run as frr, on SIGTERM
)
"""The gateway container's capabilities, all others dropped. Each one was found by running
the rendered container without it (tests/integration/test_k8s_gateway.py): FRR's daemons
ask for their set when they start (lib/privs.c) and exit without it, e.g. zebra's
NET_ADMIN, NET_RAW, SYS_ADMIN; the runtime's default set lacks SYS_ADMIN."""
OVERLAY_LABEL = "lo:geotrain"
"""The label of the gateway's overlay address on its node's loopback: an address on `lo`
needs no driver (a dummy interface needs CONFIG_DUMMY, which microVM kernels leave out,
and a container cannot load modules) and is answered on every interface the same way."""


def settings(plan: Plan, region: PlanRegion) -> KubernetesSettings:
    return region.pool.kubernetes


@dataclass(frozen=True)
class Names:
    """Every name of a region's objects, derived from the region name (at most 32
    characters: every name below fits Kubernetes' limits by construction)."""

    region: str
    namespace: str
    domain: str
    jobset: bool

    @property
    def workload(self) -> str:
        return f"gt-{self.region}"

    @property
    def service(self) -> str:
        """The headless Service (JobSet: the subdomain the JobSet controller makes)."""
        return self.workload

    def pod(self, ordinal: int) -> str:
        if self.jobset:  # <jobset>-<replicated job>-<job index>-<pod index>
            return f"{self.workload}-{JOBSET_RJOB}-0-{ordinal}"
        return f"{self.workload}-{ordinal}"

    def fqdn(self, ordinal: int) -> str:
        return f"{self.pod(ordinal)}.{self.service}.{self.namespace}.svc.{self.domain}"

    @property
    def gateway(self) -> str:
        return f"{self.workload}-gateway"

    def gateway_fqdn(self) -> str:
        return f"{self.gateway}.{self.namespace}.svc.{self.domain}"


def names(plan: Plan, region: PlanRegion) -> Names:
    k = settings(plan, region)
    return Names(region.name, k.namespace, k.cluster_domain, k.workload == "jobset")


def multi_region(plan: Plan) -> bool:
    return len(plan.regions) > 1


# -- the launch spec pods use -------------------------------------------------------------
def pod_launch_spec(plan: Plan) -> LaunchSpec:
    """The spec with addresses pods can use: each node's host is its pod's DNS name; the
    rendezvous is the first pod (one region) or the first region's gateway address."""
    spec = render_launch_spec(plan)
    regions = []
    for r, rs in zip(plan.regions, spec.regions, strict=True):
        n = names(plan, r)
        nodes = [dataclasses.replace(ns, host=n.fqdn(i)) for i, ns in enumerate(rs.nodes)]
        regions.append(dataclasses.replace(rs, nodes=nodes))
    first = plan.regions[0]
    master = first.router_id if multi_region(plan) else names(plan, first).fqdn(0)
    return dataclasses.replace(spec, regions=regions, master_addr=master)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def key_path(spec: LaunchSpec) -> str:
    """Where the run key is in the worker container (relative paths: under WORKDIR)."""
    return posixpath.normpath(posixpath.join(WORKDIR, spec.key_file))


# -- labels -------------------------------------------------------------------------------
def labels(plan: Plan, region: PlanRegion, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "geotrain",
        "app.kubernetes.io/component": component,
        "geotrain.io/region": region.name,
        "geotrain.io/jurisdiction": region.jurisdiction,
        "geotrain.io/stack": plan.stack,
        **{f"geotrain.io/{k}": v for k, v in plan.tags.items()},
    }


def selector(region: PlanRegion, component: str) -> dict[str, str]:
    """Selectors are immutable: only labels that never change (not tags)."""
    return {
        "app.kubernetes.io/name": "geotrain",
        "app.kubernetes.io/component": component,
        "geotrain.io/region": region.name,
    }


def _meta(name: str, ns: str, lab: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": ns, "labels": lab}


# -- pool: namespace, service, network policy --------------------------------------------
def pool_docs(plan: Plan, region: PlanRegion) -> list[dict[str, Any]]:
    k, n = settings(plan, region), names(plan, region)
    lab = labels(plan, region, "worker")
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": k.namespace, "labels": labels(plan, region, "namespace")},
        }
    ]
    if not n.jobset:  # a JobSet makes its own headless Service (spec.network.subdomain)
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(n.service, k.namespace, lab),
                # headless: a DNS name per pod, published before the pod is ready (the
                # group forms before any rank serves metrics); never exposed
                "spec": {
                    "clusterIP": "None",
                    "type": "ClusterIP",
                    "publishNotReadyAddresses": True,
                    "selector": selector(region, "worker"),
                    "ports": worker_ports(plan, region, service=True),
                },
            }
        )
    docs.append(network_policy(plan, region))
    return docs


def worker_ports(plan: Plan, region: PlanRegion, service: bool = False) -> list[dict[str, Any]]:
    """The rendezvous port and every rank's metrics port (local rank i: metrics_port + i)."""
    mon = plan.monitoring
    key = "port" if service else "containerPort"
    ports = [{"name": "rendezvous", key: plan.master_port, "protocol": "TCP"}]
    if mon.metrics_port:
        ports += [
            {"name": f"metrics-{i}", key: mon.metrics_port + i, "protocol": "TCP"}
            for i in range(region.nodes[0].gpus)
        ]
    return ports


def network_policy(plan: Plan, region: PlanRegion) -> dict[str, Any]:
    """Workers accept their own region's workers on every port, other regions only from
    the gateway's address (the gateway rewrites every packet's source to it) on the
    rendezvous and gloo ports, and Prometheus on the metrics ports. They send only to
    their region, DNS, and the overlay (which only the gateway routes)."""
    k, mon = settings(plan, region), plan.monitoring
    own = {"podSelector": {"matchLabels": selector(region, "worker")}}
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    egress: list[dict[str, Any]] = [
        {"to": [own]},
        {
            "to": [
                {
                    "namespaceSelector": {},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                }
            ],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        },
    ]
    if multi_region(plan):
        ingress.append(
            {
                "from": [{"ipBlock": {"cidr": f"{region.router_id}/32"}}],
                "ports": [
                    {"protocol": "TCP", "port": plan.master_port},
                    {"protocol": "TCP", "port": GLOO_PORTS[0], "endPort": GLOO_PORTS[1]},
                ],
            }
        )
        egress.append({"to": [{"ipBlock": {"cidr": str(plan.network.overlay_cidr)}}]})
    if mon.metrics_port:
        ingress.append(
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": k.monitoring_namespace}
                        }
                    }
                ],
                "ports": [
                    {"protocol": "TCP", "port": p["containerPort"]}
                    for p in worker_ports(plan, region)
                    if p["name"].startswith("metrics-")
                ],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(
            f"{names(plan, region).workload}-workers", k.namespace, labels(plan, region, "worker")
        ),
        "spec": {
            "podSelector": {"matchLabels": selector(region, "worker")},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


# -- delivery: run key, spec, workers -----------------------------------------------------
def spec_configmap_name(plan: Plan, region: PlanRegion, spec_json: str) -> str:
    return f"{names(plan, region).workload}-spec-{_digest(spec_json)}"


def delivery_docs(plan: Plan, region: PlanRegion, run_key: Any) -> list[dict[str, Any]]:
    """The run key's Secret (`run_key`: the hex key, a Pulumi secret in the program), the
    spec's ConfigMap and the workers."""
    k, n = settings(plan, region), names(plan, region)
    spec_json = pod_launch_spec(plan).to_json()
    lab = labels(plan, region, "worker")
    cm = spec_configmap_name(plan, region, spec_json)
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(f"{n.workload}-run-key", k.namespace, lab),
            "type": "Opaque",
            "stringData": {"run.key": run_key},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(cm, k.namespace, lab),
            # named by its content: a changed spec is a new name, so a new pod template
            "immutable": True,
            "data": {"launch-spec.json": spec_json},
        },
        jobset(plan, region, cm) if n.jobset else statefulset(plan, region, cm),
    ]


def _resources(plan: Plan, region: PlanRegion) -> dict[str, Any]:
    k, node = settings(plan, region), region.nodes[0]
    amounts: dict[str, Any] = {}
    if node.device == "cuda":
        amounts[k.gpu_resource] = str(node.gpus)
    if k.cpu:
        amounts["cpu"] = k.cpu
    if k.memory:
        amounts["memory"] = k.memory
    # requests = limits: extended resources (GPUs) must be equal anyway, and a training
    # pod should be Guaranteed rather than evicted first under memory pressure
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _restricted() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
    }


def pod_template(plan: Plan, region: PlanRegion, spec_cm: str, state: bool) -> dict[str, Any]:
    """The worker pod: an init container copies the run key from its Secret into a
    memory volume as a 0400 file of the worker's user (the kubelet adds group read to a
    Secret's files for fsGroup, which the runtime's owner-only check refuses); the worker
    mounts that file read-only where the spec's key_file points."""
    k, mon = settings(plan, region), plan.monitoring
    spec = pod_launch_spec(plan)
    image = f"{k.image}:{k.tag}"
    env = [
        {"name": REGION_ENV, "value": region.name},
        {"name": ON_DONE_ENV, "value": "exit" if k.workload == "jobset" else "idle"},
        {"name": "GEOTRAIN_RUN_DIR", "value": RUN_DIR},
        {"name": "HOME", "value": WORKDIR},
    ]
    worker: dict[str, Any] = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": WORKER_COMMAND,
        "workingDir": WORKDIR,
        "env": env,
        "ports": worker_ports(plan, region),
        "resources": _resources(plan, region),
        "securityContext": _restricted(),
        "volumeMounts": [
            {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "keys", "mountPath": key_path(spec), "subPath": "run.key", "readOnly": True},
            {"name": "state", "mountPath": WORKDIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if mon.metrics_port:  # ready once rank 0 of the pod serves metrics: after rendezvous
        worker["readinessProbe"] = {
            "httpGet": {"path": "/metrics", "port": "metrics-0"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        }
    init = {
        "name": "run-key",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["install", "-m", "0400", f"{SECRET_DIR}/run.key", f"{KEYS_DIR}/run.key"],
        "securityContext": _restricted(),
        "volumeMounts": [
            {"name": "run-key", "mountPath": SECRET_DIR, "readOnly": True},
            {"name": "keys", "mountPath": KEYS_DIR},
        ],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "spec", "configMap": {"name": spec_cm, "defaultMode": 0o444}},
        {
            "name": "run-key",
            "secret": {
                "secretName": f"{names(plan, region).workload}-run-key",
                "defaultMode": 0o400,
            },
        },
        {"name": "keys", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}},
    ]
    if k.data_claim:  # the region's shards; read-only: workers never write raw data
        volumes.append(
            {"name": "data", "persistentVolumeClaim": {"claimName": k.data_claim, "readOnly": True}}
        )
        worker["volumeMounts"].append({"name": "data", "mountPath": DATA_DIR, "readOnly": True})
    if not state:  # JobSet: no volume claim templates; the run lives as long as its pod
        volumes.append({"name": "state", "emptyDir": {}})
    pod: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "initContainers": [init],
        "containers": [worker],
        "volumes": volumes,
    }
    if k.node_selector:
        pod["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        pod["tolerations"] = [t.model_dump(exclude_none=True) for t in k.tolerations]
    pod_labels = {**labels(plan, region, "worker"), "geotrain.io/job": RUNTIME_JOB}
    return {"metadata": {"labels": pod_labels}, "spec": pod}


def statefulset(plan: Plan, region: PlanRegion, spec_cm: str) -> dict[str, Any]:
    k, n = settings(plan, region), names(plan, region)
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": k.checkpoint_storage}},
    }
    if k.storage_class:
        claim["storageClassName"] = k.storage_class
    keep = "Retain" if plan.training.checkpoint.keep_on_destroy else "Delete"
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(n.workload, k.namespace, labels(plan, region, "worker")),
        "spec": {
            "serviceName": n.service,
            "replicas": len(region.nodes),
            "podManagementPolicy": "Parallel",  # the group forms only with every pod up
            "selector": {"matchLabels": selector(region, "worker")},
            "template": pod_template(plan, region, spec_cm, state=True),
            # checkpoints and run files of each node on its own volume; kept on destroy
            # as training.checkpoint.keep_on_destroy says
            "volumeClaimTemplates": [{"metadata": {"name": "state"}, "spec": claim}],
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": keep, "whenScaled": keep},
        },
    }


def jobset(plan: Plan, region: PlanRegion, spec_cm: str) -> dict[str, Any]:
    k, n = settings(plan, region), names(plan, region)
    nodes = len(region.nodes)
    tmpl = pod_template(plan, region, spec_cm, state=False)
    tmpl["spec"]["restartPolicy"] = "Never"  # restarts are torchrun's, then the JobSet's
    lab = labels(plan, region, "worker")
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _meta(n.workload, k.namespace, lab),
        "spec": {
            "network": {
                "enableDNSHostnames": True,
                "subdomain": n.service,
                "publishNotReadyAddresses": True,
            },
            "failurePolicy": {"maxRestarts": plan.training.max_restarts},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [JOBSET_RJOB]},
            "replicatedJobs": [
                {
                    "name": JOBSET_RJOB,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": lab},
                        "spec": {
                            "parallelism": nodes,
                            "completions": nodes,
                            "completionMode": "Indexed",  # $JOB_COMPLETION_INDEX = node
                            "backoffLimit": 0,
                            "template": tmpl,
                        },
                    },
                }
            ],
        },
    }


# -- overlay: the gateway and the routes to it --------------------------------------------
def gateway_files(plan: Plan, region: PlanRegion, pubkeys: Mapping[str, str]) -> dict[str, str]:
    """The gateway's files: wg-quick configs and frr.conf from the host renderers (the
    pod CIDR announced beside the region subnet), and its two scripts."""
    k = settings(plan, region)
    files = {
        f"{t.side(region.name).ifname}.conf": render_wireguard(
            plan, region.name, t, pubkeys, WG_KEY_DIR
        )
        for t in plan.tunnels_of(region.name)
    }
    frr = render_frr(plan, region.name)
    if k.pod_cidr is not None:
        frr = frr.replace(
            f"  network {region.subnet}\n", f"  network {region.subnet}\n  network {k.pod_cidr}\n"
        ).replace(
            f"ip prefix-list GT-OWN seq 5 permit {region.subnet}\n",
            f"ip prefix-list GT-OWN seq 5 permit {region.subnet}\n"
            f"ip prefix-list GT-OWN seq 10 permit {k.pod_cidr}\n",
        )
    files["frr.conf"] = frr
    files["daemons"] = frr_daemons()
    files["gateway.sh"] = gateway_script(plan, region)
    files["routes.sh"] = routes_script(plan, region)
    return files


def _remote(plan: Plan, region: PlanRegion) -> list[str]:
    """Addresses a region's nodes send to the gateway: every region subnet (the gateways'
    overlay addresses, its own included for the rendezvous) and the other pod CIDRs."""
    out = [r.subnet for r in plan.regions]
    for r in plan.regions:
        cidr = settings(plan, r).pod_cidr
        if r.name != region.name and cidr is not None:
            out.append(str(cidr))
    return out


def gateway_script(plan: Plan, region: PlanRegion) -> str:
    """Runs on the gateway's node (hostNetwork): the overlay address, the tunnels, SNAT to
    the overlay address (so CNI masquerading cannot leak node addresses and workers see
    other regions as one source), MSS clamping, FRR, and in the first region the
    rendezvous forwarder. Everything is undone on SIGTERM and on any failure (a kernel
    WireGuard link or an iptables rule would outlive the container on the node); FRR daemons
    that did not start (a missing capability) fail the container instead of leaving it
    running without BGP."""
    k, me = settings(plan, region), region.router_id
    pod_cidr = str(k.pod_cidr) if k.pod_cidr else region.subnet
    overlay = plan.network.overlay_cidr
    inbound = "".join(
        f"  $IPT -t nat -A GEOTRAIN -s {r.subnet} -d {pod_cidr} -j SNAT --to-source {me}\n"
        for r in plan.regions
        if r.name != region.name
    )
    tunnels = " ".join(t.side(region.name).ifname for t in plan.tunnels_of(region.name))
    first = region.name == plan.regions[0].name
    proxy = (
        f"socat TCP-LISTEN:{plan.master_port},bind={me},fork,reuseaddr "
        f"TCP:{names(plan, region).fqdn(0)}:{plan.master_port},bind={me} &\n"
        if first
        else ""
    )
    return (
        f"#!/bin/sh\n# geotrain {plan.stack}: gateway of {region.name}, rendered, do not edit\n"
        "set -eu\n"
        # the node's kube-proxy decides the iptables backend; use the same one
        "IPT=iptables-nft\nif iptables-legacy-save 2>/dev/null | grep -q KUBE-; then "
        "IPT=iptables-legacy; fi\n"
        "cleanup() {\n"
        # by name, not `wg-quick down`: a new container has no copy of the config, but a
        # crashed one's kernel link is still on the node
        f"  for i in {tunnels}; do ip link del $i 2>/dev/null || true; done\n"
        "  /usr/lib/frr/frrinit.sh stop || true\n"
        "  $IPT -t nat -D POSTROUTING -j GEOTRAIN 2>/dev/null || true\n"
        "  $IPT -t nat -F GEOTRAIN 2>/dev/null || true\n"
        "  $IPT -t nat -X GEOTRAIN 2>/dev/null || true\n"
        "  $IPT -t mangle -D FORWARD -o wg-+ -p tcp --tcp-flags SYN,RST SYN "
        "-j TCPMSS --clamp-mss-to-pmtu 2>/dev/null || true\n"
        f"  ip addr del {me}/32 dev lo 2>/dev/null || true\n"
        "}\n"
        "trap 'exit 0' TERM INT\n"
        "trap 'rc=$?; trap - EXIT; cleanup; exit $rc' EXIT\n"
        "cleanup\n"
        f"ip addr add {me}/32 dev lo label {OVERLAY_LABEL}\n"
        "mkdir -p /etc/wireguard\n"
        f"for i in {tunnels}; do cp {GATEWAY_DIR}/$i.conf /etc/wireguard/$i.conf; "
        "wg-quick up /etc/wireguard/$i.conf; done\n"
        "$IPT -t nat -N GEOTRAIN\n$IPT -t nat -I POSTROUTING 1 -j GEOTRAIN\n"
        f"  $IPT -t nat -A GEOTRAIN -o wg-+ -s {pod_cidr} -j SNAT --to-source {me}\n"
        f"  $IPT -t nat -A GEOTRAIN -o wg-+ ! -s {overlay} -j SNAT --to-source {me}\n"
        + inbound
        + "$IPT -t mangle -A FORWARD -o wg-+ -p tcp --tcp-flags SYN,RST SYN "
        "-j TCPMSS --clamp-mss-to-pmtu\n"
        f"cp {GATEWAY_DIR}/frr.conf {GATEWAY_DIR}/daemons /etc/frr/\n"
        "/usr/lib/frr/frrinit.sh start\n"
        '/usr/lib/frr/frrinit.sh status || { echo "geotrain gateway of '
        f"{region.name}: FRR daemons did not start (status above); the container needs "
        f'capabilities {",".join(GATEWAY_CAPABILITIES)}" >&2; exit 1; }}\n'
        + proxy
        + "while :; do sleep 3600 & wait $! || true; done\n"
    )


def routes_script(plan: Plan, region: PlanRegion) -> str:
    """Runs on every worker node (hostNetwork): the overlay and the other regions' pod
    CIDRs via the gateway's node, found through the gateway's headless Service."""
    cidrs = " ".join(_remote(plan, region))
    return (
        f"#!/bin/sh\n# geotrain {plan.stack}: routes of {region.name} to its gateway, rendered\n"
        "set -u\n"
        f"CIDRS='{cidrs}'\n"
        "trap 'for c in $CIDRS; do ip route del $c proto static 2>/dev/null; done; exit 0' "
        "TERM INT\n"
        "while :; do\n"
        f"  gw=$(getent ahostsv4 {names(plan, region).gateway_fqdn()} | awk 'NR==1 {{print $1}}')\n"
        '  if [ -n "$gw" ] && ! ip -4 -o addr show | grep -q " $gw/"; then\n'
        '    for c in $CIDRS; do ip route replace $c via "$gw" proto static || true; done\n'
        "  fi\n"
        "  sleep 10 & wait $!\n"
        "done\n"
    )


def gateway_docs(
    plan: Plan, region: PlanRegion, files: Any, config_name: Any, private_key: Any
) -> list[dict[str, Any]]:
    """The gateway's key Secret, its files' ConfigMap (`config_name` carries a hash of
    `files`, so changed tunnels roll the gateway), its headless Service (the route agents
    find its node through it), the gateway Deployment and the route DaemonSet."""
    k, n = settings(plan, region), names(plan, region)
    lab = labels(plan, region, "gateway")
    config = {"name": "config", "configMap": {"name": config_name, "defaultMode": 0o555}}
    gateway_pod = {
        "hostNetwork": True,  # the tunnels, BGP and routes live in the node's namespace
        "dnsPolicy": "ClusterFirstWithHostNet",
        "nodeSelector": dict(k.gateway_node_selector),
        "terminationGracePeriodSeconds": 30,
        "containers": [
            {
                "name": "gateway",
                "image": k.gateway_image,
                "imagePullPolicy": "IfNotPresent",
                "command": GATEWAY_COMMAND,
                # root (the image has no USER) with exactly these capabilities: a runtime's
                # default set varies (containerd's vs CRI-O's) and lacks SYS_ADMIN
                "securityContext": {
                    "runAsUser": 0,
                    "runAsGroup": 0,
                    "capabilities": {"drop": ["ALL"], "add": list(GATEWAY_CAPABILITIES)},
                },
                "readinessProbe": {
                    "exec": {"command": ["/bin/sh", "-c", GATEWAY_READY]},
                    "periodSeconds": 10,
                },
                "volumeMounts": [
                    {"name": "config", "mountPath": GATEWAY_DIR, "readOnly": True},
                    {"name": "key", "mountPath": WG_KEY_DIR, "readOnly": True},
                ],
            }
        ],
        "volumes": [
            config,
            {
                "name": "key",
                "secret": {"secretName": f"{n.gateway}-key", "defaultMode": 0o400},
            },
        ],
    }
    routes_pod: dict[str, Any] = {
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "containers": [
            {
                "name": "routes",
                "image": k.gateway_image,
                "imagePullPolicy": "IfNotPresent",
                "command": ROUTES_COMMAND,
                "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}},
                "volumeMounts": [{"name": "config", "mountPath": GATEWAY_DIR, "readOnly": True}],
            }
        ],
        "volumes": [config],
    }
    if k.node_selector:  # where workers run
        routes_pod["nodeSelector"] = dict(k.node_selector)
    if k.tolerations:
        routes_pod["tolerations"] = [t.model_dump(exclude_none=True) for t in k.tolerations]
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(f"{n.gateway}-key", k.namespace, lab),
            "type": "Opaque",
            "stringData": {"private.key": private_key},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(config_name, k.namespace, lab),
            "immutable": True,
            "data": files,
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(n.gateway, k.namespace, lab),
            "spec": {
                "clusterIP": "None",
                "type": "ClusterIP",
                "publishNotReadyAddresses": True,
                "selector": selector(region, "gateway"),
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(n.gateway, k.namespace, lab),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},  # one node holds the tunnels at a time
                "selector": {"matchLabels": selector(region, "gateway")},
                "template": {"metadata": {"labels": lab}, "spec": gateway_pod},
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": _meta(f"{n.workload}-routes", k.namespace, labels(plan, region, "routes")),
            "spec": {
                "selector": {"matchLabels": selector(region, "routes")},
                "template": {
                    "metadata": {"labels": labels(plan, region, "routes")},
                    "spec": routes_pod,
                },
            },
        },
    ]


def gateway_config_name(plan: Plan, region: PlanRegion, files: Mapping[str, str]) -> str:
    body = json.dumps(dict(files), sort_keys=True)
    return f"{names(plan, region).gateway}-{_digest(body)}"


# -- monitoring -----------------------------------------------------------------------------
def monitoring_docs(plan: Plan, region: PlanRegion) -> list[dict[str, Any]]:
    """kube-prometheus-stack objects: the stack's alert rules and dashboard, unchanged."""
    k, n, mon = settings(plan, region), names(plan, region), plan.monitoring
    lab = {**labels(plan, region, "monitoring"), "release": k.monitoring_release}
    interval = f"{mon.scrape_interval_s}s"
    docs: list[dict[str, Any]] = []
    if mon.metrics_port:
        docs.append(
            {
                "apiVersion": MONITORING_API,
                "kind": "PodMonitor",
                "metadata": _meta(n.workload, k.namespace, lab),
                "spec": {
                    "jobLabel": "geotrain.io/job",  # job="geotrain-runtime", as rules expect
                    "selector": {"matchLabels": selector(region, "worker")},
                    "namespaceSelector": {"matchNames": [k.namespace]},
                    "podMetricsEndpoints": [
                        {
                            "port": p["name"],
                            "path": "/metrics",
                            "interval": interval,
                            # the runtime's own region/node/rank labels win
                            "honorLabels": True,
                            "relabelings": [
                                {
                                    "sourceLabels": [
                                        "__meta_kubernetes_pod_label_geotrain_io_region"
                                    ],
                                    "targetLabel": "region",
                                }
                            ],
                        }
                        for p in worker_ports(plan, region)
                        if p["name"].startswith("metrics-")
                    ],
                },
            }
        )
    rules = yaml.safe_load(render_alert_rules(plan))
    docs.append(
        {
            "apiVersion": MONITORING_API,
            "kind": "PrometheusRule",
            "metadata": _meta(n.workload, k.namespace, lab),
            "spec": {"groups": rules["groups"]},
        }
    )
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(
                f"{n.workload}-dashboard",
                k.monitoring_namespace,
                {**labels(plan, region, "monitoring"), "grafana_dashboard": "1"},
            ),
            "data": {f"geotrain-{plan.stack}.json": render_dashboard(plan)},
        }
    )
    gpus = any(nd.device == "cuda" for nd in region.nodes)
    if gpus and mon.gpu_metrics == "dcgm-exporter":
        docs.append(
            {
                "apiVersion": MONITORING_API,
                "kind": "ServiceMonitor",
                "metadata": _meta(f"{n.workload}-dcgm", k.dcgm_namespace, lab),
                "spec": {
                    "selector": {"matchLabels": dict(DCGM_SELECTOR)},
                    "namespaceSelector": {"matchNames": [k.dcgm_namespace]},
                    "endpoints": [
                        {
                            "port": DCGM_PORT_NAME,
                            "interval": interval,
                            "relabelings": [
                                {"targetLabel": "job", "replacement": DCGM_JOB},
                                {"targetLabel": "region", "replacement": region.name},
                                {
                                    "sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                    "targetLabel": "node",
                                },
                            ],
                        }
                    ],
                },
            }
        )
    return docs


# -- everything ---------------------------------------------------------------------------
RUN_KEY_PLACEHOLDER = "<run key: made by pulumi up as a secret>"
WG_KEY_PLACEHOLDER = "<private key: made by pulumi up as a secret>"


def render_k8s(plan: Plan, region: PlanRegion) -> list[dict[str, Any]]:
    """Every manifest of a kubernetes region, secrets as placeholders (`geotrain render`)."""
    docs = pool_docs(plan, region)
    if multi_region(plan):
        files = gateway_files(plan, region, {})
        name = gateway_config_name(plan, region, files)
        docs += gateway_docs(plan, region, files, name, WG_KEY_PLACEHOLDER)
    if plan.monitoring.enabled:
        docs += monitoring_docs(plan, region)
    return docs + delivery_docs(plan, region, RUN_KEY_PLACEHOLDER)


def worker_spec(plan: Plan) -> LaunchSpec:
    """The launch spec the stack's workers really run: the pods' (node hosts are pod DNS
    names) when every region is on Kubernetes, the hosts' otherwise."""
    kube = all(r.kind == "kubernetes" for r in plan.regions)
    return pod_launch_spec(plan) if kube else render_launch_spec(plan)
