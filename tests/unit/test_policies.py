"""Every rule through the policy SDK's own validate entry points, passing and failing; and
`geotrain check` on the shipped stacks and deliberately broken variants."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pulumi_policy import ResourceValidationArgs, StackValidationArgs

from geotrain.cli import cli
from infra.facts import monitoring_facts, pool_facts, routing_facts, training_facts
from infra.model import load_stack
from infra.plan import build_plan
from policies.rules import ALL, MONITORING, POOL, ROUTING, TRAINING
from policies.runner import _opts, policy_resource

POLICY = {p.name: p for p in ALL}
GLOBAL = build_plan(load_stack("global"))


def _validate(
    name: str, type_: str, props: dict[str, Any], config: dict[str, Any] | None = None
) -> list[str]:
    out: list[str] = []
    args = ResourceValidationArgs(
        type_, props, f"urn:test::{name}", "r", _opts(), None, config or {}
    )
    POLICY[name].validate(args, lambda msg, urn=None: out.append(msg))  # type: ignore[operator]
    return out


def _validate_stack(
    name: str, resources: list[tuple[str, dict[str, Any]]], config: dict[str, Any] | None = None
) -> list[str]:
    out: list[str] = []
    prs = [policy_resource(t, f"r{i}", f"urn:test::r{i}", p) for i, (t, p) in enumerate(resources)]
    POLICY[name].validate(
        StackValidationArgs(prs, config or {}),  # type: ignore[operator]
        lambda msg, urn=None: out.append(msg),
    )
    return out


def _training(**change: Any) -> dict[str, Any]:
    f = copy.deepcopy(training_facts(GLOBAL))
    f.update(change)
    return {"facts": f}


def test_every_rule_is_named_described_and_mandatory_by_default() -> None:
    assert len(POLICY) == 10
    for p in ALL:
        assert p.name == p.name.lower() and " " not in p.name
        assert p.description and p.severity is not None
        assert p.enforcement_level.value == "mandatory"


def test_data_residency_passes_when_shards_stay_home() -> None:
    assert _validate("data-residency", TRAINING, _training()) == []


def test_data_residency_fails_for_a_shard_moved_abroad() -> None:
    f = _training()
    f["facts"]["shards"][0]["region"] = "frankfurt"  # CN data read in the EU
    [msg] = _validate("data-residency", TRAINING, f)
    assert "cn-web" in msg and "frankfurt (EU)" in msg and "place it in beijing" in msg


def test_data_residency_fails_when_raw_data_would_cross_borders() -> None:
    [msg] = _validate(
        "data-residency", TRAINING, _training(cross_region_flows=["gradients", "raw-text"])
    )
    assert "'raw-text' would cross borders" in msg


def test_data_residency_fails_for_a_volume_of_foreign_data() -> None:
    props = {
        "metadata": {
            "labels": {"geotrain.io/data-jurisdiction": "CN", "geotrain.io/jurisdiction": "US"}
        }
    }
    assert _validate("data-residency", "kubernetes:core/v1:PersistentVolumeClaim", props)


def test_encryption_passes_with_sm4_for_cn_and_fails_without() -> None:
    assert _validate("encryption-in-transit", TRAINING, _training()) == []
    [msg] = _validate("encryption-in-transit", TRAINING, _training(cipher="aes-gcm"))
    assert "CN requires sm4-gcm" in msg


def test_encryption_requirement_is_configurable() -> None:
    f = _training(cipher="aes-gcm")
    assert _validate("encryption-in-transit", TRAINING, f, {"requiredFor": ["EU"]})
    assert _validate("encryption-in-transit", TRAINING, f, {"requiredFor": []}) == []


def test_encryption_fails_for_a_link_off_the_overlay() -> None:
    props = {"facts": {"links": [{"a": "beijing", "b": "frankfurt", "transport": "public"}]}}
    [msg] = _validate("encryption-in-transit", "geotrain:network:Overlay", props)
    assert "WireGuard overlay" in msg


def test_exposure_passes_for_private_binds() -> None:
    props = {"facts": monitoring_facts(GLOBAL)}
    assert _validate("no-public-exposure", MONITORING, props) == []


@pytest.mark.parametrize("bind", ["0.0.0.0", "8.8.8.8"])
def test_exposure_fails_for_metrics_on_public_or_all_interfaces(bind: str) -> None:
    f = monitoring_facts(GLOBAL)
    f["endpoints"][-1]["bind"] = bind
    [msg] = _validate("no-public-exposure", MONITORING, {"facts": f})
    assert "metrics on sv-7" in msg and bind in msg


def test_exposure_fails_for_an_open_load_balancer() -> None:
    props = {"spec": {"type": "LoadBalancer"}}
    assert _validate("no-public-exposure", "kubernetes:core/v1:Service", props)
    props["spec"]["loadBalancerSourceRanges"] = ["10.0.0.0/8"]
    assert _validate("no-public-exposure", "kubernetes:core/v1:Service", props) == []


def test_allowed_gpus_and_regions() -> None:
    props = {"facts": pool_facts(GLOBAL, GLOBAL.regions[0])}
    ok = {"allowedGpuTypes": ["A100-80GB"], "allowedRegions": ["beijing"]}
    assert _validate("allowed-gpu-types-and-regions", POOL, props, ok) == []
    bad = {"allowedGpuTypes": ["H100-80GB"], "allowedRegions": ["tokyo"]}
    msgs = _validate("allowed-gpu-types-and-regions", POOL, props, bad)
    assert len(msgs) == 1 + 8 and "region 'beijing' is not allowed" in msgs[0]


def _pools() -> list[tuple[str, dict[str, Any]]]:
    return [(POOL, {"facts": pool_facts(GLOBAL, r)}) for r in GLOBAL.regions]


def test_budget_cap_passes_under_and_fails_over() -> None:
    assert _validate_stack("budget-cap", _pools(), {"maxGpus": 192, "maxUsdPerHour": 800}) == []
    msgs = _validate_stack("budget-cap", _pools(), {"maxGpus": 100, "maxUsdPerHour": 500})
    assert "192 GPUs exceed the cap of 100" in msgs[0]
    assert "$787.20/hour exceeds" in msgs[1]


def test_checkpoint_cadence() -> None:
    assert _validate("checkpoint-cadence", TRAINING, _training()) == []
    slow = _training(checkpoint={"interval_minutes": 120.0, "keep": 1.0})
    msgs = _validate("checkpoint-cadence", TRAINING, slow)
    assert "every 120 minutes" in msgs[0] and "keeps 1" in msgs[1]


def test_required_tags() -> None:
    props = {"facts": pool_facts(GLOBAL, GLOBAL.regions[0])}
    assert _validate("required-tags", POOL, props) == []
    del props["facts"]["tags"]["owner"]
    [msg] = _validate("required-tags", POOL, props)
    assert "missing tag(s) owner" in msg
    assert _validate(
        "required-tags", "kubernetes:apps/v1:StatefulSet", {"metadata": {"labels": {}}}
    )


def test_network_integrity_passes_for_a_ring() -> None:
    assert _validate_stack("network-integrity", [(ROUTING, {"facts": routing_facts(GLOBAL)})]) == []


def test_network_integrity_finds_single_points_of_failure_asns_and_overlaps() -> None:
    f = routing_facts(GLOBAL)
    f["links"] = f["links"][:2]  # a chain: beijing-frankfurt-silicon-valley
    f["asns"]["frankfurt"] = f["asns"]["beijing"]
    f["subnets"]["silicon-valley"] = f["subnets"]["beijing"]
    msgs = _validate_stack("network-integrity", [(ROUTING, {"facts": f})])
    assert any("share ASN" in m for m in msgs)
    assert any("overlap" in m for m in msgs)
    assert sum("single point of failure" in m for m in msgs) == 2


# -- geotrain check on whole stacks ---------------------------------------------------
@pytest.mark.parametrize("stack", ["local", "lab", "global"])
def test_check_passes_the_shipped_stacks(stack: str) -> None:
    r = CliRunner().invoke(cli, ["check", "--stack", stack])
    assert r.exit_code == 0, r.output
    assert "pass every policy" in r.output


def _set(path: list[Any], value: Any) -> Any:
    def mutate(cfg: dict[str, Any]) -> None:
        cur = cfg
        for k in path[:-1]:
            cur = cur[k]
        cur[path[-1]] = value

    return mutate


BROKEN = {
    "metrics-public": (
        _set(["geotrain:monitoring", "bind_address"], "0.0.0.0"),
        "binds every interface",
        "no-public-exposure",
    ),
    "single-point-of-failure": (
        lambda c: c["geotrain:network"]["links"].pop(),
        "single point of failure",
        "network-integrity",
    ),
    "over-budget": (
        _set(["geotrain:policy", "max_usd_per_hour"], 100),
        "exceeds the cap of $100.00/hour",
        "budget-cap",
    ),
    "two-hour-checkpoints": (
        _set(["geotrain:training", "checkpoint", "interval_minutes"], 120),
        "checkpoints every 120 minutes",
        "checkpoint-cadence",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_check_fails_broken_variants_with_the_right_message(write_stack: Any, case: str) -> None:
    mutate, words, policy = BROKEN[case]
    path = write_stack("global", mutate)
    r = CliRunner().invoke(cli, ["check", "--stack", str(path), "--json"])
    assert r.exit_code == 1, r.output
    found = json.loads(r.output[r.output.index("[") :])
    assert any(v["policy"] == policy and words in v["message"] for v in found), found


def test_check_stops_a_shard_moved_to_another_jurisdiction(write_stack: Any) -> None:
    """Defence in depth: the stack model refuses it before any resource exists (exit 2);
    the data-residency rule catches the same under the real engine (tested above)."""
    path = write_stack(
        "global", _set(["geotrain:training", "data_shards", 0, "region"], "frankfurt")
    )
    r = CliRunner().invoke(cli, ["check", "--stack", str(path)])
    assert r.exit_code == 2
    assert "shard 'cn-web' is CN data but region frankfurt is in EU" in r.output


def test_check_emits_the_pack_config_for_the_real_cli(tmp_path: Path) -> None:
    out = tmp_path / "cfg.json"
    r = CliRunner().invoke(cli, ["check", "--stack", "global", "--emit-config", str(out)])
    assert r.exit_code == 0, r.output
    cfg = json.loads(out.read_text())
    assert cfg["budget-cap"]["maxUsdPerHour"] == 1200


# -- cloud pools (#14): the real resource types' inputs ---------------------------------
CLOUD = build_plan(load_stack("global-cloud"))
SG_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
GCP_FW = "gcp:compute/firewall:Firewall"
ALI_RULE = "alicloud:ecs/securityGroupRule:SecurityGroupRule"


def _sg(proto: str, port: int, cidr: str) -> dict[str, Any]:
    return {"ipProtocol": proto, "fromPort": float(port), "toPort": float(port), "cidrIpv4": cidr}


@pytest.mark.parametrize(
    ("type_", "props"),
    [
        (SG_RULE, _sg("tcp", 22, "198.51.100.240/28")),  # admin SSH
        (SG_RULE, _sg("udp", 51821, "203.0.113.7/32")),  # WireGuard from one peer
        (SG_RULE, {"ipProtocol": "-1", "cidrIpv4": "10.42.0.0/16"}),  # the overlay
        (
            GCP_FW,
            {"sourceRanges": ["192.0.2.9/32"], "allows": [{"protocol": "udp", "ports": ["51822"]}]},
        ),
        (
            ALI_RULE,
            {
                "type": "ingress",
                "ipProtocol": "tcp",
                "portRange": "22/22",
                "cidrIp": "198.51.100.240/28",
            },
        ),
        (
            ALI_RULE,
            {"type": "egress", "ipProtocol": "all", "portRange": "-1/-1", "cidrIp": "0.0.0.0/0"},
        ),
    ],
)
def test_exposure_passes_cloud_firewalls_open_only_to_peers_admins_and_the_overlay(
    type_: str, props: dict[str, Any]
) -> None:
    assert _validate("no-public-exposure", type_, props) == []


@pytest.mark.parametrize(
    ("type_", "props", "words"),
    [
        (
            SG_RULE,
            _sg("tcp", 22, "0.0.0.0/0"),
            "tcp port 22 from 0.0.0.0/0: open to the whole internet",
        ),
        (
            SG_RULE,
            {"ipProtocol": "-1", "cidrIpv4": "203.0.113.0/24"},
            "every protocol and port from 203.0.113.0/24",
        ),
        (
            GCP_FW,
            {
                "sourceRanges": ["0.0.0.0/0"],
                "allows": [{"protocol": "udp", "ports": ["51820-51830"]}],
            },
            "open to the whole internet",
        ),
        (
            GCP_FW,
            {
                "sourceRanges": ["198.51.100.0/24"],
                "allows": [{"protocol": "tcp", "ports": ["3000"]}],
            },
            "tcp port 3000",
        ),
        (
            ALI_RULE,
            {
                "type": "ingress",
                "ipProtocol": "udp",
                "portRange": "51820/51820",
                "cidrIp": "192.0.2.0/24",
            },
            "only WireGuard from one peer",
        ),
    ],
)
def test_exposure_fails_cloud_firewalls_open_to_the_internet(
    type_: str, props: dict[str, Any], words: str
) -> None:
    [msg] = _validate("no-public-exposure", type_, props)
    assert msg.startswith("[no-public-exposure]") and words in msg, msg


def test_allowed_gpu_types_judge_cloud_instances_by_their_type() -> None:
    rule, aws = "allowed-gpu-types-and-regions", "aws:ec2/instance:Instance"
    assert (
        _validate(rule, aws, {"instanceType": "p4de.24xlarge"}, {"allowedGpuTypes": ["A100-80GB"]})
        == []
    )
    [msg] = _validate(
        rule, aws, {"instanceType": "p4de.24xlarge"}, {"allowedGpuTypes": ["H100-80GB"]}
    )
    assert "p4de.24xlarge carries 8 x A100-80GB; allowed: H100-80GB" in msg
    gcp = _validate(rule, "gcp:compute/instance:Instance", {"machineType": "a3-highgpu-8g"})
    assert gcp == []
    [msg] = _validate(rule, "alicloud:ecs/instance:Instance", {"instanceType": "ecs.g7.large"})
    assert "not in geotrain's instance table" in msg


def test_required_tags_judge_cloud_resources_own_tags_and_labels() -> None:
    tags = {"owner": "ml-platform", "cost-centre": "research-llm", "jurisdiction": "US"}
    assert _validate("required-tags", "aws:ec2/vpc:Vpc", {"tags": tags}) == []
    labels = {k: v.lower() for k, v in tags.items() if k != "jurisdiction"}
    [msg] = _validate("required-tags", "gcp:compute/instance:Instance", {"labels": labels})
    assert "missing tag(s) jurisdiction" in msg
    assert _validate("required-tags", "alicloud:vpc/network:Network", {})
    # types that take no tags (GCP networks, route entries) are not judged
    assert _validate("required-tags", "gcp:compute/network:Network", {}) == []


def _cloud_pools() -> list[tuple[str, dict[str, Any]]]:
    return [(POOL, {"facts": pool_facts(CLOUD, r)}) for r in CLOUD.regions]


def test_budget_prices_cloud_nodes_at_their_instance_in_their_region() -> None:
    # 2 x ecs.ebmgn7e.32xlarge 32.00 + 2 x a3-highgpu-8g (europe-west3) 104.13
    # + 2 x p5.48xlarge (us-west-1) 68.80 = 409.86
    assert _validate_stack("budget-cap", _cloud_pools(), {"maxUsdPerHour": 410}) == []
    [msg] = _validate_stack("budget-cap", _cloud_pools(), {"maxUsdPerHour": 400})
    assert "$409.86/hour exceeds the cap of $400.00/hour" in msg
    # a gpu_prices override of a GPU type wins over the instance table: 16 x 1.00 + 272.00
    [msg] = _validate_stack(
        "budget-cap", _cloud_pools(), {"maxUsdPerHour": 200, "gpuPrices": {"A100-80GB": 1.0}}
    )
    assert "$361.86/hour" in msg


def test_admin_ssh_only_passes_ssh_from_admin_and_fails_ssh_from_elsewhere() -> None:
    ok = [*_cloud_pools(), (SG_RULE, _sg("tcp", 22, "198.51.100.240/28"))]
    assert _validate_stack("admin-ssh-only", ok) == []
    bad = [
        *_cloud_pools(),
        (
            GCP_FW,
            {"sourceRanges": ["8.8.8.0/24"], "allows": [{"protocol": "tcp", "ports": ["22"]}]},
        ),
    ]
    [msg] = _validate_stack("admin-ssh-only", bad)
    assert (
        "admits SSH from 8.8.8.0/24, outside geotrain:network.admin_cidrs (198.51.100.240/28)"
        in msg
    )


def test_a_pod_bound_to_its_cluster_dns_name_is_private_and_a_public_name_is_not() -> None:
    from policies.rules import _public

    assert _public("gt-beijing-0.gt-beijing.geotrain.svc.cluster.local") is None
    assert _public("workers.example.com") == "'workers.example.com' is not an IP address"
    assert _public("0.0.0.0") is not None and _public("8.8.8.8") is not None
