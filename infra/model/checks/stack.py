"""Regions, pools and their workers: names, ASNs, GPU types, pool kinds that can share a
stack, tags and the policy's GPU lists."""

from __future__ import annotations

import math

from infra.model.checks.common import LABEL_KEY, LABEL_VALUE, SINGLE_MACHINE_KINDS, err
from infra.model.gpus import GPU_TYPES
from infra.model.names import DEFAULT_LOGIN_USER, SERVICE_USER
from infra.model.schema import StackModel


def regions(m: StackModel, source: str) -> None:
    seen_names: dict[str, int] = {}
    seen_asn: dict[int, int] = {}
    seen_nodes: dict[str, str] = {}
    for i, r in enumerate(m.regions):
        if r.name in seen_names:
            raise err(
                source,
                f"regions[{i}].name",
                f"duplicate region name '{r.name}' "
                f"(also regions[{seen_names[r.name]}]); region names must be unique",
            )
        seen_names[r.name] = i
        if r.asn in seen_asn:
            raise err(
                source,
                f"regions[{i}].asn",
                f"duplicate ASN {r.asn} (also "
                f"regions[{seen_asn[r.asn]}]); give every region its own private ASN",
            )
        seen_asn[r.asn] = i
        for j, n in enumerate(r.pool.nodes):
            if n.name in seen_nodes:
                raise err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].name",
                    f"duplicate node name '{n.name}' (also in region "
                    f"{seen_nodes[n.name]}); node names must be unique in the stack",
                )
            seen_nodes[n.name] = r.name
            if n.gpu_type not in GPU_TYPES:
                raise err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].gpu_type",
                    f"unsupported gpu_type '{n.gpu_type}'; use one of {', '.join(GPU_TYPES)}",
                )


def pools(m: StackModel, source: str) -> None:
    kinds = {r.pool.kind for r in m.regions}
    if "kubernetes" in kinds and len(kinds) > 1:
        i = next(i for i, r in enumerate(m.regions) if r.pool.kind == "kubernetes")
        raise err(
            source,
            f"regions[{i}].pool.kind",
            "kubernetes regions cannot yet share a stack with "
            f"{sorted(kinds - {'kubernetes'})}: there is no WireGuard gateway between a "
            "cluster and hosts; put every region on Kubernetes or none",
        )
    for i, r in enumerate(m.regions):
        names = [n.name for n in r.pool.nodes]
        if r.pool.gateway is not None and r.pool.gateway not in names:
            raise err(
                source,
                f"regions[{i}].pool.gateway",
                f"'{r.pool.gateway}' is not a "
                f"node of region {r.name}; use one of {', '.join(names)}",
            )
        if r.pool.kind in SINGLE_MACHINE_KINDS and len(kinds) > 1:
            raise err(
                source,
                f"regions[{i}].pool.kind",
                f"'{r.pool.kind}' runs every region "
                f"on one machine and cannot mix with {sorted(kinds - {r.pool.kind})}; "
                "use the same kind in every region",
            )
        for j, n in enumerate(r.pool.nodes):
            loop = n.address.is_loopback
            if r.pool.kind == "local" and not loop:
                raise err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].address",
                    f"{n.address} is "
                    "not a loopback address; local pools run on this machine (127.0.0.1)",
                )
            if r.pool.kind == "ssh" and loop:
                raise err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].address",
                    "ssh nodes need the address the operator reaches them on, not loopback",
                )
    from infra.model.clouds import CLOUD_KINDS

    for i, r in enumerate(m.regions):
        if r.pool.kind in (*CLOUD_KINDS, "ssh") and r.pool.ssh.user == SERVICE_USER:
            raise err(
                source,
                f"regions[{i}].pool.ssh.user",
                f"{SERVICE_USER} is the workers' service user: logging in as it (with the "
                "sudo the agent needs) would give the workers sudo; use another login user "
                f"(default {DEFAULT_LOGIN_USER})",
            )
        if r.pool.kind not in (*CLOUD_KINDS, "ssh") and "mirrors" in r.pool.model_fields_set:
            raise err(
                source,
                f"regions[{i}].pool.mirrors",
                f"a {r.pool.kind} pool installs nothing on hosts (the agent runs on ssh and "
                "cloud pools only); drop mirrors, or set them on the image or machine",
            )
        if r.pool.kind in CLOUD_KINDS and r.pool.ssh.port != 22:
            raise err(
                source,
                f"regions[{i}].pool.ssh.port",
                f"{r.pool.ssh.port}: {r.pool.kind} images run sshd on port 22 and geotrain "
                "opens 22 in the instances' firewall; leave port at 22 for cloud pools",
            )
    if "ssh" in kinds and not m.network.admin_cidrs:
        raise err(
            source,
            "network.admin_cidrs",
            "ssh hosts drop every connection the stack does not expect, SSH included: list "
            "the networks you run `pulumi up` from, e.g. admin_cidrs: [203.0.113.0/24]",
        )


def workers(m: StackModel, source: str) -> None:
    """Regions may differ in GPU type and count (training.comm.topology pairs the first
    min-region-size local ranks across regions), but one region's workers share one
    intra-region backend: NCCL for GPUs, gloo for CPU workers."""
    for i, r in enumerate(m.regions):
        kinds = {n.gpu_type == "cpu" for n in r.pool.nodes}
        if len(kinds) > 1:
            raise err(
                source,
                f"regions[{i}].pool.nodes",
                f"region {r.name} mixes cpu and GPU nodes; its workers share one "
                "collective backend (NCCL or gloo): give every node of a region GPUs, or "
                "none, or split it into two regions",
            )
    privacy = [r.name for r in m.regions if r.privacy is not None]
    for i, r in enumerate(m.regions):
        if r.privacy is None or r.privacy.noise_multiplier is not None:
            continue
        from training.privacy.dpsgd import epsilon_floor  # torch and Opacus: only for DP stacks

        floor = epsilon_floor(r.privacy.delta, m.training.steps)
        if r.privacy.target_epsilon < floor:
            least = math.ceil(floor * 1000) / 1000  # printed rounded up: it then works
            raise err(
                source,
                f"regions[{i}].privacy.target_epsilon",
                f"{r.privacy.target_epsilon:g} is below {least:g}, the least any noise "
                f"reaches at delta {r.privacy.delta:g} (Opacus's RDP accountant); raise it, "
                "or raise delta",
            )
    if m.training.balance == "throughput" and privacy:
        raise err(
            source,
            "training.balance",
            f"throughput changes batches per rank, which DP-SGD's sampling rate fixes in "
            f"{', '.join(privacy)}; set training.balance: off, or remove privacy",
        )


def tags(m: StackModel, source: str) -> None:
    """Tags become Kubernetes labels (geotrain.io/<key>) and cloud tags: both must be valid."""
    for key, value in m.tags.items():
        if not LABEL_KEY.fullmatch(key):
            raise err(
                source,
                f"tags.{key[:40]}",
                "tag keys become Kubernetes label names: 1-63 characters, letters, digits, "
                "'-', '_', '.', starting and ending with a letter or digit",
            )
        if not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
            raise err(
                source,
                f"tags.{key}",
                f"value {str(value)[:40]!r} is not a valid label value: at most 63 "
                "characters, letters, digits, '-', '_', '.', starting and ending with a "
                "letter or digit",
            )


def policy(m: StackModel, source: str) -> None:
    for i, g in enumerate(m.policy.allowed_gpu_types or []):
        if g not in GPU_TYPES:
            raise err(
                source,
                f"policy.allowed_gpu_types[{i}]",
                f"unknown GPU type '{g}'; use one of {', '.join(GPU_TYPES)}",
            )
    for g in m.policy.gpu_prices:
        if g not in GPU_TYPES:
            raise err(
                source,
                f"policy.gpu_prices.{g}",
                f"unknown GPU type '{g}'; use one of {', '.join(GPU_TYPES)}",
            )
