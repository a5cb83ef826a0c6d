"""The typed stack model: every `geotrain:*` key of `stacks/Pulumi.<stack>.yaml`.

Field docstrings are the reference for stack authors (docs/architecture.md points here).
Defaults live here and nowhere else. Shape checks are pydantic's; cross-field checks are
in `infra.model.checks`.
"""

from __future__ import annotations

import ipaddress
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from infra.model.fault_tolerance import FaultTolerance
from infra.model.names import DEFAULT_LOGIN_USER, NAME_PATTERN

Jurisdiction = Literal["CN", "EU", "US", "UK", "JP", "KR", "SG", "IN", "CA", "AU", "BR", "CH"]
PoolKind = Literal["local", "lab", "ssh", "kubernetes", "aws", "alicloud", "gcp"]
SyncMode = Literal["allreduce", "diloco"]
Quantize = Literal["none", "fp16", "bf16", "int8", "int4", "ternary"]
Cipher = Literal["sm4-gcm", "aes-gcm", "none"]
_CN: Jurisdiction = "CN"
NonEmptyStr = Annotated[str, StringConstraints(min_length=1, strip_whitespace=False)]


class Strict(BaseModel):
    """Unknown keys are errors: a typo must not silently fall back to a default. A boolean
    where a number goes is an error too (pydantic reads `steps: true` as 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _bool_in(value, field.annotation):
            what = str(value).lower() if isinstance(value, bool) else "a list with a boolean"
            raise ValueError(
                f"{what} where a number goes (a boolean would be read as 1 or 0); write the number"
            )
        return value


def _takes_bool(tp: Any) -> bool:
    """Whether a value of type `tp` may be a bool."""
    if tp is bool or tp is Any:
        return True
    origin = get_origin(tp)
    if origin is Literal:
        return any(isinstance(a, bool) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_takes_bool(a) for a in get_args(tp))
    return False


def _bool_in(value: Any, tp: Any) -> bool:
    """A bool in `value` where `tp` (or, in a list, its item type) takes numbers only."""
    if isinstance(value, bool):
        return not _takes_bool(tp) and _takes_number(tp)
    if isinstance(value, (list, tuple)) and get_origin(tp) in (list, tuple):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        return bool(args) and any(_bool_in(v, args[0]) for v in value)
    return False


def _takes_number(tp: Any) -> bool:
    if tp in (int, float):
        return True
    if get_origin(tp) in (Union, types.UnionType):
        return any(_takes_number(a) for a in get_args(tp))
    return False


class Node(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    """Host name, unique in the stack (DNS label)."""
    address: ipaddress.IPv4Address = ipaddress.IPv4Address("127.0.0.1")
    """Address the operator reaches the node on (ssh) or its underlay address."""
    gpu_type: str = "cpu"
    """Accelerator type from infra.model.gpus.GPU_TYPES."""
    gpus: int = Field(default=1, ge=1, le=16)
    """Accelerators on the node = worker processes (for cpu: CPU worker processes)."""
    interface: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.@-]{1,15}$")
    """ssh: interface that gets the node's region-subnet address (default: the one holding
    `address`, else the default route's)."""


class SshSettings(Strict):
    user: str = Field(default=DEFAULT_LOGIN_USER, pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    """Login user on every node of the pool (needs sudo for the agent); a POSIX user name
    (lower case, digits, _ and -; at most 32 characters), not the workers' service user
    `geotrain` (the workers would have its sudo)."""
    port: int = Field(default=22, ge=1, le=65535)
    """SSH port."""
    private_key_config: str = "geotrain:sshPrivateKey"
    """Secret config key holding the operator's SSH private key (`pulumi config set --secret`)."""
    host_keys: dict[str, str] = {}
    """Node name -> the host's public SSH host key as in its /etc/ssh/ssh_host_ed25519_key.pub
    (`ssh-ed25519 AAAA...`; ed25519 or ecdsa), pinned on every connection to it (kind ssh)."""
    known_hosts: str | None = None
    """An OpenSSH known_hosts file (absolute or `~/...`) to pin the nodes' host keys from,
    for nodes not in `host_keys` (kind ssh); hashed entries and `[host]:port` are read."""
    strict_host_key_checking: Literal["yes", "accept-new"] = "accept-new"
    """As OpenSSH's option: `yes` refuses a node whose key is not in the stack;
    `accept-new` records its key at first contact (ssh-keyscan) in state and pins it after."""


QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
"""A Kubernetes resource quantity such as 500m, 16Gi or 4."""


class Toleration(Strict):
    key: str | None = None
    """Taint key the pods tolerate (None with operator Exists: every taint)."""
    operator: Literal["Equal", "Exists"] = "Equal"
    """Equal matches key and value; Exists matches the key alone."""
    value: str | None = None
    """Taint value (operator Equal)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect tolerated (None: every effect)."""


class KubernetesSettings(Strict):
    kubeconfig_config: str = "geotrain:kubeconfig"
    """Secret config key holding this region's kubeconfig (`pulumi config set --secret
    geotrain:kubeconfig < FILE`); never the ambient ~/.kube/config or $KUBECONFIG."""
    context: str | None = None
    """Context of that kubeconfig to use; required (there is no fall-back to the current
    context)."""
    namespace: str = Field(default="geotrain", pattern=NAME_PATTERN)
    """Namespace created for the region's workers and gateway."""
    cluster_domain: str = Field(
        default="cluster.local", pattern=r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$"
    )
    """The cluster's DNS domain: pods are reached as <pod>.<service>.<namespace>.svc.<domain>."""
    image: str = Field(default="ghcr.io/geotrain/runtime", pattern=r"^[a-z0-9][a-z0-9._/:-]*$")
    """Image of the runtime (the repository's Dockerfile, target runtime), without tag."""
    tag: str = Field(default="0.1.0-cpu", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
    """Tag of `image`."""
    variant: Literal["cpu", "cuda"] = "cpu"
    """The Dockerfile's VARIANT build argument the image was built with; GPU nodes need
    cuda."""
    gateway_image: str = Field(
        default="ghcr.io/geotrain/gateway:0.1.0", pattern=r"^[a-z0-9][a-z0-9._/:-]*$"
    )
    """Image of the WireGuard + FRR gateway (the Dockerfile's target gateway), with tag."""
    workload: Literal["statefulset", "jobset"] = "statefulset"
    """Workers in a StatefulSet (checkpoints on a volume per pod; an idle pod after the
    last step) or a JobSet (jobset.x-k8s.io: runs to completion; needs the JobSet
    controller)."""
    pod_cidr: ipaddress.IPv4Network | None = None
    """The cluster's pod CIDR, inside network.overlay_cidr; the region's gateway announces
    it over BGP (required when the stack has more than one region)."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource requested per GPU (the NVIDIA device plugin's by default)."""
    cpu: str | None = Field(default=None, pattern=QUANTITY)
    """CPU request (and limit) per worker pod, e.g. "32" (None: no request)."""
    memory: str | None = Field(default=None, pattern=QUANTITY)
    """Memory request (and limit) per worker pod, e.g. 256Gi (None: no request)."""
    shm_size: str = Field(default="16Gi", pattern=QUANTITY)
    """Size of /dev/shm (an emptyDir in memory): NCCL and data loaders need more than the
    runtime's 64 MiB default."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """nodeSelector of the worker pods, e.g. {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations of the worker pods (GPU nodes are often tainted)."""
    gateway_node_selector: dict[str, str] = Field(
        default_factory=lambda: {"geotrain.io/gateway": "true"}
    )
    """nodeSelector of the gateway pod: the node whose public address is the region's
    gateway node `address` in the stack (peers send WireGuard there)."""
    data_claim: str | None = Field(default=None, pattern=NAME_PATTERN)
    """PersistentVolumeClaim in the namespace holding the region's data shards, mounted
    read-only at /data (for `file:/data/...` shard URIs)."""
    checkpoint_storage: str = Field(default="50Gi", pattern=QUANTITY)
    """StatefulSet: size of each pod's volume for checkpoints and run files."""
    storage_class: str | None = None
    """StorageClass of those volumes (None: the cluster's default)."""
    monitoring_release: str = "kube-prometheus-stack"
    """`release` label kube-prometheus-stack selects PodMonitors and PrometheusRules by."""
    monitoring_namespace: str = Field(default="monitoring", pattern=NAME_PATTERN)
    """Namespace of Prometheus and Grafana: scrapes come from there; the dashboard goes there."""
    dcgm_namespace: str = Field(default="gpu-operator", pattern=NAME_PATTERN)
    """Namespace of the GPU Operator's dcgm-exporter Service (scraped when GPUs are used)."""


class CloudSettings(Strict):
    """Settings for kind aws, gcp or alicloud (tables: infra.model.clouds)."""

    region: str | None = None
    """The cloud's region for this geotrain region, e.g. us-west-1, europe-west3, cn-beijing
    (required): the region gets its own explicit provider for it, never the ambient one."""
    zone: str | None = None
    """Zone of every node (default: gcp the first zone geotrain's table lists for the type;
    aws and alicloud the first zone the cloud says offers every type of the region, asked
    at the first `pulumi up` and kept afterwards: a later answer never moves the network,
    disks or instances). Setting it is obeyed: a different zone replaces them."""
    project: str | None = None
    """gcp: the project to create everything in (required for gcp; no fall-back to gcloud's
    default project)."""
    image: str | None = None
    """Boot image, CUDA-ready (default: the cloud's in infra.model.clouds). aws: an AMI id or
    ssm:<public parameter>; gcp: an image or image family path; alicloud: an image id or a
    name pattern (^...) matched against the system images. A parameter, family or pattern
    is resolved when an instance is made and that image is kept (a newer release replaces
    nothing); a fixed id or image is obeyed: changing it replaces the nodes."""
    image_upgrade: bool = False
    """Move the nodes to the newest image the parameter, family or pattern names now: the
    next `pulumi up` replaces every node whose image changed (checkpoints stay on their
    data disks). Set it back to false afterwards."""
    image_disk_gb: int | None = Field(default=None, ge=1, le=16384)
    """Root disk the image needs, for an image not in geotrain's table (disk_gb is checked
    against it)."""
    disk_gb: int = Field(default=200, ge=1, le=16384)
    """Root disk of every node in GiB (the system, the runtime venv, data)."""
    data_disk_gb: int = Field(default=500, ge=10, le=16384)
    """Checkpoint disk of every node in GiB: a separate disk mounted at the checkpoint root
    (training.checkpoint.dir up to its first placeholder). It outlives the instance: a
    replaced node gets it back, and `pulumi destroy` keeps it while
    training.checkpoint.keep_on_destroy is true (the default)."""
    spot: bool = False
    """Spot/preemptible instances instead of on-demand (cheaper; a reclaimed node drops its
    region out of the quorum until it returns)."""
    placement: bool = True
    """Pack the region's nodes close together: an AWS cluster placement group, a GCP compact
    placement policy, an Alibaba low-latency deployment set."""
    peering: bool = False
    """Native cross-region VPC peering with linked regions of the same cloud that also set it
    (aws, alicloud); the WireGuard overlay stays on top."""


class Mirrors(Strict):
    """Package indexes the pool's hosts install the runtime from (ssh and cloud pools)."""

    pip_index_url: str | None = Field(default=None, pattern=r"^https://[^\s]+$")
    """A PyPI mirror for the runtime's dependencies, e.g.
    https://mirrors.aliyun.com/pypi/simple/ (https only)."""
    torch_index_url: str | None = Field(default=None, pattern=r"^https://[^\s]+$")
    """A mirror of https://download.pytorch.org/whl for GPU hosts' CUDA build of torch
    (the build's tag is appended: <url>/cu128)."""


class Pool(Strict):
    kind: PoolKind
    """Backend: local processes, lab namespaces, ssh hosts, a Kubernetes cluster, or cloud
    instances (aws, alicloud, gcp) that become ssh hosts."""
    nodes: list[Node] = Field(min_length=1)
    """The region's nodes; ranks follow this order."""
    gateway: str | None = None
    """Node that terminates the region's WireGuard tunnels and runs BGP (default: first)."""
    ssh: SshSettings = SshSettings()
    """Settings for kind=ssh."""
    kubernetes: KubernetesSettings = KubernetesSettings()
    """Settings for kind=kubernetes."""
    cloud: CloudSettings = CloudSettings()
    """Settings for kind aws, gcp and alicloud."""
    mirrors: Mirrors = Mirrors()
    """Package mirrors for the hosts the agent installs (kinds ssh, aws, gcp, alicloud);
    apt keeps each host's own sources."""


class Privacy(Strict):
    """Record-level differential privacy (DP-SGD) of one region's updates (docs/privacy.md).
    A record is one training window (seq_len + 1 bytes) of the region's data."""

    target_epsilon: float = Field(gt=0, le=100)
    """Epsilon the region may spend over the whole run (e.g. 1, 4 or 8)."""
    delta: float = Field(default=1e-6, gt=0, lt=1)
    """Delta of the (epsilon, delta) guarantee; keep it below 1 / records (the worker warns)."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Clipping norm C of each record's gradient."""
    noise_multiplier: float | None = Field(default=None, gt=0)
    """Fixed noise std / C (default: the smallest that keeps training.steps within
    target_epsilon); with a fixed one, training stops when the budget is spent."""


class Region(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    """Region name, unique in the stack (e.g. beijing)."""
    jurisdiction: Jurisdiction
    """Legal jurisdiction the region's data must stay in."""
    subnet: ipaddress.IPv4Network
    """Private subnet of the region's nodes, inside network.overlay_cidr; announced over BGP."""
    asn: int = Field(ge=64512, le=65534)
    """Private BGP ASN of the region's gateway (RFC 6996 16-bit range)."""
    pool: Pool
    """Where the region's GPUs are."""
    privacy: Privacy | None = None
    """DP-SGD on the region's records, with its own budget (None: no DP)."""


class Link(Strict):
    a: str
    """One end region."""
    b: str
    """Other end region."""
    bandwidth_mbps: int = Field(default=1000, ge=1, le=400_000)
    """Link bandwidth; the lab shapes its underlay to this with tc tbf."""
    latency_ms: float = Field(default=50.0, ge=0, le=1000)
    """One-way latency. The lab gives the link this latency with a UDP delay relay in the
    middle of its cable (the kernel here has no netem); elsewhere it is informational."""
    cost: int = Field(default=10, ge=1, le=1000)
    """Routing cost: the cheapest healthy path wins (BGP AS-path prepends = cost // 10)."""
    shape: bool | None = None
    """Shape both tunnel ends to bandwidth_mbps with tc (default: only in the lab, which
    rehearses slow links; real links are as fast as they are)."""


class Network(Strict):
    overlay_cidr: ipaddress.IPv4Network = ipaddress.IPv4Network("10.42.0.0/16")
    """Private overlay holding every region subnet and the tunnel transfer nets."""
    transfer_cidr: ipaddress.IPv4Network = ipaddress.IPv4Network("10.42.255.0/24")
    """Part of the overlay carved into /31s, one per link, for tunnel endpoints."""
    underlay_cidr: ipaddress.IPv4Network = ipaddress.IPv4Network("100.127.0.0/22")
    """lab only: addresses of the simulated internet between gateways (/30 per link)."""
    wireguard_port: int = Field(default=51820, ge=1024, le=65000)
    """First WireGuard listen port; tunnel to the i-th region listens on port + i."""
    mtu: int = Field(default=1420, ge=1280, le=9000)
    """Tunnel MTU."""
    bfd_interval_ms: int = Field(default=300, ge=50, le=10_000)
    """BFD transmit/receive interval; failover takes ~ interval x multiplier."""
    bfd_multiplier: int = Field(default=3, ge=2, le=50)
    """BFD detect multiplier."""
    links: list[Link] = Field(default_factory=list)
    """Links between regions; each becomes a WireGuard tunnel and a BGP session."""
    admin_cidrs: list[ipaddress.IPv4Network] = Field(default_factory=list)
    """Where operators (and `pulumi up`) connect from: the only sources hosts accept SSH
    and the monitoring UIs from (required for ssh pools: everything else is dropped)."""


ADAPTIVE_QUANTIZE: tuple[Quantize, ...] = ("none", "fp16", "int8", "int4")


class Adaptive(Strict):
    quantize: list[Quantize] = Field(default_factory=lambda: [*ADAPTIVE_QUANTIZE], min_length=1)
    """Quantizers the chooser may pick per link (training.sync.adaptive); receivers accept these."""
    zstd_levels: list[int] = Field(default_factory=lambda: [1, 3], min_length=1)
    """zstd levels the chooser may pick (-7 to 22)."""
    budget_seconds: float | None = Field(default=None, gt=0)
    """Sync time per step the chooser may spend on precision; unset with budget_fraction:
    always the fastest codec."""
    budget_fraction: float | None = Field(default=None, gt=0, le=10)
    """Or that budget as a fraction of the step's compute time (the overlap window is 1)."""
    margin: float = Field(default=0.15, ge=0, lt=1)
    """A challenger must be predicted this fraction faster than the current codec."""
    patience: int = Field(default=3, ge=1, le=1000)
    """Consecutive observations a challenger must win before a link switches (hysteresis)."""


class Compression(Strict):
    quantize: Quantize = "int8"
    """Quantization of cross-region payloads."""
    block_size: int = Field(default=256, ge=16, le=65536)
    """Elements per scale block for int8, int4 and ternary."""
    error_feedback: bool = True
    """Carry the quantization residual into the next step."""
    zstd_level: int = Field(default=1, ge=-7, le=22)
    """zstd level after byte-shuffle (1 is the throughput sweet spot)."""
    cipher: Cipher = "sm4-gcm"
    """Payload cipher; CN requires sm4-gcm by default policy."""
    secure_aggregation: bool = False
    """Mask each region's contribution pairwise so the summing region sees only the sum
    (training.sync.secagg; quantize int8/int4, 3+ regions; with diloco: the pseudo-gradients)."""
    adaptive: Adaptive | None = None
    """Choose quantizer and zstd level per link from the measured link and codec speeds
    (training.sync.adaptive); `quantize` is then the codec before the first measurement."""


class Diloco(Strict):
    inner_steps: int | None = Field(default=None, ge=1)
    """H: merge every H inner steps (set this or interval_minutes; neither means 100)."""
    interval_minutes: float | None = None
    """T: merge every T minutes instead (30 in the reference deployment)."""
    inner_steps_start: int | None = Field(default=None, ge=1)
    """Growing H: the first merge after this many inner steps, each next interval twice the
    last, up to inner_steps (early rounds drift less; step-based merges only)."""
    inner_steps_start_for: int | None = Field(default=None, ge=1)
    """Early H: rounds of inner_steps_start (not doubling) for this many inner steps after
    the warm-up, then inner_steps (the first rounds drift most: README, DiLoCo parity;
    benchmarks/results/diloco_parity_seeds_stdlib.md)."""
    outer_lr: float = Field(default=0.7, gt=0, le=10)
    """Outer Nesterov learning rate."""
    outer_momentum: float = Field(default=0.9, ge=0, lt=1)
    """Outer momentum, Nesterov when > 0; 0 makes the outer step plain SGD."""
    warmup_steps: int = Field(default=0, ge=0)
    """First steps synced every step (as sync: allreduce) before DiLoCo starts; < steps."""
    fragments: int = Field(default=1, ge=1)
    """Streaming DiLoCo: the sync buckets in this many contiguous groups, merged on
    staggered steps (fragment f at f * H / fragments into each period); <= inner_steps."""
    tau: int = Field(default=0, ge=0)
    """Streaming DiLoCo: a fragment's merge lands this many inner steps late, its exchange
    running while they compute; < inner_steps."""
    mix: float = Field(default=0.0, ge=0, le=1)
    """Share of the local progress of those tau steps kept on top of the merged fragment
    (0: the merged values replace it, so every region holds the same fragment)."""
    drift_correction: Literal["none", "scaffold"] = "none"
    """scaffold: correct each region's inner steps toward every region's mean step of the
    last round (SCAFFOLD from the merge's own pseudo-gradients, no extra bytes; needs
    fragments 1 and tau 0)."""

    @property
    def every_steps(self) -> int | None:
        """Inner steps between merges, or None when the merge is time-based."""
        if self.interval_minutes is not None:
            return None
        return self.inner_steps if self.inner_steps is not None else 100


class Parallel(Strict):
    shard: Literal["none", "fsdp"] = "none"
    """none: a whole replica per rank; fsdp: parameters, gradients and optimizer state
    sharded over the region's ranks (FSDP2), replicated across regions by the sync."""
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    """fsdp: bf16 parameters in forward and backward with fp32 gradient reduction."""
    activation_checkpointing: bool = False
    """fsdp: recompute each block's activations in backward (hf: models)."""
    autocast: Literal["none", "bf16"] = "none"
    """bf16: forward and backward under torch.autocast in bfloat16 (weights and optimizer
    stay fp32), with or without fsdp; what a GPU fleet wants (tensor cores)."""


class Checkpoint(Strict):
    dir: str = ".geotrain/{stack}/checkpoints"
    """Checkpoint root; {stack}, {node} and {region} are filled in (each node saves its
    own ranks under <dir>/step-N/<node>/, so hosts need no shared filesystem); relative
    paths resolve against the launch directory."""
    interval_steps: int = Field(default=50, ge=1)
    """Save every N steps."""
    interval_minutes: float = Field(default=30, gt=0)
    """Upper bound on minutes between saves (policy caps it)."""
    keep: int = Field(default=2, ge=1)
    """Committed checkpoints to keep (policy requires at least 2)."""
    keep_on_destroy: bool = True
    """`pulumi destroy` leaves the checkpoint directories on the hosts (like a
    StatefulSet's volumes); false deletes them with everything else."""


class DataShard(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    """Shard name."""
    jurisdiction: Jurisdiction
    """Jurisdiction the raw data belongs to; it may only be read there."""
    region: str
    """Region whose workers read the shard."""
    uri: str = "pydoc-topics:auto"
    """`pydoc-topics:auto` (Python's bundled docs, split per region), `file:/path` (raw text,
    byte tokens) or `tokens:/dir` (token shards made by `geotrain data prepare`)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of this shard's sequences in its region's mixture (tokens: shards only)."""
    source: str | None = None
    """Raw text a tokens: shard is prepared from on the region's hosts (`geotrain data
    prepare --stack S`): `pydoc-topics:auto` or `file:/path`."""


class Training(Strict):
    model: str = "deepseek-tiny"
    """A preset (deepseek-tiny, deepseek-small, deepseek-base: training.models.deepseek),
    `hf:<dir>` (a local Hugging Face model directory) or `python:<module>:<callable>` (the
    lab's factory returning an nn.Module)."""
    tokenizer: str | None = None
    """`bytes`, a tokenizer.json file, or a directory holding one; unset: the hf: model
    directory's tokenizer.json when it has one, else bytes."""
    sync: SyncMode = "allreduce"
    """allreduce every step, or diloco periodic global merge."""
    steps: int = Field(default=60, ge=1)
    """Optimizer steps (inner steps for diloco)."""
    batch_size: int = Field(default=8, ge=1)
    """Sequences per worker per step."""
    seq_len: int = Field(default=64, ge=8)
    """Tokens per sequence (byte-level)."""
    lr: float = Field(default=3e-3, gt=0)
    """AdamW learning rate."""
    seed: int = 1234
    """Seed for weights and data order."""
    compression: Compression = Compression()
    """Codec for cross-region payloads."""
    diloco: Diloco = Diloco()
    """Periodic global merge settings (sync: diloco)."""
    checkpoint: Checkpoint = Checkpoint()
    """Checkpoint cadence and retention."""
    parallel: Parallel = Parallel()
    """Sharding inside a region (FSDP2)."""
    data_shards: list[DataShard] = Field(default_factory=list)
    """Data per region, each tagged with its jurisdiction."""
    key_file: str = ".geotrain/{stack}/run.key"
    """File with the run's 32-byte hex key (created by `geotrain train` for local)."""
    rendezvous_port: int = Field(default=29500, ge=1024, le=65000)
    """Port of the global TCPStore on the first node."""
    max_restarts: int = Field(default=3, ge=0, le=100)
    """Restarts after a worker dies (torchrun --max-restarts semantics)."""
    bucket_mb: float = Field(default=4.0, gt=0, le=1024)
    """Gradient bucket size for the hierarchical all-reduce."""
    balance: Literal["off", "throughput"] = "off"
    """throughput: measure each region's speed, then give faster regions bigger batches per
    rank (global batch kept) so no region waits at the sync (training.balance)."""
    balance_steps: int = Field(default=5, ge=1, le=1000)
    """Steps measured (after the first) before the throughput balance assigns batches."""
    exchange: Literal["direct", "allgather", "topology"] = "direct"
    """direct: a reduce-scatter then an all-gather across regions (two rounds, each value
    sent 2 (R - 1) / R times); allgather: each region's gradients or pseudo-gradients,
    quantized once, go whole to every region (one round, R / 2 times direct's bytes: the
    same with 2 regions, 1.5x with 3); topology: each region aggregates a share of the
    gradients sized by its measured links, and flows over a slow link relay through a
    faster region (training.sync.topo_exchange)."""
    exchange_replan: int = Field(default=20, ge=1, le=100000)
    """topology: cross-region exchanges (bucket syncs) between two plans agreed by every region."""
    fault_tolerance: FaultTolerance | None = None
    """Regions drop and rejoin without a restart (torchft quorum; None: off)."""


Severity = Literal["critical", "warning"]
SEVERITIES: tuple[Severity, ...] = ("critical", "warning")


class AlertReceiver(Strict):
    """Where Alertmanager sends alerts: set exactly one of webhook_url, slack_url_config, email."""

    name: str = Field(pattern=NAME_PATTERN)
    """Receiver name, unique in the stack (shown in Alertmanager)."""
    severities: list[Severity] = Field(default_factory=lambda: list(SEVERITIES))
    """Alert severities routed to this receiver."""
    webhook_url: str | None = None
    """JSON webhook endpoint (Alertmanager's webhook format); no credentials in the URL."""
    webhook_token_config: str | None = None
    """Secret config key holding a bearer token for webhook_url (written to a file on the host)."""
    slack_url_config: str | None = None
    """Secret config key holding a Slack incoming-webhook URL (the URL is the credential)."""
    email: str | None = None
    """Address that receives alerts by email through monitoring.smtp."""


class Smtp(Strict):
    smarthost: str
    """SMTP relay as host:port."""
    sender: str
    """From address of alert emails."""
    username: str | None = None
    """SMTP login (none: unauthenticated relay)."""
    password_config: str = "geotrain:smtpPassword"
    """Secret config key holding the SMTP password (used when username is set)."""
    require_tls: bool = True
    """Require STARTTLS to the relay."""


class Monitoring(Strict):
    enabled: bool = True
    """Render and deliver monitoring."""
    metrics_port: int = Field(default=9400, ge=0, le=65000)
    """First runtime metrics port; local rank i serves on port + i (0: no metrics)."""
    node_exporter_port: int = Field(default=9100, ge=1024, le=65535)
    """node-exporter port on every node."""
    dcgm_exporter_port: int = Field(default=9500, ge=1024, le=65535)
    """dcgm-exporter port on GPU nodes (gpu_metrics: dcgm-exporter)."""
    gpu_metrics: Literal["dcgm-exporter", "runtime"] = "dcgm-exporter"
    """Source of GPU series for alerts and dashboards: NVIDIA's dcgm-exporter on every GPU
    node, or the runtime's NVML gauges (each rank its own device; nothing to install)."""
    prometheus_port: int = Field(default=9090, ge=1024, le=65535)
    """Prometheus listen port on the monitoring host."""
    alertmanager_port: int = Field(default=9093, ge=1024, le=65535)
    """Alertmanager listen port on the monitoring host."""
    grafana: bool = True
    """Install Grafana on the monitoring host (ssh) from Grafana's apt repository, which
    the host must reach."""
    grafana_port: int = Field(default=3000, ge=1024, le=65535)
    """Grafana listen port on the monitoring host."""
    grafana_admin_password_config: str = "geotrain:grafanaAdminPassword"
    """Secret config key holding Grafana's admin password (written to a file on the host)."""
    bind_address: str = "private"
    """`private` (overlay/loopback address of the node) or an explicit IPv4 address."""
    scrape_interval_s: int = Field(default=15, ge=1, le=600)
    """Prometheus scrape interval."""
    host: str | None = None
    """Node running Prometheus, Alertmanager and Grafana (default: the first region's gateway)."""
    receivers: list[AlertReceiver] = Field(default_factory=list)
    """Alert receivers; with none, Alertmanager keeps alerts in its UI only."""
    smtp: Smtp | None = None
    """SMTP relay for email receivers."""


class Policy(Strict):
    allowed_gpu_types: list[str] | None = None
    """GPU types this stack may use (default: any known)."""
    allowed_regions: list[str] | None = None
    """Region names this stack may use (default: any)."""
    max_gpus: int | None = Field(default=None, ge=1)
    """Budget: total accelerators."""
    max_usd_per_hour: float | None = Field(default=None, gt=0)
    """Budget: estimated hourly cost from the price table."""
    gpu_prices: dict[str, PositiveFloat] = Field(default_factory=dict)
    """Overrides of the default USD/GPU-hour prices."""
    encryption_required_for: list[Jurisdiction] = Field(default_factory=lambda: [_CN])
    """Jurisdictions whose regions require payload encryption with sm4-gcm."""
    max_checkpoint_interval_minutes: float = Field(default=30, gt=0)
    """Checkpoints at least this often."""
    min_checkpoint_keep: int = Field(default=2, ge=1)
    """Checkpoints to keep at least."""
    dp_required_for: list[Jurisdiction] = Field(default_factory=list)
    """Jurisdictions whose regions must train with differential privacy (regions[].privacy)."""
    max_dp_epsilon: float | None = Field(default=None, gt=0)
    """Largest target_epsilon a DP region may set (default: no cap)."""
    required_tags: list[NonEmptyStr] = Field(default_factory=lambda: ["owner", "cost-centre"])
    """Tags every resource must carry (jurisdiction is added per region)."""


class StackModel(Strict):
    """The whole stack: what `geotrain:*` config declares."""

    stack: str
    """Stack name (from the file name or the Pulumi engine)."""
    regions: list[Region] = Field(min_length=1)
    """Regions, in rank order."""
    network: Network = Network()
    """Overlay, tunnels and routing."""
    training: Training = Training()
    """The training job."""
    monitoring: Monitoring = Monitoring()
    """Metrics, alerts and dashboards."""
    policy: Policy = Policy()
    """Guardrail settings read by the policy pack and `geotrain check`."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Tags added to every resource."""

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def lighthouse_node(self) -> tuple[int, int]:
        """(region index, node index) the fault-tolerance Lighthouse runs on: the named
        region's first node, or the named node; KeyError when it names neither."""
        ft = self.training.fault_tolerance
        assert ft is not None
        for i, r in enumerate(self.regions):
            if r.name == ft.lighthouse:
                return i, 0
            for j, n in enumerate(r.pool.nodes):
                if n.name == ft.lighthouse:
                    return i, j
        raise KeyError(ft.lighthouse)
