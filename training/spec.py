"""The launch spec: the JSON contract between the Pulumi program and the runtime.

infra renders it (`launch_spec` stack output, `launch-spec.json`); the runtime reads only
this. Every field is plain JSON so SSH hosts and pods need nothing but the file.

The specs are pydantic dataclasses: constructing one validates its fields (types, bounds,
allowed values, contiguous ranks), and `LaunchSpec.from_json` reads a file strictly (no
unknown keys, no "8" for 8) and turns the first problem into one `SpecError` line that
names the key path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import ErrorDetails

from training.errors import SpecError, clip, short_repr

SPEC_VERSION = 1

_STRICT = ConfigDict(extra="forbid")
"""Every spec class refuses keys it does not know: a typo must not fall back to a default."""
Count = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Port = Annotated[int, Field(ge=0, le=65535)]
Device = Literal["cuda", "cpu"]
Quantize = Literal["none", "fp16", "bf16", "int8", "int4", "ternary"]
Cipher = Literal["sm4-gcm", "aes-gcm", "none"]
SyncMode = Literal["allreduce", "diloco"]
DriftCorrection = Literal["none", "scaffold"]
Balance = Literal["off", "throughput"]
Exchange = Literal["direct", "allgather", "topology"]


@dataclass(frozen=True, config=_STRICT)
class ShardSpec:
    name: str
    """Shard name."""
    jurisdiction: str
    """Jurisdiction of the raw data."""
    uri: str
    """pydoc-topics:auto | file:/path (bytes) | tokens:/dir (`geotrain data prepare`)."""
    weight: Positive = 1.0
    """Share of this shard's sequences in its region's mixture (tokens: shards)."""


@dataclass(frozen=True, config=_STRICT)
class NodeSpec:
    name: str
    """Node name (unique)."""
    host: str
    """Address this node's workers bind to and are reached on (private/overlay)."""
    first_rank: NonNegative
    """Global rank of the node's local rank 0."""
    nprocs: Count
    """Worker processes (= accelerators) on the node."""
    device: Device
    """cuda | cpu."""
    netns: str | None = None
    """lab only: network namespace the workers run in."""


@dataclass(frozen=True, config=_STRICT)
class PrivacySpec:
    """DP-SGD inside one region (training.privacy); see infra.model.schema.Privacy."""

    target_epsilon: Positive
    """Epsilon the region may spend over the run."""
    delta: Annotated[float, Field(gt=0, lt=1)]
    """Delta of the (epsilon, delta) guarantee."""
    max_grad_norm: Positive
    """Per-record gradient clipping norm C."""
    noise_multiplier: Positive | None = None
    """Fixed noise multiplier (None: calibrated to target_epsilon over the planned steps)."""


@dataclass(frozen=True, config=_STRICT)
class RegionSpec:
    name: str
    """Region name."""
    jurisdiction: str
    """Jurisdiction of the region."""
    nodes: Annotated[list[NodeSpec], Field(min_length=1)]
    """Nodes in rank order."""
    shards: list[ShardSpec]
    """Data this region reads; never another region's."""
    privacy: PrivacySpec | None = None
    """Record-level differential privacy of the region's updates (None: off)."""


QUANTIZERS = ("none", "fp16", "bf16", "int8", "int4", "ternary")
"""Quantizers of the codec, most precise first (training.sync.codec.QUANT)."""


@dataclass(frozen=True, config=_STRICT)
class AdaptiveSpec:
    """The codec chosen per link from measured costs (training.sync.adaptive)."""

    quantize: tuple[str, ...] = ("none", "fp16", "int8", "int4")
    """Quantizers the chooser may pick (receivers accept exactly these)."""
    zstd_levels: tuple[int, ...] = (1, 3)
    """zstd levels the chooser may pick."""
    budget_seconds: float | None = None
    """Sync time per step the chooser may spend on precision (None: see budget_fraction)."""
    budget_fraction: float | None = None
    """Or that budget as a fraction of the step's compute time (None and None: fastest)."""
    margin: float = 0.15
    """A challenger must be predicted this fraction faster than the current choice."""
    patience: int = 3
    """Consecutive observations a challenger must win before the link switches to it."""

    @model_validator(mode="after")
    def _bounds(self) -> AdaptiveSpec:
        for key, message in adaptive_problems(self):
            raise ValueError(f"{key}: {message}")
        return self


def adaptive_problems(a: Any) -> list[tuple[str, str]]:
    """What is wrong with `a` (an AdaptiveSpec, or the stack schema's Adaptive: the same
    field names), as (field, message): the launch spec and the stack checks say the same."""
    out = []
    bad = [q for q in a.quantize if q not in QUANTIZERS]
    if not a.quantize or bad or len(set(a.quantize)) != len(a.quantize):
        out.append(("quantize", f"{list(a.quantize)} must be distinct values of {QUANTIZERS}"))
    if not a.zstd_levels or any(not -7 <= lv <= 22 for lv in a.zstd_levels):
        out.append(("zstd_levels", f"{list(a.zstd_levels)} must be levels from -7 to 22"))
    if a.budget_seconds is not None and a.budget_fraction is not None:
        out.append(("budget_seconds", "set budget_seconds or budget_fraction, not both"))
    if a.budget_seconds is not None and not a.budget_seconds > 0:
        out.append(("budget_seconds", f"{a.budget_seconds} must be > 0"))
    if a.budget_fraction is not None and not 0 < a.budget_fraction <= 10:
        out.append(("budget_fraction", f"{a.budget_fraction} must be in (0, 10]"))
    if not 0 <= a.margin < 1:
        out.append(("margin", f"{a.margin} must be in [0, 1)"))
    if a.patience < 1:
        out.append(("patience", f"{a.patience} must be at least 1"))
    return out


@dataclass(frozen=True, config=_STRICT)
class CodecSpec:
    quantize: Quantize = "int8"
    """none | fp16 | bf16 | int8 | int4 | ternary (training.sync.codec)."""
    block_size: Count = 256
    """Elements per scale block (int8, int4, ternary)."""
    error_feedback: bool = True
    """Keep the quantization residual per bucket."""
    zstd_level: Annotated[int, Field(ge=-7, le=22)] = 1
    """zstd level after byte-shuffle."""
    cipher: Cipher = "sm4-gcm"
    """sm4-gcm | aes-gcm | none."""
    secure_aggregation: bool = False
    """Mask the cross-region scatter stage pairwise (training.sync.secagg); int8 or int4 only."""
    adaptive: AdaptiveSpec | None = None
    """Choose quantizer and zstd level per link from measured costs (None: fixed)."""

    @model_validator(mode="after")
    def _adaptive_fits(self) -> CodecSpec:
        a = self.adaptive
        if a is not None and self.secure_aggregation:
            raise ValueError(
                "adaptive cannot be combined with secure_aggregation (the masked stage "
                "needs one quantizer every region agreed on); drop one of them"
            )
        if a is not None and self.quantize not in a.quantize:
            raise ValueError(
                f"quantize '{self.quantize}' (the codec before the first measurement) must "
                f"be one of adaptive.quantize {list(a.quantize)}"
            )
        return self


SCAFFOLD_STREAMING = (
    "scaffold needs whole-model merges (its drift estimates are per round; streaming "
    "fragments end theirs on other steps): set fragments: 1 and tau: 0, or "
    "drift_correction: none"
)
"""One message for the launch spec and the stack check (infra.model.checks)."""


def quantize_hint(quantize: str, sync: str, drift_correction: str = "none") -> str | None:
    """A `geotrain validate` hint where ternary meets what it was not measured to suit."""
    if quantize != "ternary":
        return None
    if sync != "diloco":
        return (
            "hint: training.compression.quantize ternary rounds every step's gradient to "
            "-s, 0, +s and trained clearly behind int8 and int4 that way (benchmarks/"
            "results/codec_and_sync.md); it is meant for sync: diloco merges"
        )
    if drift_correction == "scaffold":
        return (
            "hint: training.compression.quantize ternary with drift_correction scaffold "
            "ended further behind than ternary alone (benchmarks/results/diloco_parity.md): "
            "scaffold's estimates follow the rounded average; use int4 with scaffold"
        )
    return None


def growing_h_problem(
    every: int | None, start: int | None, streaming: bool, start_for: int | None = None
) -> str | None:
    """What is wrong with a growing-H or early-H schedule (None: nothing), in the stack's
    key names (inner_steps_start and inner_steps_start_for are the launch spec's
    every_steps_start and every_steps_start_for)."""
    if start_for is not None and start is None:
        return "inner_steps_start_for needs inner_steps_start: the H of those early steps"
    if start is None:
        return None
    if start_for is not None and start_for < start:
        return (
            f"inner_steps_start_for {start_for} must be >= inner_steps_start ({start}): at "
            "least one early round"
        )
    if every is None:
        return "inner_steps_start needs step-based merges; set inner_steps, not interval_minutes"
    if start > every:
        return f"inner_steps_start {start} must be <= inner_steps ({every}): H grows to it"
    if streaming:
        return (
            "inner_steps_start cannot be combined with streaming (fragments/tau): fragments "
            "are staggered over a fixed H; drop one of them"
        )
    return None


@dataclass(frozen=True, config=_STRICT)
class DilocoSpec:
    every_steps: Count | None = 100
    """Merge every H inner steps (None: time-based)."""
    every_steps_start: Count | None = None
    """Growing H: the first merge comes this many inner steps in, each next interval twice
    the last, up to every_steps (None: every_steps from the start)."""
    every_steps_start_for: Count | None = None
    """Early H: rounds of every_steps_start (not doubling) for this many inner steps after
    the warm-up (rounded down to whole rounds), then every_steps (None: growing H)."""
    interval_minutes: Positive | None = None
    """Merge every T minutes (None: step-based)."""
    outer_lr: Positive = 0.7
    """Outer Nesterov learning rate."""
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    """Outer Nesterov momentum."""
    warmup_steps: NonNegative = 0
    """First steps synced every step across regions before DiLoCo starts (training.diloco)."""
    fragments: Count = 1
    """Streaming DiLoCo: contiguous groups of sync buckets merged on staggered steps."""
    tau: NonNegative = 0
    """Streaming DiLoCo: inner steps a fragment's merge lands late (its exchange overlaps them)."""
    mix: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Share of the local progress made during those tau steps kept on the merged fragment."""
    drift_correction: DriftCorrection = "none"
    """scaffold: every inner step is shifted by (global - own) mean step of the last round,
    both read off the merge's pseudo-gradients, no extra bytes (training.diloco)."""

    @model_validator(mode="after")
    def _streaming_bounds(self) -> DilocoSpec:
        """The streaming and schedule settings' bounds (infra.model.checks says the same for
        the stack)."""
        problem = growing_h_problem(
            self.every_steps, self.every_steps_start, self.streaming, self.every_steps_start_for
        )
        if problem:
            raise ValueError(problem)
        if not self.streaming:
            return self
        if self.drift_correction != "none":
            raise ValueError(SCAFFOLD_STREAMING)
        h = self.every_steps
        if h is None:
            raise ValueError("fragments/tau need step-based merges (every_steps), not minutes")
        if self.fragments > h:
            raise ValueError(f"fragments {self.fragments} must be in 1..every_steps ({h})")
        if self.tau >= h:
            raise ValueError(f"tau {self.tau} must be in 0..every_steps - 1 ({h - 1})")
        return self

    @property
    def streaming(self) -> bool:
        """Fragments or late merges: training.diloco's streaming schedule."""
        return self.fragments > 1 or self.tau > 0


Shard = Literal["none", "fsdp"]
ParamDtype = Literal["fp32", "bf16"]
Autocast = Literal["none", "bf16"]


@dataclass(frozen=True, config=_STRICT)
class ParallelSpec:
    shard: Shard = "none"
    """none: every rank holds the whole model; fsdp: parameters, gradients and optimizer
    state sharded over the region's ranks (FSDP2), replicated across regions by the sync."""
    param_dtype: ParamDtype = "fp32"
    """fsdp: dtype of the gathered parameters in forward/backward (bf16: mixed precision
    with fp32 gradient reduction); the sharded master weights stay fp32."""
    activation_checkpointing: bool = False
    """fsdp: recompute each block's activations in backward (hf: models)."""
    autocast: Autocast = "none"
    """bf16: the forward pass (and so its backward) under torch.autocast in bfloat16 on
    the worker's device, the weights and the optimizer staying fp32; none: fp32."""


AUTOCAST_WITH_PRIVACY = (
    "parallel.autocast bf16 cannot be combined with privacy (regions {regions}): DP-SGD's "
    "per-sample gradients and clipping are computed in fp32; drop autocast or privacy"
)
"""The refusal of autocast with DP-SGD; the stack check and the worker share it."""


def fsdp_conflict(
    *,
    privacy: list[str],
    streaming: bool,
    balance: bool,
    fault_tolerance: bool,
    secure_aggregation: bool,
    workers: dict[str, int],
) -> str | None:
    """Why `parallel.shard: fsdp` cannot run with the rest of a stack or spec (None: it
    can); the stack check and the worker share it."""
    if privacy:
        return (
            f"cannot be combined with privacy (regions {', '.join(privacy)}): DP-SGD "
            "clips per-sample gradients of a whole replica"
        )
    if streaming:
        return (
            "cannot be combined with streaming DiLoCo (fragments > 1 or tau > 0) yet; use "
            "blocking merges"
        )
    if balance:
        return (
            "cannot be combined with balance: throughput (FSDP's shards need equal batches "
            "per rank)"
        )
    if fault_tolerance:
        return (
            "cannot be combined with fault_tolerance yet (a healing region would need every shard)"
        )
    if secure_aggregation:
        return "cannot be combined with secure_aggregation yet"
    if len(set(workers.values())) > 1:
        sizes = ", ".join(f"{r} {n}" for r, n in workers.items())
        return (
            f"needs the same number of workers in every region ({sizes}): rank c of each "
            "region holds the same shard and exchanges it with its peers"
        )
    return None


@dataclass(frozen=True, config=_STRICT)
class CheckpointSpec:
    dir: str = ".geotrain/checkpoints"
    """Checkpoint root; relative paths resolve against the launch directory."""
    interval_steps: Count = 50
    """Save every N steps."""
    interval_minutes: Positive = 30.0
    """And at least every T minutes."""
    keep: Count = 2
    """Committed checkpoints kept."""


@dataclass(frozen=True, config=_STRICT)
class FaultToleranceSpec:
    """Regions as torchft replica groups (training.ft.quorum); see docs/fault-tolerance.md."""

    lighthouse: str
    """host:port the Lighthouse binds and every region dials (an overlay or loopback
    address, never a hostname default)."""
    min_replicas: Count
    """Regions a quorum needs; a region that finds fewer stops (exit 3) and restarts."""
    store_port: Annotated[int, Field(ge=1, le=65535)] = 29600
    """Region i's rendezvous store listens on its first node's host at store_port + i."""
    join_timeout_s: Positive = 30.0
    """How long the Lighthouse waits for a live region before a smaller quorum (a round
    plus a heal; see infra.model.fault_tolerance)."""
    heartbeat_timeout_s: Positive = 5.0
    """A region whose Manager is silent this long is left out of the next quorum."""
    timeout_s: Positive = 30.0
    """Cross-region collectives and heals: a dead peer fails the round after at most this."""
    quorum_timeout_s: Positive = 120.0
    """How long a region waits for a quorum (a DiLoCo region waits a whole merge interval)."""


@dataclass(frozen=True, config=_STRICT)
class LaunchSpec:
    run_id: str
    """Stable id of the run; bound into every payload and checkpoint."""
    stack: str
    """Stack the spec was rendered from."""
    master_addr: str
    """Host of the global TCPStore (first node)."""
    master_port: Port
    """Port of the global TCPStore."""
    regions: list[RegionSpec]
    """Regions in rank order."""
    model: str = "deepseek-tiny"
    """A preset name, `hf:<dir>` or `python:<module>:<callable>` (training.models.build)."""
    tokenizer: str | None = None
    """`bytes`, a tokenizer.json file or a directory holding one (training.data.tokenizer);
    None: the hf: model directory's tokenizer.json when it has one, else bytes."""
    sync: SyncMode = "allreduce"
    """allreduce | diloco."""
    steps: Count = 60
    """Optimizer (inner) steps."""
    batch_size: Count = 8
    """Sequences per worker per step."""
    seq_len: Count = 64
    """Tokens per sequence."""
    lr: Positive = 3e-3
    """AdamW learning rate."""
    seed: int = 1234
    """Seed."""
    bucket_mb: Positive = 4.0
    """Gradient bucket size."""
    balance: Balance = "off"
    """throughput: batch per rank set per region by measured speed (training.balance)."""
    balance_steps: Count = 5
    """Steps measured before the throughput balance assigns batches."""
    codec: CodecSpec = field(default_factory=CodecSpec)
    """Cross-region codec."""
    exchange: Exchange = "direct"
    """allgather: each region's shard whole to every region, one round (training.sync.hier);
    topology: pieces and relays planned from the measured links (training.sync.topo_exchange)."""
    exchange_replan: Count = 20
    """topology: cross-region exchanges (bucket syncs) between two agreed plans."""
    diloco: DilocoSpec = field(default_factory=DilocoSpec)
    """Periodic merge settings."""
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """Sharding inside a region (training.parallel)."""
    """Checkpoint settings."""
    key_file: str = ".geotrain/run.key"
    """File with the run's hex key."""
    metrics_port: Port = 9400
    """Local rank i serves Prometheus metrics on metrics_port + i (0: off); see
    metrics_port()."""
    metrics_bind: str = "127.0.0.1"
    """Bind address for metrics ('private' = the node's host)."""
    max_restarts: NonNegative = 3
    """Restarts after a worker dies."""
    fault_tolerance: FaultToleranceSpec | None = None
    """Regions drop and rejoin without a restart (training.ft.quorum); None: off."""
    version: int = SPEC_VERSION
    """Spec format version."""

    @field_validator("regions")
    @classmethod
    def _ranks_contiguous(cls, regions: list[RegionSpec]) -> list[RegionSpec]:
        check_ranks(regions)
        return regions

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
        if not isinstance(raw, dict):
            raise SpecError(f"{source}: the spec must be a JSON object")
        if raw.get("version") != SPEC_VERSION:  # before the fields: they may have changed
            raise SpecError(
                f"{source}: spec version {short_repr(raw.get('version'))} is not supported; "
                f"this runtime reads version {SPEC_VERSION}"
            )
        try:
            return _ADAPTER.validate_json(text, strict=True)
        except ValidationError as e:
            raise spec_error(e, source) from None

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
        except UnicodeDecodeError:
            raise SpecError(
                f"launch spec {p} is not UTF-8 text (a launch spec is JSON); render it "
                "with `geotrain render --stack S --out DIR`"
            ) from None
        return LaunchSpec.from_json(text, str(p))


PLACEHOLDERS = ("{stack}", "{node}", "{region}")
"""What a checkpoint dir may contain; the worker fills them in (`node_root`)."""


def node_root(template: str, stack: str, node: str, region: str) -> Path:
    """A node's checkpoint root: `template` with {stack}, {node} and {region} filled in.
    With {node} (or {region}) every node gets its own root, as on hosts without a shared
    filesystem; without, nodes share one root and keep apart by their node directories."""
    return Path(
        template.replace("{stack}", stack).replace("{node}", node).replace("{region}", region)
    )


FINAL_CLAIM = ".final.claim"
"""<run_dir>/.final.claim: made (O_EXCL) by the region leader that writes final.pt this
launch under fault_tolerance (the first to finish); the launcher removes it at start."""


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
    with: the rendezvous store (rank 0, training.comm.session.rendezvous_store), each worker's
    gloo device (training.comm.gloo; ephemeral ports, shown as 0) and metrics endpoint."""
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


def fault_tolerance_conflict(
    *,
    secure_aggregation: bool,
    privacy: list[str],
    timed_merges: bool,
    streaming: bool,
    adaptive: bool,
    balance: bool,
    workers: dict[str, int],
    cuda: list[str],
    kubernetes: bool = False,
    topology: bool = False,
) -> str | None:
    """Why fault_tolerance cannot run with the rest of a stack or spec (None: it can); the
    stack check (infra.model.fault_tolerance) and the spec's (training.ft.quorum) share it.
    `privacy`: the regions with differential privacy; `workers`: each region's workers;
    `cuda`: the regions on GPUs."""
    off = "or turn fault_tolerance off"
    agreed = "its rounds are agreed by every region at once"
    later = "the quorum loop does not run it"
    cases = [
        (secure_aggregation, "secure_aggregation", agreed, f"set it false {off}"),
        (
            bool(privacy),
            f"privacy (regions {', '.join(privacy)})",
            agreed,
            f"remove those regions' privacy {off}",
        ),
        (timed_merges, "diloco.interval_minutes", agreed, f"use diloco.inner_steps {off}"),
        (
            streaming,
            "diloco.fragments/tau (streaming DiLoCo)",
            later,
            f"set fragments 1 and tau 0 {off}",
        ),
        (adaptive, "compression.adaptive", later, f"remove it {off}"),
        (balance, "balance: throughput", later, f"use balance: equal {off}"),
        (
            len(set(workers.values())) > 1,
            "regions of different worker counts ("
            + ", ".join(f"{r} {n}" for r, n in workers.items())
            + ")",
            later,
            f"give every region as many workers {off}",
        ),
        (
            bool(cuda),
            f"GPU nodes (regions {', '.join(cuda)})",
            "the quorum loop trains on CPU with gloo only",
            f"run fault_tolerance on CPU pools {off}",
        ),
        (topology, "exchange: topology", later, f"use exchange: direct {off}"),
        (
            kubernetes,
            "kubernetes pools",
            "no Lighthouse or per-region restart is rendered for pods",
            f"use host pools {off}",
        ),
    ]
    for on, key, why, fix in cases:
        if on:
            return f"cannot be combined with {key} yet ({why}); {fix}"
    return None


def exchange_conflict(exchange: str, *, secure_aggregation: bool, adaptive: bool) -> str | None:
    """Why `exchange` cannot run with the rest of a stack or spec (None: it can); the stack
    check (infra.model.checks) and the launch spec's (training.sync.topo_exchange,
    training.sync.hier) share it."""
    if exchange == "direct":
        return None
    if exchange == "allgather":
        if secure_aggregation:
            return (
                "cannot be combined with secure_aggregation (it sends each region's own "
                "values to every region, which secure aggregation exists to prevent); set "
                "exchange: direct, or turn secure_aggregation off"
            )
        return None
    if secure_aggregation:
        return (
            "cannot be combined with secure_aggregation yet (its masked stage sums equal "
            "pieces sent directly); set exchange: direct, or turn secure_aggregation off"
        )
    if adaptive:
        return (
            "cannot be combined with compression.adaptive yet (its codec is chosen per direct "
            "link, a relayed payload crosses two); set exchange: direct, or drop adaptive"
        )
    return None


def _quorum_listeners(spec: LaunchSpec) -> list[dict[str, Any]]:
    """fault_tolerance (training.ft.quorum): the Lighthouse, each region's store, and per
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


_ADAPTER: TypeAdapter[LaunchSpec] = TypeAdapter(LaunchSpec)
_CLASSES: dict[str, type[Any]] = {
    "regions": RegionSpec,
    "nodes": NodeSpec,
    "shards": ShardSpec,
    "privacy": PrivacySpec,
    "codec": CodecSpec,
    "adaptive": AdaptiveSpec,
    "diloco": DilocoSpec,
    "checkpoint": CheckpointSpec,
    "fault_tolerance": FaultToleranceSpec,
}
"""The spec class a key path's last named key holds (top level: LaunchSpec)."""
_FIX = "re-render it with `geotrain render --stack S --out DIR`"


def check_ranks(regions: list[RegionSpec]) -> None:
    """Ranks run contiguously from 0 in region order, and a region's nodes share one device
    kind (its intra-region group is NCCL or gloo). Regions may differ in worker count:
    the hierarchical all-reduce pairs the first min-region-size local ranks
    (training.comm.topology)."""
    expect = 0
    for r in regions:
        for n in r.nodes:
            if n.first_rank != expect:
                raise ValueError(
                    f"node {n.name} has first_rank {n.first_rank}; ranks must be contiguous "
                    f"from 0 in region order (expected first_rank {expect})"
                )
            expect += n.nprocs
        devices = sorted({n.device for n in r.nodes})
        if len(devices) > 1:
            raise ValueError(
                f"region {r.name} mixes devices {devices}; a region's workers share one "
                "collective backend, so split it into two regions"
            )


def spec_error(e: ValidationError, source: str) -> SpecError:
    """pydantic's errors as one line: the first one's key path, what is wrong and the fix,
    and how many more there are."""
    errors = e.errors(include_url=False)
    first = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = clip(key_path(first["loc"]), 80)  # a key path may echo an unknown key
    return SpecError(f"{source}: {where}: {_problem(first)}{more}")


def key_path(loc: tuple[int | str, ...]) -> str:
    """("regions", 1, "nodes", 0, "nprocs") -> "regions[1].nodes[0].nprocs"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(top level)"


def _problem(err: ErrorDetails) -> str:
    kind, loc, msg = err["type"], err["loc"], str(err["msg"])
    if kind == "missing":
        return f"required key is missing; {_FIX}"
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        names = [p for p in loc[:-1] if isinstance(p, str)]
        cls = _CLASSES[names[-1]] if names else LaunchSpec
        owner = key_path(loc[:-1]) if names else "the spec"
        return f"unknown key; {owner} takes {', '.join(f.name for f in fields(cls))}"
    if kind == "value_error":  # our own checks: the message carries the fix
        return msg.removeprefix("Value error, ")
    if kind == "too_short":
        return f"needs at least {err.get('ctx', {}).get('min_length')} item; {_FIX}"
    value = short_repr(err["input"])
    if msg.startswith("Input should"):  # "Input should be a valid integer"
        return f"{value} {msg.removeprefix('Input ')}; {_FIX}"
    return f"{msg}, not {value}; {_FIX}"
