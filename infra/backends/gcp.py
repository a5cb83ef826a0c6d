"""`gcp`: Compute Engine GPU instances in a VPC network per region, through pulumi-gcp and
one gcp.Provider per region (project, region and zone explicit; infra/backends/cloud.py
does the rest).

Per region: a custom-mode network (MTU 1500, so a 1420-byte WireGuard packet plus its 60
bytes of headers fits) and the region subnet; GCP's implied rules deny all ingress and the
network's default route reaches the internet; one firewall per rule, aimed by network tags
(`gt-<region>-node`, `-gateway`, `-worker`); routes that send the other regions' subnets
from the workers to the gateway (IP forwarding on); a compact placement policy; a static
external address for the gateway; the instances (A2/A3 machine types carry their GPUs;
GPU instances stop for host maintenance; gVNIC where the machine type requires it, A3),
each with a persistent disk for its checkpoints (device name `geotrain-data`).

An image family is resolved here (compute.getImage) and that image, like the zone taken
from geotrain's table, is fixed in each instance and disk when it is made (cloud.pinned):
a new image in the family, or another table, replaces nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_gcp as gcp

from infra.backends.base import Parent
from infra.backends.cloud import Built, CloudBackend, RegionArgs, Rule, base_rules, pinned
from infra.plan import PlanNode

MTU = 1500
"""The network's MTU (GCP's default is 1460, too small for WireGuard's 1420 + 60)."""
DATA_DEVICE = "geotrain-data"
"""Device name of the data disk: the guest sees it as /dev/disk/by-id/google-<name>."""


class GcpApi:
    def build(self, args: RegionArgs, component: pulumi.ComponentResource) -> Built:
        s, n = args.settings, args.name
        zone = args.default_zone(args.region.gateway)
        provider = gcp.Provider(
            f"{n}-gcp",
            project=s.project,
            region=args.cloud_region,
            zone=zone,
            opts=pulumi.ResourceOptions(parent=component),
        )
        b = Built(args, component, provider, {})
        network = gcp.compute.Network(
            f"{n}-net",
            auto_create_subnetworks=False,
            routing_mode="REGIONAL",
            mtu=MTU,
            description=f"geotrain {args.plan.stack} {args.region.name}",
            opts=b.opts(),
        )
        subnet = gcp.compute.Subnetwork(
            f"{n}-subnet",
            network=network.id,
            ip_cidr_range=args.region.subnet,
            region=args.cloud_region,
            opts=b.opts(),
        )
        b.handles.update(network=network)
        for rule in base_rules(args):
            _firewall(b, rule)
        policy = (
            gcp.compute.ResourcePolicy(
                f"{n}-placement",
                region=args.cloud_region,
                group_placement_policy=gcp.compute.ResourcePolicyGroupPlacementPolicyArgs(
                    collocation="COLLOCATED"
                ),
                opts=b.opts(),
            )
            if s.placement
            else None
        )
        image = _image(args, b)
        for node in args.region.nodes:
            _instance(b, node, subnet, policy, image)
        gw = b.instances[args.region.gateway.name]
        for peer in args.peer_subnets():
            gcp.compute.Route(
                f"{n}-route-{peer.replace('/', '-').replace('.', '-')}",
                network=network.id,
                dest_range=peer,
                next_hop_instance=gw.id,
                priority=900,
                tags=[tag(args, "worker")],  # not the gateway: it routes them into tunnels
                opts=b.opts(),
            )
        return b

    def admit(self, built: Built, rules: list[Rule]) -> list[pulumi.Resource]:
        return [_firewall(built, rule) for rule in rules]

    def peer(self, a: Built, b: Built, parent: Parent) -> list[pulumi.Resource]:
        return []  # the model checks refuse peering on GCP (checks/clouds.py: _peering)


def tag(args: RegionArgs, role: str) -> str:
    return f"gt-{args.region.name}-{role}"


def labels(args: RegionArgs) -> dict[str, str]:
    """GCP label values are lowercase (the model checks refuse tags that cannot be labels)."""
    return {k: v.lower() for k, v in args.tags.items()}


def _firewall(b: Built, rule: Rule) -> gcp.compute.Firewall:
    allow = gcp.compute.FirewallAllowArgs(
        protocol=rule.protocol,
        ports=[
            f"{rule.ports[0]}-{rule.ports[1]}"
            if rule.ports[0] != rule.ports[1]
            else str(rule.ports[0])
        ]
        if rule.ports
        else None,
    )
    return gcp.compute.Firewall(
        f"{b.args.name}-{rule.role}",
        network=b.handles["network"].id,
        direction="INGRESS",
        source_ranges=list(rule.sources),
        allows=[allow],
        target_tags=[tag(b.args, "gateway" if rule.gateway_only else "node")],
        description=f"geotrain {rule.role}",
        opts=b.opts(),
    )


def _image(args: RegionArgs, b: Built) -> pulumi.Input[str]:
    """An image path as given, or the image a family path names now (its self link)."""
    ref = args.settings.image or args.cloud.image.ref
    if "/family/" not in ref and not ref.startswith("family/"):
        return ref
    head, family = ref.split("family/", 1)
    project = head.split("/")[1] if head.startswith("projects/") else None
    return gcp.compute.get_image_output(
        family=family,
        project=project,
        opts=pulumi.InvokeOutputOptions(provider=b.provider, parent=b.component),
    ).self_link


def _instance(
    b: Built,
    node: PlanNode,
    subnet: gcp.compute.Subnetwork,
    policy: gcp.compute.ResourcePolicy | None,
    image: pulumi.Input[str],
) -> None:
    args, s, gw = b.args, b.args.settings, node.is_gateway
    zone = args.default_zone(node)
    # a zone from geotrain's table (not the stack's) stays where the node was made
    zone_pin = None if s.zone else "zone"
    disk = gcp.compute.Disk(
        f"{args.name}-{node.name}-data",
        zone=zone,
        size=s.data_disk_gb,
        type="pd-balanced",
        labels=labels(args),
        # the checkpoints outlive the instance, and `pulumi destroy` unless
        # training.checkpoint.keep_on_destroy is false
        opts=b.opts(retain_on_delete=args.keep_disks, ignore_changes=pinned(zone_pin)),
    )
    nic = args.cloud.instance(node.gpu_type, node.gpus)
    static = (
        gcp.compute.Address(
            f"{args.name}-{node.name}-ip",
            region=args.cloud_region,
            address_type="EXTERNAL",
            labels=labels(args),
            opts=b.opts(),
        )
        if gw
        else None
    )
    inst = gcp.compute.Instance(
        f"{args.name}-{node.name}",
        machine_type=args.instance_type(node),
        zone=zone,
        boot_disk=gcp.compute.InstanceBootDiskArgs(
            auto_delete=True,
            initialize_params=gcp.compute.InstanceBootDiskInitializeParamsArgs(
                image=image, size=s.disk_gb, type="pd-balanced"
            ),
        ),
        # a disk of its own: deleting the instance detaches it, never deletes it
        attached_disks=[
            gcp.compute.InstanceAttachedDiskArgs(
                source=disk.self_link, device_name=DATA_DEVICE, mode="READ_WRITE"
            )
        ],
        network_interfaces=[
            gcp.compute.InstanceNetworkInterfaceArgs(
                subnetwork=subnet.id,
                network_ip=node.private_ip,  # the plan's address
                nic_type=nic.nic_type if nic else None,  # GVNIC: A3 starts with no other
                access_configs=[
                    gcp.compute.InstanceNetworkInterfaceAccessConfigArgs(
                        nat_ip=static.address if static else None  # workers: ephemeral
                    )
                ],
            )
        ],
        can_ip_forward=gw,  # the gateway forwards other regions' traffic
        scheduling=gcp.compute.InstanceSchedulingArgs(
            on_host_maintenance="TERMINATE",  # GPU instances cannot live-migrate
            automatic_restart=not s.spot,
            preemptible=s.spot,
            provisioning_model="SPOT" if s.spot else "STANDARD",
            instance_termination_action="STOP" if s.spot else None,
        ),
        resource_policies=policy.self_link if policy else None,
        metadata={
            "user-data": args.user_data(node, f"/dev/disk/by-id/google-{DATA_DEVICE}"),
            "enable-oslogin": "FALSE",
            # only cloud-init's key logs in: no project-wide keys from the guest agent
            "block-project-ssh-keys": "TRUE",
        },
        labels=labels(args),
        tags=[tag(args, "node"), tag(args, "gateway" if gw else "worker")],
        allow_stopping_for_update=True,
        opts=b.opts(
            # the replacement takes the plan's private IP and the data disk, which the
            # old instance holds until it is gone
            delete_before_replace=True,
            ignore_changes=pinned(
                zone_pin,
                "bootDisk.initializeParams.image"
                if args.image_pinned(s.image or args.cloud.image.ref)
                else None,
            ),
        ),
    )
    b.instances[node.name] = inst
    b.public_ips[node.name] = static.address if static else inst.network_interfaces.apply(_nat_ip)


def _nat_ip(nics: Sequence[gcp.compute.outputs.InstanceNetworkInterface]) -> str:
    """A worker's ephemeral external address, from its first interface's access config."""
    configs = nics[0].access_configs or []
    return str(configs[0].nat_ip) if configs else ""


def backend() -> CloudBackend:
    return CloudBackend("gcp", GcpApi())
