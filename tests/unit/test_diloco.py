"""training.diloco.DiLoCo on real gloo worlds, driven by a tiny regression model with a plain
SGD inner optimizer, against per-step all-reduce training of the same model on the same data."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from geotrain.cli import cli
from training.comm.topology import Groups, Topology, make_groups
from training.gradsync import buckets, hierarchical_step, region_average_grads
from training.spec import CodecSpec, DilocoSpec, LaunchSpec
from training.sync.codec import Codec
from training.sync.diloco import DiLoCo, outer_hint, suggested_outer_lr
from training.sync.hier import HierarchicalAllReduce
from training.testing import PerBucket, make_spec, run_world

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))
BUCKET_MB = 2e-4  # ~50 floats: the model's parameters travel in several buckets
LR = 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(7)  # identical initial weights on every rank and in every run
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own data (different per rank, the same in every run)."""
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.linspace(-1, 1, 6)
    out = []
    for _ in range(steps):
        x = torch.randn(16, 6, generator=g)
        out.append((x, (x @ w).sin().unsqueeze(1)))
    return out


def _eval_loss(model: torch.nn.Module) -> float:
    x, y = _batches(999, 1)[0]
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def _sync(topo: Topology, groups: Groups, cipher: str) -> HierarchicalAllReduce:
    codec = Codec(CodecSpec(quantize="none", cipher=cipher), KEY)
    return HierarchicalAllReduce(topo, groups, codec, "test-run", error_feedback=False)


def _grads(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    return loss.item()


def _region_average(model: torch.nn.Module, groups: Groups, local: int) -> None:
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad, group=groups.intra)
        p.grad.div_(local)


def _train(
    rank: int, regions: int, local: int, steps: int, diloco: DilocoSpec | None, cipher: str
) -> dict[str, Any]:
    """`steps` SGD steps: per-step all-reduce (diloco None), or the DiLoCo class's
    schedule (warm-up steps all-reduced, then in-region steps and merges).
    Returns the weights after every step and the final eval loss."""
    topo = Topology.of(make_spec(regions, local), rank)
    groups = make_groups(topo, torch.device("cpu"))
    sync = _sync(topo, groups, cipher)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # no momentum, no weight decay
    parts = buckets(list(model.parameters()), BUCKET_MB)
    d = DiLoCo(parts, diloco, sync) if diloco else None
    weights, merged, warm_end = [], [], None
    for step, batch in enumerate(_batches(rank, steps)):
        _grads(model, batch)
        if d is None or d.warming(step):
            hierarchical_step(model, sync, step, BUCKET_MB)
        else:
            _region_average(model, groups, local)
        opt.step()
        if d is not None:
            d.step_done(step)
            if diloco is not None and step + 1 == diloco.warmup_steps:
                warm_end = [g.clone() for g in d.global_params]
            if d.due(step, steps):
                d.merge(step)
                merged.append(step + 1)
        weights.append([p.detach().clone() for p in model.parameters()])
    return {"weights": weights, "loss": _eval_loss(model), "merged": merged, "warm_end": warm_end}


def _world(regions: int, local: int, steps: int, diloco: DilocoSpec | None, cipher: str) -> Any:
    return run_world(_world_fn, regions * local, regions, local, steps, diloco, cipher)


def _world_fn(rank: int, world: int, *args: Any) -> dict[str, Any]:
    return _train(rank, *args)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("cipher", ["none", "sm4-gcm"])
def test_h1_with_outer_sgd_lr_1_equals_per_step_all_reduce_training(cipher: str) -> None:
    """H=1, inner SGD, outer SGD (lr 1, momentum 0): global - (global - local) averaged is
    the all-reduce step, to floating-point rounding."""
    steps = 5
    ref = _world(2, 2, steps, None, cipher)
    spec = DilocoSpec(every_steps=1, outer_lr=1.0, outer_momentum=0.0)
    dl = _world(2, 2, steps, spec, cipher)
    assert dl[0]["merged"] == [1, 2, 3, 4, 5]
    for r in range(4):
        for s in range(steps):
            assert _max_diff(dl[r]["weights"][s], ref[r]["weights"][s]) < 1e-6, (r, s)
    # and the data differ per rank: an in-region-only step (no merge) would not match
    drift = _world(
        2, 2, steps, DilocoSpec(every_steps=steps, outer_lr=1.0, outer_momentum=0.0), cipher
    )
    assert _max_diff(drift[0]["weights"][0], ref[0]["weights"][0]) > 1e-4


def test_one_region_diloco_is_no_worse_than_per_step_training() -> None:
    """One region of two ranks, H=4 with the default outer Nesterov (lr 0.7, momentum 0.9)."""
    steps = 40
    ref = _world(1, 2, steps, None, "none")
    dl = _world(1, 2, steps, DilocoSpec(every_steps=4), "none")
    first = _eval_loss(_model())
    assert ref[0]["loss"] < 0.8 * first  # the per-step run learned: the comparison means something
    assert dl[0]["merged"] == list(range(4, steps + 1, 4))
    assert dl[0]["loss"] <= ref[0]["loss"] * 1.05, (dl[0]["loss"], ref[0]["loss"])


def test_a_one_rank_region_keeps_its_inner_gradients_without_a_collective() -> None:
    """A region of one rank has nothing to average: its gradients are left as they are
    (no copy in or out, no collective: no process group exists here) and a parameter
    autograd left without one gets zeros, as the average over a bigger region gives."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 3), "unused": torch.nn.Linear(4, 3)})
    model["used"](torch.randn(5, 4)).square().sum().backward()
    before = {n: p.grad for n, p in model.named_parameters()}
    values = {n: None if g is None else g.clone() for n, g in before.items()}
    job = SimpleNamespace(
        model=model, topo=SimpleNamespace(local_size=1), groups=SimpleNamespace(intra=None)
    )
    assert not dist.is_initialized()
    region_average_grads(job)  # type: ignore[arg-type]
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        if n.startswith("used"):
            assert p.grad is before[n] and torch.equal(p.grad, values[n]), n
        else:
            assert values[n] is None and torch.count_nonzero(p.grad) == 0, n


def test_warmup_steps_are_bitwise_all_reduce_steps_then_diloco_starts_from_them() -> None:
    """warmup 3, H 2, 8 steps: steps 1-3 bitwise the all-reduce run's, the global copy is the
    step-3 weights, merges follow at 5, 7 and the last step, and step 4 (in-region) differs."""
    w, steps = 3, 8
    ref = _world(2, 2, steps, None, "sm4-gcm")
    dl = _world(2, 2, steps, DilocoSpec(every_steps=2, warmup_steps=w), "sm4-gcm")
    for r in range(4):
        for s in range(w):
            assert all(
                torch.equal(a, b)
                for a, b in zip(dl[r]["weights"][s], ref[r]["weights"][s], strict=True)
            ), (r, s)
        assert all(
            torch.equal(a, b)
            for a, b in zip(dl[r]["warm_end"], dl[r]["weights"][w - 1], strict=True)
        )
        assert _max_diff(dl[r]["weights"][w], ref[r]["weights"][w]) > 1e-6
    assert dl[0]["merged"] == [5, 7, 8]


def test_schedule_counts_merges_from_the_end_of_the_warmup() -> None:
    d = DiLoCo(
        [[torch.nn.Parameter(torch.zeros(2))]], DilocoSpec(every_steps=3, warmup_steps=2), _NoSync()
    )
    due = [s + 1 for s in range(10) if d.due(s, 10)]
    assert due == [5, 8, 10]
    assert [d.warming(s) for s in range(3)] == [True, True, False]
    timed = DiLoCo(
        [[torch.nn.Parameter(torch.zeros(2))]],
        DilocoSpec(every_steps=None, interval_minutes=1, warmup_steps=2),
        _NoSync(),
    )
    now = timed.last_merge + 61
    assert [timed.time_due(s, now) for s in range(3)] == [False, False, True]
    assert not timed.due(5, 10)  # time-based only: no step-based merge before the last step


class _NoSync(PerBucket):
    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        return x


def test_outer_lr_rule_rises_with_regions_between_the_anchors() -> None:
    assert [suggested_outer_lr(r) for r in (1, 2, 4, 6, 8, 16)] == [0.6, 0.6, 0.6, 0.7, 0.8, 0.8]
    assert outer_hint(3, 0.7, 0.9) is None
    hint = outer_hint(8, 0.3, 0.9)
    assert hint is not None and "suggests outer_lr 0.80" in hint
    assert outer_hint(3, 0.6, 0.0) is not None  # outer SGD at lr 0.6: neither
    assert outer_hint(3, 1.0, 0.0) is None  # plain averaging: measured best over tens of merges
    assert "plain averaging (outer_lr 1, outer_momentum 0)" in (outer_hint(3, 1.4, 0.0) or "")


def _diloco_stack(write_stack: Any, **diloco: Any) -> Any:
    def mutate(c: dict[str, Any]) -> None:
        t = c["geotrain:training"]
        t["sync"] = "diloco"
        t["steps"] = 20
        t["diloco"] = {"inner_steps": 5, **diloco}

    return write_stack("local", mutate, name="dl")


def test_validate_hints_at_an_outer_lr_off_the_rule(write_stack: Any) -> None:
    r = CliRunner().invoke(cli, ["validate", "--stack", str(_diloco_stack(write_stack))])
    assert r.exit_code == 0 and "outer_lr" not in r.output, r.output  # 3 regions, 0.7: near 0.6
    f = _diloco_stack(write_stack, outer_lr=2.0)
    r = CliRunner().invoke(cli, ["validate", "--stack", str(f)])
    assert r.exit_code == 0 and "the rule suggests outer_lr 0.60" in r.output, r.output


def test_warmup_of_all_the_steps_is_a_one_line_error(write_stack: Any) -> None:
    r = CliRunner().invoke(
        cli, ["validate", "--stack", str(_diloco_stack(write_stack, warmup_steps=20))]
    )
    assert r.exit_code == 2 and "warmup_steps" in r.output and "< training.steps" in r.output
    ok = CliRunner().invoke(
        cli, ["validate", "--stack", str(_diloco_stack(write_stack, warmup_steps=19))]
    )
    assert ok.exit_code == 0, ok.output


def test_render_carries_warmup_steps_into_the_launch_spec(write_stack: Any) -> None:
    from infra.model import load_stack
    from infra.plan import build_plan
    from infra.render.runtime import render_launch_spec

    spec = render_launch_spec(
        build_plan(load_stack(str(_diloco_stack(write_stack, warmup_steps=4))))
    )
    assert spec.diloco.warmup_steps == 4
    assert LaunchSpec.from_json(spec.to_json()).diloco.warmup_steps == 4


def _walk(d: DiLoCo, steps: int, start: int = 0) -> None:
    """Local updates and a merge each step (a one-rank world: the sync is the identity)."""
    for s in range(start, start + steps):
        with torch.no_grad():
            for p in d.params:
                p.sub_(0.1 * torch.cos(p + s))
        d.merge(s)


def test_state_round_trip_continues_the_outer_momentum_bitwise() -> None:
    spec = DilocoSpec(every_steps=1)  # Nesterov, momentum 0.9: the buffer matters
    a = DiLoCo([[torch.nn.Parameter(torch.arange(4.0))]], spec, _NoSync())
    _walk(a, 3)
    saved = copy.deepcopy(a.state_dict())
    assert set(saved) == {"params", "outer"}  # the checkpoint's "global" key, as before
    b = DiLoCo([[torch.nn.Parameter(a.params[0].detach().clone())]], spec, _NoSync())
    b.load_state_dict(saved)
    _walk(a, 2, start=3)
    _walk(b, 2, start=3)
    assert torch.equal(a.global_params[0], b.global_params[0])
    fresh = DiLoCo([[torch.nn.Parameter(torch.arange(4.0))]], spec, _NoSync())
    fresh.global_params[0].data.copy_(saved["params"]["0"])  # weights but no momentum
    with torch.no_grad():
        fresh.params[0].copy_(saved["params"]["0"])
    _walk(fresh, 2, start=3)
    assert not torch.equal(a.global_params[0], fresh.global_params[0])


def test_growing_h_doubles_the_interval_from_the_start_value_up_to_h() -> None:
    """start 2, H 10, warm-up 1: rounds of 2, 4, 8, then 10 (the doubling stops at H),
    counted from the warm-up's end, plus the last step."""
    spec = DilocoSpec(every_steps=10, every_steps_start=2, warmup_steps=1)
    d = DiLoCo([[torch.nn.Parameter(torch.zeros(2))]], spec, _NoSync())
    assert [s + 1 for s in range(40) if d.due(s, 40)] == [3, 7, 15, 25, 35, 40]
    same = DiLoCo(
        [[torch.nn.Parameter(torch.zeros(2))]],
        DilocoSpec(every_steps=4, every_steps_start=4),
        _NoSync(),
    )
    assert [s + 1 for s in range(12) if same.due(s, 12)] == [4, 8, 12]


def test_early_h_keeps_the_start_interval_for_its_steps_then_h() -> None:
    """start 3 for 10 steps, H 10, warm-up 1: early rounds of 3 (3 whole ones: the 10
    steps rounded down to 9), then rounds of 10 counted from there, plus the last step."""
    spec = DilocoSpec(every_steps=10, every_steps_start=3, every_steps_start_for=10, warmup_steps=1)
    d = DiLoCo([[torch.nn.Parameter(torch.zeros(2))]], spec, _NoSync())
    assert [s + 1 for s in range(41) if d.due(s, 41)] == [4, 7, 10, 20, 30, 40, 41]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"every_steps_start_for": 20}, "inner_steps_start_for needs inner_steps_start"),
        (
            {"every_steps_start": 5, "every_steps_start_for": 4},
            r"inner_steps_start_for 4 must be >= inner_steps_start \(5\)",
        ),
        (
            {"every_steps_start": 5, "every_steps_start_for": 20, "fragments": 2},
            "cannot be combined with streaming",
        ),
    ],
)
def test_early_h_settings_it_cannot_run_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DilocoSpec(every_steps=10, **settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"every_steps": None, "interval_minutes": 5}, "needs step-based merges"),
        ({"every_steps": 4}, r"must be <= inner_steps \(4\)"),
        ({"every_steps": 10, "fragments": 2}, "cannot be combined with streaming"),
    ],
)
def test_growing_h_settings_it_cannot_run_are_refused(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        DilocoSpec(every_steps_start=5, **settings)


def test_stack_growing_h_renders_and_an_inverted_one_is_a_one_line_error(write_stack: Any) -> None:
    from infra.model import load_stack
    from infra.plan import build_plan
    from infra.render.runtime import render_launch_spec

    ok = _diloco_stack(write_stack, inner_steps_start=2)
    assert render_launch_spec(build_plan(load_stack(str(ok)))).diloco.every_steps_start == 2
    r = CliRunner().invoke(
        cli, ["validate", "--stack", str(_diloco_stack(write_stack, inner_steps_start=8))]
    )
    assert r.exit_code == 2 and "training.diloco.inner_steps_start" in r.output, r.output
    assert "must be <= inner_steps (5)" in r.output
    early = _diloco_stack(write_stack, inner_steps_start=2, inner_steps_start_for=6)
    d = render_launch_spec(build_plan(load_stack(str(early)))).diloco
    assert (d.every_steps_start, d.every_steps_start_for) == (2, 6)
    r = CliRunner().invoke(
        cli, ["validate", "--stack", str(_diloco_stack(write_stack, inner_steps_start_for=6))]
    )
    assert r.exit_code == 2 and "training.diloco.inner_steps_start_for" in r.output, r.output
    assert "needs inner_steps_start" in r.output and len(r.output.strip().splitlines()) == 1


def test_validate_hints_at_ternary_where_it_was_measured_to_cost(write_stack: Any) -> None:
    def stack(sync: str, drift: str) -> Any:
        def mutate(c: dict[str, Any]) -> None:
            t = c["geotrain:training"]
            t["sync"] = sync
            t["compression"]["quantize"] = "ternary"
            t["diloco"] = {"inner_steps": 5, "outer_lr": 0.6, "drift_correction": drift}

        return write_stack("local", mutate, name=f"t-{sync}-{drift}")

    out = {
        (s, d): CliRunner().invoke(cli, ["validate", "--stack", str(stack(s, d))])
        for s, d in (("allreduce", "none"), ("diloco", "none"), ("diloco", "scaffold"))
    }
    assert all(r.exit_code == 0 for r in out.values()), {k: r.output for k, r in out.items()}
    assert "meant for sync: diloco merges" in out[("allreduce", "none")].output
    assert "hint" not in out[("diloco", "none")].output, out[("diloco", "none")].output
    assert "use int4 with scaffold" in out[("diloco", "scaffold")].output
