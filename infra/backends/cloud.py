"""Cloud pools (`aws`, `alicloud`, `gcp`): the instances, networks and firewalls come from
the cloud's own Pulumi provider; then the instances are ssh hosts, and the ssh backend
copies the bundle, prepares the gateway and runs the agent on them (delegated here, never
copied).

Per region, under one `geotrain:cloud:CloudRegion` component and ONE explicit provider for
the region's cloud region (never the ambient default provider):
- a network and the region subnet (geotrain:regions[].subnet), internet access, routes that
  send the other regions' subnets to the gateway (which forwards them into its tunnels);
- firewalls: SSH from network.admin_cidrs, everything from the overlay (private traffic),
  and, added by `overlay()` once every region's gateway has an address, WireGuard UDP on
  the gateway's listen ports from each peer gateway's public IP; nothing else inbound;
- per node an instance of the type infra.model.clouds maps its GPUs to, at the plan's
  private IP, with a public IP (a static one for the gateway: it is the peers' WireGuard
  endpoint), in a placement group where the cloud has one, spot or on-demand;
- per node a data disk for its checkpoints, a resource of its own attached to the instance
  and mounted at the checkpoint root: it survives the instance's replacement, and
  `pulumi destroy` keeps it (retain_on_delete) while training.checkpoint.keep_on_destroy;
- cloud-init makes the ssh login user, installs the node's SSH host key (made here, from a
  seed the engine keeps in state), mounts the data disk and, last, authorizes the
  operator's public key (derived from the secret geotrain:sshPrivateKey, which never
  leaves the Pulumi secret).

Stable across `pulumi up`s: what the backends look up at deploy time (an SSM image
parameter, a GCP image family, an Alibaba image pattern, the zone that offers the types)
is fixed in each resource when it is made (`ignore_changes` on exactly those inputs,
`pinned()`), so a new image release or another zone offering replaces nothing. An image
or zone the stack sets is obeyed; `cloud.image_upgrade: true` moves to the newest image
(docs/clouds.md). Instances and attachments are deleted before they are replaced: the
instance's private IP and its data disk can belong to one instance at a time.

Each node's public IP goes into `ctx.addresses` and its public host key into
`ctx.host_keys`: the ssh backend connects there, pins that key, and passes the addresses
to every agent, which fills them into the `<address of NODE>` placeholders the renderers
wrote (WireGuard endpoints, firewall peers).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shlex
import struct
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import pulumi
import pulumi_random as random

from infra.backends.base import BackendContext, Parent
from infra.backends.ssh import SshBackend
from infra.facts import tags as plan_tags
from infra.model.clouds import (
    CLOUDS,
    NVIDIA_DRIVER_BRANCH,
    Cloud,
    checkpoint_mount,
    checkpoint_root_on_host,
    image_is_lookup,
)
from infra.model.pulumi_config import secret
from infra.model.schema import CloudSettings
from infra.plan import Plan, PlanNode, PlanRegion

TOKEN = "geotrain:cloud:CloudRegion"
GATEWAY_TAG = "gateway"
"""Role of the gateway in firewall targets and resource names."""


@dataclass(frozen=True)
class Rule:
    """One inbound allowance, cloud-neutral; each cloud module turns it into its own."""

    role: str
    """Names the resource: `<region>-<role>`."""
    protocol: str
    """tcp | udp | all."""
    ports: tuple[int, int] | None
    """First and last port (None: every port)."""
    sources: tuple[pulumi.Input[str], ...]
    """Source CIDRs."""
    gateway_only: bool = False
    """Applies to the gateway alone (WireGuard), else to every node."""


@dataclass(frozen=True)
class RegionArgs:
    """Everything a cloud module needs for one region, from the plan."""

    plan: Plan
    region: PlanRegion
    settings: CloudSettings
    cloud: Cloud
    name: str
    """Resource name prefix (the pool component's name)."""
    tags: dict[str, str]
    """Tags (labels) for every taggable resource: the stack's, jurisdiction, stack, region."""
    host_keys: dict[str, pulumi.Output[HostKey]] = field(default_factory=dict)
    """Node -> its SSH host key pair (cloud-init installs it; the ssh backend pins it)."""

    @property
    def cloud_region(self) -> str:
        return str(self.settings.region)

    @property
    def keep_disks(self) -> bool:
        """`pulumi destroy` leaves the data disks (training.checkpoint.keep_on_destroy)."""
        return bool(self.plan.training.checkpoint.keep_on_destroy)

    @property
    def mount(self) -> str:
        """Where every node mounts its data disk: the checkpoint root on the host."""
        t = self.plan.training.checkpoint.dir
        return checkpoint_mount(checkpoint_root_on_host(t, self.plan.stack))

    def user_data(self, node: PlanNode, device: pulumi.Input[str]) -> pulumi.Output[str]:
        """cloud-init of `node`: its host key and its data disk, found by `device` (a
        block device serial, or a /dev/disk/by-id path)."""
        boot = pulumi.Output.all(self.host_keys[node.name], device).apply(
            lambda v: Boot(v[0], DataDisk(self.mount, v[1]))
        )
        return cloud_init(self.region, boot)

    def image_pinned(self, ref: str) -> bool:
        """True when an image looked up at deploy time stays what each instance was made
        with (see `pinned`)."""
        return image_is_lookup(self.cloud.kind, ref) and not self.settings.image_upgrade

    def instance_type(self, node: PlanNode) -> str:
        t = self.cloud.instance(node.gpu_type, node.gpus)
        assert t is not None  # the model checks: every cloud node maps to an instance type
        return t.name

    def default_zone(self, node: PlanNode) -> str | None:
        """The configured zone, else the first the table lists for the node's type."""
        if self.settings.zone:
            return self.settings.zone
        t = self.cloud.instance(node.gpu_type, node.gpus)
        offer = t.offers.get(self.cloud_region) if t else None
        return offer.zones[0] if offer and offer.zones else None

    def peer_subnets(self) -> list[str]:
        """The other regions' subnets: sent to the gateway, which forwards them."""
        return [r.subnet for r in self.plan.regions if r.name != self.region.name]


@dataclass
class Built:
    """What one region's pool() made, for overlay() to add to."""

    args: RegionArgs
    component: pulumi.ComponentResource
    provider: pulumi.ProviderResource
    handles: dict[str, Any]
    """Cloud-specific handles (network, firewall ids) the module needs later."""
    instances: dict[str, pulumi.CustomResource] = field(default_factory=dict)
    public_ips: dict[str, pulumi.Output[str]] = field(default_factory=dict)

    def opts(self, *after: pulumi.Resource, **more: Any) -> pulumi.ResourceOptions:
        # every cloud resource names its region's provider: the ambient default provider
        # (credentials and region from the environment) is never used
        return pulumi.ResourceOptions(
            parent=self.component, provider=self.provider, depends_on=list(after) or None, **more
        )


def pinned(*inputs: str | None) -> list[str] | None:
    """ignore_changes for the inputs (camelCase property paths, as the engine diffs them)
    that hold a value looked up at deploy time; None entries are inputs the stack set,
    which are obeyed. The engine keeps such an input as the resource was made with, so a
    newer answer to the look-up (a new image release, another zone offering) never
    replaces the resource; the resource's other inputs stay live."""
    paths = [p for p in inputs if p]
    return paths or None


class CloudApi(Protocol):
    """One cloud's resources behind the few calls CloudBackend makes."""

    def build(self, args: RegionArgs, component: pulumi.ComponentResource) -> Built:
        """Provider, network, base firewall rules, instances, routes; fills public_ips."""
        ...

    def admit(self, built: Built, rules: list[Rule]) -> list[pulumi.Resource]:
        """Add inbound rules (WireGuard from peers) to the region's firewall."""
        ...

    def peer(self, a: Built, b: Built, parent: Parent) -> list[pulumi.Resource]:
        """Native peering between two regions' networks (an underlay; see README)."""
        ...


class CloudRegion(pulumi.ComponentResource):
    """A region's cloud resources; outputs the nodes' public and private IPs."""

    def __init__(self, name: str, region: PlanRegion, opts: pulumi.ResourceOptions) -> None:
        super().__init__(TOKEN, name, {"kind": region.kind, "region": region.name}, opts)


class CloudBackend:
    """The pool kind `kind` on `api`; everything on the hosts is SshBackend's."""

    def __init__(self, kind: str, api: CloudApi) -> None:
        self.kind = kind
        self.api = api
        self.ssh = SshBackend()

    def pool(
        self, ctx: BackendContext, region: PlanRegion, parent: Parent
    ) -> list[pulumi.Resource]:
        comp = CloudRegion(f"{parent.name}-cloud", region, parent.opts())
        args = region_args(ctx.plan, region, parent.name, comp)
        built = self.api.build(args, comp)
        _built(ctx)[region.name] = built
        ctx.addresses.update(built.public_ips)
        # the ssh backend pins these in every connection (ConnectionArgs.host_key): the run
        # key on the agent's stdin goes only to the host that holds the private half
        for n in region.nodes:
            ctx.host_keys[n.name] = args.host_keys[n.name].apply(lambda k: k.public)
        comp.register_outputs(
            {
                "public_ips": pulumi.Output.all(**built.public_ips),
                "private_ips": {n.name: n.private_ip for n in region.nodes},
                "instance_types": {n.name: args.instance_type(n) for n in region.nodes},
            }
        )
        # the bundle copies connect to the instances' public IPs; they also wait for the
        # rest of the region (the firewall rule that admits SSH, the internet route)
        hosts = Parent(parent.name, parent.resource, (*parent.depends_on, comp))
        return [comp, *self.ssh.pool(ctx, region, hosts)]

    def overlay(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        out: list[pulumi.Resource] = []
        for r in regions:
            built = _built(ctx)[r.name]
            out += self.api.admit(built, wireguard_rules(ctx, r))
        out += self._peerings(ctx, regions, parent)
        # the gateways' keys are made only once their WireGuard ports are open
        after = Parent(parent.name, parent.resource, (*parent.depends_on, *out))
        return out + self.ssh.overlay(ctx, regions, after)

    def _peerings(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        names = {r.name for r in regions if r.pool.cloud.peering}
        built = _built(ctx)
        out: list[pulumi.Resource] = []
        for t in ctx.plan.tunnels:
            if t.a in names and t.b in names:
                out += self.api.peer(built[t.a], built[t.b], parent)
        return out

    def routing(
        self, ctx: BackendContext, regions: list[PlanRegion], parent: Parent
    ) -> list[pulumi.Resource]:
        return self.ssh.routing(ctx, regions, parent)

    def monitoring(self, ctx: BackendContext, parent: Parent) -> list[pulumi.Resource]:
        return self.ssh.monitoring(ctx, parent)

    def run_key(self, ctx: BackendContext, parent: Parent) -> pulumi.Output[str] | None:
        # one run key per stack: every agent backend would make `<parent>-run-key`, so
        # the ssh backend makes it when the stack has ssh regions, else the first cloud's
        kinds = [r.kind for r in ctx.plan.regions]
        owner = "ssh" if "ssh" in kinds else next(k for k in kinds if k in CLOUDS)
        return self.ssh.run_key(ctx, parent) if owner == self.kind else None

    def deliver(
        self,
        ctx: BackendContext,
        region: PlanRegion,
        run_key: pulumi.Output[str] | None,
        parent: Parent,
    ) -> list[pulumi.Resource]:
        return self.ssh.deliver(ctx, region, run_key, parent)


def _built(ctx: BackendContext) -> dict[str, Built]:
    """Region -> what its pool() built, kept on the context the program shares (backends
    are stateless objects made per call, and overlay() runs after every pool)."""
    return cast(dict[str, Built], ctx.__dict__.setdefault("_cloud_regions", {}))


def region_args(
    plan: Plan, region: PlanRegion, name: str, component: pulumi.Resource
) -> RegionArgs:
    s = region.pool.cloud
    t = dict(plan_tags(plan, region.jurisdiction))
    t.update({"geotrain-stack": plan.stack, "geotrain-region": region.name})
    return RegionArgs(
        plan=plan,
        region=region,
        settings=s,
        cloud=CLOUDS[region.kind],
        name=name,
        tags=t,
        host_keys={n.name: host_key(f"{name}-{n.name}", component) for n in region.nodes},
    )


@dataclass(frozen=True)
class HostKey:
    """An ed25519 SSH host key pair."""

    private: str
    """OpenSSH private key file (a secret: only cloud-init sees it)."""
    public: str
    """`ssh-ed25519 BASE64`, as pulumi-command's host_key and known_hosts take it."""


def host_key(name: str, component: pulumi.Resource) -> pulumi.Output[HostKey]:
    """A node's host key, from 32 random bytes the engine makes once and keeps (a secret in
    state): the same key on every `up` and on a replaced instance, so the pin holds."""
    seed = random.RandomBytes(
        f"{name}-host-key",
        length=32,
        # random's own provider: never the region's cloud provider
        opts=pulumi.ResourceOptions(parent=component),
    )
    pair = seed.hex.apply(lambda h: host_key_from_seed(bytes.fromhex(h)))
    return cast(pulumi.Output[HostKey], pulumi.Output.secret(pair))  # random marks hex secret too


def host_key_from_seed(seed: bytes) -> HostKey:
    """The ed25519 key pair of a 32-byte seed, the private key in OpenSSH's file format.
    Written here rather than by `cryptography`, whose OpenSSH encoder draws random check
    bytes: the same seed must give the same file, or the user data (and with it the
    instance) would change on every `up`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    raw = serialization.Encoding.Raw
    pub = (
        ed25519.Ed25519PrivateKey.from_private_bytes(seed)
        .public_key()
        .public_bytes(raw, serialization.PublicFormat.Raw)
    )

    def s(b: bytes) -> bytes:  # an SSH string: uint32 length, then the bytes
        return struct.pack(">I", len(b)) + b

    kind = b"ssh-ed25519"
    blob = s(kind) + s(pub)
    check = hashlib.sha256(b"geotrain host key check" + seed).digest()[:4]
    body = check + check + s(kind) + s(pub) + s(seed + pub) + s(b"geotrain")
    body += bytes(range(1, 1 + (-len(body)) % 8))  # padding 1, 2, 3, ... to 8 bytes
    data = b"openssh-key-v1\0" + s(b"none") + s(b"none") + s(b"") + struct.pack(">I", 1)
    data += s(blob) + s(body)
    text = base64.b64encode(data).decode()
    lines = [text[i : i + 70] for i in range(0, len(text), 70)]
    private = "\n".join(
        ["-----BEGIN OPENSSH PRIVATE KEY-----", *lines, "-----END OPENSSH PRIVATE KEY-----", ""]
    )
    return HostKey(private, f"ssh-ed25519 {base64.b64encode(blob).decode()}")


@dataclass(frozen=True)
class DataDisk:
    """A node's checkpoint disk as cloud-init finds and mounts it."""

    mount: str
    """Absolute mount point: the checkpoint root."""
    device: str
    """A /dev/disk/by-id/ path (GCP: the attached disk's device name), else the block
    device's serial number (AWS: the volume id without its dash; Alibaba: the disk id
    without `d-`, which the guest may cut to 20 characters)."""


@dataclass(frozen=True)
class Boot:
    """What one node's cloud-init sets up besides the login user."""

    host_key: HostKey
    disk: DataDisk


def base_rules(args: RegionArgs) -> list[Rule]:
    """SSH from the admin networks; anything from the overlay (the region's own subnet and
    the traffic the gateway forwards from other regions). Egress stays open: packages,
    the peers' WireGuard ports."""
    admin = tuple(str(c) for c in args.plan.network.admin_cidrs)
    overlay = (str(args.plan.network.overlay_cidr),)
    return [
        Rule("ssh-admin", "tcp", (22, 22), admin),
        Rule("overlay", "all", None, overlay),
    ]


def wireguard_rules(ctx: BackendContext, region: PlanRegion) -> list[Rule]:
    """WireGuard UDP on the gateway's listen port of each tunnel, from that tunnel's peer
    gateway only: its private address over a native peering, else its public IP once
    deployed (or the address the stack gives it)."""
    out = []
    for t in ctx.plan.tunnels_of(region.name):
        end = t.side(region.name)
        peer = ctx.plan.region(end.peer).gateway
        ip = end.peer_underlay or ctx.addresses.get(peer.name) or peer.address
        cidr = pulumi.Output.concat(ip, "/32")
        out.append(Rule(f"wg-{end.peer}", "udp", (end.port, end.port), (cidr,), True))
    return out


def cloud_init(region: PlanRegion, boot: pulumi.Output[Boot] | None = None) -> pulumi.Output[str]:
    """cloud-init user data: the ssh login user with passwordless sudo (the agent runs
    `sudo -n`); with `boot`, the node's SSH host key (the only one sshd offers) and its
    data disk mounted at the checkpoint root; and, as cloud-init's last step, the
    operator's public key: until then the ssh backend's connections fail and are retried,
    so the agent never starts on a host that is still being set up, or whose disk or host
    key did not come up (the steps after the driver run under `set -e`). On Alibaba's
    plain Ubuntu image it first installs the NVIDIA server driver and the fabric manager
    (8-GPU HGX boards need it) from Ubuntu."""
    ssh = region.pool.ssh
    key = secret(ssh.private_key_config)
    home = "/root" if ssh.user == "root" else f"/home/{ssh.user}"
    user = shlex.quote(ssh.user)  # a POSIX name (the schema's pattern); quoted all the same
    cfg: dict[str, Any] = {
        "users": [
            "default",
            {"name": ssh.user, "shell": "/bin/bash", "sudo": "ALL=(ALL) NOPASSWD:ALL"},
        ]
    }
    first: list[str] = []
    if region.kind == "alicloud" and region.pool.cloud.image is None:
        b = NVIDIA_DRIVER_BRANCH
        cfg["packages"] = [f"nvidia-driver-{b}-server", f"nvidia-fabricmanager-{b}"]
        first = [
            "modprobe -r nouveau || true",
            "modprobe nvidia",
            "systemctl enable --now nvidia-fabricmanager",
        ]

    def render(pub: str | None, node: Boot | None) -> str:
        body = dict(cfg)
        steps: list[str] = []
        if node is not None:
            k = node.host_key
            # cloud-init's ssh module installs the key before sshd first starts, and makes
            # no other; runcmd installs it again, late, should anything (GCP's guest
            # agent) have made new host keys on first boot
            body.update(
                ssh_deletekeys=True,
                ssh_genkeytypes=[],
                ssh_keys={"ed25519_private": k.private, "ed25519_public": k.public},
            )
            steps = ["set -e", *host_key_script(k), *mount_script(node.disk)]
        last = (
            [
                f"install -d -m 0700 -o {user} -g {user} {home}/.ssh",
                f"echo {shlex.quote(pub)} > {home}/.ssh/authorized_keys",
                f"chown {user}:{user} {home}/.ssh/authorized_keys",
                f"chmod 0600 {home}/.ssh/authorized_keys",
            ]
            if pub
            else []
        )
        runcmd = first + steps + last
        if runcmd:
            body["runcmd"] = runcmd
        return "#cloud-config\n" + json.dumps(body, indent=1) + "\n"

    if boot is None:
        if key is None:
            return pulumi.Output.from_input(render(None, None))  # targets.py warns: set it
        return key.apply(lambda k: render(public_key(k), None))
    if key is None:
        return boot.apply(lambda b: render(None, b))
    return pulumi.Output.all(key, boot).apply(lambda v: render(public_key(v[0]), v[1]))


SSH_DIR = "/etc/ssh"


def host_key_script(k: HostKey) -> list[str]:
    """Shell lines that make `k` sshd's only host key and have a running sshd reload it."""
    priv, pub = f"{SSH_DIR}/ssh_host_ed25519_key", f"{SSH_DIR}/ssh_host_ed25519_key.pub"
    others = " ".join(
        f"{SSH_DIR}/ssh_host_{t}_key {SSH_DIR}/ssh_host_{t}_key.pub"
        for t in ("rsa", "ecdsa", "dsa")
    )
    return [
        f"(umask 077 && printf '%s\\n' {shlex.quote(k.private.strip())} > {priv})",
        f"printf '%s\\n' {shlex.quote(k.public)} > {pub}",
        f"rm -f {others}",
        # Ubuntu 24.04 starts sshd per connection (ssh.socket): the next one reads the key;
        # a running sshd reloads; try-: never starts one beside the socket
        'for u in ssh sshd; do systemctl try-reload-or-restart "$u.service" 2>/dev/null'
        " || true; done",
    ]


DATA_LABEL = "geotrain-data"
"""Filesystem label of a data disk geotrain formatted."""
DISK_WAIT = (180, 5)
"""Tries and seconds between them while cloud-init waits for the data disk (15 minutes):
on AWS and Alibaba the attachment is made only once the instance runs."""


def mount_script(d: DataDisk) -> list[str]:
    """Shell lines that wait for the data disk, format it only when it holds no filesystem
    or partition table at all (a disk kept from a replaced instance keeps its checkpoints),
    and mount it at `d.mount` now and at every boot (fstab by UUID, nofail: a missing disk
    never stops the boot). A new filesystem loses its empty lost+found (e2fsck makes it
    again when it needs it): the host agent re-owns a checkpoint root it did not make only
    while it is empty."""
    if d.device.startswith("/dev/"):
        find = f"if [ -b {shlex.quote(d.device)} ]; then echo {shlex.quote(d.device)}; fi"
    else:
        # the device whose serial is a prefix of the expected one (guests may truncate it)
        find = (
            "lsblk -dnpo NAME,SERIAL | awk -v s="
            f"{shlex.quote(d.device)}"
            " 'length($2) >= 8 && index(s, $2) == 1 {print $1; exit}'"
        )
    tries, pause = DISK_WAIT
    m = shlex.quote(d.mount)
    return [
        f'dev=""; i=0; while [ -z "$dev" ] && [ $i -lt {tries} ]; do '
        f'dev=$({find} || true); [ -n "$dev" ] || sleep {pause}; i=$((i+1)); done',
        f'[ -n "$dev" ] || {{ echo "geotrain: data disk {d.device} not attached" >&2; exit 1; }}',
        f'fresh=""; blkid -p "$dev" >/dev/null 2>&1 || {{ mkfs.ext4 -q -L {DATA_LABEL} "$dev"; '
        "fresh=1; }",
        'uuid=$(blkid -s UUID -o value "$dev")',
        f"mkdir -p {m}",
        f'grep -q "^UUID=$uuid " /etc/fstab'
        f' || echo "UUID=$uuid {m} ext4 defaults,nofail 0 2" >> /etc/fstab',
        f"mountpoint -q {m} || mount {m}",
        # a new filesystem's only entry: the agent takes over an empty checkpoint root only
        f'if [ -n "$fresh" ]; then rmdir {m}/lost+found; fi',
    ]


def public_key(private_pem: str) -> str:
    """The OpenSSH public key of an OpenSSH or PEM private key."""
    from cryptography.hazmat.primitives import serialization

    data = private_pem.encode()
    loader = (
        serialization.load_ssh_private_key
        if b"OPENSSH PRIVATE KEY" in data
        else serialization.load_pem_private_key
    )
    k = loader(data, password=None)
    pub = k.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return pub.decode() + " geotrain"
