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
- cloud-init makes the ssh login user and, last, authorizes the operator's public key
  (derived from the secret geotrain:sshPrivateKey, which never leaves the Pulumi secret).

Each node's public IP goes into `ctx.addresses`: the ssh backend connects there and passes
it to every agent, which fills it into the `<address of NODE>` placeholders the renderers
wrote (WireGuard endpoints, firewall peers).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import pulumi

from infra.backends.base import BackendContext, Parent
from infra.backends.ssh import SshBackend
from infra.facts import tags as plan_tags
from infra.model.clouds import CLOUDS, NVIDIA_DRIVER_BRANCH, Cloud
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
    user_data: pulumi.Output[str]
    """cloud-init for every node."""

    @property
    def cloud_region(self) -> str:
        return str(self.settings.region)

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

    def opts(self, *after: pulumi.Resource) -> pulumi.ResourceOptions:
        # every cloud resource names its region's provider: the ambient default provider
        # (credentials and region from the environment) is never used
        return pulumi.ResourceOptions(
            parent=self.component, provider=self.provider, depends_on=list(after) or None
        )


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
        args = region_args(ctx.plan, region, parent.name)
        built = self.api.build(args, comp)
        _built(ctx)[region.name] = built
        ctx.addresses.update(built.public_ips)
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


def region_args(plan: Plan, region: PlanRegion, name: str) -> RegionArgs:
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
        user_data=cloud_init(region),
    )


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


def cloud_init(region: PlanRegion) -> pulumi.Output[str]:
    """cloud-init user data: the ssh login user with passwordless sudo (the agent runs
    `sudo -n`) and, as cloud-init's last step, the operator's public key: until then the
    ssh backend's connections fail and are retried, so the agent never starts on a host
    that is still being set up. On Alibaba's plain Ubuntu image it first installs the
    NVIDIA server driver and the fabric manager (8-GPU HGX boards need it) from Ubuntu."""
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

    def render(pub: str | None) -> str:
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
        body = {**cfg, "runcmd": first + last} if first or last else cfg
        return "#cloud-config\n" + json.dumps(body, indent=1) + "\n"

    if key is None:
        return pulumi.Output.from_input(render(None))  # targets.py warns: set the key
    return key.apply(lambda k: render(public_key(k)))


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
