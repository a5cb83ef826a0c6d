"""The stack model: shipped stacks load; broken ones fail with file, key path and fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.model import load_stack
from training.errors import ConfigError


@pytest.mark.parametrize("stack", ["local", "lab", "global"])
def test_shipped_stacks_load(stack: str) -> None:
    m = load_stack(stack)
    assert [r.name for r in m.regions] == ["beijing", "frankfurt", "silicon-valley"]
    assert [r.jurisdiction for r in m.regions] == ["CN", "EU", "US"]


def test_global_stack_is_the_reference_layout() -> None:
    m = load_stack("global")
    for r in m.regions:
        assert r.pool.kind == "ssh"
        assert len(r.pool.nodes) == 8
        assert {(n.gpu_type, n.gpus) for n in r.pool.nodes} == {("A100-80GB", 8)}
        # RFC 5737 documentation ranges only
        assert all(
            str(n.address).startswith(("192.0.2.", "198.51.100.", "203.0.113."))
            for n in r.pool.nodes
        )


def _set(path: str, value: Any) -> Any:
    """Mutation setting a dotted/indexed path inside the config mapping."""

    def mutate(cfg: dict[str, Any]) -> None:
        keys = path.split(".")
        cur: Any = cfg
        for k in keys[:-1]:
            cur = cur[int(k)] if k.isdigit() else cur[k]
        last = keys[-1]
        if last.isdigit():
            cur[int(last)] = value
        else:
            cur[last] = value

    return mutate


def _both(*mutations: Any) -> Any:
    def mutate(cfg: dict[str, Any]) -> None:
        for m in mutations:
            m(cfg)

    return mutate


BROKEN = [
    # (id, base stack, mutation, expected key path, expected words in message)
    (
        "unknown-key",
        "local",
        _set("geotrain:training.stepz", 5),
        "geotrain:training.stepz",
        "unknown key 'stepz'",
    ),
    ("unknown-top-key", "local", _set("geotrain:trainng", {}), "geotrain:trainng", "allowed keys"),
    (
        "wrong-type",
        "local",
        _set("geotrain:training.steps", "many"),
        "geotrain:training.steps",
        "valid integer",
    ),
    (
        "bad-gpu",
        "global",
        _set("geotrain:regions.1.pool.nodes.0.gpu_type", "A10"),
        "geotrain:regions[1].pool.nodes[0].gpu_type",
        "use one of A100-40GB",
    ),
    (
        "bad-jurisdiction",
        "local",
        _set("geotrain:regions.0.jurisdiction", "XX"),
        "geotrain:regions[0].jurisdiction",
        "'CN'",
    ),
    (
        "duplicate-asn",
        "local",
        _set("geotrain:regions.2.asn", 64601),
        "geotrain:regions[2].asn",
        "duplicate ASN 64601",
    ),
    (
        "duplicate-region",
        "local",
        _set("geotrain:regions.1.name", "beijing"),
        "geotrain:regions[1].name",
        "duplicate region name",
    ),
    (
        "overlapping-cidr",
        "local",
        _set("geotrain:regions.1.subnet", "10.42.1.128/25"),
        "geotrain:regions[1].subnet",
        "overlaps regions[0]",
    ),
    (
        "subnet-outside-overlay",
        "lab",
        _set("geotrain:regions.0.subnet", "192.168.0.0/24"),
        "geotrain:regions[0].subnet",
        "not inside overlay_cidr",
    ),
    (
        "unknown-region-in-link",
        "lab",
        _set("geotrain:network.links.0.b", "tokyo"),
        "geotrain:network.links[0].b",
        "unknown region 'tokyo'",
    ),
    (
        "shard-outside-jurisdiction",
        "local",
        _set("geotrain:training.data_shards.0.region", "frankfurt"),
        "geotrain:training.data_shards[0].region",
        "data must stay in its jurisdiction",
    ),
    (
        "bad-pool-kind",
        "local",
        _set("geotrain:regions.0.pool.kind", "ec2"),
        "geotrain:regions[0].pool.kind",
        "'local'",
    ),
    (
        "mixed-single-machine-kinds",
        "local",
        _set("geotrain:regions.0.pool.kind", "ssh"),
        "geotrain:regions[0].pool.nodes[0].address",
        "not loopback",
    ),
    (
        "gateway-not-a-node",
        "lab",
        _set("geotrain:regions.0.pool.gateway", "nope"),
        "geotrain:regions[0].pool.gateway",
        "use one of bj-gw",
    ),
    (
        "region-mixes-cpu-and-gpu",
        "lab",
        _set("geotrain:regions.0.pool.nodes.1.gpu_type", "H100-80GB"),
        "geotrain:regions[0].pool.nodes",
        "mixes cpu and GPU nodes",
    ),
    (
        "balance-with-privacy",
        "local",
        _both(
            _set("geotrain:training.balance", "throughput"),
            _set("geotrain:regions.1.privacy", {"target_epsilon": 4}),
        ),
        "geotrain:training.balance",
        "DP-SGD's sampling rate fixes in frankfurt",
    ),
    (
        "asn-out-of-range",
        "local",
        _set("geotrain:regions.0.asn", 65001 + 1000),
        "geotrain:regions[0].asn",
        "less than or equal to 65534",
    ),
    (
        "self-link",
        "lab",
        _set("geotrain:network.links.0.b", "beijing"),
        "geotrain:network.links[0]",
        "to itself",
    ),
    (
        "monitoring-port-clash",
        "local",
        _set("geotrain:monitoring.prometheus_port", 9401),
        "geotrain:monitoring.prometheus_port",
        "collides",
    ),
    (
        "missing-required",
        "local",
        _set("geotrain:regions.0.subnet", None),
        "geotrain:regions[0].subnet",
        "IPv4",
    ),
    # address pools with too little room: said up front, with the room needed
    (
        "region-subnet-too-small",
        "lab",
        _set("geotrain:regions.1.subnet", "10.42.2.0/29"),
        "geotrain:regions[1].subnet",
        "2 nodes need 13 (gateway .1, workers from .10, broadcast); use /28 or larger",
    ),
    (
        "lab-underlay-too-small",
        "lab",
        _set("geotrain:network.underlay_cidr", "100.127.0.0/30"),
        "geotrain:network.underlay_cidr",
        "holds 1 /30 cables, 6 needed (two per link); use /27 or larger",
    ),
    (
        "lab-underlay-single-address",
        "lab",
        _set("geotrain:network.underlay_cidr", "100.127.0.0/32"),
        "geotrain:network.underlay_cidr",
        "holds 0 /30 cables",
    ),
    (
        "wireguard-ports-past-65535",
        "lab",
        _set("geotrain:network.wireguard_port", 65000),
        None,
        "",
    ),
    (
        "ssh-without-admin-cidrs",
        "global",
        _set("geotrain:network.admin_cidrs", []),
        "geotrain:network.admin_cidrs",
        "list the networks you run `pulumi up` from",
    ),
    (
        "kubernetes-next-to-ssh",
        "global",
        _set("geotrain:regions.2.pool.kind", "kubernetes"),
        "geotrain:regions[2].pool.kind",
        "no WireGuard gateway between a cluster and hosts",
    ),
    (
        "tag-not-a-label",
        "local",
        _set("geotrain:tags", {"owner": "a team with spaces", "cost-centre": "x"}),
        "geotrain:tags.owner",
        "not a valid label value",
    ),
    (
        "host-address-inside-the-overlay",
        "global",
        _set("geotrain:regions.0.pool.nodes.1.address", "10.42.7.7"),
        "geotrain:regions[0].pool.nodes[1].address",
        "inside overlay_cidr",
    ),
    (
        "two-nodes-one-host",
        "global",
        _set("geotrain:regions.0.pool.nodes.1.address", "192.0.2.10"),
        "geotrain:regions[0].pool.nodes[1].address",
        "one host serves one node",
    ),
]
BROKEN = [b for b in BROKEN if b[3] is not None]  # (65000 + 2 regions fits: no error)


@pytest.mark.parametrize(
    ("base", "mutate", "path", "words"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN]
)
def test_broken_stack_names_file_key_and_fix(
    write_stack: Any, base: str, mutate: Any, path: str, words: str
) -> None:
    file = write_stack(base, mutate)
    with pytest.raises(ConfigError) as e:
        load_stack(str(file))
    msg = str(e.value)
    assert e.value.path == path, msg
    assert words in msg, msg
    assert "Pulumi.broken.yaml" in msg
    assert "\n" not in msg


def test_bad_yaml_names_line(tmp_path: Path) -> None:
    f = tmp_path / "Pulumi.bad.yaml"
    f.write_text("config:\n  geotrain:regions: [\n    - name: x\n")
    with pytest.raises(ConfigError) as e:
        load_stack(str(f))
    assert "invalid YAML" in str(e.value) and e.value.path.startswith("line ")


def test_missing_config_mapping_is_explained(tmp_path: Path) -> None:
    f = tmp_path / "Pulumi.empty.yaml"
    f.write_text("encryptionsalt: abc\n")
    with pytest.raises(ConfigError, match="'config:' mapping"):
        load_stack(str(f))


def test_unknown_stack_lists_available() -> None:
    from infra.model import available_stacks

    assert {"global", "lab", "local"} <= set(available_stacks())
    with pytest.raises(ConfigError, match="available stacks: " + ", ".join(available_stacks())):
        load_stack("nope")


def test_other_providers_config_and_secrets_are_ignored(write_stack: Any) -> None:
    def mutate(cfg: dict[str, Any]) -> None:
        cfg["aws:region"] = "eu-central-1"
        cfg["geotrain:sshPrivateKey"] = {"secure": "v1:abc"}

    assert load_stack(str(write_stack("global", mutate))).stack == "broken"


def test_long_region_names_with_a_common_prefix_get_distinct_interface_names(
    write_stack: Any,
) -> None:
    def rename(cfg: dict[str, Any]) -> None:
        names = ["europe-central-1", "europe-central-2", "europe-central-3"]
        old = [r["name"] for r in cfg["geotrain:regions"]]
        for r, n in zip(cfg["geotrain:regions"], names, strict=True):
            r["name"] = n
        mapping = dict(zip(old, names, strict=True))
        for link in cfg["geotrain:network"]["links"]:
            link["a"], link["b"] = mapping[link["a"]], mapping[link["b"]]
        for s in cfg["geotrain:training"]["data_shards"]:
            s["region"] = mapping[s["region"]]

    from infra.plan import build_plan

    plan = build_plan(load_stack(str(write_stack("lab", rename))))
    for r in plan.regions:
        names = [t.side(r.name).ifname for t in plan.tunnels_of(r.name)]
        uplinks = [t.a_uplink if t.a == r.name else t.b_uplink for t in plan.tunnels_of(r.name)]
        assert len(set(names)) == len(names) == 2, names
        assert len(set(uplinks)) == 2, uplinks
        assert all(len(n) <= 15 for n in names + uplinks)
