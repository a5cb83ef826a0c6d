"""The Pulumi program under `pulumi.runtime.set_mocks`: resources and key inputs."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from infra import outputs
from infra.mocks import Recording, run_under_mocks
from infra.model import load_stack


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
    keygens = {r.name: r for r in rec.resources if r.name.endswith("-wgkey")}
    assert sorted(keygens) == ["overlay-bj-0-wgkey", "overlay-fra-0-wgkey", "overlay-sv-0-wgkey"]
    for k in keygens.values():
        assert " prepare --bundle " in k.inputs["create"], k.urn
    pubkeys = rec.outputs[outputs.WIREGUARD_PUBLIC_KEYS]
    agents = {r.name: r for r in rec.resources if r.name.endswith("-agent")}
    bj = json.loads(agents["training-bj-0-agent"].inputs["stdin"])
    assert bj["wireguard"] == {"fra-0": pubkeys["fra-0"], "sv-0": pubkeys["sv-0"]}
    worker = json.loads(agents["training-bj-1-agent"].inputs["stdin"])
    assert worker["wireguard"] == {}  # workers route through their gateway
    assert all("PrivateKey" not in a.inputs["stdin"] for a in agents.values())


def test_global_stack_copies_a_bundle_to_every_host_and_runs_the_agent_there() -> None:
    rec = _run("global")
    copies = rec.by_type("command:remote:CopyToRemote")
    agents = [r for r in rec.by_type("command:remote:Command") if r.name.endswith("-agent")]
    assert len(copies) == len(agents) == 24
    for c in copies:
        assert c.inputs["remotePath"] == ".geotrain/bundles"
        assert len(c.inputs["triggers"]) == 1 and len(c.inputs["triggers"][0]) == 64  # digest
    for a in agents:
        conn = a.inputs["connection"]
        assert conn["user"] == "ops" and conn["port"] == 22, a.urn
        assert conn["host"].startswith(("192.0.2.", "198.51.100.", "203.0.113.")), a.urn
        # a new bundle is an update (same command, new digest), never create-then-delete
        assert a.inputs["create"] == a.inputs["update"]
        assert " apply --bundle " in a.inputs["create"] and "--secrets-stdin" in a.inputs["create"]
        assert a.inputs["triggers"] == [f"{conn['host']}:22"]  # only another host replaces
        assert "geotrain-node remove" in a.inputs["delete"]


def test_the_run_key_is_an_engine_secret_on_stdin_and_never_logged() -> None:
    rec = _run("global")
    [key] = rec.by_type("random:index/randomBytes:RandomBytes")
    assert key.inputs["length"] == 32
    for a in (r for r in rec.resources if r.name.endswith("-agent")):
        stdin = json.loads(a.inputs["stdin"])
        assert len(stdin["run_key"]) == 64
        assert stdin["run_key"] not in a.inputs["create"]
        assert "stdin" in a.secrets, f"{a.urn}: stdin holds the run key but is not a secret"
        assert a.inputs["logging"] == "none"


def test_kubernetes_pools_get_a_strict_provider_and_workloads_per_region() -> None:
    rec = _run("k8s")  # stacks/Pulumi.k8s.yaml: two clusters
    types = Counter(r.type for r in rec.resources)
    assert types["pulumi:providers:kubernetes"] == 2
    workloads = types["kubernetes:apps/v1:StatefulSet"] + types.get(
        "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet", 0
    )
    assert workloads == 2
    specs = [c for c in rec.by_type("kubernetes:core/v1:ConfigMap") if c.name.endswith("-spec")]
    assert len(specs) == 2
    for svc in rec.by_type("kubernetes:core/v1:Service"):
        assert svc.inputs["spec"]["type"] == "ClusterIP", svc.urn
    for p in rec.by_type("pulumi:providers:kubernetes"):
        assert p.inputs.get("context"), f"{p.urn}: no context: the ambient one would be used"
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
        outputs.GRAFANA_URL,
        outputs.GRAFANA_ADMIN_PASSWORD,
        outputs.HOSTS,
    }
