"""Cloud pools (aws, gcp, alicloud) under Pulumi mocks: what stacks/Pulumi.global-cloud.yaml
makes per region, with the providers' real type tokens and the mocks' provider-like
outputs; the instances as ssh hosts of the same agent; the firewalls; broken inputs; the
policies on whole stack variants. No cloud account is involved: nothing here proves that a
cloud accepts these resources (see README, "From an empty cloud account to a training run")."""

from __future__ import annotations

import importlib
import inspect
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from geotrain.cli import cli
from infra import outputs
from infra.backends.cloud import cloud_init, public_key
from infra.mocks import Recording, Registered, run_under_mocks
from infra.model import load_stack
from infra.model.clouds import CLOUDS, taggable_types
from infra.model.load import validate
from infra.plan import build_plan
from infra.render.host import ROLES, render_host
from policies.rules import ingress_rules, is_internet

# the cloud SDKs import their deprecated modules with the package
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning:pulumi_aws",
    "ignore::DeprecationWarning:pulumi_gcp",
    "ignore::DeprecationWarning:pulumi_alicloud",
)
STACK = "global-cloud"
REGIONS = {"beijing": "alicloud", "frankfurt": "gcp", "silicon-valley": "aws"}
PREFIX = {"beijing": "bj", "frankfurt": "fra", "silicon-valley": "sv"}
INSTANCE = {
    "alicloud": "alicloud:ecs/instance:Instance",
    "gcp": "gcp:compute/instance:Instance",
    "aws": "aws:ec2/instance:Instance",
}
NETWORK = {
    "alicloud": ["alicloud:vpc/network:Network", "alicloud:vpc/switch:Switch"],
    "gcp": ["gcp:compute/network:Network", "gcp:compute/subnetwork:Subnetwork"],
    "aws": ["aws:ec2/vpc:Vpc", "aws:ec2/subnet:Subnet", "aws:ec2/internetGateway:InternetGateway"],
}
FIREWALL = {
    "alicloud": "alicloud:ecs/securityGroupRule:SecurityGroupRule",
    "gcp": "gcp:compute/firewall:Firewall",
    "aws": "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
}
STATIC_IP = {
    "alicloud": ("alicloud:ecs/eipAddress:EipAddress", "ipAddress"),
    "gcp": ("gcp:compute/address:Address", "address"),
    "aws": ("aws:ec2/eip:Eip", "publicIp"),
}


@pytest.fixture(scope="module")
def rec() -> Recording:
    return run_under_mocks(load_stack(STACK))


def _in_region(rec: Recording, region: str) -> list[Registered]:
    """Resources under the region's CloudRegion component."""
    [comp] = [r for r in rec.resources if r.name == f"{region}-pool-cloud"]
    return [r for r in rec.resources if r.parent == comp.urn]


def _is_cloud(r: Registered) -> bool:
    return r.type.split(":", 1)[0] in CLOUDS


# -- what the program makes ---------------------------------------------------------------
def test_global_cloud_makes_a_network_firewall_and_instances_per_region(rec: Recording) -> None:
    for region, kind in REGIONS.items():
        types = Counter(r.type for r in _in_region(rec, region))
        assert types[f"pulumi:providers:{kind}"] == 1, (region, types)
        assert all(types[t] == 1 for t in NETWORK[kind]), (region, types)
        assert types[INSTANCE[kind]] == 2, (region, types)
        # SSH from admin, the overlay, WireGuard from each of the two peers
        assert types[FIREWALL[kind]] == 4, (region, types)
        assert types[STATIC_IP[kind][0]] == 1, (region, types)  # the gateway's


def test_every_cloud_resource_names_its_regions_explicit_provider(rec: Recording) -> None:
    for region, kind in REGIONS.items():
        own = _in_region(rec, region)
        [provider] = [r for r in own if r.type == f"pulumi:providers:{kind}"]
        cloud_region = load_stack(STACK).region(region).pool.cloud.region
        assert provider.inputs["region"] == cloud_region
        for r in own:
            if _is_cloud(r):
                assert r.provider and r.provider.startswith(provider.urn + "::"), r.urn
    # and nothing anywhere fell back to a default provider
    assert not [r for r in rec.resources if "pulumi:providers" in r.type and "default" in r.name]


def test_instances_sit_at_the_plans_private_ips_with_the_tables_types(rec: Recording) -> None:
    plan = build_plan(load_stack(STACK))
    for region, kind in REGIONS.items():
        r = plan.region(region)
        insts = {x.name: x for x in _in_region(rec, region) if x.type == INSTANCE[kind]}
        for n in r.nodes:
            inst = insts[f"{region}-pool-{n.name}"]
            if kind == "gcp":
                ip, itype = (
                    inst.inputs["networkInterfaces"][0]["networkIp"],
                    inst.inputs["machineType"],
                )
            else:
                ip, itype = inst.inputs["privateIp"], inst.inputs["instanceType"]
            assert ip == n.private_ip
            assert itype == CLOUDS[kind].instance(n.gpu_type, n.gpus).name  # type: ignore[union-attr]
        assert r.gateway.private_ip.endswith(".4")  # clouds keep .0-.3 for themselves
        assert all(n.address == "" for n in r.nodes)  # known once deployed


def test_agents_reach_the_public_ips_and_every_agent_gets_every_address(rec: Recording) -> None:
    gateways = {
        region: next(r for r in _in_region(rec, region) if r.type == STATIC_IP[kind][0])
        for region, kind in REGIONS.items()
    }
    agents = {r.name: r for r in rec.resources if r.name.endswith("-agent")}
    assert len(agents) == 6
    expected = {
        "bj-0": gateways["beijing"].inputs["ipAddress"],
        "fra-0": gateways["frankfurt"].inputs["address"],
        "sv-0": gateways["silicon-valley"].inputs["publicIp"],
    }
    for a in agents.values():
        addresses = json.loads(a.inputs["stdin"])["addresses"]
        assert sorted(addresses) == ["bj-0", "bj-1", "fra-0", "fra-1", "sv-0", "sv-1"]
        assert {k: addresses[k] for k in expected} == expected
        node = a.name.removeprefix("training-").removesuffix("-agent")
        assert a.inputs["connection"]["host"] == addresses[node]
    copies = rec.by_type("command:remote:CopyToRemote")
    assert {c.inputs["connection"]["host"] for c in copies} == set(addresses.values())
    # and the stack outputs them, with the private addresses, for the operator
    hosts = rec.outputs[outputs.HOSTS]
    assert {n: h["public_ip"] for n, h in hosts.items()} == addresses
    assert hosts["fra-1"]["region"] == "frankfurt"
    assert hosts["fra-1"]["private_ip"] == build_plan(load_stack(STACK)).node("fra-1").private_ip
    # one run key for the stack, though three backends deliver
    seeds = rec.by_type("random:index/randomBytes:RandomBytes")
    assert len([r for r in seeds if r.name.endswith("-run-key")]) == 1
    # the rest: one host key seed per cloud node
    assert sorted(r.name for r in seeds if not r.name.endswith("-run-key")) == sorted(
        f"{region}-pool-{n}-host-key"
        for region, n in [(r, f"{p}-{i}") for r, p in PREFIX.items() for i in (0, 1)]
    )


def test_firewalls_admit_wireguard_only_from_peer_gateways_and_ssh_only_from_admin(
    rec: Recording,
) -> None:
    plan = build_plan(load_stack(STACK))
    agents = [r for r in rec.resources if r.name.endswith("-agent")]
    addresses = json.loads(agents[0].inputs["stdin"])["addresses"]
    [admin] = [str(c) for c in plan.network.admin_cidrs]
    for region in REGIONS:
        rules = [rule for r in _in_region(rec, region) for rule in ingress_rules(r.type, r.inputs)]
        internet = [rule for rule in rules if is_internet(rule[2])]
        # everything else comes from the overlay, which is private
        assert {src for _, _, src in rules} - {src for _, _, src in internet} == {"10.42.0.0/16"}
        peers = {
            (plan.region(t.side(region).peer).gateway.name, t.side(region).port)
            for t in plan.tunnels_of(region)
        }
        want = {("tcp", (22, 22), admin)} | {
            ("udp", (port, port), f"{addresses[gw]}/32") for gw, port in peers
        }
        assert set(internet) == want, region
        assert all(src not in ("0.0.0.0/0", "::/0") for _, _, src in internet)


def test_gateways_forward_and_the_other_regions_subnets_route_to_them(rec: Recording) -> None:
    sv = _in_region(rec, "silicon-valley")
    gw = next(r for r in sv if r.name == "silicon-valley-pool-sv-0")
    assert gw.inputs["sourceDestCheck"] is False and gw.inputs["associatePublicIpAddress"] is False
    routes = {
        r.inputs["destinationCidrBlock"]: r.inputs for r in sv if r.type == "aws:ec2/route:Route"
    }
    assert set(routes) == {"0.0.0.0/0", "10.42.1.0/24", "10.42.2.0/24"}
    assert routes["10.42.1.0/24"]["networkInterfaceId"].startswith("eni-")
    fra = {r.name: r for r in _in_region(rec, "frankfurt")}
    assert fra["frankfurt-pool-fra-0"].inputs["canIpForward"] is True
    gcp_routes = [r for r in fra.values() if r.type == "gcp:compute/route:Route"]
    assert sorted(r.inputs["destRange"] for r in gcp_routes) == ["10.42.1.0/24", "10.42.3.0/24"]
    assert all(r.inputs["tags"] == ["gt-frankfurt-worker"] for r in gcp_routes)
    bj = [r for r in _in_region(rec, "beijing") if r.type == "alicloud:vpc/routeEntry:RouteEntry"]
    assert sorted(r.inputs["destinationCidrblock"] for r in bj) == ["10.42.2.0/24", "10.42.3.0/24"]
    assert all(r.inputs["nexthopType"] == "Instance" for r in bj)


def test_placement_images_disks_and_user_data(rec: Recording) -> None:
    by_name = {r.name: r for r in rec.resources}
    sv = by_name["silicon-valley-pool-sv-1"].inputs
    assert sv["placementGroup"] == by_name["silicon-valley-pool-placement"].inputs.get(
        "id", sv["placementGroup"]
    )
    assert by_name["silicon-valley-pool-placement"].inputs["strategy"] == "cluster"
    assert sv["ami"].startswith("ami-")  # read from the DLAMI's public SSM parameter
    assert sv["rootBlockDevice"]["volumeSize"] == 300 and "instanceMarketOptions" not in sv
    fra = by_name["frankfurt-pool-fra-1"].inputs
    # the family's current image, resolved in the family's project
    image = fra["bootDisk"]["initializeParams"]["image"]
    family = CLOUDS["gcp"].image.ref.split("/family/")[1]
    assert "/projects/ubuntu-os-accelerator-images/global/images/" in image
    assert image.rsplit("/", 1)[1].startswith(family + "-v")
    assert fra["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert fra["resourcePolicies"].endswith("frankfurt-pool-placement")
    bj = by_name["beijing-pool-bj-1"].inputs
    assert bj["imageId"].startswith("ubuntu_24_04_x64") and bj["systemDiskSize"] == 300
    assert (
        bj["deploymentSetId"]
        and by_name["beijing-pool-placement"].inputs["strategy"] == "LowLatency"
    )
    for node in ("silicon-valley-pool-sv-0", "beijing-pool-bj-0"):
        assert by_name[node].inputs["userData"].startswith("#cloud-config\n")
    assert (
        by_name["frankfurt-pool-fra-0"].inputs["metadata"]["user-data"].startswith("#cloud-config")
    )


def test_cloud_resources_carry_the_required_tags_as_their_cloud_stores_them(rec: Recording) -> None:
    tagged = taggable_types()
    seen = {r.type for r in rec.resources if r.type in tagged}
    assert set(INSTANCE.values()) <= seen
    for r in rec.resources:
        if r.type in tagged:
            tags = r.inputs[tagged[r.type]]
            assert tags["owner"] == "ml-platform" and tags["cost-centre"] == "research-llm", r.urn
            assert tags["jurisdiction"].upper() in ("CN", "EU", "US"), r.urn


def test_the_tag_table_matches_the_cloud_sdks(rec: Recording) -> None:
    """The required-tags rule judges exactly the types whose SDK class takes tags/labels:
    every listed type has that input, and every cloud type the program makes that has one
    is listed."""

    def params(token: str) -> set[str]:
        pkg, mod_cls = token.split(":", 1)
        module, cls = mod_cls.split(":")
        m = importlib.import_module(f"pulumi_{pkg}.{module.split('/')[0]}")
        return set(inspect.signature(getattr(m, cls)._internal_init).parameters)

    tagged = taggable_types()
    for token, key in tagged.items():
        assert key in params(token), token
    for t in {r.type for r in rec.resources if _is_cloud(r) and "providers" not in r.type}:
        # GCP's `tags` are network tags (firewall and route targets); its labels are tags
        has = params(t) & ({"labels"} if t.startswith("gcp:") else {"tags", "labels"})
        assert bool(has) == (t in tagged), (t, has)


# -- the instances are hosts of the same agent ------------------------------------------
def test_cloud_hosts_bundles_name_peers_by_placeholder_filled_at_deploy() -> None:
    plan = build_plan(load_stack(STACK))
    host, files = render_host(plan, plan.node("sv-0"), ROLES["ssh"])
    conf = next(
        text for rel, text in files.items() if rel.startswith("wireguard/") and "beijing" in rel
    )
    assert "Endpoint = <address of bj-0>:" in conf
    assert "<address of fra-0>" in files["firewall.nft"]
    assert host.addresses[0].address == "10.42.3.4/24"  # the NIC's own: add_address is a no-op


def test_cloud_init_authorizes_the_operators_key_last(monkeypatch: pytest.MonkeyPatch) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode()
    pub = public_key(pem)
    assert pub.startswith("ssh-ed25519 ") and pub.endswith(" geotrain")
    import infra.backends.cloud as cloud

    monkeypatch.setattr(cloud, "secret", lambda _key: _Known(pem))
    plan = build_plan(load_stack(STACK))
    text = cloud_init(plan.region("beijing")).value  # type: ignore[attr-defined]
    doc = json.loads(text.removeprefix("#cloud-config\n"))
    assert doc["users"][1] == {  # the login user, never the workers' service user
        "name": "geotrain-admin",
        "shell": "/bin/bash",
        "sudo": "ALL=(ALL) NOPASSWD:ALL",
    }
    assert "PRIVATE KEY" not in text
    assert pub in doc["runcmd"][-3] and doc["runcmd"][0] == "modprobe -r nouveau || true"
    assert doc["packages"] == ["nvidia-driver-570-server", "nvidia-fabricmanager-570"]


class _Known:
    """A stand-in for a resolved secret Output: apply runs at once."""

    def __init__(self, value: str) -> None:
        self.value = value

    def apply(self, fn: Callable[[str], str]) -> _Known:
        return _Known(fn(self.value))


# -- variants -------------------------------------------------------------------------------
def _two_aws_regions(**cloud: Any) -> Any:
    raw = load_stack(STACK).model_dump(mode="json", exclude_unset=True)
    raw["stack"] = "two-aws"
    raw["regions"] = raw["regions"][2:] * 2
    raw["regions"][0] = {
        **raw["regions"][0],
        "name": "oregon",
        "subnet": "10.42.4.0/24",
        "asn": 64604,
    }
    raw["regions"][0]["pool"] = {
        **raw["regions"][0]["pool"],
        "gateway": "or-0",
        "cloud": {"region": "us-west-2", **cloud},
        "nodes": [{"name": f"or-{i}", "gpu_type": "H100-80GB", "gpus": 8} for i in range(2)],
    }
    raw["regions"][1]["pool"]["cloud"] = {"region": "us-west-1", **cloud}
    raw["network"]["links"] = [{"a": "oregon", "b": "silicon-valley"}]
    raw["training"]["data_shards"] = [
        {"name": f"us-{r}", "jurisdiction": "US", "region": r} for r in ("oregon", "silicon-valley")
    ]
    raw["monitoring"] = {"host": "sv-0"}
    raw["policy"] = {}
    return validate(raw, "test")


def test_same_cloud_regions_can_peer_their_vpcs_under_the_overlay() -> None:
    rec = run_under_mocks(_two_aws_regions(peering=True, spot=True, placement=False))
    [conn] = rec.by_type("aws:ec2/vpcPeeringConnection:VpcPeeringConnection")
    [accept] = rec.by_type("aws:ec2/vpcPeeringConnectionAccepter:VpcPeeringConnectionAccepter")
    assert conn.inputs["peerRegion"] == "us-west-1" and accept.inputs["autoAccept"] is True
    assert "oregon-pool-aws" in str(conn.provider) and "silicon-valley-pool-aws" in str(
        accept.provider
    )
    assert conn.inputs["vpcId"].startswith("vpc-") and conn.inputs["peerVpcId"].startswith("vpc-")
    # the overlay stays on top: tunnels and keys as without peering
    assert len([r for r in rec.resources if r.name.endswith("-wgkey")]) == 2
    # ... but under it the peering: each side routes the other's gateway (/32) through it,
    # the tunnel's endpoints are the gateways' private addresses, and each firewall admits
    # WireGuard from the peer gateway's private address only
    plan = build_plan(_two_aws_regions(peering=True))
    gw = {r.name: r.gateway.private_ip for r in plan.regions}
    routes = {
        r.inputs["destinationCidrBlock"]: r
        for r in rec.by_type("aws:ec2/route:Route")
        if "vpcPeeringConnectionId" in r.inputs
    }
    assert set(routes) == {f"{ip}/32" for ip in gw.values()}
    [t] = plan.tunnels
    assert (t.a_underlay, t.b_underlay) == (gw[t.a], gw[t.b])
    wg = [
        r.inputs["cidrIpv4"]
        for r in rec.by_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
        if r.inputs.get("ipProtocol") == "udp"
    ]
    assert sorted(wg) == sorted(f"{ip}/32" for ip in gw.values())

    inst = next(r for r in rec.by_type(INSTANCE["aws"]) if r.name == "oregon-pool-or-1")
    assert inst.inputs["instanceMarketOptions"]["marketType"] == "spot"
    assert "placementGroup" not in inst.inputs
    assert not rec.by_type("aws:ec2/placementGroup:PlacementGroup")
    # the zone AWS says offers the type, asked through the region's provider
    [subnet] = [r for r in rec.by_type("aws:ec2/subnet:Subnet") if r.name.startswith("oregon")]
    assert subnet.inputs["availabilityZone"] == "us-west-2a"


def test_without_peering_tunnels_take_the_public_ips_filled_at_deploy() -> None:
    [t] = build_plan(_two_aws_regions()).tunnels
    assert (t.a_underlay, t.b_underlay) == ("", "")  # `<address of NODE>` in the bundles


# -- broken inputs: exit 2, one line: file, key path, value, fix ------------------------
def _region(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in cfg["geotrain:regions"] if r["name"] == name)


BROKEN: dict[str, tuple[Callable[[dict[str, Any]], None], list[str]]] = {
    "gpu-not-offered": (
        lambda c: [
            n.update(gpu_type="A100-80GB") for n in _region(c, "silicon-valley")["pool"]["nodes"]
        ],
        [
            "geotrain:regions[2].pool.nodes[0].gpu_type",
            "AWS us-west-1 does not offer A100-80GB",
            "p4de.24xlarge is in us-east-1, us-west-2",
            "or a GPU type us-west-1 offers: H100-80GB (p5.48xlarge)",
        ],
    ),
    "unknown-region": (
        lambda c: _region(c, "frankfurt")["pool"]["cloud"].update(region="europe-west33"),
        [
            "geotrain:regions[1].pool.cloud.region",
            "unknown GCP region 'europe-west33'",
            "did you mean europe-west3",
        ],
    ),
    "disk-too-small": (
        lambda c: _region(c, "silicon-valley")["pool"]["cloud"].update(disk_gb=40),
        [
            "geotrain:regions[2].pool.cloud.disk_gb",
            "40 GiB is smaller than the image needs (75 GiB",
            "use disk_gb: 75 or more",
        ],
    ),
    "aws-image-form": (
        lambda c: _region(c, "silicon-valley")["pool"]["cloud"].update(image="ubuntu-24.04"),
        ["geotrain:regions[2].pool.cloud.image", "'ubuntu-24.04' is neither an AMI id"],
    ),
    "checkpoint-disk-over-srv": (
        lambda c: c["geotrain:training"]["checkpoint"].update(dir="/srv/{node}/checkpoints"),
        [
            "geotrain:training.checkpoint.dir",
            "cloud nodes mount their checkpoint disk at /srv, which is /srv itself",
            "e.g. /var/lib/geotrain/checkpoints/{node}",
        ],
    ),
    "checkpoint-disk-over-agent-state": (
        lambda c: c["geotrain:training"]["checkpoint"].update(dir="{node}/ckpt"),
        ["geotrain:training.checkpoint.dir", "at /var/lib/geotrain, over the agent's own files"],
    ),
    "address-on-a-cloud-node": (
        lambda c: _region(c, "beijing")["pool"]["nodes"][1].update(address="198.51.100.9"),
        ["geotrain:regions[0].pool.nodes[1].address", "198.51.100.9", "drop address"],
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_cloud_inputs_exit_2_with_one_line(write_stack: Any, case: str) -> None:
    mutate, words = BROKEN[case]
    path: Path = write_stack(STACK, mutate)
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and path.name in line, line
    assert all(w in line for w in words), line


# -- policies on whole variants (geotrain check, mocks) ---------------------------------
def test_check_passes_global_cloud() -> None:
    r = CliRunner().invoke(cli, ["check", "--stack", STACK])
    assert r.exit_code == 0, r.output
    assert "pass every policy" in r.output


def _open_ssh_to_the_world(cfg: dict[str, Any]) -> None:
    cfg["geotrain:network"]["admin_cidrs"] = ["0.0.0.0/0"]


def _drop_a_tag(cfg: dict[str, Any]) -> None:
    del cfg["geotrain:tags"]["cost-centre"]


@pytest.mark.parametrize(
    ("mutate", "policy", "words"),
    [
        (_open_ssh_to_the_world, "no-public-exposure", "tcp port 22 from 0.0.0.0/0"),
        (_drop_a_tag, "required-tags", "missing tag(s) cost-centre"),
    ],
    ids=["open-to-0.0.0.0/0", "tag-dropped"],
)
def test_check_fails_cloud_variants_on_the_named_rule(
    write_stack: Any, mutate: Callable[[dict[str, Any]], None], policy: str, words: str
) -> None:
    path = write_stack(STACK, mutate)
    r = CliRunner().invoke(cli, ["check", "--stack", str(path), "--json"])
    assert r.exit_code == 1, r.output
    found = json.loads(r.output[r.output.index("[") :])
    cloud = [v for v in found if v["policy"] == policy and words in v["message"]]
    kinds = {v["message"].split(" ")[1].split(":")[0] for v in cloud}
    assert {"aws", "gcp", "alicloud"} <= kinds, found


def test_cloud_init_puts_roots_key_in_root_home(
    monkeypatch: pytest.MonkeyPatch, write_stack: Any
) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    pem = (
        ed25519.Ed25519PrivateKey.generate()
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        .decode()
    )
    import infra.backends.cloud as cloud

    monkeypatch.setattr(cloud, "secret", lambda _key: _Known(pem))
    f = write_stack(STACK, lambda c: c["geotrain:regions"][0]["pool"].update(ssh={"user": "root"}))
    plan = build_plan(load_stack(str(f)))
    text = cloud_init(plan.region("beijing")).value  # type: ignore[attr-defined]
    runcmd = json.loads(text.removeprefix("#cloud-config\n"))["runcmd"]
    assert "install -d -m 0700 -o root -g root /root/.ssh" in runcmd
    assert not any("/home/root" in c for c in runcmd)
