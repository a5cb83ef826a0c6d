"""`aws`: EC2 GPU instances in a VPC per region, through pulumi-aws and one aws.Provider
per region (infra/backends/cloud.py does the rest).

Per region: a VPC and a subnet, both the region subnet; an internet gateway with the
default route; routes that send the other regions' subnets to the gateway's network
interface (source/destination check off: it forwards them into its tunnels); two security
groups, `nodes` (SSH from admin_cidrs, the overlay) and `gateway` (WireGuard from the
peers, added by overlay()), with explicit rules and one egress rule (AWS's default egress
rule is removed when the group is made through the provider); a cluster placement group;
an elastic IP for the gateway; the instances, each with an EBS data volume for its
checkpoints (attached as /dev/sdf, found by the guest through the volume id in the NVMe
serial).

The AMI read from an SSM parameter and the zone read from the instance type offerings are
fixed in the instances, the subnet and the volumes when those are made (cloud.pinned):
the next AMI release or another offering replaces nothing.
"""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_aws as aws

from infra.backends.base import Parent
from infra.backends.cloud import Built, CloudBackend, RegionArgs, Rule, base_rules, pinned
from infra.plan import PlanNode

EVERYWHERE = "0.0.0.0/0"


class AwsApi:
    def build(self, args: RegionArgs, component: pulumi.ComponentResource) -> Built:
        provider = aws.Provider(
            f"{args.name}-aws",
            region=args.cloud_region,
            opts=pulumi.ResourceOptions(parent=component),
        )
        b = Built(args, component, provider, {})
        n, cidr = args.name, args.region.subnet
        vpc = aws.ec2.Vpc(
            f"{n}-vpc",
            cidr_block=cidr,
            enable_dns_hostnames=True,
            tags=_tags(args, "vpc"),
            opts=b.opts(),
        )
        subnet = aws.ec2.Subnet(
            f"{n}-subnet",
            vpc_id=vpc.id,
            cidr_block=cidr,
            availability_zone=_zone(args, b),
            map_public_ip_on_launch=False,  # only nodes that need one get a public IP
            tags=_tags(args, "subnet"),
            # a zone AWS was asked for stays the subnet's (moving it replaces every node)
            opts=b.opts(ignore_changes=pinned(_zone_pin(args))),
        )
        igw = aws.ec2.InternetGateway(
            f"{n}-igw", vpc_id=vpc.id, tags=_tags(args, "igw"), opts=b.opts()
        )
        table = aws.ec2.RouteTable(
            f"{n}-routes", vpc_id=vpc.id, tags=_tags(args, "routes"), opts=b.opts()
        )
        aws.ec2.RouteTableAssociation(
            f"{n}-routes-subnet", subnet_id=subnet.id, route_table_id=table.id, opts=b.opts()
        )
        internet = aws.ec2.Route(
            f"{n}-route-internet",
            route_table_id=table.id,
            destination_cidr_block=EVERYWHERE,
            gateway_id=igw.id,
            opts=b.opts(),
        )
        groups = {
            role: aws.ec2.SecurityGroup(
                f"{n}-{role}",
                vpc_id=vpc.id,
                description=f"geotrain {args.plan.stack} {args.region.name} {role}",
                tags=_tags(args, role),
                opts=b.opts(),
            )
            for role in ("nodes", "gateway")
        }
        b.handles.update(groups=groups, table=table, vpc=vpc)
        for rule in base_rules(args):
            _ingress(b, rule)
        aws.vpc.SecurityGroupEgressRule(
            f"{n}-egress",
            security_group_id=groups["nodes"].id,
            ip_protocol="-1",
            cidr_ipv4=EVERYWHERE,  # packages, the peers' WireGuard ports
            tags=_tags(args, "egress"),
            opts=b.opts(),
        )
        placement = (
            aws.ec2.PlacementGroup(
                f"{n}-placement",
                strategy="cluster",
                tags=_tags(args, "placement"),
                opts=b.opts(),
            )
            if args.settings.placement
            else None
        )
        ami = _ami(args, b)
        for node in args.region.nodes:
            _instance(b, node, subnet, ami, placement, internet)
        gw = b.instances[args.region.gateway.name]
        for peer in args.peer_subnets():
            aws.ec2.Route(
                f"{n}-route-{peer.replace('/', '_')}",
                route_table_id=table.id,
                destination_cidr_block=peer,
                network_interface_id=gw.primary_network_interface_id,  # type: ignore[attr-defined]
                opts=b.opts(),
            )
        return b

    def admit(self, built: Built, rules: list[Rule]) -> list[pulumi.Resource]:
        return [r for rule in rules for r in _ingress(built, rule)]

    def peer(self, a: Built, b: Built, parent: Parent) -> list[pulumi.Resource]:
        name = f"{parent.name}-peering-{a.args.region.name}-{b.args.region.name}"
        conn = aws.ec2.VpcPeeringConnection(
            name,
            vpc_id=a.handles["vpc"].id,
            peer_vpc_id=b.handles["vpc"].id,
            peer_region=b.args.cloud_region,
            tags=_tags(a.args, "peering"),
            opts=pulumi.ResourceOptions(parent=parent.resource, provider=a.provider),
        )
        accept = aws.ec2.VpcPeeringConnectionAccepter(
            f"{name}-accept",
            vpc_peering_connection_id=conn.id,
            auto_accept=True,
            tags=_tags(b.args, "peering"),
            opts=pulumi.ResourceOptions(parent=parent.resource, provider=b.provider),
        )
        # each side reaches the other's gateway (the tunnel's underlay, plan._underlay)
        # through the peering; a /32, so the overlay's routes to the peer's whole subnet
        # (next hop: this region's gateway) stay as they are
        routes = [
            aws.ec2.Route(
                f"{name}-route-{x.args.region.name}",
                route_table_id=x.handles["table"].id,
                destination_cidr_block=f"{y.args.region.gateway.private_ip}/32",
                vpc_peering_connection_id=conn.id,
                opts=pulumi.ResourceOptions(
                    parent=parent.resource, provider=x.provider, depends_on=[accept]
                ),
            )
            for x, y in ((a, b), (b, a))
        ]
        return [conn, accept, *routes]


def _tags(args: RegionArgs, role: str) -> dict[str, str]:
    return {**args.tags, "Name": f"{args.plan.stack}-{args.region.name}-{role}"}


def _ingress(b: Built, rule: Rule) -> list[pulumi.Resource]:
    group = b.handles["groups"]["gateway" if rule.gateway_only else "nodes"]
    ports: dict[str, Any] = (
        {"from_port": rule.ports[0], "to_port": rule.ports[1]} if rule.ports else {}
    )
    return [
        aws.vpc.SecurityGroupIngressRule(
            f"{b.args.name}-{rule.role}-{i}",
            security_group_id=group.id,
            ip_protocol="-1" if rule.protocol == "all" else rule.protocol,
            cidr_ipv4=src,
            description=f"geotrain {rule.role}",
            tags=_tags(b.args, rule.role),
            opts=b.opts(),
            **ports,
        )
        for i, src in enumerate(rule.sources)
    ]


def _zone_pin(args: RegionArgs) -> str | None:
    """The subnet's and volumes' zone input when AWS picks it, else None (the stack's)."""
    return None if args.settings.zone else "availabilityZone"


def _zone(args: RegionArgs, b: Built) -> pulumi.Input[str]:
    """The configured zone, else the first zone (sorted) that offers every instance type
    of the region, asked of AWS itself at deploy time (zone names differ per account)."""
    if args.settings.zone:
        return args.settings.zone
    types = sorted({args.instance_type(n) for n in args.region.nodes})
    offers = aws.ec2.get_instance_type_offerings_output(
        location_type="availability-zone",
        filters=[{"name": "instance-type", "values": types}],
        region=args.cloud_region,
        opts=pulumi.InvokeOutputOptions(provider=b.provider, parent=b.component),
    )

    def pick(o: Any) -> str:
        have: dict[str, set[str]] = {}
        for zone, t in zip(o.locations, o.instance_types, strict=True):
            have.setdefault(zone, set()).add(t)
        zones = sorted(z for z, ts in have.items() if ts >= set(types))
        if not zones:
            raise ValueError(f"no zone of {args.cloud_region} offers {', '.join(types)}")
        return zones[0]

    return offers.apply(pick)


def _ami(args: RegionArgs, b: Built) -> pulumi.Input[str]:
    """An AMI id, or the value of a public SSM parameter (ssm:<name>) read in the region."""
    image = args.settings.image or args.cloud.image.ref
    if not image.startswith("ssm:"):
        return image
    return aws.ssm.get_parameter_output(
        name=image.removeprefix("ssm:"),
        region=args.cloud_region,
        opts=pulumi.InvokeOutputOptions(provider=b.provider, parent=b.component),
    ).value


def _instance(
    b: Built,
    node: PlanNode,
    subnet: aws.ec2.Subnet,
    ami: pulumi.Input[str],
    placement: aws.ec2.PlacementGroup | None,
    internet: pulumi.Resource,
) -> None:
    args, s, gw = b.args, b.args.settings, node.is_gateway
    groups = b.handles["groups"]
    disk = aws.ebs.Volume(
        f"{args.name}-{node.name}-data",
        availability_zone=subnet.availability_zone,  # the subnet's, as made
        size=s.data_disk_gb,
        type="gp3",
        encrypted=True,
        tags=_tags(args, f"{node.name}-data"),
        # the checkpoints outlive the instance, and `pulumi destroy` unless
        # training.checkpoint.keep_on_destroy is false
        opts=b.opts(retain_on_delete=args.keep_disks, ignore_changes=pinned(_zone_pin(args))),
    )
    spot = (
        aws.ec2.InstanceInstanceMarketOptionsArgs(
            market_type="spot",
            # a reclaimed node stops (keeps its disk and private IP) and starts again when
            # capacity returns: its region rejoins the quorum and heals
            spot_options=aws.ec2.InstanceInstanceMarketOptionsSpotOptionsArgs(
                instance_interruption_behavior="stop", spot_instance_type="persistent"
            ),
        )
        if s.spot
        else None
    )
    inst = aws.ec2.Instance(
        f"{args.name}-{node.name}",
        ami=ami,
        instance_type=args.instance_type(node),
        subnet_id=subnet.id,
        private_ip=node.private_ip,  # the plan's address: the agent finds it already there
        vpc_security_group_ids=[groups["nodes"].id, *([groups["gateway"].id] if gw else [])],
        associate_public_ip_address=not gw,  # the gateway gets an elastic IP below
        source_dest_check=not gw,  # the gateway forwards other regions' traffic
        placement_group=placement.id if placement else None,
        root_block_device=aws.ec2.InstanceRootBlockDeviceArgs(
            volume_size=s.disk_gb,
            volume_type="gp3",
            encrypted=True,
            delete_on_termination=True,
            # not volume_tags: AWS documents that they fight the data volume's own tags
            tags=_tags(args, f"{node.name}-root"),
        ),
        instance_market_options=spot,
        metadata_options=aws.ec2.InstanceMetadataOptionsArgs(http_tokens="required"),
        # the guest finds the volume by its NVMe serial: the volume id without the dash
        user_data=args.user_data(node, disk.id.apply(lambda v: v.replace("-", ""))),
        tags=_tags(args, node.name),
        opts=b.opts(
            internet,  # cloud-init needs the internet route first
            # the replacement takes the plan's private IP and the data volume, which the
            # old instance holds until it is gone
            delete_before_replace=True,
            # an AMI read from SSM stays the one the instance was made with
            ignore_changes=pinned(
                "ami" if args.image_pinned(s.image or args.cloud.image.ref) else None
            ),
        ),
    )
    b.instances[node.name] = inst
    aws.ec2.VolumeAttachment(
        f"{args.name}-{node.name}-data-attachment",
        device_name="/dev/sdf",
        volume_id=disk.id,
        instance_id=inst.id,
        # detach from a stopped instance: never from under a mounted filesystem
        stop_instance_before_detaching=True,
        # a volume attaches to one instance at a time
        opts=b.opts(delete_before_replace=True),
    )
    if gw:
        eip = aws.ec2.Eip(
            f"{args.name}-{node.name}-ip",
            domain="vpc",
            instance=inst.id,
            tags=_tags(args, f"{node.name}-ip"),
            opts=b.opts(),
        )
        b.public_ips[node.name] = eip.public_ip
    else:
        b.public_ips[node.name] = inst.public_ip


def backend() -> CloudBackend:
    return CloudBackend("aws", AwsApi())
