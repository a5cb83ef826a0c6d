"""`alicloud`: Alibaba Cloud ECS GPU instances in a VPC per region, through pulumi-alicloud
and one alicloud.Provider per region (infra/backends/cloud.py does the rest).

Per region: a VPC and a vSwitch, both the region subnet, in a zone that has the instance
type (asked of Alibaba at deploy time unless the stack names one); route entries that send
the other regions' subnets to the gateway instance; two security groups, `nodes` (SSH from
admin_cidrs, the overlay) and `gateway` (WireGuard from the peers, added by overlay()), whose
outbound default stays open; a low-latency deployment set; an EIP for the gateway (public
bandwidth is capped per EIP: see README); the instances, pay-as-you-go or spot, each with
an ESSD data disk for its checkpoints (found by the guest through its serial, the disk id
without `d-`).

The zone asked of Alibaba and the image matched by a name pattern are fixed in the
vSwitch, the disks and the instances when those are made (cloud.pinned): new stock or a
newer image replaces nothing.
"""

from __future__ import annotations

import pulumi
import pulumi_alicloud as alicloud

from infra.backends.base import Parent
from infra.backends.cloud import Built, CloudBackend, RegionArgs, Rule, base_rules, pinned
from infra.plan import PlanNode

EIP_MBPS = 200
"""Bandwidth of the gateway's EIP: the most a pay-by-traffic EIP allows."""
WORKER_MBPS = 100
"""Public bandwidth of a worker (packages, SSH from the operator)."""


class AlicloudApi:
    def build(self, args: RegionArgs, component: pulumi.ComponentResource) -> Built:
        n = args.name
        provider = alicloud.Provider(
            f"{n}-alicloud",
            region=args.cloud_region,
            opts=pulumi.ResourceOptions(parent=component),
        )
        b = Built(args, component, provider, {})
        vpc = alicloud.vpc.Network(
            f"{n}-vpc", cidr_block=args.region.subnet, tags=args.tags, opts=b.opts()
        )
        vswitch = alicloud.vpc.Switch(
            f"{n}-vswitch",
            vpc_id=vpc.id,
            cidr_block=args.region.subnet,
            zone_id=_zone(args, b),
            tags=args.tags,
            # a zone Alibaba was asked for stays the vSwitch's (moving it replaces every node)
            opts=b.opts(ignore_changes=pinned(_zone_pin(args))),
        )
        groups = {
            role: alicloud.ecs.SecurityGroup(
                f"{n}-{role}",
                vpc_id=vpc.id,
                description=f"geotrain {args.plan.stack} {args.region.name} {role}",
                tags=args.tags,
                opts=b.opts(),
            )
            for role in ("nodes", "gateway")
        }
        b.handles.update(groups=groups, vpc=vpc)
        for rule in base_rules(args):
            _ingress(b, rule)
        placement = (
            alicloud.ecs.EcsDeploymentSet(
                f"{n}-placement",
                strategy="LowLatency",  # close together, like a cluster placement group
                description=f"geotrain {args.plan.stack} {args.region.name}",
                opts=b.opts(),
            )
            if args.settings.placement
            else None
        )
        image = _image(args, b)
        for node in args.region.nodes:
            _instance(b, node, vswitch, image, placement)
        gw = b.instances[args.region.gateway.name]
        for peer in args.peer_subnets():
            alicloud.vpc.RouteEntry(
                f"{n}-route-{peer.replace('/', '_')}",
                route_table_id=vpc.route_table_id,
                destination_cidrblock=peer,
                nexthop_type="Instance",
                nexthop_id=gw.id,
                opts=b.opts(),
            )
        return b

    def admit(self, built: Built, rules: list[Rule]) -> list[pulumi.Resource]:
        return [r for rule in rules for r in _ingress(built, rule)]

    def peer(self, a: Built, b: Built, parent: Parent) -> list[pulumi.Resource]:
        name = f"{parent.name}-peering-{a.args.region.name}-{b.args.region.name}"
        conn = alicloud.vpc.PeerConnection(
            name,
            vpc_id=a.handles["vpc"].id,
            accepting_region_id=b.args.cloud_region,
            accepting_vpc_id=b.handles["vpc"].id,
            tags=a.args.tags,
            opts=pulumi.ResourceOptions(parent=parent.resource, provider=a.provider),
        )
        accept = alicloud.vpc.PeerConnectionAccepter(
            f"{name}-accept",
            instance_id=conn.id,
            opts=pulumi.ResourceOptions(parent=parent.resource, provider=b.provider),
        )
        # each side reaches the other's gateway (the tunnel's underlay) through the peering;
        # a /32, so the overlay's routes to the peer's subnet (via the gateway) stay
        routes = [
            alicloud.vpc.RouteEntry(
                f"{name}-route-{x.args.region.name}",
                route_table_id=x.handles["vpc"].route_table_id,
                destination_cidrblock=f"{y.args.region.gateway.private_ip}/32",
                nexthop_type="VpcPeer",
                nexthop_id=conn.id,
                opts=pulumi.ResourceOptions(
                    parent=parent.resource, provider=x.provider, depends_on=[accept]
                ),
            )
            for x, y in ((a, b), (b, a))
        ]
        return [conn, accept, *routes]


def _ingress(b: Built, rule: Rule) -> list[pulumi.Resource]:
    group = b.handles["groups"]["gateway" if rule.gateway_only else "nodes"]
    ports = f"{rule.ports[0]}/{rule.ports[1]}" if rule.ports else "-1/-1"
    return [
        alicloud.ecs.SecurityGroupRule(
            f"{b.args.name}-{rule.role}-{i}",
            type="ingress",
            ip_protocol=rule.protocol,
            port_range=ports,
            cidr_ip=src,
            security_group_id=group.id,
            nic_type="intranet",  # VPC security groups take only intranet
            policy="accept",
            priority=1,
            description=f"geotrain {rule.role}",
            opts=b.opts(),
        )
        for i, src in enumerate(rule.sources)
    ]


def _zone_pin(args: RegionArgs) -> str | None:
    """The vSwitch's and disks' zone input when Alibaba picks it, else None (the stack's)."""
    return None if args.settings.zone else "zoneId"


def _zone(args: RegionArgs, b: Built) -> pulumi.Input[str]:
    """The configured zone, else the first zone Alibaba says can host every instance type
    of the region in a vSwitch (asked at deploy time: stock changes)."""
    if args.settings.zone:
        return args.settings.zone
    types = sorted({args.instance_type(n) for n in args.region.nodes})
    opts = pulumi.InvokeOutputOptions(provider=b.provider, parent=b.component)
    per_type = [
        alicloud.get_zones_output(
            available_instance_type=t, available_resource_creation="VSwitch", opts=opts
        ).ids
        for t in types
    ]

    def pick(ids: list[list[str]]) -> str:
        common = sorted(set(ids[0]).intersection(*ids[1:]))
        if not common:
            raise ValueError(f"no zone of {args.cloud_region} has {', '.join(types)} now")
        return common[0]

    return pulumi.Output.all(*per_type).apply(pick)


def _image(args: RegionArgs, b: Built) -> pulumi.Input[str]:
    """An image id, or the newest system image whose name matches a pattern (^...)."""
    image = args.settings.image or args.cloud.image.ref
    if not image.startswith("^"):
        return image
    return alicloud.ecs.get_images_output(
        name_regex=image,
        owners="system",
        most_recent=True,
        opts=pulumi.InvokeOutputOptions(provider=b.provider, parent=b.component),
    ).ids.apply(lambda ids: ids[0])


def _instance(
    b: Built,
    node: PlanNode,
    vswitch: alicloud.vpc.Switch,
    image: pulumi.Input[str],
    placement: alicloud.ecs.EcsDeploymentSet | None,
) -> None:
    args, s, gw = b.args, b.args.settings, node.is_gateway
    groups = b.handles["groups"]
    disk = alicloud.ecs.EcsDisk(
        f"{args.name}-{node.name}-data",
        zone_id=vswitch.zone_id,  # the vSwitch's, as made
        size=s.data_disk_gb,
        category="cloud_essd",
        delete_with_instance=False,
        tags=args.tags,
        # the checkpoints outlive the instance, and `pulumi destroy` unless
        # training.checkpoint.keep_on_destroy is false
        opts=b.opts(retain_on_delete=args.keep_disks, ignore_changes=pinned(_zone_pin(args))),
    )
    ref = s.image or args.cloud.image.ref
    inst = alicloud.ecs.Instance(
        f"{args.name}-{node.name}",
        instance_type=args.instance_type(node),
        image_id=image,
        vswitch_id=vswitch.id,
        private_ip=node.private_ip,  # the plan's address
        security_groups=[groups["nodes"].id, *([groups["gateway"].id] if gw else [])],
        system_disk_category="cloud_essd",
        system_disk_size=s.disk_gb,
        # the gateway's public address is its EIP; workers get one with the instance
        internet_max_bandwidth_out=0 if gw else WORKER_MBPS,
        internet_charge_type="PayByTraffic",
        instance_charge_type="PostPaid",
        spot_strategy="SpotAsPriceGo" if s.spot else "NoSpot",
        deployment_set_id=placement.id if placement else None,
        host_name=node.name,
        # the guest finds the disk by its serial: the disk id without `d-`
        user_data=args.user_data(node, disk.id.apply(lambda d: d.removeprefix("d-"))),
        tags=args.tags,
        volume_tags=args.tags,
        opts=b.opts(
            # the replacement takes the plan's private IP and the data disk, which the
            # old instance holds until it is gone
            delete_before_replace=True,
            # an image matched by a pattern stays the one the instance was made with
            ignore_changes=pinned("imageId" if args.image_pinned(ref) else None),
        ),
    )
    b.instances[node.name] = inst
    alicloud.ecs.EcsDiskAttachment(
        f"{args.name}-{node.name}-data-attachment",
        disk_id=disk.id,
        instance_id=inst.id,
        delete_with_instance=False,
        # a disk attaches to one instance at a time
        opts=b.opts(delete_before_replace=True),
    )
    if gw:
        eip = alicloud.ecs.EipAddress(
            f"{args.name}-{node.name}-ip",
            bandwidth=str(EIP_MBPS),
            internet_charge_type="PayByTraffic",
            payment_type="PayAsYouGo",
            tags=args.tags,
            opts=b.opts(),
        )
        alicloud.ecs.EipAssociation(
            f"{args.name}-{node.name}-ip-association",
            allocation_id=eip.id,
            instance_id=inst.id,
            opts=b.opts(),
        )
        b.public_ips[node.name] = eip.ip_address
    else:
        b.public_ips[node.name] = inst.public_ip


def backend() -> CloudBackend:
    return CloudBackend("alicloud", AlicloudApi())
