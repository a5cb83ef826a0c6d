"""The cloud tables: which instance type gives a node its GPUs on each cloud, where that type
is offered, what it costs, which image boots it, and which addresses a cloud keeps for itself.

Pure data plus look-ups; the stack checks (`infra.model.checks.clouds`), the plan, the cloud
backends (`infra/backends/aws.py`, `gcp.py`, `alicloud.py`) and the policies read it.

Where the numbers come from, and how far to trust them:
- AWS and GCP offerings and on-demand prices: the public price lists as SkyPilot's catalog
  (skypilot-org/skypilot-catalog, v8) recorded them in 2025, rounded to cents. GCP prices of
  a2/a3 machines are the machine plus its GPUs; outside us-central1 they are scaled from
  the machine's regional price and marked approximate in `note`.
- Alibaba Cloud: the instance family docs list gn7e/ebmgn7e (A100 80GB) in the mainland
  regions below; geotrain has not checked per-zone stock, and the price is an estimate (no
  USD list price was checked here). Override it with geotrain:policy.gpu_prices.
- Capacity is never guaranteed by a listing: 8-GPU types usually need a quota increase or
  a reservation first (see README, "From an empty cloud account to a training run").
Check a region before a first deployment with the cloud's own tool:
`aws ec2 describe-instance-type-offerings --region R --filters Name=instance-type,Values=T`,
`gcloud compute machine-types list --filter=name=T`,
`aliyun ecs DescribeAvailableResource --RegionId R --DestinationResource InstanceType`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CLOUD_KINDS = ("aws", "alicloud", "gcp")
"""Pool kinds whose nodes are cloud instances made by the stack."""

CLOUD_GATEWAY_HOST = 4
"""A cloud gateway's private IP is host 4 of the region subnet: AWS keeps .0-.3 of every
subnet (network, VPC router, DNS, reserved), GCP .0-.1 (network, gateway), Alibaba .0."""


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


@dataclass(frozen=True)
class Offer:
    """One instance type in one cloud region."""

    usd_per_hour: float
    """On-demand list price of the whole instance (all its GPUs), USD per hour."""
    zones: tuple[str, ...] = ()
    """Zones known to have the type (empty: not listed; AWS zone names differ per account)."""
    note: str = ""
    """How sure the entry is, when it is less than a checked list price."""


@dataclass(frozen=True)
class InstanceType:
    name: str
    """The cloud's name for it (what the instance resource's type input holds)."""
    gpu_type: str
    """infra.model.gpus.GPU_TYPES key."""
    gpus: int
    """GPUs per instance."""
    offers: dict[str, Offer]
    """Cloud region -> offer; a region not listed does not offer the type."""
    nic_type: str | None = None
    """The NIC the type requires (GCP: GVNIC for A3, whose 8 GPUs' network needs Google's
    virtual NIC; the image must support it), else None: the cloud's default NIC."""


@dataclass(frozen=True)
class Image:
    ref: str
    """Default image reference (see CloudSettings.image for the forms each cloud takes)."""
    min_disk_gb: int
    """Root disk the image needs (its snapshot size, rounded up)."""
    description: str
    """What it is, for messages and docs."""


@dataclass(frozen=True)
class Cloud:
    kind: str
    """Pool kind."""
    title: str
    """Name in messages."""
    regions: tuple[str, ...]
    """Every region of the cloud geotrain knows (an unknown one is a typo or a new region)."""
    instances: tuple[InstanceType, ...]
    """GPU instance types geotrain can put a node on."""
    image: Image
    """The default CUDA-ready image."""
    reserved_low: int
    """Addresses the cloud keeps at the start of every subnet."""
    reserved_high: int
    """Addresses the cloud keeps at the end of every subnet (broadcast included)."""
    prefix_range: tuple[int, int]
    """Shortest and longest subnet prefix the cloud accepts."""
    taggable: dict[str, str] = field(default_factory=dict)
    """Resource type token -> its tag input (`tags` or `labels`), for every type the backend
    makes that carries tags: the required-tags policy judges exactly these."""

    def instance(self, gpu_type: str, gpus: int) -> InstanceType | None:
        return next((t for t in self.instances if (t.gpu_type, t.gpus) == (gpu_type, gpus)), None)

    def by_name(self, name: str) -> InstanceType | None:
        return next((t for t in self.instances if t.name == name), None)


AWS = Cloud(
    kind="aws",
    title="AWS",
    regions=_words(
        "us-east-1 us-east-2 us-west-1 us-west-2 ca-central-1 ca-west-1 mx-central-1 "
        "sa-east-1 eu-central-1 eu-central-2 eu-west-1 eu-west-2 eu-west-3 eu-south-1 "
        "eu-south-2 eu-north-1 il-central-1 me-south-1 me-central-1 af-south-1 ap-east-1 "
        "ap-east-2 ap-south-1 ap-south-2 ap-southeast-1 ap-southeast-2 ap-southeast-3 "
        "ap-southeast-4 ap-southeast-5 ap-southeast-7 ap-northeast-1 ap-northeast-2 "
        "ap-northeast-3 cn-north-1 cn-northwest-1 us-gov-west-1 us-gov-east-1"
    ),
    instances=(
        InstanceType(
            "p4de.24xlarge",
            "A100-80GB",
            8,
            {
                "us-east-1": Offer(27.45),
                "us-west-2": Offer(27.45),
                "eu-central-1": Offer(34.29),
                "ap-northeast-1": Offer(37.62),
                "ap-southeast-1": Offer(32.94),
            },
        ),
        InstanceType(
            "p4d.24xlarge",
            "A100-40GB",
            8,
            {
                "us-east-1": Offer(21.96),
                "us-east-2": Offer(21.96),
                "us-west-2": Offer(21.96),
                "ca-central-1": Offer(25.25),
                "eu-central-1": Offer(27.43),
                "eu-north-1": Offer(23.72),
                "eu-west-1": Offer(23.72),
                "eu-west-2": Offer(28.54),
                "ap-northeast-1": Offer(30.10),
                "ap-northeast-2": Offer(30.41),
                "ap-south-1": Offer(26.34),
                "ap-southeast-2": Offer(28.54),
            },
        ),
        InstanceType(
            "p5.48xlarge",
            "H100-80GB",
            8,
            {
                "us-east-1": Offer(55.04),
                "us-east-2": Offer(55.04),
                "us-west-1": Offer(68.80),
                "us-west-2": Offer(55.04),
                "ca-central-1": Offer(63.30),
                "eu-north-1": Offer(58.89),
                "eu-west-2": Offer(71.55),
                "ap-northeast-1": Offer(68.80),
                "ap-northeast-2": Offer(75.96),
                "ap-south-1": Offer(66.05),
                "ap-southeast-2": Offer(71.55),
                "ap-southeast-3": Offer(75.96),
            },
        ),
    ),
    image=Image(
        "ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id",
        75,
        "AWS Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04), its latest AMI id "
        "read from the public SSM parameter in the region",
    ),
    reserved_low=4,
    reserved_high=1,
    prefix_range=(16, 28),
    taggable={
        "aws:ec2/vpc:Vpc": "tags",
        "aws:ec2/subnet:Subnet": "tags",
        "aws:ec2/internetGateway:InternetGateway": "tags",
        "aws:ec2/routeTable:RouteTable": "tags",
        "aws:ec2/securityGroup:SecurityGroup": "tags",
        "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": "tags",
        "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule": "tags",
        "aws:ec2/eip:Eip": "tags",
        "aws:ec2/instance:Instance": "tags",
        "aws:ebs/volume:Volume": "tags",
        "aws:ec2/placementGroup:PlacementGroup": "tags",
        "aws:ec2/vpcPeeringConnection:VpcPeeringConnection": "tags",
        "aws:ec2/vpcPeeringConnectionAccepter:VpcPeeringConnectionAccepter": "tags",
    },
)

_GCP_APPROX = "approximate: scaled from the machine's regional price"
GCP = Cloud(
    kind="gcp",
    title="GCP",
    regions=_words(
        "us-central1 us-east1 us-east4 us-east5 us-south1 us-west1 us-west2 us-west3 "
        "us-west4 northamerica-northeast1 northamerica-northeast2 northamerica-south1 "
        "southamerica-east1 southamerica-west1 europe-central2 europe-north1 "
        "europe-north2 europe-southwest1 europe-west1 europe-west2 europe-west3 "
        "europe-west4 europe-west6 europe-west8 europe-west9 europe-west10 europe-west12 "
        "me-central1 me-central2 me-west1 africa-south1 asia-east1 asia-east2 "
        "asia-northeast1 asia-northeast2 asia-northeast3 asia-south1 asia-south2 "
        "asia-southeast1 asia-southeast2 australia-southeast1 australia-southeast2"
    ),
    instances=(
        InstanceType(
            "a2-ultragpu-8g",
            "A100-80GB",
            8,
            {
                "us-central1": Offer(40.22, ("us-central1-a", "us-central1-c")),
                "us-east5": Offer(40.22, ("us-east5-a", "us-east5-b")),
                "us-east4": Offer(45.29, ("us-east4-c",), _GCP_APPROX),
                "europe-west4": Offer(44.27, ("europe-west4-a",), _GCP_APPROX),
                "asia-southeast1": Offer(49.61, ("asia-southeast1-c",), _GCP_APPROX),
            },
        ),
        InstanceType(
            "a2-highgpu-8g",
            "A100-40GB",
            8,
            {
                "us-central1": Offer(29.39, ("us-central1-a", "us-central1-b", "us-central1-c")),
                "us-east1": Offer(29.39, ("us-east1-b",)),
                "us-west1": Offer(29.39, ("us-west1-b",)),
                "us-west3": Offer(35.30, ("us-west3-b",), _GCP_APPROX),
                "us-west4": Offer(33.10, ("us-west4-b",), _GCP_APPROX),
                "europe-west4": Offer(32.36, ("europe-west4-a", "europe-west4-b"), _GCP_APPROX),
                "me-west1": Offer(32.33, ("me-west1-a", "me-west1-c"), _GCP_APPROX),
                "asia-northeast1": Offer(
                    37.68, ("asia-northeast1-a", "asia-northeast1-c"), _GCP_APPROX
                ),
                "asia-northeast3": Offer(
                    37.68, ("asia-northeast3-a", "asia-northeast3-b"), _GCP_APPROX
                ),
                "asia-southeast1": Offer(
                    36.26, ("asia-southeast1-b", "asia-southeast1-c"), _GCP_APPROX
                ),
            },
        ),
        InstanceType(
            "a3-highgpu-8g",
            "H100-80GB",
            8,
            nic_type="GVNIC",  # A3 machines start only with gVNIC (no VirtIO-Net)
            offers={
                "us-central1": Offer(88.25, ("us-central1-a", "us-central1-b", "us-central1-c")),
                "us-east4": Offer(88.25, ("us-east4-a", "us-east4-b", "us-east4-c")),
                "us-west1": Offer(88.25, ("us-west1-a", "us-west1-b")),
                "us-east5": Offer(99.40, ("us-east5-a",), _GCP_APPROX),
                "us-west4": Offer(99.40, ("us-west4-a",), _GCP_APPROX),
                "europe-west1": Offer(97.17, ("europe-west1-b", "europe-west1-c"), _GCP_APPROX),
                "europe-west3": Offer(104.13, ("europe-west3-c",), _GCP_APPROX),
                "europe-west4": Offer(92.66, ("europe-west4-b", "europe-west4-c"), _GCP_APPROX),
                "europe-west9": Offer(102.37, ("europe-west9-c",), _GCP_APPROX),
                "europe-north1": Offer(97.17, ("europe-north1-c",), _GCP_APPROX),
                "asia-east1": Offer(102.18, ("asia-east1-c",), _GCP_APPROX),
                "asia-northeast1": Offer(113.33, ("asia-northeast1-b",), _GCP_APPROX),
                "asia-south1": Offer(91.78, ("asia-south1-c",), _GCP_APPROX),
                "asia-southeast1": Offer(
                    108.87, ("asia-southeast1-b", "asia-southeast1-c"), _GCP_APPROX
                ),
                "australia-southeast1": Offer(110.31, ("australia-southeast1-c",), _GCP_APPROX),
            },
        ),
    ),
    image=Image(
        "projects/ubuntu-os-accelerator-images/global/images/family/"
        "ubuntu-accelerator-2404-amd64-with-nvidia-570",
        50,
        "Canonical's Ubuntu 24.04 accelerator image with the NVIDIA 570 driver (image family)",
    ),
    reserved_low=2,
    reserved_high=2,
    prefix_range=(8, 29),
    # networks, subnetworks, firewalls, routes and resource policies take no labels
    taggable={
        "gcp:compute/address:Address": "labels",
        "gcp:compute/instance:Instance": "labels",
        "gcp:compute/disk:Disk": "labels",
    },
)

ALICLOUD = Cloud(
    kind="alicloud",
    title="Alibaba Cloud",
    regions=_words(
        "cn-hangzhou cn-shanghai cn-nanjing cn-fuzhou cn-qingdao cn-beijing "
        "cn-zhangjiakou cn-huhehaote cn-wulanchabu cn-shenzhen cn-heyuan cn-guangzhou "
        "cn-chengdu cn-hongkong ap-northeast-1 ap-northeast-2 ap-southeast-1 "
        "ap-southeast-3 ap-southeast-5 ap-southeast-6 ap-southeast-7 us-east-1 us-west-1 "
        "eu-west-1 eu-central-1 me-east-1 me-central-1"
    ),
    instances=(
        InstanceType(
            "ecs.ebmgn7e.32xlarge",
            "A100-80GB",
            8,
            {
                r: Offer(32.00, note="estimate; zones and price unchecked")
                for r in (
                    "cn-beijing",
                    "cn-shanghai",
                    "cn-hangzhou",
                    "cn-zhangjiakou",
                    "cn-wulanchabu",
                )
            },
        ),
    ),
    image=Image(
        "^ubuntu_24_04_x64",
        20,
        "Alibaba's Ubuntu 24.04 system image (newest match of the name pattern); cloud-init "
        "installs the NVIDIA server driver and fabric manager from Ubuntu's archive",
    ),
    reserved_low=1,
    reserved_high=3,
    prefix_range=(16, 29),
    taggable={
        "alicloud:vpc/network:Network": "tags",
        "alicloud:vpc/switch:Switch": "tags",
        "alicloud:ecs/securityGroup:SecurityGroup": "tags",
        "alicloud:ecs/eipAddress:EipAddress": "tags",
        "alicloud:ecs/instance:Instance": "tags",
        "alicloud:ecs/ecsDisk:EcsDisk": "tags",
        "alicloud:vpc/peerConnection:PeerConnection": "tags",
    },
)

CLOUDS: dict[str, Cloud] = {c.kind: c for c in (AWS, ALICLOUD, GCP)}

NVIDIA_DRIVER_BRANCH = "570"
"""Driver branch cloud-init installs where the image has none (Alibaba's system image)."""


HOST_WORK_DIR = "/var/lib/geotrain"
"""The workers' working directory on hosts, where relative checkpoint dirs resolve (the same
as infra.render.runtime.REMOTE_STATE_DIR, which the model may not import; a test keeps
them equal). A data disk is never mounted on it or above it: the agent's state and run
files there belong to the instance, not to the disk that outlives it."""


def checkpoint_root_on_host(template: str, stack: str) -> str:
    """training.checkpoint.dir as a host sees it: absolute, {stack} filled in."""
    path = template if template.startswith("/") else f"{HOST_WORK_DIR}/{template}"
    return path.replace("{stack}", stack)


def checkpoint_mount(root_on_host: str) -> str:
    """Where a cloud node mounts its data disk: the checkpoint root as the host sees it
    (absolute, {stack} filled in) up to its first component that holds a placeholder
    ({node}, {region}), so every node's checkpoints land on its own disk."""
    parts: list[str] = []
    for c in root_on_host.split("/")[1:]:
        if "{" in c:
            break
        if c:
            parts.append(c)
    return "/" + "/".join(parts)


def image_is_lookup(kind: str, ref: str) -> bool:
    """True when `ref` names a moving target that the backend resolves at deploy time (an
    AWS SSM parameter, a GCP image family, an Alibaba name pattern), not one fixed image.
    Such an image is fixed per instance when the instance is made (ignore_changes) and
    moves only with `cloud.image_upgrade` or an explicit image (docs/clouds.md)."""
    if kind == "aws":
        return ref.startswith("ssm:")
    if kind == "gcp":
        return "/family/" in ref or ref.startswith("family/")
    return ref.startswith("^")


def instance_type_gpus(type_name: str) -> tuple[str, int] | None:
    """(gpu_type, gpus) of an instance type of any cloud, or None when geotrain has no entry."""
    for c in CLOUDS.values():
        t = c.by_name(type_name)
        if t is not None:
            return t.gpu_type, t.gpus
    return None


def taggable_types() -> dict[str, str]:
    """Every cloud resource type geotrain makes that carries tags -> its tag input."""
    return {k: v for c in CLOUDS.values() for k, v in c.taggable.items()}
