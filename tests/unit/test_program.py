"""The Pulumi program under `pulumi.runtime.set_mocks`: resources and key inputs."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from infra import outputs
from infra.mocks import Recording, run_under_mocks
from infra.model import load_stack
from infra.model.load import validate


def _run(stack: str) -> Recording:
    return run_under_mocks(load_stack(stack))


def test_local_stack_creates_pools_monitoring_and_the_spec() -> None:
    rec = _run("local")
    types = Counter(r.type for r in rec.resources)
    assert types["geotrain:pool:RegionPool"] == 3
    assert types["geotrain:network:Overlay"] == 1
    assert types["geotrain:routing:Routing"] == 1
    assert types["geotrain:monitoring:Monitoring"] == 1
    assert types["geotrain:training:TrainingDeployment"] == 1
    assert types["command:remote:Command"] == 0
    spec = json.loads(rec.outputs[outputs.LAUNCH_SPEC])
    assert spec["run_id"] == rec.outputs[outputs.RUN_ID]
    assert rec.outputs[outputs.WORLD_SIZE] == 6


def test_every_child_is_parented_to_its_component() -> None:
    rec = _run("global")
    components = {r.urn for r in rec.resources if not r.custom}
    for r in rec.resources:
        if r.custom:
            assert r.parent in components, f"{r.urn} has no component parent"


def test_global_stack_keys_flow_from_hosts_to_peers() -> None:
    rec = _run("global")
    keygens = [r for r in rec.resources if r.name.endswith("-wgkey")]
    assert len(keygens) == 3
    for k in keygens:
        assert "wg genkey" in k.inputs["create"], k.urn
    confs = [
        r
        for r in rec.resources
        if r.name.endswith("-conf") and "/wireguard/" in r.inputs.get("create", "")
    ]
    assert len(confs) == 6
    pubkeys = rec.outputs[outputs.WIREGUARD_PUBLIC_KEYS]
    for c in confs:
        assert "PrivateKey" not in c.inputs["stdin"], c.urn
        assert any(f"PublicKey = {k}" in c.inputs["stdin"] for k in pubkeys.values()), c.urn


def test_global_stack_bootstraps_every_host_and_starts_workers() -> None:
    rec = _run("global")
    names = Counter(
        r.name.rsplit("-", 1)[-1] for r in rec.resources if r.type == "command:remote:Command"
    )
    assert names["bootstrap"] == 24
    assert names["start"] == 24
    assert names["exporter"] == 24  # node-exporter everywhere
    for r in rec.by_type("command:remote:Command"):
        conn = r.inputs["connection"]
        assert conn["user"] == "geotrain" and conn["port"] == 22, r.urn
        assert conn["host"].startswith(("192.0.2.", "198.51.100.", "203.0.113.")), r.urn


def test_frr_reload_reapplies_when_the_config_changes() -> None:
    rec = _run("global")
    reloads = [r for r in rec.resources if r.name.endswith("frr-reload")]
    assert len(reloads) == 3
    for r in reloads:
        assert r.inputs["triggers"], f"{r.urn}: no triggers, a changed frr.conf would not apply"


def _k8s_stack() -> Any:
    raw = load_stack("local").model_dump(mode="json")
    for r in raw["regions"]:
        r["pool"]["kind"] = "kubernetes"
        r["pool"]["nodes"][0]["address"] = "198.51.100.7"
    raw["stack"] = "k8s"
    return validate(raw, "test")


def test_kubernetes_pools_get_a_provider_and_workloads_per_region() -> None:
    rec = run_under_mocks(_k8s_stack())
    types = Counter(r.type for r in rec.resources)
    assert types["pulumi:providers:kubernetes"] == 3
    assert types["kubernetes:apps/v1:StatefulSet"] == 3
    assert types["kubernetes:core/v1:ConfigMap"] == 3
    for svc in rec.by_type("kubernetes:core/v1:Service"):
        assert svc.inputs["spec"]["type"] == "ClusterIP", svc.urn
    for sts in rec.by_type("kubernetes:apps/v1:StatefulSet"):
        assert sts.provider and "provider" in sts.provider, sts.urn


@pytest.mark.parametrize("stack", ["local", "lab", "global"])
def test_outputs_are_the_shared_constants(stack: str) -> None:
    rec = _run(stack)
    assert set(rec.outputs) == {
        outputs.LAUNCH_SPEC,
        outputs.RUN_ID,
        outputs.WORLD_SIZE,
        outputs.REGIONS,
        outputs.WIREGUARD_PUBLIC_KEYS,
        outputs.PROMETHEUS_URL,
    }
