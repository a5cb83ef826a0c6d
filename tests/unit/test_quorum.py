"""training.ft.quorum's validation and view, and training.ft.heal's sealed transport."""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.error import HTTPError

import pytest
import torch
import yaml
from prometheus_client import generate_latest

from geotrain.monitoring import RegionView, _fold, format_top
from infra.model import load_stack
from infra.model.load import STACKS_DIR as STACKS
from infra.plan import build_plan
from infra.render.runtime import render_launch_spec
from training.comm.topology import Topology
from training.errors import ConfigError, SpecError, TransientReject
from training.ft.heal import SealedTransport, seal, unseal
from training.ft.quorum import arrived, lighthouse_for, validate, view
from training.launch import launcher as launch
from training.observe.metrics import RuntimeMetrics
from training.spec import AdaptiveSpec, CodecSpec, FaultToleranceSpec, LaunchSpec, listeners
from training.testing import make_spec, run_world

QUORUM_SERVICES = {"lighthouse", "region-store", "torchft-manager", "heal"}
FT = FaultToleranceSpec(lighthouse="127.0.0.1:29510", min_replicas=2)


def test_min_replicas_outside_the_regions_is_refused_with_the_majority_as_fix() -> None:
    with pytest.raises(SpecError, match=r"min_replicas 4 is outside 1..3.*use 2"):
        validate(make_spec(3, 1, fault_tolerance=replace(FT, min_replicas=4)))
    assert validate(make_spec(3, 1, fault_tolerance=FT)) == FT


def test_a_spec_with_a_setting_only_the_main_loop_runs_is_refused() -> None:
    with pytest.raises(SpecError, match=r"compression.adaptive yet"):
        validate(make_spec(3, 1, fault_tolerance=FT, codec=CodecSpec(adaptive=AdaptiveSpec())))


def test_a_lighthouse_without_a_port_and_secure_aggregation_are_refused() -> None:
    with pytest.raises(SpecError, match="not host:port"):
        validate(make_spec(3, 1, fault_tolerance=replace(FT, lighthouse="vm")))
    with pytest.raises(SpecError, match="not host:port"):
        validate(make_spec(3, 1, fault_tolerance=replace(FT, lighthouse="10.0.0.1:99999")))
    with pytest.raises(SpecError, match="passes 65535"):
        validate(make_spec(3, 1, fault_tolerance=replace(FT, store_port=65535)))
    with pytest.raises(SpecError, match="secure_aggregation"):
        validate(make_spec(3, 1, fault_tolerance=FT, codec=CodecSpec(secure_aggregation=True)))


def test_the_quorum_view_averages_over_contributors_and_addresses_global_ranks() -> None:
    topo = Topology.of(make_spec(3, 2), 5)  # region 2, local rank 1
    v = view(topo, [0, 2], contributors=1)
    assert (v.regions, v.region_index, v.world_size) == (2, 1, 2)
    assert v.peer_ranks(1) == [1, 5]
    assert v.region_names == ("beijing", "silicon-valley")


def test_a_heal_moves_the_state_sealed_and_bound_to_its_request() -> None:
    key = os.urandom(32)
    donor = SealedTransport("127.0.0.1", key, "run-a")
    healer = SealedTransport("127.0.0.1", key, "run-a")
    try:
        state = {"w": torch.arange(6.0), "step": 7}
        donor.send_checkpoint([1], 7, state, timedelta(seconds=5))
        got = healer.recv_checkpoint(0, donor.metadata(), 7, timedelta(seconds=5))
        assert torch.equal(got["w"], state["w"]) and got["step"] == 7
        other = SealedTransport("127.0.0.1", os.urandom(32), "run-a")
        with pytest.raises(TransientReject, match="failed authentication"):
            other.recv_checkpoint(0, donor.metadata(), 7, timedelta(seconds=5))
        other.shutdown()
        donor.disallow_checkpoint()
        donor.wait_s = 0.1
        with pytest.raises(HTTPError):
            healer.recv_checkpoint(0, donor.metadata(), 7, timedelta(seconds=5))
    finally:
        donor.shutdown()
        healer.shutdown()


def test_a_sealed_body_replayed_for_another_challenge_fails() -> None:
    key = os.urandom(16)
    blob = seal(key, "sm4-gcm", b"state", b"challenge-1")
    assert unseal(key, "sm4-gcm", blob, b"challenge-1") == b"state"
    with pytest.raises(TransientReject):
        unseal(key, "sm4-gcm", blob, b"challenge-2")


# -- the stack places the Lighthouse -------------------------------------------------------
def _stack(tmp_path: Path, **ft: Any) -> Path:
    doc = yaml.safe_load((STACKS / "Pulumi.local.yaml").read_text())
    doc["config"]["geotrain:training"]["fault_tolerance"] = ft
    path = tmp_path / "Pulumi.ft.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_the_stack_places_the_lighthouse_on_a_region_at_its_private_address(
    tmp_path: Path,
) -> None:
    plan = build_plan(load_stack(str(_stack(tmp_path, lighthouse="frankfurt"))))
    ft = render_launch_spec(plan).fault_tolerance
    assert ft is not None
    host = plan.regions[1].nodes[0].private_ip
    assert ft.lighthouse == f"{host}:29510"
    assert ft.min_replicas == len(plan.regions) // 2 + 1  # the default: a majority
    spec = render_launch_spec(plan)
    assert LaunchSpec.from_json(spec.to_json()).fault_tolerance == ft


def test_a_lighthouse_on_an_unknown_place_or_too_many_replicas_is_a_config_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"fault_tolerance.lighthouse: 'mars' is no region"):
        load_stack(str(_stack(tmp_path, lighthouse="mars")))
    with pytest.raises(ConfigError, match=r"min_replicas: 9 exceeds the stack's 3 regions; use 2"):
        load_stack(str(_stack(tmp_path, lighthouse="beijing", min_replicas=9)))


@pytest.mark.parametrize(
    ("training", "words"),
    [
        ({"sync": "diloco", "diloco": {"inner_steps": 4, "tau": 1}}, "streaming DiLoCo"),
        ({"compression": {"quantize": "int8", "adaptive": {}}}, "compression.adaptive"),
        ({"balance": "throughput"}, "balance: throughput"),
        ({"exchange": "topology"}, "exchange: topology"),
    ],
)
def test_settings_only_the_main_loop_runs_are_refused_with_fault_tolerance(
    tmp_path: Path, training: dict[str, Any], words: str
) -> None:
    path = _stack(tmp_path, lighthouse="beijing")
    doc = yaml.safe_load(path.read_text())
    doc["config"]["geotrain:training"].update(training)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConfigError, match=f"cannot be combined with .*{re.escape(words)}"):
        load_stack(str(path))


def _edit(path: Path, edit: Any) -> Path:
    doc = yaml.safe_load(path.read_text())
    edit(doc["config"])
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_fault_tolerance_on_gpu_nodes_is_refused_until_the_quorum_loop_runs_cuda(
    tmp_path: Path,
) -> None:
    def gpus(cfg: dict[str, Any]) -> None:
        cfg["geotrain:regions"][1]["pool"]["nodes"][0]["gpu_type"] = "A100-80GB"

    path = _edit(_stack(tmp_path, lighthouse="beijing"), gpus)
    with pytest.raises(
        ConfigError, match=r"GPU nodes \(regions frankfurt\).*on CPU with gloo only"
    ):
        load_stack(str(path))
    spec = make_spec(2, 1, fault_tolerance=FT)
    node = replace(spec.regions[1].nodes[0], device="cuda")
    on_gpu = replace(spec, regions=[spec.regions[0], replace(spec.regions[1], nodes=[node])])
    with pytest.raises(SpecError, match=r"GPU nodes \(regions"):
        validate(on_gpu)


def test_conflicts_name_the_regions_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def uneven(cfg: dict[str, Any]) -> None:
        cfg["geotrain:regions"][2]["pool"]["nodes"][0]["gpus"] = 1

    path = _edit(_stack(tmp_path, lighthouse="beijing"), uneven)
    monkeypatch.chdir(tmp_path)  # a short source, as a user's: errors are clipped to a line
    with pytest.raises(ConfigError) as e:
        load_stack(path.name)
    assert "(beijing 2, frankfurt 2, silicon-valley 1)" in str(e.value)
    assert "give every region as many workers or turn fault_tolerance off" in str(e.value)


def test_a_lighthouse_named_like_a_region_and_another_regions_node_is_refused(
    tmp_path: Path,
) -> None:
    def rename(cfg: dict[str, Any]) -> None:
        cfg["geotrain:regions"][0]["pool"]["nodes"][0]["name"] = "frankfurt"

    path = _edit(_stack(tmp_path, lighthouse="frankfurt"), rename)
    with pytest.raises(ConfigError, match=r"could run on frankfurt or fra-0"):
        load_stack(str(path))


@pytest.mark.parametrize(
    ("ft", "key", "words"),
    [
        ({"heartbeat_timeout_s": 0.05}, "heartbeat_timeout_s", "beat every 0.1 s"),
        ({"join_timeout_s": 700}, "join_timeout_s", "not below quorum_timeout_s 600"),
        ({"port": 9403}, "port", "runtime metrics ports 9400-9405"),  # local: one per rank
        ({"store_port": 9398}, "store_port", "9400 on sv-0 collides with the runtime metrics"),
    ],
)
def test_fault_tolerance_timeouts_and_ports_that_would_fail_at_run_time_are_refused(
    tmp_path: Path, ft: dict[str, Any], key: str, words: str
) -> None:
    path = _stack(tmp_path, lighthouse="beijing", **ft)
    with pytest.raises(ConfigError, match=rf"fault_tolerance\.{key}: .*{re.escape(words)}"):
        load_stack(str(path))


def test_lighthouse_ports_collide_only_with_what_runs_on_its_node(tmp_path: Path) -> None:
    """The lab's Prometheus runs on fra-gw only, and lab nodes run no node exporter."""

    def lab(**ft: Any) -> Path:
        doc = yaml.safe_load((STACKS / "Pulumi.lab.yaml").read_text())
        doc["config"]["geotrain:training"]["fault_tolerance"] = ft
        path = tmp_path / "Pulumi.ftlab.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    with pytest.raises(ConfigError, match=r"port: 9090 on fra-gw collides with .*prometheus"):
        load_stack(str(lab(lighthouse="frankfurt", port=9090)))
    load_stack(str(lab(lighthouse="beijing", port=9090)))  # bj-gw: no Prometheus there
    load_stack(str(lab(lighthouse="beijing", port=9100)))  # lab nodes: no node exporter


def test_a_lighthouse_port_in_use_is_one_line_naming_the_setting() -> None:
    from training.ft.quorum import start_lighthouse

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = replace(FT, lighthouse=f"127.0.0.1:{s.getsockname()[1]}")
        with pytest.raises(SpecError, match=r"cannot start the Lighthouse .*in use.*\.port"):
            start_lighthouse(taken)


def test_the_launcher_of_the_lighthouse_node_hosts_it_and_no_other_launcher_does() -> None:
    spec = make_spec(2, 1, fault_tolerance=replace(FT, lighthouse="127.0.0.1:0", min_replicas=1))
    other = replace(spec.regions[0].nodes[0], host="10.9.0.1")
    with lighthouse_for(spec, [other], Path("spec.json")) as elsewhere:
        assert elsewhere is None
    with lighthouse_for(spec, spec.regions[0].nodes, Path("spec.json")) as addr:
        assert addr is not None and addr.startswith("127.0.0.1:")
        host, port = addr.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()


def test_every_quorum_listener_is_listed_at_a_node_address_for_the_policy_facts() -> None:
    spec = make_spec(2, 1, fault_tolerance=FT)
    ft = [e for e in listeners(spec) if e["service"] in QUORUM_SERVICES]
    assert {e["service"] for e in ft} == QUORUM_SERVICES
    assert {e["bind"] for e in ft} == {"127.0.0.1"}
    assert [e["port"] for e in ft if e["service"] == "region-store"] == [29600, 29601]
    assert not [e for e in listeners(make_spec(2, 1)) if e["service"] in QUORUM_SERVICES]


# -- torchrun restarts a failed region alone (training.launch.launcher, real torchrun agents) --
STUB = """
import json, os, sys, time
node, codes, holds, until = sys.argv[1], *(a.split(",") for a in sys.argv[2:5])
local, run = os.environ["LOCAL_RANK"], os.environ["GEOTRAIN_RUN_DIR"]
with open(f"{run}/starts-{node}-{local}", "a+") as f:  # starts so far, this one too
    f.write("x")
    f.seek(0)
    n = len(f.read()) - 1
seen = {v: os.environ[v] for v in ("RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")}
seen |= {"restart": os.environ["TORCHELASTIC_RESTART_COUNT"], "node": node, "local": local}
with open(f"{run}/env.jsonl", "a") as f:
    f.write(json.dumps(seen) + "\\n")
code = int(codes[n])
for w in filter(None, until if code == 0 else []):  # ends once others came back (file:starts)
    path, count = f"{run}/starts-" + w.split(":")[0], int(w.split(":")[1])
    deadline = time.time() + 60
    while time.time() < deadline:
        if os.path.exists(path) and len(open(path).read()) >= count:
            break
        time.sleep(0.05)
if code == 2:  # bad input: the worker records it before it exits (torchrun.record_failure)
    with open(os.environ["GEOTRAIN_EVENTS"], "a") as f:
        e = {"event": "failed", "node": node, "local_rank": int(local), "exit_code": 2}
        f.write(json.dumps({**e, "reason": "bad input", "t": time.time()}) + "\\n")
time.sleep(float(holds[n]))
sys.exit(code)
"""


def _supervise(
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[int],
    workers: dict[str, tuple[str, str, str]],
) -> tuple[launch.LaunchResult, Path]:
    """Every region's torchrun (one job per region) running STUB; `workers[node]`: exit
    codes per start, seconds each start holds, what it waits for first."""
    from training.ft.testing import free_base

    ft = replace(FT, store_port=free_base(len(sizes)))
    spec = make_spec(len(sizes), sizes, fault_tolerance=ft, max_restarts=2)
    (tmp / "stub.py").write_text(STUB)

    def entry(spec_path: Path, node: Any) -> list[str]:
        return [str(tmp / "stub.py"), node.name, *workers[node.name]]

    monkeypatch.setattr(launch, "worker_entry", entry)
    nodes = [n for r in spec.regions for n in r.nodes]
    result = launch.LaunchResult()
    launch.Supervisor(spec, tmp / "spec.json", nodes, tmp / "run", result).run(None, None)
    return result, tmp / "run"


def _starts(run: Path, worker: str) -> int:
    return len((run / f"starts-{worker}").read_text())


def test_torchrun_restarts_a_failed_or_cut_off_region_alone_while_the_others_train_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """frankfurt's worker is killed (137), silicon-valley's lost its quorum (3) while
    beijing (two workers) trains on; each region's torchrun restarts its own workers,
    with the region as its world. Nobody ends before both came back."""
    result, run = _supervise(
        tmp_path,
        monkeypatch,
        [2, 1, 1],
        {
            "n0": ("0", "0", "n1-0:2,n2-0:2"),
            "n1": ("137,0", "0.2,0", "n2-0:2"),
            "n2": ("3,0", "0.2,0", "n1-0:2"),
        },
    )
    assert result.ok, result
    assert sorted((a.rc, a.failed) for a in result.attempts[:-1]) == [(3, "n2/0"), (137, "n1/0")]
    starts = {w: _starts(run, w) for w in ("n0-0", "n0-1", "n1-0", "n2-0")}
    assert starts == {"n0-0": 1, "n0-1": 1, "n1-0": 2, "n2-0": 2}
    seen = [json.loads(line) for line in (run / "env.jsonl").read_text().splitlines()]
    assert {(e["node"], e["WORLD_SIZE"]) for e in seen} == {("n0", "2"), ("n1", "1"), ("n2", "1")}
    assert sorted(e["restart"] for e in seen if e["node"] != "n0") == ["0", "0", "1", "1"]
    assert {e["restart"] for e in seen if e["node"] == "n0"} == {"0"}
    assert {e["MASTER_ADDR"] for e in seen} == {"127.0.0.1"}  # --local-addr, the node's


def test_a_region_out_of_restarts_leaves_the_others_training_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, run = _supervise(
        tmp_path,
        monkeypatch,
        [1, 1],
        {"n0": ("0", "2", "n1-0:3"), "n1": ("137,137,137", "0,0,0", "")},
    )
    assert result.ok, result  # beijing ended the run (2 s after frankfurt's last failure)
    assert _starts(run, "n0-0") == 1 and _starts(run, "n1-0") == 3  # max_restarts 2
    assert [a.failed for a in result.attempts[:-1]] == ["n1/0"] * 3


def test_bad_input_in_one_region_stops_every_region_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, run = _supervise(
        tmp_path, monkeypatch, [1, 1], {"n0": ("0", "60", ""), "n1": ("2", "0", "")}
    )
    [only] = result.attempts
    assert (only.rc, only.failed) == (2, "n1/0")
    assert only.seconds < 30  # not restarted to its end, nor the other region run on
    # torchrun may have started it again before the launcher read the event: then that
    # start was stopped too (a second start of the stand-in would exit 1, not 0)
    assert _starts(run, "n1-0") <= 2


def test_a_region_failing_after_another_finished_the_run_is_stopped_not_awaited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody is left to heal from: its restart would train alone to no end."""
    result, _ = _supervise(
        tmp_path, monkeypatch, [1, 1], {"n0": ("0", "0", ""), "n1": ("137,0", "5,60", "")}
    )
    assert result.ok
    assert result.attempts[-1].seconds < launch.FINISH_GRACE_S


def test_top_shows_the_quorum_size_and_the_regions_it_leaves_out() -> None:
    m = RuntimeMetrics("beijing", "bj-0", 0)
    m.step.set(7)
    v = RegionView(targets=1, up=1)
    _fold(v, generate_latest(m.registry).decode())
    assert "quorum" not in format_top({"beijing": v})  # no fault_tolerance: no column
    m.quorum(["beijing", "singapore"], ["frankfurt"])
    v = RegionView(targets=1, up=1)
    _fold(v, generate_latest(m.registry).decode())
    out = format_top({"beijing": v})
    assert out.splitlines()[0].endswith("quorum") and out.splitlines()[1].endswith("2")
    assert out.splitlines()[-1] == "left out of the training quorum: frankfurt"


def _late_member(rank: int, world: int, meet: bool) -> str:
    """Rank 1 arrives 3 s late at a group whose collectives time out after 1 s (a member
    healing into a new quorum); rank 0 waits at `arrived` or at a plain barrier."""
    import time

    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(3)  # the heal: the donor's state crossing the WAN
    try:
        arrived(group, 30) if meet else group.barrier().wait()
    except RuntimeError as e:
        return f"failed: {e}"[:80]
    x = torch.ones(2)
    dist.all_reduce(x, group=group)
    return f"ok {x.tolist()}"


def test_a_member_healing_longer_than_timeout_s_still_meets_the_others() -> None:
    assert run_world(_late_member, 2, True) == ["ok [2.0, 2.0]"] * 2
    # the group's own timeout: the others give up while it heals
    assert run_world(_late_member, 2, False)[0].startswith("failed")
