"""Kubernetes regions: every manifest is schema-valid (kubernetes-validate --strict for each
supported version; CRDs against their upstream schemas, bundled in tests/unit/crds), the
pods get what they need to train, the image matches what pods run, broken settings are
one line and exit 2, the Provider is strict, and the policy facts are true."""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from geotrain.cli import cli
from infra.backends import kubernetes as backend
from infra.facts import overlay_facts
from infra.mocks import run_under_mocks
from infra.model import load_stack
from infra.model.load import validate
from infra.plan import Plan, build_plan
from infra.render import k8s, render_alert_rules, render_dashboard
from infra.render.monitoring import RUNTIME_JOB
from policies.rules import OVERLAY
from tests.conftest import stack_doc
from training.errors import ConfigError, SpecError
from training.launch import torchrun

ROOT = Path(__file__).resolve().parents[2]
CRDS = {p.stem: json.loads(p.read_text()) for p in (Path(__file__).parent / "crds").glob("*.json")}


def _model(mutate: Callable[[dict[str, Any]], None] | None = None) -> Any:
    doc = copy.deepcopy(stack_doc("k8s"))["config"]
    if mutate:
        mutate(doc)
    raw = {k.removeprefix("geotrain:"): v for k, v in doc.items()}
    return validate({"stack": "k8s", **raw}, "stacks/Pulumi.k8s.yaml")


def _kube(cfg: dict[str, Any], i: int) -> dict[str, Any]:
    return cfg["geotrain:regions"][i]["pool"]["kubernetes"]


def _single(cfg: dict[str, Any]) -> None:
    del cfg["geotrain:regions"][1]
    cfg["geotrain:network"]["links"] = []
    cfg["geotrain:training"]["data_shards"] = cfg["geotrain:training"]["data_shards"][:1]


def _jobset_cpu(cfg: dict[str, Any]) -> None:
    for i in (0, 1):
        _kube(cfg, i).update(workload="jobset", variant="cpu", tag="0.1.0-cpu", data_claim="shards")
        for n in cfg["geotrain:regions"][i]["pool"]["nodes"]:
            n.update(gpu_type="cpu", gpus=2)


VARIANTS = {
    "k8s": None,
    "single-region": _single,
    "jobset-cpu": _jobset_cpu,
}


def _plan(variant: str) -> Plan:
    return build_plan(_model(VARIANTS[variant]))


def _docs(plan: Plan) -> Iterator[dict[str, Any]]:
    for r in plan.regions:
        yield from k8s.render_k8s(plan, r)


# -- schema validation -------------------------------------------------------------------
def _strict(schema: Any) -> Any:
    """A CRD schema as the API server's strict field validation reads it: unknown fields
    are errors (a structural schema would otherwise prune them silently)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _validate_crd(doc: dict[str, Any]) -> None:
    crd = CRDS[doc["kind"].lower()]
    assert doc["apiVersion"] == f"{crd['group']}/{crd['version']}"
    # OpenAPI v3 schemas are close to draft 7; Go-only regexes (inline flags) in fields we
    # never set are not compiled unless used, so the schema itself is not checked
    jsonschema.Draft7Validator(_strict(crd["schema"])).validate(doc)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("version", k8s.K8S_VERSIONS)
def test_every_manifest_passes_strict_schema_validation(variant: str, version: str) -> None:
    seen = set()
    for doc in _docs(_plan(variant)):
        seen.add(doc["kind"])
        if doc["kind"].lower() in CRDS:
            _validate_crd(doc)
            if doc["kind"] == "JobSet":  # its Job template is a batch/v1 Job
                for rj in doc["spec"]["replicatedJobs"]:
                    job = {"apiVersion": "batch/v1", "kind": "Job", **rj["template"]}
                    job["metadata"] = {**job["metadata"], "name": rj["name"]}
                    kubernetes_validate.validate(job, version, strict=True)
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    assert "PrometheusRule" in seen and "NetworkPolicy" in seen


def test_unknown_fields_fail_strict_validation_for_core_and_crd_objects() -> None:
    docs = list(_docs(_plan("k8s")))
    sts = copy.deepcopy(next(d for d in docs if d["kind"] == "StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, k8s.K8S_VERSIONS[-1], strict=True)
    pm = copy.deepcopy(next(d for d in docs if d["kind"] == "PodMonitor"))
    pm["spec"]["podMetricsEndpoints"][0]["ports"] = "metrics-0"
    with pytest.raises(jsonschema.ValidationError):
        _validate_crd(pm)


def test_kubernetes_validate_works_offline_with_its_bundled_schemas() -> None:
    versions = {v.rsplit(".", 1)[0] for v in kubernetes_validate.utils.all_versions()}
    assert set(k8s.K8S_VERSIONS) <= versions


# -- what pods need to train -------------------------------------------------------------
def _workload(plan: Plan, region: int = 0) -> dict[str, Any]:
    docs = k8s.render_k8s(plan, plan.regions[region])
    return next(d for d in docs if d["kind"] in ("StatefulSet", "JobSet"))


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    if doc["kind"] == "JobSet":
        return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return doc["spec"]["template"]["spec"]


def test_pods_get_gpus_every_rank_port_shm_readiness_and_placement() -> None:
    plan = _plan("k8s")
    pod = _pod(_workload(plan))
    [worker] = pod["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert worker["resources"]["requests"] == worker["resources"]["limits"]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"rendezvous": 29500, **{f"metrics-{i}": 9400 + i for i in range(8)}}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics-0"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_run_key_is_a_secret_mounted_read_only_as_an_owner_only_file() -> None:
    plan = _plan("k8s")
    spec = k8s.pod_launch_spec(plan)
    pod = _pod(_workload(plan))
    secret_vol = next(v for v in pod["volumes"] if v["name"] == "run-key")
    assert secret_vol["secret"]["defaultMode"] == 0o400
    [init] = pod["initContainers"]
    assert init["command"][:3] == ["install", "-m", "0400"]
    assert all(m["readOnly"] for m in init["volumeMounts"] if m["name"] == "run-key")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "keys")
    assert mount == {
        "name": "keys",
        "mountPath": "/var/lib/geotrain/keys/run.key",
        "subPath": "run.key",
        "readOnly": True,
    }
    assert k8s.key_path(spec) == mount["mountPath"]
    assert not spec.key_file.startswith(torchrun.SPEC_DIR)  # not under the read-only spec


def test_a_changed_spec_is_a_new_configmap_name_so_the_pods_roll() -> None:
    a = _plan("k8s")
    b = build_plan(_model(lambda c: c["geotrain:training"].__setitem__("steps", 7)))

    def cm(plan: Plan) -> str:
        vols = _pod(_workload(plan))["volumes"]
        return str(next(v for v in vols if v["name"] == "spec")["configMap"]["name"])

    assert cm(a) != cm(b) and cm(a).startswith("gt-beijing-spec-")
    docs = k8s.render_k8s(a, a.regions[0])
    spec_cm = next(d for d in docs if d["metadata"]["name"] == cm(a))
    assert spec_cm["immutable"] is True
    assert json.loads(spec_cm["data"]["launch-spec.json"])["steps"] == 20000


def test_the_spec_gives_pods_addresses_they_can_use() -> None:
    plan = _plan("k8s")
    spec = k8s.pod_launch_spec(plan)
    hosts = [n.host for r in spec.regions for n in r.nodes]
    assert hosts[0] == "gt-beijing-0.gt-beijing.geotrain.svc.cluster.local"
    assert hosts[3] == "gt-frankfurt-1.gt-frankfurt.geotrain.svc.cluster.local"
    # other clusters cannot resolve those names: the rendezvous is the first gateway
    assert spec.master_addr == plan.regions[0].router_id == "10.42.1.1"
    gw = k8s.gateway_files(plan, plan.regions[0], {})["gateway.sh"]
    assert "TCP-LISTEN:29500,bind=10.42.1.1" in gw and f"TCP:{hosts[0]}:29500" in gw
    one = _plan("single-region")
    assert k8s.pod_launch_spec(one).master_addr == hosts[0]  # one cluster: the first pod
    js = k8s.pod_launch_spec(_plan("jobset-cpu"))
    assert js.regions[0].nodes[1].host == (
        "gt-beijing-workers-0-1.gt-beijing.geotrain.svc.cluster.local"
    )


def test_headless_service_publishes_pods_before_they_are_ready() -> None:
    plan = _plan("k8s")
    svc = next(d for d in k8s.render_k8s(plan, plan.regions[0]) if d["kind"] == "Service")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    js = _workload(_plan("jobset-cpu"))
    assert js["spec"]["network"]["publishNotReadyAddresses"] is True
    assert _pod(js)["restartPolicy"] == "Never"


def test_selectors_never_carry_tags_that_may_change() -> None:
    plan = _plan("k8s")
    sel = _workload(plan)["spec"]["selector"]["matchLabels"]
    assert not any(k.endswith(("owner", "cost-centre", "stack")) for k in sel)


def test_names_fit_kubernetes_limits_for_the_longest_region_names() -> None:
    long = "r" + "x" * 30 + "z"  # NAME_PATTERN's longest

    def mutate(c: dict[str, Any]) -> None:
        _jobset_cpu(c)
        c["geotrain:regions"][0]["name"] = long
        c["geotrain:network"]["links"][0]["a"] = long
        c["geotrain:training"]["data_shards"][0]["region"] = long

    plan = build_plan(_model(mutate))
    for doc in _docs(plan):
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
    n = k8s.names(plan, plan.regions[0])
    assert len(n.pod(15)) <= 63 and len(n.workload) <= 52  # StatefulSet revision label
    for label in n.fqdn(15).split("."):
        assert len(label) <= 63


# -- the gateway --------------------------------------------------------------------------
def test_gateway_uses_the_host_renderers_and_announces_the_pod_cidr() -> None:
    plan = _plan("k8s")
    files = k8s.gateway_files(plan, plan.regions[0], {"fra-0": "PUB="})
    assert "PublicKey = PUB=" in files["wg-frankfurt.conf"]
    assert "Endpoint = 198.51.100.20:" in files["wg-frankfurt.conf"]
    assert "  network 10.42.1.0/24\n  network 10.44.0.0/16\n" in files["frr.conf"]
    assert "10.45.0.0/16" in files["routes.sh"] and "10.44.0.0/16" not in files["routes.sh"]
    if shutil.which("sh"):
        for script in ("gateway.sh", "routes.sh"):
            subprocess.run(["sh", "-n"], input=files[script], text=True, check=True)


def test_cross_region_traffic_reaches_workers_only_from_the_gateway_address() -> None:
    plan = _plan("k8s")
    pol = next(d for d in k8s.render_k8s(plan, plan.regions[1]) if d["kind"] == "NetworkPolicy")
    blocks = [
        f["ipBlock"]["cidr"]
        for rule in pol["spec"]["ingress"]
        for f in rule["from"]
        if "ipBlock" in f
    ]
    assert blocks == ["10.42.2.1/32"]  # frankfurt's gateway; it SNATs whatever it forwards
    gw = k8s.gateway_files(plan, plan.regions[1], {})["gateway.sh"]
    assert "-s 10.42.1.0/24 -d 10.45.0.0/16 -j SNAT --to-source 10.42.2.1" in gw
    single = _plan("single-region")
    pol1 = next(
        d for d in k8s.render_k8s(single, single.regions[0]) if d["kind"] == "NetworkPolicy"
    )
    assert all("ipBlock" not in f for r in pol1["spec"]["ingress"] for f in r["from"])
    assert not any(d["kind"] == "Deployment" for d in k8s.render_k8s(single, single.regions[0]))


def _gateway_container(plan: Plan, i: int) -> dict[str, Any]:
    deploy = next(d for d in k8s.render_k8s(plan, plan.regions[i]) if d["kind"] == "Deployment")
    [c] = deploy["spec"]["template"]["spec"]["containers"]
    return dict(c)


def test_gateway_runs_as_root_with_exactly_the_capabilities_frr_and_wireguard_need() -> None:
    """Not the runtime's default set plus additions: that set varies by runtime and lacks
    SYS_ADMIN, without which FRR's zebra, bgpd and bfdd exit (issue 36, item 2; the
    integration test runs the container with exactly this set)."""
    c = _gateway_container(_plan("k8s"), 0)
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": list(k8s.GATEWAY_CAPABILITIES)}
    assert {"NET_ADMIN", "NET_RAW", "SYS_ADMIN", "NET_BIND_SERVICE"} <= set(
        k8s.GATEWAY_CAPABILITIES
    )
    assert (sc["runAsUser"], sc["runAsGroup"]) == (0, 0) and not sc.get("privileged")
    # ready once the tunnels are up and bgpd answers (not only the tunnels)
    assert c["readinessProbe"]["exec"]["command"] == ["/bin/sh", "-c", k8s.GATEWAY_READY]
    assert "vtysh" in k8s.GATEWAY_READY


def test_gateway_script_fails_without_frr_and_undoes_itself_on_any_exit() -> None:
    plan = _plan("k8s")
    gw = k8s.gateway_files(plan, plan.regions[0], {})["gateway.sh"]
    lines = gw.splitlines()
    # a failed start undoes the tunnels and rules a kernel would keep on the node
    assert "trap 'rc=$?; trap - EXIT; cleanup; exit $rc' EXIT" in lines
    assert lines.index("/usr/lib/frr/frrinit.sh start") + 1 == next(
        i for i, ln in enumerate(lines) if ln.startswith("/usr/lib/frr/frrinit.sh status ||")
    )
    # a crashed container's kernel link is removed by name (a new one has no config copy)
    assert "  for i in wg-frankfurt; do ip link del $i 2>/dev/null || true; done" in lines
    # the overlay address on lo: no dummy driver needed
    assert "ip addr add 10.42.1.1/32 dev lo label lo:geotrain" in lines
    assert "  ip addr del 10.42.1.1/32 dev lo 2>/dev/null || true" in lines


# -- monitoring ---------------------------------------------------------------------------
def test_monitoring_reuses_the_stack_rules_and_dashboard_for_kube_prometheus_stack() -> None:
    plan = _plan("k8s")
    docs = {d["kind"]: d for d in k8s.monitoring_docs(plan, plan.regions[0])}
    assert (
        docs["PrometheusRule"]["spec"]["groups"]
        == yaml.safe_load(render_alert_rules(plan))["groups"]
    )
    dash = docs["ConfigMap"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dash["metadata"]["namespace"] == "monitoring"
    assert list(dash["data"].values()) == [render_dashboard(plan)]
    for kind in ("PodMonitor", "PrometheusRule", "ServiceMonitor"):
        assert docs[kind]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pm = docs["PodMonitor"]["spec"]
    assert [e["port"] for e in pm["podMetricsEndpoints"]] == [f"metrics-{i}" for i in range(8)]
    pod_labels = _workload(plan)["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[pm["jobLabel"]] == RUNTIME_JOB  # job="geotrain-runtime" as rules say
    sm = docs["ServiceMonitor"]["spec"]["endpoints"][0]["relabelings"]
    assert {"targetLabel": "job", "replacement": "dcgm-exporter"} in sm
    cpu = _plan("jobset-cpu")
    assert "ServiceMonitor" not in {d["kind"] for d in k8s.monitoring_docs(cpu, cpu.regions[0])}


def test_monitoring_renderers_are_unchanged_for_other_stacks() -> None:
    plan = build_plan(load_stack("global"))
    assert render_alert_rules(plan).startswith("# geotrain global: rendered")
    assert json.loads(render_dashboard(plan))["uid"] == "geotrain-global"


# -- the image ----------------------------------------------------------------------------
def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _stage(name: str) -> str:
    text = _dockerfile()
    start = text.index(f" AS {name}\n")
    end = text.find("\nFROM ", start)
    return text[start : end if end > 0 else None]


def _cmd(stage: str) -> list[str]:
    [line] = [ln for ln in _stage(stage).splitlines() if ln.startswith("CMD ")]
    return list(json.loads(line.removeprefix("CMD ")))


def test_dockerfile_cmd_is_what_the_pods_run() -> None:
    plan = _plan("k8s")
    assert _cmd("runtime") == _pod(_workload(plan))["containers"][0]["command"]
    gw = next(d for d in k8s.render_k8s(plan, plan.regions[0]) if d["kind"] == "Deployment")
    assert _cmd("gateway") == gw["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"USER {k8s.UID}:{k8s.UID}" in _stage("runtime")
    assert f"WORKDIR {torchrun.WORKDIR}" in _stage("runtime")


def test_dockerfile_copies_only_what_exists_and_the_ignore_file_admits() -> None:
    ignore = (ROOT / ".dockerignore").read_text()
    for line in _dockerfile().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
                assert f"!{src.rstrip('/')}" in ignore.replace("/\n", "\n"), src


def test_dockerfile_variants_and_runtime_dependencies_follow_pyproject() -> None:
    text = _dockerfile()
    assert "ARG VARIANT=cpu" in text and "cpu)" in text and "cuda)" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    for pin in re.findall(r'"([a-z-]+[<>=]=?[0-9.]+)"', _stage("runtime")):
        assert f'"{pin}"' in pyproject, pin
    torch = re.search(r'"torch==([0-9.]+)"', pyproject)
    assert torch and f"TORCH_VERSION={torch.group(1)}" in text


@pytest.mark.skipif(not shutil.which("hadolint"), reason="hadolint is not installed here")
def test_dockerfile_passes_hadolint() -> None:
    subprocess.run(["hadolint", str(ROOT / "Dockerfile")], check=True)


# -- broken settings ----------------------------------------------------------------------
def _broken(write_stack: Any, mutate: Callable[[dict[str, Any]], None]) -> str:
    f = write_stack("k8s", mutate)
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


@pytest.mark.parametrize(
    ("mutate", "expect"),
    [
        (lambda c: _kube(c, 0).pop("context"), "pool.kubernetes.context: no kubeconfig context"),
        (lambda c: _kube(c, 1).update(variant="cpu"), "requests GPUs but its image"),
        (lambda c: _kube(c, 0).pop("pod_cidr"), "pod_cidr: not set"),
        (lambda c: _kube(c, 1).update(pod_cidr="10.44.0.0/16"), "overlaps"),
        (lambda c: _kube(c, 0).update(pod_cidr="10.96.0.0/16"), "not inside overlay_cidr"),
        (lambda c: _kube(c, 0).update(cluster_domain="a" * 70 + ".local"), "longer than DNS"),
        (
            lambda c: c["geotrain:regions"][1]["pool"]["nodes"][0].update(address="192.0.2.20"),
            "also region beijing's gateway address",
        ),
        (
            lambda c: [  # 4 + 12 GPUs: as many as frankfurt's 8 + 8, in unequal pods
                n.update(gpus=g)
                for n, g in zip(c["geotrain:regions"][0]["pool"]["nodes"], (4, 12), strict=True)
            ],
            "share one template",
        ),
        (
            lambda c: c["geotrain:training"]["checkpoint"].update(dir="/ckpt"),
            "outside the pods' volume",
        ),
        (lambda c: _kube(c, 0).update(shm_size="lots"), "shm_size"),
        (lambda c: _kube(c, 1).update(gateway_node_selector={}), "would run on any node"),
        (
            lambda c: c["geotrain:regions"][0]["pool"]["nodes"][0].update(address="169.254.7.7"),
            "cannot be the WireGuard endpoint",
        ),
        (
            lambda c: c["geotrain:network"].update(wireguard_port=32767),
            "WireGuard ports 32767-32768 fall in Kubernetes' NodePort range",
        ),
        (
            lambda c: c["geotrain:training"].update(rendezvous_port=10250),
            "10250 is taken on the gateway's node (the kubelet)",
        ),
        (
            lambda c: c["geotrain:training"].update(rendezvous_port=30001),
            "30001 is taken on the gateway's node (Kubernetes' NodePort range)",
        ),
    ],
)
def test_broken_kubernetes_settings_are_one_line_exit_2(
    write_stack: Any, mutate: Callable[[dict[str, Any]], None], expect: str
) -> None:
    assert expect in _broken(write_stack, mutate)


def test_a_stack_name_too_long_for_a_label_is_one_line_exit_2(tmp_path: Path) -> None:
    doc = stack_doc("k8s")
    f = tmp_path / f"Pulumi.{'k' * 60}.yaml"
    f.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 2 and "Kubernetes label values hold 63" in r.output, r.output


# -- the Pulumi program: strict providers, secrets, keys -----------------------------------
def test_every_object_goes_through_its_regions_provider_with_a_context() -> None:
    rec = run_under_mocks(load_stack("k8s"))
    providers = {r.urn: r for r in rec.by_type("pulumi:providers:kubernetes")}
    assert len(providers) == 2
    for p in providers.values():
        assert p.inputs["context"] in ("beijing-prod", "frankfurt-prod")
        assert "kubeconfig" in p.secrets  # the region's own kubeconfig, a secret
    for r in rec.resources:
        if r.type.startswith("kubernetes:"):
            assert r.provider, r.urn
            ref = r.provider.rsplit("::", 1)[0]  # provider reference: <urn>::<id>
            region = "beijing" if "beijing" in r.name else "frankfurt"
            assert ref in providers and region in ref, (r.urn, r.provider)


def test_a_missing_kubeconfig_is_an_error_under_the_engine(monkeypatch: Any) -> None:
    monkeypatch.setattr(backend, "under_mocks", lambda: False)
    with pytest.raises(ConfigError, match="geotrain:kubeconfigBeijing: is not set"):
        run_under_mocks(load_stack("k8s"))


def test_secrets_stay_secret_and_public_keys_come_from_the_private_keys() -> None:
    rec = run_under_mocks(load_stack("k8s"))
    secrets = {r.name: r for r in rec.by_type("kubernetes:core/v1:Secret")}
    for r in secrets.values():
        assert "stringData" in r.secrets, r.name
    run_key = secrets["training-beijing-run-key"].inputs["stringData"]["run.key"]
    assert len(bytes.fromhex(run_key)) == 32
    private = secrets["overlay-beijing-gateway-key"].inputs["stringData"]["private.key"]
    pub = X25519PrivateKey.from_private_bytes(base64.b64decode(private)).public_key()
    raw = pub.public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert rec.outputs["wireguard_public_keys"]["bj-0"] == base64.b64encode(raw).decode()
    cms = {r.name: r for r in rec.by_type("kubernetes:core/v1:ConfigMap")}
    fra = cms["overlay-frankfurt-gateway-config"].inputs["data"]["wg-beijing.conf"]
    assert f"PublicKey = {base64.b64encode(raw).decode()}" in fra
    assert private not in json.dumps([r.inputs for r in rec.resources if r.name not in secrets])


def test_workloads_are_replaced_whole_on_a_spec_change() -> None:
    # A gang cannot roll one pod at a time; the backend sets replaceOnChanges and
    # deleteBeforeReplace on the workload (resource options are not in mock inputs, so
    # this checks the code path that sets them)
    import inspect

    src = inspect.getsource(backend.KubernetesBackend._apply)
    assert "delete_before_replace=True" in src and 'replace_on_changes=["spec"]' in src


# -- policies -----------------------------------------------------------------------------
def test_overlay_facts_name_the_gateway_tunnels_and_check_passes(write_stack: Any) -> None:
    plan = build_plan(load_stack("k8s"))
    f = overlay_facts(plan)
    assert [link["transport"] for link in f["links"]] == ["wireguard"]
    assert f["gateways"]["beijing"].startswith("gt-beijing-gateway")
    r = CliRunner().invoke(cli, ["check", "--stack", "k8s"])
    assert r.exit_code == 0 and "pass every policy" in r.output, r.output


def test_encryption_rule_fails_a_kubernetes_link_that_is_not_wireguard() -> None:
    from pulumi_policy import ResourceValidationArgs

    from policies.rules import encryption_in_transit
    from policies.runner import _opts

    f = overlay_facts(build_plan(load_stack("k8s")))
    f["links"][0]["transport"] = "cluster-network"
    out: list[str] = []
    args = ResourceValidationArgs(OVERLAY, {"facts": f}, "urn:x", "overlay", _opts(), None, {})
    encryption_in_transit(args, lambda msg, urn=None: out.append(msg))
    assert out and "cluster-network" in out[0]


@pytest.mark.parametrize("command", ["validate", "render", "graph"])
def test_the_example_stack_validates_renders_and_graphs(command: str, tmp_path: Path) -> None:
    args = [command, "--stack", "k8s"] + (["--out", str(tmp_path)] if command == "render" else [])
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    if command == "render":
        docs = json.loads((tmp_path / "kubernetes" / "beijing.json").read_text())
        assert "JobSet" not in {d["kind"] for d in docs}
        spec = json.loads((tmp_path / "launch-spec.json").read_text())
        assert spec["master_addr"] == "10.42.1.1"


# -- torchrun -----------------------------------------------------------------------------
def test_pods_find_their_node_from_ordinal_completion_index_or_pet() -> None:
    spec = k8s.pod_launch_spec(_plan("k8s"))
    env = {torchrun.REGION_ENV: "frankfurt", "HOSTNAME": "gt-frankfurt-1"}
    assert torchrun.pod_node(spec, env)[0] == 3
    env = {torchrun.REGION_ENV: "beijing", "JOB_COMPLETION_INDEX": "1", "HOSTNAME": "x"}
    assert torchrun.pod_node(spec, env)[1].name == "bj-1"
    assert torchrun.pod_node(spec, {"PET_NODE_RANK": "2"})[1].name == "fra-0"
    with pytest.raises(SpecError, match="more replicas than the spec has nodes"):
        torchrun.pod_node(spec, {torchrun.REGION_ENV: "beijing", "HOSTNAME": "gt-beijing-2"})
    argv = torchrun.torchrun_argv(spec, "/s.json", 3, spec.regions[1].nodes[1])
    assert "--nnodes=4" in argv and "--node-rank=3" in argv and "--nproc-per-node=8" in argv
    assert "--master-addr=10.42.1.1" in argv
    assert argv[-5:] == ["-m", "training.worker", "--torchrun", "--spec", "/s.json"]


def test_worker_checks_torchruns_ranks_against_the_spec() -> None:
    spec = k8s.pod_launch_spec(_plan("k8s"))
    env = {"RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "32", "GROUP_RANK": "1"}
    t = torchrun.from_env(spec, {**env, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (t.node, t.local_rank, t.restart) == ("bj-1", 3, 2)
    with pytest.raises(SpecError, match="ranks start at 8"):
        torchrun.from_env(spec, {**env, "RANK": "4"})
    with pytest.raises(SpecError, match=r"\$GROUP_RANK is not set"):
        torchrun.from_env(spec, {k: v for k, v in env.items() if k != "GROUP_RANK"})


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("node_selector", {"bad key!": "x"}, "not a Kubernetes label key"),
        ("node_selector", {"ok/key": "bad value"}, "label value 'bad value'"),
        ("gateway_node_selector", {"geotrain.io/gateway": "yes please"}, "label value"),
        ("gpu_resource", "nvidia gpu", "not a resource name"),
        ("storage_class", "Fast SSD", "not a StorageClass name"),
        ("tolerations", [{"key": "a", "operator": "Exists", "value": "b"}], "takes no value"),
    ],
)
def test_names_the_api_server_would_refuse_are_refused_by_validate(
    write_stack: Any, key: str, value: Any, words: str
) -> None:
    def put(c: dict[str, Any]) -> None:
        c["geotrain:regions"][0]["pool"]["kubernetes"][key] = value

    r = CliRunner().invoke(cli, ["validate", "--stack", str(write_stack("k8s", put))])
    assert r.exit_code == 2 and words in r.output and f"kubernetes.{key}" in r.output, r.output
