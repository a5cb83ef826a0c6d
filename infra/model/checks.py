"""Cross-field checks of a parsed stack: the rules pydantic's per-field types cannot see."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

from infra.model import fault_tolerance
from infra.model.gpus import GPU_TYPES
from infra.model.schema import StackModel
from infra.plan.names import WORKER_HOST_OFFSET, ifname
from training.errors import ConfigError
from training.spec import (
    PLACEHOLDERS,
    SCAFFOLD_STREAMING,
    adaptive_problems,
    exchange_conflict,
    growing_h_problem,
)

SINGLE_MACHINE_KINDS = ("local", "lab")


def check_model(m: StackModel, source: str) -> None:
    """Raise ConfigError for the first inconsistency, naming its key path and the fix."""
    for check in (
        _regions,
        _addresses,
        _pools,
        _workers,
        _links,
        _names,
        _ports,
        _tags,
        _shards,
        _training,
        _monitoring,
        _policy,
        _runtime,
        _kubernetes,
        _clouds,
    ):
        check(m, source)


def _err(source: str, path: str, msg: str) -> ConfigError:
    return ConfigError(source, "geotrain:" + path, msg)


def _regions(m: StackModel, source: str) -> None:
    seen_names: dict[str, int] = {}
    seen_asn: dict[int, int] = {}
    seen_nodes: dict[str, str] = {}
    for i, r in enumerate(m.regions):
        if r.name in seen_names:
            raise _err(
                source,
                f"regions[{i}].name",
                f"duplicate region name '{r.name}' "
                f"(also regions[{seen_names[r.name]}]); region names must be unique",
            )
        seen_names[r.name] = i
        if r.asn in seen_asn:
            raise _err(
                source,
                f"regions[{i}].asn",
                f"duplicate ASN {r.asn} (also "
                f"regions[{seen_asn[r.asn]}]); give every region its own private ASN",
            )
        seen_asn[r.asn] = i
        for j, n in enumerate(r.pool.nodes):
            if n.name in seen_nodes:
                raise _err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].name",
                    f"duplicate node name '{n.name}' (also in region "
                    f"{seen_nodes[n.name]}); node names must be unique in the stack",
                )
            seen_nodes[n.name] = r.name
            if n.gpu_type not in GPU_TYPES:
                raise _err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].gpu_type",
                    f"unsupported gpu_type '{n.gpu_type}'; use one of {', '.join(GPU_TYPES)}",
                )


def _addresses(m: StackModel, source: str) -> None:
    net = m.network
    ov = net.overlay_cidr
    if ov.is_loopback or ov.is_multicast or ov.is_link_local or ov.is_reserved:
        raise _err(
            source,
            "network.overlay_cidr",
            f"{ov} is a loopback, multicast, link-local or reserved block, which hosts do "
            "not route; use private space such as 10.42.0.0/16",
        )
    for i, r in enumerate(m.regions):
        for j, n in enumerate(r.pool.nodes):
            addr = n.address
            if addr.is_unspecified or addr.is_multicast or addr.is_reserved:  # and broadcast
                raise _err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].address",
                    f"{addr} is not a host's address (unspecified, multicast, broadcast or "
                    "reserved); give the address the operator reaches the node on",
                )
    if not net.transfer_cidr.subnet_of(net.overlay_cidr):
        raise _err(
            source,
            "network.transfer_cidr",
            f"{net.transfer_cidr} is not inside "
            f"overlay_cidr {net.overlay_cidr}; pick a block inside the overlay",
        )
    for i, r in enumerate(m.regions):
        if not r.subnet.subnet_of(net.overlay_cidr):
            raise _err(
                source,
                f"regions[{i}].subnet",
                f"{r.subnet} is not inside overlay_cidr "
                f"{net.overlay_cidr}; pick a subnet inside the overlay",
            )
        if r.subnet.overlaps(net.transfer_cidr):
            raise _err(
                source,
                f"regions[{i}].subnet",
                f"{r.subnet} overlaps transfer_cidr {net.transfer_cidr}; move one of them",
            )
        need = WORKER_HOST_OFFSET + len(r.pool.nodes) + 1
        if r.subnet.num_addresses < need:
            raise _err(
                source,
                f"regions[{i}].subnet",
                f"{r.subnet} holds {r.subnet.num_addresses} addresses but "
                f"{len(r.pool.nodes)} nodes need {need} (gateway .1, workers from "
                f".{WORKER_HOST_OFFSET}, broadcast); use /{_prefix_for(need)} or larger",
            )
    for (i, a), (j, b) in itertools.combinations(enumerate(m.regions), 2):
        if a.subnet.overlaps(b.subnet):
            raise _err(
                source,
                f"regions[{j}].subnet",
                f"{b.subnet} overlaps regions[{i}] "
                f"({a.name}) subnet {a.subnet}; region subnets must not overlap",
            )
    if net.underlay_cidr.overlaps(net.overlay_cidr):
        raise _err(
            source,
            "network.underlay_cidr",
            f"{net.underlay_cidr} overlaps the overlay "
            f"{net.overlay_cidr}; the underlay must be separate",
        )
    lab = any(r.pool.kind == "lab" for r in m.regions)
    need = 2 * len(net.links)  # two cables per link: gateway - relay - gateway
    if lab and net.underlay_cidr.num_addresses // 4 < need:
        raise _err(
            source,
            "network.underlay_cidr",
            f"{net.underlay_cidr} holds {net.underlay_cidr.num_addresses // 4} /30 cables, "
            f"{need} needed (two per link); use /{_prefix_for(4 * need)} or larger",
        )
    seen: dict[str, str] = {}
    for i, r in enumerate(m.regions):
        for j, n in enumerate(r.pool.nodes):
            if r.pool.kind not in ("ssh",):
                continue
            path = f"regions[{i}].pool.nodes[{j}].address"
            if n.address in net.overlay_cidr:
                raise _err(
                    source,
                    path,
                    f"{n.address} is inside overlay_cidr {net.overlay_cidr}; give the address "
                    "the operator reaches the host on (its underlay address)",
                )
            if str(n.address) in seen:
                raise _err(
                    source,
                    path,
                    f"{n.address} is also node {seen[str(n.address)]}'s address; one host "
                    "serves one node",
                )
            seen[str(n.address)] = n.name


def _pools(m: StackModel, source: str) -> None:
    kinds = {r.pool.kind for r in m.regions}
    if "kubernetes" in kinds and len(kinds) > 1:
        i = next(i for i, r in enumerate(m.regions) if r.pool.kind == "kubernetes")
        raise _err(
            source,
            f"regions[{i}].pool.kind",
            "kubernetes regions cannot yet share a stack with "
            f"{sorted(kinds - {'kubernetes'})}: there is no WireGuard gateway between a "
            "cluster and hosts; put every region on Kubernetes or none",
        )
    for i, r in enumerate(m.regions):
        names = [n.name for n in r.pool.nodes]
        if r.pool.gateway is not None and r.pool.gateway not in names:
            raise _err(
                source,
                f"regions[{i}].pool.gateway",
                f"'{r.pool.gateway}' is not a "
                f"node of region {r.name}; use one of {', '.join(names)}",
            )
        if r.pool.kind in SINGLE_MACHINE_KINDS and len(kinds) > 1:
            raise _err(
                source,
                f"regions[{i}].pool.kind",
                f"'{r.pool.kind}' runs every region "
                f"on one machine and cannot mix with {sorted(kinds - {r.pool.kind})}; "
                "use the same kind in every region",
            )
        for j, n in enumerate(r.pool.nodes):
            loop = n.address.is_loopback
            if r.pool.kind == "local" and not loop:
                raise _err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].address",
                    f"{n.address} is "
                    "not a loopback address; local pools run on this machine (127.0.0.1)",
                )
            if r.pool.kind == "ssh" and loop:
                raise _err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].address",
                    "ssh nodes need the address the operator reaches them on, not loopback",
                )
    from infra.model.clouds import CLOUD_KINDS

    for i, r in enumerate(m.regions):
        if r.pool.kind in CLOUD_KINDS and r.pool.ssh.port != 22:
            raise _err(
                source,
                f"regions[{i}].pool.ssh.port",
                f"{r.pool.ssh.port}: {r.pool.kind} images run sshd on port 22 and geotrain "
                "opens 22 in the instances' firewall; leave port at 22 for cloud pools",
            )
    if "ssh" in kinds and not m.network.admin_cidrs:
        raise _err(
            source,
            "network.admin_cidrs",
            "ssh hosts drop every connection the stack does not expect, SSH included: list "
            "the networks you run `pulumi up` from, e.g. admin_cidrs: [203.0.113.0/24]",
        )


def _workers(m: StackModel, source: str) -> None:
    """Regions may differ in GPU type and count (training.topology pairs the first
    min-region-size local ranks across regions), but one region's workers share one
    intra-region backend: NCCL for GPUs, gloo for CPU workers."""
    for i, r in enumerate(m.regions):
        kinds = {n.gpu_type == "cpu" for n in r.pool.nodes}
        if len(kinds) > 1:
            raise _err(
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
        from training.privacy import epsilon_floor  # torch and Opacus: only for DP stacks

        floor = epsilon_floor(r.privacy.delta, m.training.steps)
        if r.privacy.target_epsilon < floor:
            least = math.ceil(floor * 1000) / 1000  # printed rounded up: it then works
            raise _err(
                source,
                f"regions[{i}].privacy.target_epsilon",
                f"{r.privacy.target_epsilon:g} is below {least:g}, the least any noise "
                f"reaches at delta {r.privacy.delta:g} (Opacus's RDP accountant); raise it, "
                "or raise delta",
            )
    if m.training.balance == "throughput" and privacy:
        raise _err(
            source,
            "training.balance",
            f"throughput changes batches per rank, which DP-SGD's sampling rate fixes in "
            f"{', '.join(privacy)}; set training.balance: off, or remove privacy",
        )


def _links(m: StackModel, source: str) -> None:
    names = [r.name for r in m.regions]
    pairs: dict[frozenset[str], int] = {}
    for i, link in enumerate(m.network.links):
        for end in ("a", "b"):
            value = getattr(link, end)
            if value not in names:
                raise _err(
                    source,
                    f"network.links[{i}].{end}",
                    f"unknown region '{value}'; use one of {', '.join(names)}",
                )
        if link.a == link.b:
            raise _err(
                source,
                f"network.links[{i}]",
                f"links {link.a} to itself; a link joins two different regions",
            )
        key = frozenset((link.a, link.b))
        if key in pairs:
            raise _err(
                source,
                f"network.links[{i}]",
                f"duplicate link {link.a}-{link.b} "
                f"(also links[{pairs[key]}]); one link per region pair",
            )
        pairs[key] = i
    need = len(m.network.links) * 2
    if need > m.network.transfer_cidr.num_addresses:
        raise _err(
            source,
            "network.transfer_cidr",
            f"{m.network.transfer_cidr} holds "
            f"{m.network.transfer_cidr.num_addresses // 2} /31 tunnels, {need // 2} "
            "needed; use a larger block",
        )
    if len(m.regions) > 1 and not m.network.links and m.regions[0].pool.kind != "local":
        raise _err(
            source,
            "network.links",
            "no links between regions; add at least one "
            "link per region so every region is reachable",
        )
    if m.network.links and len(m.regions) > 1:  # the overlay must reach every region
        reach = reachable(m.regions[0].name, [(lk.a, lk.b) for lk in m.network.links])
        cut = [r.name for r in m.regions if r.name not in reach]
        if cut:
            raise _err(
                source,
                "network.links",
                f"no path of links from {m.regions[0].name} to {', '.join(cut)}: the "
                "regions' gradients could not meet; add a link to each of them",
            )


def reachable(start: str, links: list[tuple[str, str]]) -> set[str]:
    """The regions a path of links joins to `start` (itself included); the policy pack's
    network-integrity check reads it too."""
    reach, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for a, b in links:
            for x, y in ((a, b), (b, a)):
                if x == here and y not in reach:
                    reach.add(y)
                    todo.append(y)
    return reach


def _names(m: StackModel, source: str) -> None:
    """Derived interface names must be distinct per gateway (they name config files, units
    and BGP neighbours)."""
    names = [r.name for r in m.regions]
    for prefix in ("wg-", "u-"):
        seen: dict[str, str] = {}
        for i, name in enumerate(names):
            derived = ifname(prefix, name)
            if derived in seen:
                raise _err(
                    source,
                    f"regions[{i}].name",
                    f"regions '{seen[derived]}' and '{name}' both give the interface name "
                    f"'{derived}' (Linux allows 15 characters); rename one of them",
                )
            seen[derived] = name


def _ports(m: StackModel, source: str) -> None:
    net, mon = m.network, m.monitoring
    last = net.wireguard_port + len(m.regions) - 1
    if last > 65535:
        raise _err(
            source,
            "network.wireguard_port",
            f"{net.wireguard_port} + one port per region ends at {last} > 65535; "
            f"use at most {65535 - len(m.regions) + 1}",
        )
    if mon.metrics_port:
        shared = any(r.pool.kind == "local" for r in m.regions)
        span = (
            sum(n.gpus for r in m.regions for n in r.pool.nodes)
            if shared
            else max(n.gpus for r in m.regions for n in r.pool.nodes)
        )
        end = mon.metrics_port + span - 1
        if end > 65535:
            raise _err(
                source,
                "monitoring.metrics_port",
                f"{mon.metrics_port} + {span} worker ports ends at {end} > 65535; "
                f"use at most {65535 - span + 1}",
            )
        port = m.training.rendezvous_port
        if mon.metrics_port <= port <= end:
            raise _err(
                source,
                "training.rendezvous_port",
                f"{port} collides with the runtime metrics ports {mon.metrics_port}-{end}; "
                "move one of them",
            )


LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")


def _tags(m: StackModel, source: str) -> None:
    """Tags become Kubernetes labels (geotrain.io/<key>) and cloud tags: both must be valid."""
    for key, value in m.tags.items():
        if not LABEL_KEY.fullmatch(key):
            raise _err(
                source,
                f"tags.{key[:40]}",
                "tag keys become Kubernetes label names: 1-63 characters, letters, digits, "
                "'-', '_', '.', starting and ending with a letter or digit",
            )
        if not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
            raise _err(
                source,
                f"tags.{key}",
                f"value {str(value)[:40]!r} is not a valid label value: at most 63 "
                "characters, letters, digits, '-', '_', '.', starting and ending with a "
                "letter or digit",
            )


def _prefix_for(addresses: int) -> int:
    """The longest IPv4 prefix whose block holds `addresses` addresses."""
    return 32 - max(0, (addresses - 1).bit_length())


def _shards(m: StackModel, source: str) -> None:
    seen: set[str] = set()
    for i, s in enumerate(m.training.data_shards):
        if s.name in seen:
            raise _err(source, f"training.data_shards[{i}].name", f"duplicate shard '{s.name}'")
        seen.add(s.name)
        try:
            region = m.region(s.region)
        except KeyError:
            raise _err(
                source,
                f"training.data_shards[{i}].region",
                f"unknown region '{s.region}'; use one of {', '.join(r.name for r in m.regions)}",
            ) from None
        if region.jurisdiction != s.jurisdiction:
            ok = [r.name for r in m.regions if r.jurisdiction == s.jurisdiction]
            hint = f"place it in {' or '.join(ok)}" if ok else "add a region in that jurisdiction"
            raise _err(
                source,
                f"training.data_shards[{i}].region",
                f"shard '{s.name}' is "
                f"{s.jurisdiction} data but region {s.region} is in "
                f"{region.jurisdiction}; data must stay in its jurisdiction: {hint}",
            )
        if not (s.uri == "pydoc-topics:auto" or s.uri.startswith("file:")):
            raise _err(
                source,
                f"training.data_shards[{i}].uri",
                f"unsupported uri '{s.uri}'; use pydoc-topics:auto or file:/path/to/text",
            )
        if s.uri.strip() in ("file:", "file:.", "file:./"):  # every .txt under the launch dir
            raise _err(
                source,
                f"training.data_shards[{i}].uri",
                f"'{s.uri}' names the launch directory, and the shard would take every .txt "
                "under it; give the shard's own file or directory, e.g. file:/data/cn",
            )
    have = {s.region for s in m.training.data_shards}
    for i, r in enumerate(m.regions):
        if r.name not in have:  # its workers would stop at start, after the deployment
            raise _err(
                source,
                "training.data_shards",
                f"region {r.name} (regions[{i}]) has no data shard and its workers train on "
                f"their region's data only: add {{name: ..., jurisdiction: {r.jurisdiction}, "
                f"region: {r.name}}}",
            )


def _training(m: StackModel, source: str) -> None:
    d = m.training.diloco
    if d.inner_steps is not None and d.interval_minutes is not None:
        raise _err(source, "training.diloco", "set inner_steps or interval_minutes, not both")
    if d.interval_minutes is not None and d.interval_minutes <= 0:
        raise _err(source, "training.diloco.interval_minutes", f"{d.interval_minutes} must be > 0")
    if d.warmup_steps >= m.training.steps:
        fix = (
            "lower it or use sync: allreduce"
            if m.training.sync == "diloco"
            else "lower it, or drop training.diloco (sync: allreduce does not use it)"
        )
        raise _err(
            source,
            "training.diloco.warmup_steps",
            f"{d.warmup_steps} must be < training.steps ({m.training.steps}): DiLoCo would "
            f"never start; {fix}",
        )
    streaming = d.fragments > 1 or d.tau > 0
    problem = growing_h_problem(
        d.every_steps, d.inner_steps_start, streaming, d.inner_steps_start_for
    )
    if problem:
        key = "inner_steps_start_for" if problem.startswith("inner_steps_start_for") else ""
        raise _err(source, f"training.diloco.{key or 'inner_steps_start'}", problem)
    _streaming(m, source)
    _secure_aggregation(m, source)
    _adaptive(m, source)
    _exchange(m, source)
    fault_tolerance.check(m, source)


def _exchange(m: StackModel, source: str) -> None:
    c = m.training.compression
    x = m.training.exchange
    conflict = exchange_conflict(
        x, secure_aggregation=c.secure_aggregation, adaptive=c.adaptive is not None
    )
    if conflict:
        raise _err(source, "training.exchange", f"{x} {conflict}")


def _adaptive(m: StackModel, source: str) -> None:
    """The launch spec's own checks (training.spec.adaptive_problems), with the stack path."""
    c, path = m.training.compression, "training.compression.adaptive"
    if c.adaptive is None:
        return
    a = c.adaptive
    for key, message in adaptive_problems(a):
        raise _err(source, f"{path}.{key}", message)
    if c.secure_aggregation:
        raise _err(
            source,
            path,
            "cannot be combined with secure_aggregation (the masked stage needs one "
            "quantizer every region agreed on); drop one of them",
        )
    if c.quantize not in a.quantize:
        raise _err(
            source,
            "training.compression.quantize",
            f"'{c.quantize}' (the codec before the first measurement) must be one of "
            f"adaptive.quantize {list(a.quantize)}",
        )


def _streaming(m: StackModel, source: str) -> None:
    """Streaming DiLoCo needs step-based merges, a step per fragment, and tau < H."""
    d = m.training.diloco
    if d.fragments == 1 and d.tau == 0:
        return
    if d.drift_correction != "none":
        raise _err(source, "training.diloco.drift_correction", SCAFFOLD_STREAMING)
    h = d.every_steps
    if h is None:
        raise _err(
            source,
            "training.diloco",
            "fragments/tau need step-based merges; set inner_steps instead of interval_minutes",
        )
    if d.fragments > h:
        raise _err(
            source,
            "training.diloco.fragments",
            f"{d.fragments} must be <= inner_steps ({h}): each fragment merges on its own step",
        )
    if d.tau >= h:
        raise _err(
            source,
            "training.diloco.tau",
            f"{d.tau} must be < inner_steps ({h}): a fragment's merge must land before its next",
        )
    if d.fragments > 1:
        from training.model import sync_bucket_count  # torch: only for streaming stacks

        t = m.training
        count = sync_bucket_count(t.model, t.bucket_mb)
        if d.fragments > count:
            raise _err(
                source,
                "training.diloco.fragments",
                f"{d.fragments} is more than the {count} sync buckets of {t.model} at "
                f"bucket_mb {t.bucket_mb:g} (a fragment is whole buckets); lower fragments "
                f"to <= {count}, or lower training.bucket_mb",
            )
    if m.training.sync == "diloco" and m.training.balance == "throughput":
        raise _err(
            source,
            "training.balance",
            "throughput weights each merge by the samples of its interval, which streaming "
            "fragments (fragments/tau) do not share; set training.balance: off, or "
            "fragments: 1 and tau: 0",
        )


def _secure_aggregation(m: StackModel, source: str) -> None:
    """Masks add integers, and with 2 regions the sum less one's own is the other's."""
    c, path = m.training.compression, "training.compression.secure_aggregation"
    if not c.secure_aggregation:
        return
    if c.quantize not in ("int8", "int4"):
        raise _err(
            source,
            path,
            f"needs quantize int8 or int4 (masks add integers), not '{c.quantize}'; "
            "set training.compression.quantize: int8",
        )
    if len(m.regions) < 3:
        raise _err(
            source,
            path,
            f"hides nothing with {len(m.regions)} regions (the sum less a region's own "
            "contribution is the other's); use 3 or more regions, or set it false",
        )


def _monitoring(m: StackModel, source: str) -> None:
    mon = m.monitoring
    nodes = [n.name for r in m.regions for n in r.pool.nodes]
    if mon.host is not None and mon.host not in nodes:
        raise _err(
            source,
            "monitoring.host",
            f"'{mon.host}' is not a node of this stack; use one of {', '.join(nodes)}",
        )
    most = max(n.gpus for r in m.regions for n in r.pool.nodes)
    if 0 < mon.metrics_port < 1024:
        raise _err(
            source,
            "monitoring.metrics_port",
            f"{mon.metrics_port} is a privileged "
            "port; use 1024-65000, or 0 to turn runtime metrics off",
        )
    span = range(mon.metrics_port, mon.metrics_port + most) if mon.metrics_port else range(0)
    taken: dict[int, str] = {}
    for key in (
        "node_exporter_port",
        "dcgm_exporter_port",
        "prometheus_port",
        "alertmanager_port",
        "grafana_port",
    ):
        port = getattr(mon, key)
        if port in span:
            raise _err(
                source,
                f"monitoring.{key}",
                f"{port} collides with the "
                f"runtime metrics ports {span.start}-{span.stop - 1}; move one of them",
            )
        if port in taken:
            raise _err(
                source,
                f"monitoring.{key}",
                f"{port} is also monitoring.{taken[port]}; give every service its own port",
            )
        taken[port] = key
    rdzv = m.training.rendezvous_port
    if mon.enabled and rdzv in taken:  # the exporters run on every node, rank 0's too
        raise _err(
            source,
            "training.rendezvous_port",
            f"{rdzv} is also monitoring.{taken[rdzv]} (on the nodes it runs on, rank 0's "
            "among them); give the rendezvous its own port, e.g. 29500",
        )
    _quorum_ports(m, span, source)
    if mon.bind_address != "private":
        import ipaddress

        try:
            addr = ipaddress.IPv4Address(mon.bind_address)
        except ValueError:
            raise _err(
                source,
                "monitoring.bind_address",
                f"'{mon.bind_address}' is neither 'private' nor an IPv4 address",
            ) from None
        hosts = [n for r in m.regions if r.pool.kind != "local" for n in r.pool.nodes]
        if len(hosts) > 1 and not addr.is_unspecified:  # 0.0.0.0: every host's own (policy)
            why = (
                "a loopback address, which Prometheus on the monitoring host cannot scrape"
                if addr.is_loopback
                else f"one address, which {len(hosts)} hosts cannot share"
            )
            raise _err(
                source,
                "monitoring.bind_address",
                f"{mon.bind_address} would be every host's metrics address: {why}; leave "
                "'private' (each host's own private address)",
            )
    _alert_receivers(m, source)


def _alert_receivers(m: StackModel, source: str) -> None:
    """Each receiver names exactly one destination; email needs the SMTP relay."""
    seen: set[str] = set()
    for i, r in enumerate(m.monitoring.receivers):
        path = f"monitoring.receivers[{i}]"
        if r.name in seen or r.name == "null":
            raise _err(
                source,
                f"{path}.name",
                f"receiver name '{r.name}' is used twice or reserved ('null'); "
                "give every receiver its own name",
            )
        seen.add(r.name)
        targets = [k for k in ("webhook_url", "slack_url_config", "email") if getattr(r, k)]
        if len(targets) != 1:
            raise _err(
                source,
                path,
                f"receiver '{r.name}' sets {targets or 'no destination'}; "
                "set exactly one of webhook_url, slack_url_config, email",
            )
        if r.webhook_token_config and not r.webhook_url:
            raise _err(
                source,
                f"{path}.webhook_token_config",
                "a webhook token needs webhook_url; set it or drop the token",
            )
        if r.webhook_url:
            from urllib.parse import urlsplit

            u = urlsplit(r.webhook_url)
            if u.scheme not in ("https", "http") or not u.hostname:
                raise _err(
                    source,
                    f"{path}.webhook_url",
                    f"'{r.webhook_url}' is not an http(s) URL with a host",
                )
            if u.username or u.password:
                raise _err(
                    source,
                    f"{path}.webhook_url",
                    "the URL carries credentials, which would sit in the rendered config; "
                    "put the token in webhook_token_config (a secret)",
                )
        if r.email and not EMAIL.fullmatch(r.email):
            raise _err(source, f"{path}.email", f"'{r.email}' is not an e-mail address")
        if r.email and m.monitoring.smtp is None:
            raise _err(
                source,
                f"{path}.email",
                "email receivers need geotrain:monitoring.smtp (smarthost, sender)",
            )
        if not r.severities:
            raise _err(
                source,
                f"{path}.severities",
                "no severities: the receiver would get nothing; use critical and/or warning",
            )
    smtp = m.monitoring.smtp
    if smtp is not None:
        host, _, port = smtp.smarthost.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise _err(
                source,
                "monitoring.smtp.smarthost",
                f"'{smtp.smarthost}' is not host:port (Alertmanager needs the port), e.g. "
                "smtp.example.org:587",
            )
        if not EMAIL.fullmatch(smtp.sender):
            raise _err(
                source, "monitoring.smtp.sender", f"'{smtp.sender}' is not an e-mail address"
            )


EMAIL = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")
"""An address Alertmanager can send to or from: local part, @, a dotted domain."""


def _policy(m: StackModel, source: str) -> None:
    for i, g in enumerate(m.policy.allowed_gpu_types or []):
        if g not in GPU_TYPES:
            raise _err(
                source,
                f"policy.allowed_gpu_types[{i}]",
                f"unknown GPU type '{g}'; use one of {', '.join(GPU_TYPES)}",
            )
    for g in m.policy.gpu_prices:
        if g not in GPU_TYPES:
            raise _err(
                source,
                f"policy.gpu_prices.{g}",
                f"unknown GPU type '{g}'; use one of {', '.join(GPU_TYPES)}",
            )


SYSTEM_TREES: tuple[str, ...] = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64")
SYSTEM_TREES += ("/libx32", "/proc", "/sbin", "/sys", "/usr")
"""Absolute checkpoint dirs refused anywhere under these: the system's own files."""
SHARED_DIRS: tuple[str, ...] = ("/", "/data", "/home", "/media", "/mnt", "/opt", "/root")
SHARED_DIRS += ("/run", "/snap", "/srv", "/tmp", "/var", "/var/lib", "/var/tmp")
"""Absolute checkpoint dirs refused as they are (a directory under them is fine): other
users' and programs' files live there."""


def _agent_etc_names() -> set[str]:
    """What the host agent keeps in /etc/geotrain: a key file there takes another name."""
    from infra.render.host import FIREWALL_PATH
    from infra.render.k8s import GATEWAY_DIR
    from infra.render.network import WG_KEY_DIR
    from infra.render.runtime import REMOTE_SPEC_PATH

    return {p.rsplit("/", 1)[1] for p in (REMOTE_SPEC_PATH, FIREWALL_PATH, WG_KEY_DIR, GATEWAY_DIR)}


def checkpoint_dir_problem(template: str) -> str | None:
    """Why `template` (training.checkpoint.dir) cannot be a checkpoint root, or None. The
    root is geotrain's: the host agent makes it the service user's with mode 0750 and
    `geotrain train --fresh` deletes checkpoints in it, so it must be a directory of its
    own, never the launch directory, one above it or a system directory."""
    return _path_problem(template, file=False)


def key_file_problem(template: str) -> str | None:
    """Why `template` (training.key_file) cannot hold the run key, or None: the host agent
    writes the key there (replacing what is there), so never a system file or one of the
    files it manages; directly in /etc/geotrain is fine (the global stack's
    /etc/geotrain/run.key)."""
    return _path_problem(template, file=True)


def _path_problem(template: str, file: bool) -> str | None:
    d = template
    if not d.strip():
        return "is empty" + ("" if file else ": the launch directory")
    if d.startswith("~"):
        return "starts with '~', which is not expanded"
    if file and d.endswith("/"):
        return "ends with '/': it names a directory, not a file"
    probe = d
    for known in PLACEHOLDERS:
        probe = probe.replace(known, "x")
    parts = probe.split("/")
    if ".." in parts:
        return "climbs out with '..'"
    real = [p for p in parts if p not in ("", ".")]
    if not real:
        return "is the filesystem root" if d.startswith("/") else "is the launch directory"
    if d.startswith("/"):
        path = "/" + "/".join(real)
        if file and real[:2] == ["etc", "geotrain"] and len(real) == 3:  # geotrain's own
            taken = real[2] in _agent_etc_names()
            return f"is the host agent's {path}" if taken else None
        if any(path == t or path.startswith(t + "/") for t in SYSTEM_TREES):
            return f"is in /{real[0]}: system files"
        if path in SHARED_DIRS:
            return f"is {path} itself: others' files"
    return None


def _quorum_ports(m: StackModel, span: range, source: str) -> None:
    """fault_tolerance's Lighthouse (on its node) and region stores (store_port + i on
    region i's first node) against what else listens on that node: the runtime metrics
    ports (`span` on every node; on the local stack's one host, one per rank), and with
    monitoring on, Prometheus, Alertmanager and Grafana on the monitoring host and the
    node exporter on ssh and cloud nodes (local and lab run no exporters; dcgm-exporter
    runs on GPU nodes, which fault tolerance refuses)."""
    from infra.model.clouds import CLOUD_KINDS

    ft, mon = m.training.fault_tolerance, m.monitoring
    if ft is None:
        return
    try:
        li, lj = fault_tolerance.lighthouse_node(m)
    except KeyError:  # fault_tolerance.check names it
        return
    if span and all(r.pool.kind == "local" for r in m.regions):
        world = sum(n.gpus for r in m.regions for n in r.pool.nodes)
        span = range(span.start, span.start + world)
    first = m.regions[0]
    mon_host = mon.host or first.pool.gateway or first.pool.nodes[0].name
    where = "training.fault_tolerance"
    on_nodes = [("port", ft.port, m.regions[li], m.regions[li].pool.nodes[lj].name)]
    on_nodes += [
        ("store_port", ft.store_port + i, r, r.pool.nodes[0].name) for i, r in enumerate(m.regions)
    ]
    for key, port, region, node in on_nodes:
        services: dict[int, str] = {}
        if mon.enabled and node == mon_host:
            services[mon.prometheus_port] = "prometheus_port"
            services[mon.alertmanager_port] = "alertmanager_port"
            if mon.grafana:
                services[mon.grafana_port] = "grafana_port"
        if mon.enabled and (region.pool.kind == "ssh" or region.pool.kind in CLOUD_KINDS):
            services[mon.node_exporter_port] = "node_exporter_port"
        other = (
            f"the runtime metrics ports {span.start}-{span.stop - 1}"
            if port in span
            else f"monitoring.{services[port]}"
            if port in services
            else None
        )
        if other is not None:
            raise _err(
                source,
                f"{where}.{key}",
                f"{port} on {node} collides with {other} there; move one of them "
                "(the defaults are 29510 for the Lighthouse, 29520 for the stores)",
            )


def _runtime(m: StackModel, source: str) -> None:
    """Settings each field accepts but the runtime could not run with."""
    t, mon = m.training, m.monitoring
    problem = checkpoint_dir_problem(t.checkpoint.dir)
    if problem is not None:
        raise _err(
            source,
            "training.checkpoint.dir",
            f"'{t.checkpoint.dir}' {problem}; use a directory of its own (geotrain owns it: "
            "mode 0750, --fresh empties it), e.g. /var/lib/geotrain/checkpoints",
        )
    problem = key_file_problem(t.key_file)
    if problem is not None:
        raise _err(
            source,
            "training.key_file",
            f"'{t.key_file}' {problem}; hosts write the run key there, replacing what is "
            "there: give a file of its own, e.g. .geotrain/{stack}/run.key",
        )
    rest = t.checkpoint.dir
    for known in PLACEHOLDERS:
        rest = rest.replace(known, "")
    if "{" in rest or "}" in rest:
        raise _err(
            source,
            "training.checkpoint.dir",
            f"'{t.checkpoint.dir}' has a placeholder the runtime does not fill in; "
            "use only {stack}, {node} and {region}",
        )
    if not 0 <= t.seed < 2**32:
        raise _err(
            source,
            "training.seed",
            f"{t.seed} is outside 0-{2**32 - 1}; the runtime seeds each rank's data order "
            "with seed * 1000 + rank, which must fit in 64 bits",
        )
    if mon.metrics_port and any(r.pool.kind == "local" for r in m.regions):
        # one machine: every worker serves on metrics_port + its global rank
        world = sum(n.gpus for r in m.regions for n in r.pool.nodes)
        span = range(mon.metrics_port, mon.metrics_port + world)
        for key in type(mon).model_fields:
            port = getattr(mon, key)
            if key.endswith("_port") and key != "metrics_port" and port in span:
                raise _err(
                    source,
                    f"monitoring.{key}",
                    f"{port} collides with the runtime metrics ports {span.start}-"
                    f"{span.stop - 1} (on a local stack every worker takes metrics_port + "
                    "its rank); move one of them",
                )


K8S_WORKDIR = "/var/lib/geotrain"
"""training.torchrun.WORKDIR: a pod's volume; files elsewhere die with the container."""
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


def _k8s_names(k: Any, source: str, path: str) -> None:
    """Names and labels the API server would refuse, refused here with their key path."""
    for field in ("node_selector", "gateway_node_selector"):
        for key, value in getattr(k, field).items():
            if not QUALIFIED_NAME.fullmatch(key) or len(key.split("/")[0]) > 253:
                raise _err(
                    source, f"{path}.{field}", f"label key {key!r} is not a Kubernetes label key"
                )
            if not LABEL_VALUE.fullmatch(value):
                raise _err(
                    source,
                    f"{path}.{field}.{key}",
                    f"label value {value!r}: at most 63 letters, digits, '-', '_' or '.', "
                    "starting and ending with a letter or digit",
                )
    if not QUALIFIED_NAME.fullmatch(k.gpu_resource):
        raise _err(
            source,
            f"{path}.gpu_resource",
            f"{k.gpu_resource!r} is not a resource name; e.g. nvidia.com/gpu",
        )
    if k.storage_class is not None and not DNS_SUBDOMAIN.fullmatch(k.storage_class):
        raise _err(
            source,
            f"{path}.storage_class",
            f"{k.storage_class!r} is not a StorageClass name (lower case, digits, '-', '.')",
        )
    for j, t in enumerate(k.tolerations):
        if t.key is not None and not QUALIFIED_NAME.fullmatch(t.key):
            raise _err(source, f"{path}.tolerations[{j}].key", f"{t.key!r} is not a taint key")
        if t.operator == "Exists" and t.value:
            raise _err(
                source,
                f"{path}.tolerations[{j}].value",
                "operator Exists matches the key alone and takes no value; drop value or "
                "use operator Equal",
            )


def _kubernetes(m: StackModel, source: str) -> None:
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
            raise _err(
                source,
                f"{path}.context",
                "no kubeconfig context: geotrain never falls back to the current context; "
                "set the context of this region's cluster in its kubeconfig",
            )
        _k8s_nodes(m, source, i)
        _k8s_names(k, source, path)
        if k.variant == "cpu" and any(n.gpu_type != "cpu" for n in r.pool.nodes):
            raise _err(
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
            raise _err(
                source,
                f"{path}.cluster_domain",
                f"'{k.cluster_domain[:40]}' makes pod names longer than DNS allows (253 "
                "characters, 63 per label); use the cluster's real domain (cluster.local)",
            )
        if multi:
            _k8s_network(m, source, i)
    _k8s_paths(m, source)


def _k8s_nodes(m: StackModel, source: str, i: int) -> None:
    r = m.regions[i]
    first = r.pool.nodes[0]
    for j, n in enumerate(r.pool.nodes):
        if (n.gpu_type, n.gpus) != (first.gpu_type, first.gpus):
            raise _err(
                source,
                f"regions[{i}].pool.nodes[{j}]",
                f"{n.name} has {n.gpus} x {n.gpu_type} but {first.name} {first.gpus} x "
                f"{first.gpu_type}; a region's pods share one template: make them equal",
            )


def _k8s_network(m: StackModel, source: str, i: int) -> None:
    """The gateway announces the pod CIDR; peers send WireGuard to the gateway address."""
    import ipaddress

    r, net = m.regions[i], m.network
    path = f"regions[{i}].pool.kubernetes.pod_cidr"
    cidr = r.pool.kubernetes.pod_cidr
    if cidr is None:
        raise _err(
            source,
            path,
            f"not set: the gateway of {r.name} announces the cluster's pod CIDR to the other "
            f"regions; set it (inside overlay_cidr {net.overlay_cidr})",
        )
    if not cidr.subnet_of(net.overlay_cidr):
        raise _err(
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
            raise _err(source, path, f"{cidr} overlaps {where} ({other}); move one of them")
    gw_name = r.pool.gateway or r.pool.nodes[0].name
    j, gw = next((j, n) for j, n in enumerate(r.pool.nodes) if n.name == gw_name)
    addr = gw.address
    if addr.is_loopback or addr in net.overlay_cidr or addr == ipaddress.IPv4Address("0.0.0.0"):
        raise _err(
            source,
            f"regions[{i}].pool.nodes[{j}].address",
            f"{addr} cannot be the WireGuard endpoint of {r.name}'s gateway; give the public "
            "address of the node labelled for the gateway (kubernetes.gateway_node_selector)",
        )
    for o in m.regions[:i]:
        o_gw = o.pool.gateway or o.pool.nodes[0].name
        if next(n.address for n in o.pool.nodes if n.name == o_gw) == addr:
            raise _err(
                source,
                f"regions[{i}].pool.nodes[{j}].address",
                f"{addr} is also region {o.name}'s gateway address; every region's gateway "
                "needs its own",
            )


def _k8s_paths(m: StackModel, source: str) -> None:
    """Checkpoints must land on the pods' volume (the run key is mounted wherever
    training.key_file points)."""
    value = m.training.checkpoint.dir
    if value.startswith("/") and not value.startswith(K8S_WORKDIR + "/"):
        raise _err(
            source,
            "training.checkpoint.dir",
            f"'{value}' is outside the pods' volume {K8S_WORKDIR}: checkpoints would vanish "
            "with the container; use a relative path (it resolves under that volume)",
        )


GCP_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
GCP_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


def _clouds(m: StackModel, source: str) -> None:
    """Cloud regions: a known cloud region that offers each node's GPUs, a disk the image
    fits on, subnet addresses the cloud does not keep for itself (tables: clouds.py)."""
    from infra.model.clouds import CLOUD_KINDS

    regions = [(i, r) for i, r in enumerate(m.regions) if r.pool.kind in CLOUD_KINDS]
    if not regions:
        return
    if not m.network.admin_cidrs:
        raise _err(
            source,
            "network.admin_cidrs",
            "cloud firewalls admit SSH only from the stack's admin networks and there are "
            "none: list the networks you run `pulumi up` from, e.g. admin_cidrs: [203.0.113.0/24]",
        )
    for i, r in regions:
        _cloud_region(m, source, i)
        for j in range(len(r.pool.nodes)):
            _cloud_node(m, source, i, j)
    if any(r.pool.kind == "gcp" for _, r in regions):
        _gcp_labels(m, source)


def _cloud_region(m: StackModel, source: str, i: int) -> None:
    import difflib

    from infra.model.clouds import CLOUDS

    r = m.regions[i]
    c, s, path = CLOUDS[r.pool.kind], r.pool.cloud, f"regions[{i}].pool.cloud"
    if s.region is None:
        raise _err(
            source,
            f"{path}.region",
            f"not set: region {r.name} needs the {c.title} region its instances run in, "
            f"e.g. region: {c.regions[0]}",
        )
    if s.region not in c.regions:
        near = difflib.get_close_matches(s.region, c.regions, n=3)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise _err(
            source,
            f"{path}.region",
            f"unknown {c.title} region '{s.region}'; {hint}geotrain knows "
            f"{', '.join(c.regions[:8])}, ... ({len(c.regions)} in infra/model/clouds.py)",
        )
    if r.pool.kind == "gcp" and not s.project:
        raise _err(
            source,
            f"{path}.project",
            "not set: GCP regions name their project (there is no fall-back to gcloud's "
            "default project); set project: <your-project-id>",
        )
    if s.zone is not None and not s.zone.startswith(s.region):
        raise _err(
            source,
            f"{path}.zone",
            f"'{s.zone}' is not a zone of {s.region}; use a zone of that region or drop zone",
        )
    low, high = c.prefix_range
    if not low <= r.subnet.prefixlen <= high:
        raise _err(
            source,
            f"regions[{i}].subnet",
            f"{r.subnet}: {c.title} subnets are /{low} to /{high}; pick a subnet in that range",
        )
    if r.pool.kind == "aws" and s.image and not s.image.startswith(("ami-", "ssm:")):
        raise _err(
            source,
            f"{path}.image",
            f"'{s.image}' is neither an AMI id (ami-...) nor a public SSM parameter "
            f"(ssm:/aws/service/...); use one of those, or drop image for {c.image.ref}",
        )
    need, what = _image_need(r.pool.kind, s.image, s.image_disk_gb)
    if need is not None and s.disk_gb < need:
        raise _err(
            source,
            f"{path}.disk_gb",
            f"{s.disk_gb} GiB is smaller than the image needs ({need} GiB for {what}); "
            f"use disk_gb: {need} or more",
        )
    if s.peering:
        _peering(m, source, i)


def _image_need(kind: str, image: str | None, declared: int | None) -> tuple[int | None, str]:
    from infra.model.clouds import CLOUDS

    default = CLOUDS[kind].image
    if image is None or image == default.ref:
        return default.min_disk_gb, default.description
    return declared, f"image {image} (image_disk_gb)"


def _cloud_node(m: StackModel, source: str, i: int, j: int) -> None:
    from infra.model.clouds import CLOUD_GATEWAY_HOST, CLOUDS

    r = m.regions[i]
    n, c, s = r.pool.nodes[j], CLOUDS[r.pool.kind], r.pool.cloud
    path = f"regions[{i}].pool.nodes[{j}]"
    if "address" in n.model_fields_set:
        raise _err(
            source,
            f"{path}.address",
            f"{n.address}: a cloud instance gets its address when it is made; drop address "
            "(the public IP reaches peers and the agent at deploy time)",
        )
    t = c.instance(n.gpu_type, n.gpus)
    if t is None:
        shapes = ", ".join(f"{x.gpus} x {x.gpu_type} ({x.name})" for x in c.instances)
        raise _err(
            source,
            f"{path}.gpu_type",
            f"{n.gpus} x {n.gpu_type}: {c.title} has no such instance in geotrain's table; "
            f"use one of {shapes}",
        )
    region = str(s.region)
    offer = t.offers.get(region)
    if offer is None:
        where = ", ".join(t.offers)
        here = [f"{x.gpu_type} ({x.name})" for x in c.instances if region in x.offers]
        alt = f", or a GPU type {region} offers: {', '.join(here)}" if here else ""
        raise _err(
            source,
            f"{path}.gpu_type",
            f"{c.title} {region} does not offer {n.gpu_type} ({t.name} is in {where}); "
            f"put region {r.name} in one of those{alt}",
        )
    if s.zone is not None and offer.zones and s.zone not in offer.zones:
        raise _err(
            source,
            f"regions[{i}].pool.cloud.zone",
            f"{s.zone} does not offer {t.name}; use one of {', '.join(offer.zones)}",
        )
    gw = r.pool.gateway or r.pool.nodes[0].name
    host = CLOUD_GATEWAY_HOST if n.name == gw else WORKER_HOST_OFFSET + j
    last = r.subnet.num_addresses - 1 - c.reserved_high
    if not c.reserved_low <= host <= last:
        raise _err(
            source,
            f"regions[{i}].subnet",
            f"node {n.name} would get {r.subnet[host]}, which {c.title} keeps for itself (the "
            f"first {c.reserved_low} and last {c.reserved_high} of every subnet); use a "
            "larger subnet",
        )


def _peering(m: StackModel, source: str, i: int) -> None:
    r = m.regions[i]
    if r.pool.kind == "gcp":
        raise _err(
            source,
            f"regions[{i}].pool.cloud.peering",
            "not on GCP: peered GCP networks exchange subnet routes, so the workers' traffic "
            "would take the peering beside the WireGuard overlay instead of under it; drop it",
        )
    peers = [
        o.name
        for link in m.network.links
        if r.name in (link.a, link.b)
        for o in m.regions
        if o.name in (link.a, link.b)
        and o.name != r.name
        and o.pool.kind == r.pool.kind
        and o.pool.cloud.peering
    ]
    if not peers:
        raise _err(
            source,
            f"regions[{i}].pool.cloud.peering",
            f"true, but no region linked to {r.name} is on {r.pool.kind} with peering: true; "
            "peering joins two linked regions of the same cloud: set it on both or drop it",
        )


def _gcp_labels(m: StackModel, source: str) -> None:
    """GCP labels are stricter than tags elsewhere: lowercase keys and values, no dots."""
    for key, value in m.tags.items():
        if not GCP_LABEL_KEY.fullmatch(key) or not GCP_LABEL_VALUE.fullmatch(value.lower()):
            raise _err(
                source,
                f"tags.{key}",
                f"{key}: {value!r} cannot be a GCP label (keys start with a lowercase letter; "
                "keys and values hold lowercase letters, digits, '-' and '_'); rename it",
            )


def idle_settings(m: StackModel) -> list[str]:
    """`geotrain validate` hints for settings the run will not use: valid, but a user who
    set them expected an effect."""
    t = m.training
    d = t.diloco
    out = []
    if t.sync == "allreduce" and d != type(d)():
        out.append(
            "hint: training.diloco is set but sync is allreduce, which does not use it; "
            "set sync: diloco to merge periodically"
        )
    elif d.mix > 0 and d.tau == 0:
        out.append(
            f"hint: training.diloco.mix {d.mix:g} has no effect with tau 0 (a merge lands at "
            "once, with no local progress since its send to keep); set tau, or drop mix"
        )
    from infra.model.clouds import CLOUD_KINDS

    for i, r in enumerate(m.regions):
        uses = {
            "ssh": r.pool.kind == "ssh" or r.pool.kind in CLOUD_KINDS,
            "kubernetes": r.pool.kind == "kubernetes",
            "cloud": r.pool.kind in CLOUD_KINDS,
        }
        for key, used in uses.items():
            value = getattr(r.pool, key)
            if not used and value != type(value)():
                out.append(
                    f"hint: regions[{i}].pool.{key} is set but pools of kind {r.pool.kind} "
                    "do not use it"
                )
    every = d.every_steps
    first = d.inner_steps_start or every  # the first round (a ramp starts shorter)
    inner = t.steps - d.warmup_steps
    if t.sync == "diloco" and first is not None and first >= inner:
        key = "inner_steps_start" if d.inner_steps_start else "inner_steps"
        out.append(
            f"hint: training.diloco.{key} {first} is not below the {inner} steps after the "
            "warm-up: the regions merge once, at the end, and train apart until then; set "
            f"it to {max(1, inner // 10)} or so for ten merges"
        )
    ft = t.fault_tolerance
    if ft is not None and ft.replicas(len(m.regions)) == len(m.regions):
        R = len(m.regions)
        out.append(
            f"hint: training.fault_tolerance needs all {R} regions in a quorum (min_replicas "
            f"{R}): losing any region stops the others too, until it is back; with 3 or more "
            "regions a majority trains on (below a majority, regions cut apart train apart)"
        )
    if t.checkpoint.interval_steps >= t.steps:
        out.append(
            f"hint: training.checkpoint.interval_steps {t.checkpoint.interval_steps} is not "
            f"below steps ({t.steps}): the run saves no checkpoint before its end, so a "
            "restart begins again at step 0"
        )
    return out
