"""Kubernetes regions: settings a cluster would refuse, or that would leave the pods unable
to train."""

from __future__ import annotations

import re
from typing import Any

from infra.model.checks.common import LABEL_VALUE, err
from infra.model.schema import StackModel
from training.errors import ConfigError

K8S_WORKDIR = "/var/lib/geotrain"
"""training.launch.torchrun.WORKDIR: a pod's volume; files elsewhere die with the container."""
K8S_LABEL_MAX = 63
K8S_RUN_SUFFIX = 11
"""The run id is `<stack>-<10 hex digits>`; it names the run in labels and files."""


QUALIFIED_NAME = re.compile(
    r"(?:[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
"""A Kubernetes label key, taint key or extended resource name: an optional DNS prefix and
'/', then a name of at most 63 characters."""
DNS_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")
NODE_PORTS = range(30000, 32768)
"""Kubernetes' default NodePort range: kube-proxy redirects a NodePort on every local
address of every node (the gateway's overlay address included) before any process sees it."""
NODE_TCP_PORTS = {
    179: "BGP: FRR's bgpd on the gateway's node",
    2379: "etcd",
    2380: "etcd peers",
    6443: "the API server",
    10248: "the kubelet's health check",
    10249: "kube-proxy's metrics",
    10250: "the kubelet",
    10255: "the kubelet's read-only port",
    10256: "kube-proxy's health check",
    10257: "kube-controller-manager",
    10259: "kube-scheduler",
}
"""TCP ports taken on a node (the gateway runs on hostNetwork)."""


def check(m: StackModel, source: str) -> None:
    """Settings a cluster would refuse, or that would leave the pods unable to train."""
    kube = [(i, r) for i, r in enumerate(m.regions) if r.pool.kind == "kubernetes"]
    if not kube:
        return
    if len(m.stack) + K8S_RUN_SUFFIX > K8S_LABEL_MAX:
        raise ConfigError(
            source,
            "stack name",
            f"'{m.stack[:40]}' is {len(m.stack)} characters; Kubernetes label values hold "
            f"{K8S_LABEL_MAX}, so stacks on Kubernetes allow at most "
            f"{K8S_LABEL_MAX - K8S_RUN_SUFFIX - 1}; rename the stack file",
        )
    multi = len(m.regions) > 1
    for i, r in kube:
        k, path = r.pool.kubernetes, f"regions[{i}].pool.kubernetes"
        if not k.context:
            raise err(
                source,
                f"{path}.context",
                "no kubeconfig context: geotrain never falls back to the current context; "
                "set the context of this region's cluster in its kubeconfig",
            )
        _k8s_nodes(m, source, i)
        _k8s_names(k, source, path)
        if k.variant == "cpu" and any(n.gpu_type != "cpu" for n in r.pool.nodes):
            raise err(
                source,
                f"{path}.variant",
                f"region {r.name} requests GPUs but its image {k.image}:{k.tag} is the cpu "
                "variant; build the Dockerfile with --build-arg VARIANT=cuda and set "
                "variant: cuda and its tag",
            )
        fqdn = f"gt-{r.name}-workers-0-{len(r.pool.nodes)}.gt-{r.name}.{k.namespace}.svc."
        if len(fqdn) + len(k.cluster_domain) > 253 or any(
            len(label) > K8S_LABEL_MAX for label in k.cluster_domain.split(".")
        ):
            raise err(
                source,
                f"{path}.cluster_domain",
                f"'{k.cluster_domain[:40]}' makes pod names longer than DNS allows (253 "
                "characters, 63 per label); use the cluster's real domain (cluster.local)",
            )
        if multi:
            _k8s_network(m, source, i)
    _k8s_paths(m, source)


def _k8s_names(k: Any, source: str, path: str) -> None:
    """Names and labels the API server would refuse, refused here with their key path."""
    for field in ("node_selector", "gateway_node_selector"):
        for key, value in getattr(k, field).items():
            if not QUALIFIED_NAME.fullmatch(key) or len(key.split("/")[0]) > 253:
                raise err(
                    source, f"{path}.{field}", f"label key {key!r} is not a Kubernetes label key"
                )
            if not LABEL_VALUE.fullmatch(value):
                raise err(
                    source,
                    f"{path}.{field}.{key}",
                    f"label value {value!r}: at most 63 letters, digits, '-', '_' or '.', "
                    "starting and ending with a letter or digit",
                )
    if not QUALIFIED_NAME.fullmatch(k.gpu_resource):
        raise err(
            source,
            f"{path}.gpu_resource",
            f"{k.gpu_resource!r} is not a resource name; e.g. nvidia.com/gpu",
        )
    if k.storage_class is not None and not DNS_SUBDOMAIN.fullmatch(k.storage_class):
        raise err(
            source,
            f"{path}.storage_class",
            f"{k.storage_class!r} is not a StorageClass name (lower case, digits, '-', '.')",
        )
    for j, t in enumerate(k.tolerations):
        if t.key is not None and not QUALIFIED_NAME.fullmatch(t.key):
            raise err(source, f"{path}.tolerations[{j}].key", f"{t.key!r} is not a taint key")
        if t.operator == "Exists" and t.value:
            raise err(
                source,
                f"{path}.tolerations[{j}].value",
                "operator Exists matches the key alone and takes no value; drop value or "
                "use operator Equal",
            )


def _k8s_nodes(m: StackModel, source: str, i: int) -> None:
    r = m.regions[i]
    first = r.pool.nodes[0]
    for j, n in enumerate(r.pool.nodes):
        if (n.gpu_type, n.gpus) != (first.gpu_type, first.gpus):
            raise err(
                source,
                f"regions[{i}].pool.nodes[{j}]",
                f"{n.name} has {n.gpus} x {n.gpu_type} but {first.name} {first.gpus} x "
                f"{first.gpu_type}; a region's pods share one template: make them equal",
            )


def _k8s_network(m: StackModel, source: str, i: int) -> None:
    """The gateway announces the pod CIDR; peers send WireGuard to the gateway address."""

    r, net = m.regions[i], m.network
    path = f"regions[{i}].pool.kubernetes.pod_cidr"
    cidr = r.pool.kubernetes.pod_cidr
    if cidr is None:
        raise err(
            source,
            path,
            f"not set: the gateway of {r.name} announces the cluster's pod CIDR to the other "
            f"regions; set it (inside overlay_cidr {net.overlay_cidr})",
        )
    if not cidr.subnet_of(net.overlay_cidr):
        raise err(
            source,
            path,
            f"{cidr} is not inside overlay_cidr {net.overlay_cidr}; the gateways route only "
            "the overlay: widen overlay_cidr or renumber the pods",
        )
    taken = [(f"regions[{j}].subnet", o.subnet) for j, o in enumerate(m.regions)] + [
        ("network.transfer_cidr", net.transfer_cidr)
    ]
    taken += [
        (f"regions[{j}].pool.kubernetes.pod_cidr", o.pool.kubernetes.pod_cidr)
        for j, o in enumerate(m.regions)
        if j != i and o.pool.kubernetes.pod_cidr is not None
    ]
    for where, other in taken:
        if other is not None and cidr.overlaps(other):
            raise err(source, path, f"{cidr} overlaps {where} ({other}); move one of them")
    gw_name = r.pool.gateway or r.pool.nodes[0].name
    j, gw = next((j, n) for j, n in enumerate(r.pool.nodes) if n.name == gw_name)
    addr = gw.address
    unroutable = addr.is_loopback or addr.is_link_local or addr.is_multicast or addr.is_reserved
    if unroutable or addr in net.overlay_cidr or addr.is_unspecified:
        raise err(
            source,
            f"regions[{i}].pool.nodes[{j}].address",
            f"{addr} cannot be the WireGuard endpoint of {r.name}'s gateway; give the public "
            "address of the node labelled for the gateway (kubernetes.gateway_node_selector)",
        )
    for o in m.regions[:i]:
        o_gw = o.pool.gateway or o.pool.nodes[0].name
        if next(n.address for n in o.pool.nodes if n.name == o_gw) == addr:
            raise err(
                source,
                f"regions[{i}].pool.nodes[{j}].address",
                f"{addr} is also region {o.name}'s gateway address; every region's gateway "
                "needs its own",
            )
    if not r.pool.kubernetes.gateway_node_selector:
        raise err(
            source,
            f"regions[{i}].pool.kubernetes.gateway_node_selector",
            f"empty: the gateway would run on any node, but the other regions send WireGuard "
            f"to {addr}, one node's address; label that node and select it "
            "(e.g. geotrain.io/gateway: 'true')",
        )
    _k8s_gateway_ports(m, source, first=i == 0)


def _k8s_gateway_ports(m: StackModel, source: str, first: bool) -> None:
    """Ports the gateway listens on in its node's network namespace (hostNetwork)."""
    net = m.network
    wg = range(net.wireguard_port, net.wireguard_port + len(m.regions))
    if set(wg) & set(NODE_PORTS):
        raise err(
            source,
            "network.wireguard_port",
            f"WireGuard ports {wg.start}-{wg.stop - 1} fall in Kubernetes' NodePort range "
            f"{NODE_PORTS.start}-{NODE_PORTS.stop - 1}: a NodePort Service would take the "
            "gateway's datagrams; use a port outside it (default 51820)",
        )
    port = m.training.rendezvous_port
    taken = "Kubernetes' NodePort range" if port in NODE_PORTS else NODE_TCP_PORTS.get(port)
    if first and taken:  # the first region's gateway forwards the rendezvous
        raise err(
            source,
            "training.rendezvous_port",
            f"{port} is taken on the gateway's node ({taken}): the first region's gateway "
            "forwards the rendezvous there on hostNetwork; use another port (default 29500)",
        )


def _k8s_paths(m: StackModel, source: str) -> None:
    """Checkpoints must land on the pods' volume (the run key is mounted wherever
    training.key_file points)."""
    value = m.training.checkpoint.dir
    if value.startswith("/") and not value.startswith(K8S_WORKDIR + "/"):
        raise err(
            source,
            "training.checkpoint.dir",
            f"'{value}' is outside the pods' volume {K8S_WORKDIR}: checkpoints would vanish "
            "with the container; use a relative path (it resolves under that volume)",
        )
