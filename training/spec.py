"""The launch spec: the JSON contract between the Pulumi program and the runtime.

infra renders it (`launch_spec` stack output, `launch-spec.json`); the runtime reads only
this. Every field is plain JSON so SSH hosts and pods need nothing but the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.errors import SpecError

SPEC_VERSION = 1


@dataclass(frozen=True)
class ShardSpec:
    name: str
    """Shard name."""
    jurisdiction: str
    """Jurisdiction of the raw data."""
    uri: str
    """pydoc-topics:auto | file:/path."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    """Node name (unique)."""
    host: str
    """Address this node's workers bind to and are reached on (private/overlay)."""
    first_rank: int
    """Global rank of the node's local rank 0."""
    nprocs: int
    """Worker processes (= accelerators) on the node."""
    device: str
    """cuda | cpu."""
    netns: str | None = None
    """lab only: network namespace the workers run in."""


@dataclass(frozen=True)
class PrivacySpec:
    """DP-SGD inside one region (training.privacy); see infra.model.schema.Privacy."""

    target_epsilon: float
    """Epsilon the region may spend over the run."""
    delta: float
    """Delta of the (epsilon, delta) guarantee."""
    max_grad_norm: float
    """Per-record gradient clipping norm C."""
    noise_multiplier: float | None = None
    """Fixed noise multiplier (None: calibrated to target_epsilon over the planned steps)."""


@dataclass(frozen=True)
class RegionSpec:
    name: str
    """Region name."""
    jurisdiction: str
    """Jurisdiction of the region."""
    nodes: list[NodeSpec]
    """Nodes in rank order."""
    shards: list[ShardSpec]
    """Data this region reads; never another region's."""
    privacy: PrivacySpec | None = None
    """Record-level differential privacy of the region's updates (None: off)."""


@dataclass(frozen=True)
class CodecSpec:
    quantize: str = "int8"
    """none | fp16 | bf16 | int8 | int4."""
    block_size: int = 256
    """Elements per scale block (int8/int4)."""
    error_feedback: bool = True
    """Keep the quantization residual per bucket."""
    zstd_level: int = 1
    """zstd level after byte-shuffle."""
    cipher: str = "sm4-gcm"
    """sm4-gcm | aes-gcm | none."""
    secure_aggregation: bool = False
    """Mask the cross-region scatter stage pairwise (training.secagg); int8 or int4 only."""


@dataclass(frozen=True)
class DilocoSpec:
    every_steps: int | None = 100
    """Merge every H inner steps (None: time-based)."""
    interval_minutes: float | None = None
    """Merge every T minutes (None: step-based)."""
    outer_lr: float = 0.7
    """Outer Nesterov learning rate."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum."""
    warmup_steps: int = 0
    """First steps synced every step across regions before DiLoCo starts (training.diloco)."""


@dataclass(frozen=True)
class CheckpointSpec:
    dir: str = ".geotrain/checkpoints"
    """Checkpoint root; relative paths resolve against the launch directory."""
    interval_steps: int = 50
    """Save every N steps."""
    interval_minutes: float = 30
    """And at least every T minutes."""
    keep: int = 2
    """Committed checkpoints kept."""


@dataclass(frozen=True)
class FaultToleranceSpec:
    """Regions as torchft replica groups (training.quorum); see docs/fault-tolerance.md."""

    lighthouse: str
    """host:port the Lighthouse binds and every region dials (an overlay or loopback
    address, never a hostname default)."""
    min_replicas: int
    """Regions a quorum needs; fewer and the survivors stop (exit 3: whole-job restart)."""
    store_port: int = 29600
    """Region i's rendezvous store listens on its first node's host at store_port + i."""
    join_timeout_s: float = 2.0
    """How long the Lighthouse waits for every live region before it forms a smaller quorum."""
    heartbeat_timeout_s: float = 5.0
    """A region whose Manager is silent this long is left out of the next quorum."""
    timeout_s: float = 30.0
    """Cross-region collectives and heals: a dead peer fails the round after at most this."""
    quorum_timeout_s: float = 120.0
    """How long a region waits for a quorum (a DiLoCo region waits a whole merge interval)."""


@dataclass(frozen=True)
class LaunchSpec:
    run_id: str
    """Stable id of the run; bound into every payload and checkpoint."""
    stack: str
    """Stack the spec was rendered from."""
    master_addr: str
    """Host of the global TCPStore (first node)."""
    master_port: int
    """Port of the global TCPStore."""
    regions: list[RegionSpec]
    """Regions in rank order."""
    model: str = "deepseek-tiny"
    """Model preset."""
    sync: str = "allreduce"
    """allreduce | diloco."""
    steps: int = 60
    """Optimizer (inner) steps."""
    batch_size: int = 8
    """Sequences per worker per step."""
    seq_len: int = 64
    """Tokens per sequence."""
    lr: float = 3e-3
    """AdamW learning rate."""
    seed: int = 1234
    """Seed."""
    bucket_mb: float = 4.0
    """Gradient bucket size."""
    codec: CodecSpec = field(default_factory=CodecSpec)
    """Cross-region codec."""
    diloco: DilocoSpec = field(default_factory=DilocoSpec)
    """Periodic merge settings."""
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    """Checkpoint settings."""
    key_file: str = ".geotrain/run.key"
    """File with the run's hex key."""
    metrics_port: int = 9400
    """Local rank i serves Prometheus metrics on metrics_port + i (0: off); see
    metrics_port()."""
    metrics_bind: str = "127.0.0.1"
    """Bind address for metrics ('private' = the node's host)."""
    max_restarts: int = 3
    """Restarts after a worker dies."""
    fault_tolerance: FaultToleranceSpec | None = None
    """Regions drop and rejoin without a restart (training.quorum); None: off."""
    version: int = SPEC_VERSION
    """Spec format version."""

    @property
    def world_size(self) -> int:
        return sum(n.nprocs for r in self.regions for n in r.nodes)

    def node(self, name: str) -> tuple[RegionSpec, NodeSpec]:
        for r in self.regions:
            for n in r.nodes:
                if n.name == name:
                    return r, n
        names = ", ".join(n.name for r in self.regions for n in r.nodes)
        raise SpecError(
            f"node '{name}' is not in the launch spec of run {self.run_id}; use one of {names}"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str, source: str = "launch spec") -> LaunchSpec:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(
                f"{source}: not valid JSON ({e}); re-render it with `geotrain render`"
            ) from None
        return _from_dict(raw, source)

    @staticmethod
    def load(path: str | Path) -> LaunchSpec:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise SpecError(
                f"cannot read launch spec {p}: {e.strerror}; render it with "
                "`geotrain render --stack S --out DIR`"
            ) from None
        return LaunchSpec.from_json(text, str(p))


def node_root(template: str, stack: str, node: str, region: str) -> Path:
    """A node's checkpoint root: `template` with {stack}, {node} and {region} filled in.
    With {node} (or {region}) every node gets its own root, as on hosts without a shared
    filesystem; without, nodes share one root and keep apart by their node directories."""
    return Path(
        template.replace("{stack}", stack).replace("{node}", node).replace("{region}", region)
    )


def record_path(state_dir: Path, node: str) -> Path:
    """A node's high-water record (training.checkpoint)."""
    return state_dir / f"high-water-{node}.json"


def metrics_port(base: int, first_rank: int, local_rank: int, shared_host: bool) -> int:
    """Port of a worker's metrics endpoint; 0 disables metrics. When every node shares one
    host (the local stack), ports are offset by global rank so they do not collide."""
    if base == 0:
        return 0
    return base + (first_rank if shared_host else 0) + local_rank


def metrics_endpoint(spec: LaunchSpec, node: NodeSpec, local_rank: int) -> tuple[str, int]:
    """(address, port) a worker's metrics endpoint binds; port 0: no endpoint."""
    host = node.host if spec.metrics_bind == "private" else spec.metrics_bind
    shared = len({n.host for r in spec.regions for n in r.nodes}) == 1
    return host, metrics_port(spec.metrics_port, node.first_rank, local_rank, shared)


def listeners(spec: LaunchSpec) -> list[dict[str, Any]]:
    """Every socket the runtime listens on, from the same functions the workers bind
    with: the rendezvous store (rank 0, training.session.rendezvous_store), each worker's
    gloo device (training.gloo; ephemeral ports, shown as 0) and metrics endpoint."""
    out: list[dict[str, Any]] = [
        {"service": "rendezvous", "bind": spec.master_addr, "port": spec.master_port}
    ]
    for r in spec.regions:
        for n in r.nodes:
            for i in range(n.nprocs):
                out.append({"service": "gloo", "bind": n.host, "port": 0, "node": n.name})
                host, port = metrics_endpoint(spec, n, i)
                if port:
                    out.append({"service": "metrics", "bind": host, "port": port, "node": n.name})
    return out + _quorum_listeners(spec)


def _quorum_listeners(spec: LaunchSpec) -> list[dict[str, Any]]:
    """fault_tolerance (training.quorum): the Lighthouse, each region's store, and per
    worker its torchft ManagerServer and heal server (ephemeral ports, shown as 0)."""
    ft = spec.fault_tolerance
    if ft is None:
        return []
    host, _, port = ft.lighthouse.rpartition(":")
    out: list[dict[str, Any]] = [{"service": "lighthouse", "bind": host, "port": int(port)}]
    for i, r in enumerate(spec.regions):
        first = r.nodes[0]
        out.append(
            {
                "service": "region-store",
                "bind": first.host,
                "port": ft.store_port + i,
                "node": first.name,
            }
        )
        for n in r.nodes:
            for service in ("torchft-manager", "heal"):
                out.append({"service": service, "bind": n.host, "port": 0, "node": n.name})
    return out


def _from_dict(raw: Any, source: str) -> LaunchSpec:
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the spec must be a JSON object")
    if raw.get("version") != SPEC_VERSION:
        raise SpecError(
            f"{source}: spec version {raw.get('version')!r} is not supported; "
            f"this runtime reads version {SPEC_VERSION}"
        )
    try:
        regions = [
            RegionSpec(
                name=r["name"],
                jurisdiction=r["jurisdiction"],
                nodes=[NodeSpec(**n) for n in r["nodes"]],
                shards=[ShardSpec(**s) for s in r["shards"]],
                privacy=PrivacySpec(**r["privacy"]) if r.get("privacy") else None,
            )
            for r in raw["regions"]
        ]
        body = {
            k: v
            for k, v in raw.items()
            if k not in ("regions", "codec", "diloco", "checkpoint", "fault_tolerance")
        }
        ft = raw.get("fault_tolerance")
        spec = LaunchSpec(
            regions=regions,
            codec=CodecSpec(**raw["codec"]),
            diloco=DilocoSpec(**raw["diloco"]),
            checkpoint=CheckpointSpec(**raw["checkpoint"]),
            fault_tolerance=FaultToleranceSpec(**ft) if ft else None,
            **body,
        )
    except (KeyError, TypeError) as e:
        raise SpecError(
            f"{source}: malformed launch spec ({e}); re-render it with `geotrain render`"
        ) from None
    _check_ranks(spec, source)
    return spec


def _check_ranks(spec: LaunchSpec, source: str) -> None:
    expect = 0
    for r in spec.regions:
        if not r.nodes:
            raise SpecError(f"{source}: region {r.name} has no nodes")
        for n in r.nodes:
            if n.first_rank != expect or n.nprocs < 1:
                raise SpecError(
                    f"{source}: node {n.name} has first_rank {n.first_rank} "
                    f"and nprocs {n.nprocs}; ranks must be contiguous from 0 "
                    f"(expected first_rank {expect})"
                )
            expect += n.nprocs
    sizes = {sum(n.nprocs for n in r.nodes) for r in spec.regions}
    if len(sizes) != 1:
        raise SpecError(
            f"{source}: regions have different worker counts {sorted(sizes)}; "
            "the hierarchical all-reduce pairs local ranks across regions, so "
            "every region needs the same number of workers"
        )
