"""DiLoCo's drift correction (`drift_correction: scaffold`, training.diloco): the control
variates' arithmetic, its exact no-op with one region, its fix of client drift on a toy
problem whose regions disagree (real gloo worlds), its state through a checkpoint and a
heal, and the settings it refuses."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from pydantic import ValidationError

from geotrain.cli import cli
from training.comm.topology import Topology, make_groups
from training.errors import SpecError
from training.gradsync import buckets
from training.spec import CodecSpec, DilocoSpec
from training.sync.codec import Codec
from training.sync.diloco import DiLoCo
from training.sync.hier import HierarchicalAllReduce
from training.testing import PerBucket, make_spec, run_world

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))
SCAFFOLD = "scaffold"


class _Peer(PerBucket):
    """A two-region average where the other region's pseudo-gradient is fixed: `other`."""

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        return (x + self.other) / 2


def _walk(d: DiLoCo, steps: int, own_step: torch.Tensor, start: int = 0) -> None:
    """`steps` inner steps that each move the weights by -own_step (the inner optimizer),
    then the drift correction (step_done)."""
    for s in range(start, start + steps):
        with torch.no_grad():
            d.params[0].sub_(own_step)
        d.step_done(s)


def test_control_variates_are_the_mean_steps_and_the_correction_persists() -> None:
    """Inner steps of a (own) against another region whose mean step is b: after a round
    of K steps c = (a + b) / 2 and c_i = a; the next round each step is corrected by
    -(c - c_i), so the region moves by c per step, and c_i is still a: the correction is
    taken back out of the pseudo-gradient, so it does not cancel itself a round later."""
    K = 4
    a, b = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 2.0])
    d = DiLoCo(
        [[torch.nn.Parameter(torch.zeros(2))]],
        DilocoSpec(every_steps=K, outer_lr=1.0, outer_momentum=0.0, drift_correction=SCAFFOLD),
        _Peer(K * b),
    )
    _walk(d, K, a)
    assert d.round_steps == K
    d.merge(K - 1)
    c = (a + b) / 2
    assert torch.allclose(d.drift[0], c) and torch.allclose(d.own_drift[0], a)
    assert d.round_steps == 0
    start = d.params[0].detach().clone()
    peer = d.sync
    assert isinstance(peer, _Peer)
    peer.other = K * c  # the other region, corrected too, moves by c per step as well
    _walk(d, K, a, start=K)
    assert torch.allclose(start - d.params[0], K * c)  # corrected: the mean step, not a
    d.merge(2 * K - 1)
    assert torch.allclose(d.own_drift[0], a), d.own_drift[0]  # naive d_i / K would give c
    assert torch.allclose(d.drift[0], c)


class _FailsOnce(_Peer):
    """Fails the second bucket's exchange of the second merge (step 3) once, as a quorum
    round cut off midway."""

    failed = False

    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        if step == 3 and bucket == 1 and not self.failed:
            self.failed = True
            raise RuntimeError("peer lost")
        return super().all_reduce(x, step, bucket)


def test_a_merge_that_fails_midway_and_runs_again_updates_the_drift_once() -> None:
    """training.ft.loop runs a failed round again: c and c_i come out as from one merge."""
    spec = DilocoSpec(every_steps=2, outer_lr=1.0, outer_momentum=0.0, drift_correction=SCAFFOLD)
    own, other = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])

    def two_rounds(sync: _Peer) -> DiLoCo:
        d = DiLoCo(
            [[torch.nn.Parameter(torch.zeros(2))], [torch.nn.Parameter(torch.zeros(2))]], spec, sync
        )
        for r in range(2):
            for s in (2 * r, 2 * r + 1):
                with torch.no_grad():
                    for p in d.params:
                        p.sub_(own)
                d.step_done(s)
            if r == 1 and isinstance(sync, _FailsOnce):
                with pytest.raises(RuntimeError, match="peer lost"):
                    d.merge(2 * r + 1)
            d.merge(2 * r + 1)
        return d

    clean, retried = two_rounds(_Peer(2 * other)), two_rounds(_FailsOnce(2 * other))
    for a, b in zip(clean.drift + clean.own_drift, retried.drift + retried.own_drift, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(clean.params[1], retried.params[1])


def test_drift_none_keeps_no_control_variates_and_the_old_checkpoint_keys() -> None:
    d = DiLoCo(
        [[torch.nn.Parameter(torch.zeros(2))]], DilocoSpec(every_steps=2), _Peer(torch.zeros(2))
    )
    assert d.drift == [] and d.region_state_dict() == {}
    assert set(d.state_dict()) == {"params", "outer"}


# -- real worlds --------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 6, generator=g)
    return x, (x @ torch.linspace(-1, 1, 6) + rank).sin().unsqueeze(1)  # per-rank data


def _one_region(rank: int, world: int, drift: str, steps: int) -> dict[str, Any]:
    """One region of `world` ranks, AdamW inner steps, DiLoCo H=3 with the outer Nesterov
    default, through the real sync (int8, error feedback)."""
    topo = Topology.of(make_spec(1, world), rank)
    groups = make_groups(topo, torch.device("cpu"))
    codec = Codec(CodecSpec(quantize="int8", cipher="sm4-gcm"), KEY)
    sync = HierarchicalAllReduce(topo, groups, codec, "test-run", error_feedback=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    spec = DilocoSpec(every_steps=3, drift_correction=drift)  # type: ignore[arg-type]
    d = DiLoCo(buckets(list(model.parameters()), 2e-4), spec, sync)
    weights = []
    for step in range(steps):
        model.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # the in-region average
            assert p.grad is not None
            torch.distributed.all_reduce(p.grad, group=groups.intra)
            p.grad.div_(world)
        opt.step()
        d.step_done(step)
        if d.due(step, steps):
            d.merge(step)
        weights.append([p.detach().clone() for p in model.parameters()])
    return {"weights": weights, "c": sum(c.abs().sum().item() for c in d.drift)}


def test_one_region_scaffold_is_bitwise_plain_diloco() -> None:
    """c == c_i when the merge averages one region with itself: every weight of every step
    equals the uncorrected run's, bit for bit, though c itself is far from zero."""
    steps = 10
    plain = run_world(_one_region, 2, "none", steps)
    fixed = run_world(_one_region, 2, SCAFFOLD, steps)
    assert fixed[0]["c"] > 1e-3  # the control variates were computed: the test can fail
    for r in range(2):
        for s in range(steps):
            for a, b in zip(plain[r]["weights"][s], fixed[r]["weights"][s], strict=True):
                assert torch.equal(a, b), (r, s)


CURVATURE = (torch.tensor([1.0, 0.1, 0.5, 1.5]), torch.tensor([0.1, 1.0, 1.5, 0.2]))
OPTIMUM = (torch.tensor([1.0, -1.0, 2.0, 0.0]), torch.tensor([-1.0, 1.0, 0.0, 2.0]))


def _quadratic(rank: int, world: int, drift: str, rounds: int, h: int) -> dict[str, Any]:
    """Region i (one rank each) minimises 0.5 sum A_i (x - a_i)^2 with inner SGD lr 0.1,
    merged by plain averaging every h steps through the real sync (no quantization).
    Returns the final global weights and the regions' spread just before the last merge."""
    topo = Topology.of(make_spec(world, 1), rank)
    groups = make_groups(topo, torch.device("cpu"))
    sync = HierarchicalAllReduce(
        topo, groups, Codec(CodecSpec(quantize="none", cipher="none"), KEY), "test-run"
    )
    x = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([x], lr=0.1)
    spec = DilocoSpec(every_steps=h, outer_lr=1.0, outer_momentum=0.0, drift_correction=drift)  # type: ignore[arg-type]
    d = DiLoCo([[x]], spec, sync)
    steps = rounds * h
    for step in range(steps):
        opt.zero_grad()
        (0.5 * (CURVATURE[rank] * (x - OPTIMUM[rank]) ** 2).sum()).backward()
        opt.step()
        d.step_done(step)
        if d.due(step, steps):
            last_local = x.detach().clone()
            d.merge(step)
    return {"x": x.detach().clone(), "local": last_local}


def test_scaffold_takes_two_disagreeing_regions_to_the_joint_optimum() -> None:
    """Two regions with different optima and curvatures: averaging their H-step SGD runs
    (FedAvg) settles off the joint optimum sum(A_i a_i) / sum(A_i), and each region ends
    its rounds near its own optimum; with scaffold both regions walk toward the joint one."""
    target = sum(A * a for A, a in zip(CURVATURE, OPTIMUM, strict=True)) / sum(CURVATURE)
    plain = run_world(_quadratic, 2, "none", 40, 10)
    fixed = run_world(_quadratic, 2, SCAFFOLD, 40, 10)
    err_plain = (plain[0]["x"] - target).norm().item()
    err_fixed = (fixed[0]["x"] - target).norm().item()
    assert err_plain > 0.05, err_plain  # client drift biases plain averaging here
    assert err_fixed < 0.1 * err_plain, (err_fixed, err_plain)
    spread = [(r[0]["local"] - r[1]["local"]).norm().item() for r in (plain, fixed)]
    assert spread[1] < 0.5 * spread[0], spread  # the regions' rounds stay closer together


# -- state --------------------------------------------------------------------------------
def test_state_round_trip_and_heal_carry_the_control_variates() -> None:
    """A DiLoCo restored from state_dict + region_state_dict mid-round continues bitwise; one
    restored without its region state (c_i) does not. A healed one restarts c_i at c."""
    spec = DilocoSpec(every_steps=3, outer_lr=1.0, outer_momentum=0.0, drift_correction=SCAFFOLD)
    a, step = torch.tensor([0.5, -1.0]), torch.tensor([0.25, 0.75])

    def made() -> DiLoCo:
        return DiLoCo([[torch.nn.Parameter(torch.zeros(2))]], spec, _Peer(3 * step))

    def run(d: DiLoCo, start: int, steps: int) -> None:
        for s in range(start, start + steps):
            _walk(d, 1, a, start=s)
            if d.due(s, 100):
                d.merge(s)

    first = made()
    run(first, 0, 7)  # two merges, then one step into the third round
    saved, own = copy.deepcopy(first.state_dict()), copy.deepcopy(first.region_state_dict())
    assert saved["round_steps"] == 1 and set(own) == {"own_drift"}
    weights = first.params[0].detach().clone()

    def restored(with_own: bool) -> DiLoCo:
        d = made()
        d.load_state_dict(saved)
        if with_own:
            d.load_region_state_dict(own)
        with torch.no_grad():
            d.params[0].copy_(weights)
        return d

    again, lost = restored(True), restored(False)
    for d in (first, again, lost):
        run(d, 7, 5)
    assert torch.equal(first.params[0], again.params[0])
    assert torch.equal(first.own_drift[0], again.own_drift[0])
    assert not torch.equal(first.params[0], lost.params[0])

    healed = restored(False)
    healed.restart_drift()
    assert torch.equal(healed.own_drift[0], healed.drift[0])
    before = healed.params[0].detach().clone()
    _walk(healed, 1, torch.zeros(2), start=7)
    assert torch.equal(healed.params[0], before)  # c_i == c: no correction


# -- validation ---------------------------------------------------------------------------
def test_scaffold_with_streaming_is_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="set fragments: 1 and tau: 0"):
        DilocoSpec(every_steps=10, fragments=2, drift_correction=SCAFFOLD)
    with pytest.raises(ValidationError, match="whole-model merges"):
        DilocoSpec(every_steps=10, tau=2, drift_correction=SCAFFOLD)
    DilocoSpec(every_steps=None, interval_minutes=5, drift_correction=SCAFFOLD)  # time-based: ok
    built = DilocoSpec(every_steps=10, fragments=2)
    object.__setattr__(built, "drift_correction", SCAFFOLD)  # as if it skipped validation
    two = [[torch.nn.Parameter(torch.zeros(2))], [torch.nn.Parameter(torch.zeros(2))]]
    with pytest.raises(SpecError, match="fragments: 1"):
        DiLoCo(two, built, _Peer(torch.zeros(2)))


def _stack(write_stack: Any, **diloco: Any) -> Any:
    def mutate(c: dict[str, Any]) -> None:
        t = c["geotrain:training"]
        t["sync"] = "diloco"
        t["steps"] = 20
        t["diloco"] = {"inner_steps": 5, **diloco}

    return write_stack("local", mutate, name="dl")


def test_stack_scaffold_validates_renders_and_refuses_streaming(write_stack: Any) -> None:
    from infra.model import load_stack
    from infra.plan import build_plan
    from infra.render.runtime import render_launch_spec

    ok = _stack(write_stack, drift_correction=SCAFFOLD)
    r = CliRunner().invoke(cli, ["validate", "--stack", str(ok)])
    assert r.exit_code == 0, r.output
    assert render_launch_spec(build_plan(load_stack(str(ok)))).diloco.drift_correction == SCAFFOLD
    bad = _stack(write_stack, drift_correction=SCAFFOLD, fragments=2, tau=1)
    r = CliRunner().invoke(cli, ["validate", "--stack", str(bad)])
    assert r.exit_code == 2, r.output
    assert "training.diloco.drift_correction" in r.output and "fragments: 1" in r.output
