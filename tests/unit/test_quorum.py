"""training.quorum's validation and view, and training.heal's sealed transport."""

from __future__ import annotations

import os
import re
import socket
import sys
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
from training import ft_launch
from training.errors import ConfigError, SpecError, TransientReject
from training.ft_launch import run_regions
from training.heal import SealedTransport, seal, unseal
from training.metrics import RuntimeMetrics
from training.quorum import arrived, lighthouse_for, validate, view
from training.spec import AdaptiveSpec, CodecSpec, FaultToleranceSpec, LaunchSpec, listeners
from training.testing import make_spec, run_world
from training.topology import Topology

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


# -- the launcher restarts a failed region alone --------------------------------------------
def _fake_workers(
    monkeypatch: pytest.MonkeyPatch,
    tmp: Path,
    codes: dict[str, list[int]],
    holds: dict[str, float] | None = None,
) -> None:
    """Workers that count their starts in tmp/<node>, run holds[node] seconds (default:
    region 0 a while, the others not at all) and exit with codes[node][start]."""
    script = (
        "import sys, time, pathlib\n"
        "p = pathlib.Path(sys.argv[1]); n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1)); time.sleep(float(sys.argv[3]))\n"
        "sys.exit(int(sys.argv[2].split(',')[n]))\n"
    )

    def command(spec_path: Path, node: Any, local_rank: int) -> list[str]:
        c = codes[node.name]
        hold = str((holds or {"n0": 0.6}).get(node.name, 0))
        return [sys.executable, "-c", script, str(tmp / node.name), ",".join(map(str, c)), hold]

    monkeypatch.setattr(ft_launch, "worker_command", command)


def _starts(tmp: Path, node: str) -> int:
    return int((tmp / node).read_text())


def test_a_failed_region_restarts_alone_while_the_other_trains_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec(2, 1, fault_tolerance=FT, max_restarts=2)
    _fake_workers(monkeypatch, tmp_path, {"n0": [0], "n1": [137, 0]})
    nodes = [n for r in spec.regions for n in r.nodes]
    attempt = run_regions(spec, tmp_path / "spec.json", nodes, dict(os.environ), tmp_path / "logs")
    assert attempt.rc == 0
    assert (_starts(tmp_path, "n0"), _starts(tmp_path, "n1")) == (1, 2)


def test_a_region_that_lost_its_quorum_restarts_alone_while_the_others_train_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A region cut off loses its quorum (exit 3) while the majority trains on: one
    launcher running every region must not stop the others with it."""
    spec = make_spec(2, 1, fault_tolerance=FT, max_restarts=2)
    _fake_workers(monkeypatch, tmp_path, {"n0": [0], "n1": [3, 0]})
    nodes = [n for r in spec.regions for n in r.nodes]
    attempt = run_regions(spec, tmp_path / "spec.json", nodes, dict(os.environ), tmp_path / "logs")
    assert attempt.rc == 0
    assert (_starts(tmp_path, "n0"), _starts(tmp_path, "n1")) == (1, 2)


def test_bad_input_ends_the_attempt_of_every_region(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec(2, 1, fault_tolerance=FT, max_restarts=2)
    _fake_workers(monkeypatch, tmp_path, {"n0": [0], "n1": [2]})
    nodes = [n for r in spec.regions for n in r.nodes]
    attempt = run_regions(spec, tmp_path / "spec.json", nodes, dict(os.environ), tmp_path / "logs")
    assert (attempt.rc, attempt.failed) == (2, "n1/0")
    assert _starts(tmp_path, "n1") == 1


def test_a_region_that_fails_after_another_finished_the_run_is_not_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec(2, 1, fault_tolerance=FT, max_restarts=2)
    _fake_workers(monkeypatch, tmp_path, {"n0": [0], "n1": [137, 0]}, {"n0": 0, "n1": 0.6})
    nodes = [n for r in spec.regions for n in r.nodes]
    attempt = run_regions(spec, tmp_path / "spec.json", nodes, dict(os.environ), tmp_path / "logs")
    assert attempt.rc == 0  # nobody is left to heal from: the run is done
    assert _starts(tmp_path, "n1") == 1


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
