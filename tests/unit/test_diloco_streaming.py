"""Streaming DiLoCo (training.diloco with fragments / tau / mix): the schedule, the late
landing on real gloo worlds with the exchange on its background thread, and the settings'
validation in the stack, the launch spec and the runtime."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from geotrain.cli import cli
from training.comm.topology import Topology, make_groups
from training.errors import SpecError
from training.gradsync import buckets
from training.spec import CodecSpec, DilocoSpec, LaunchSpec
from training.sync.codec import Codec
from training.sync.diloco import DiLoCo, split_fragments
from training.sync.hier import HierarchicalAllReduce
from training.sync.streaming import twin
from training.testing import PerBucket, make_spec, run_world

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))
BUCKET_MB = 2e-4  # 52 floats: buckets [w0 (72)] and [b0, w1, b1 (25)]
LR = 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 6, generator=g)
    return x, (x @ torch.linspace(-1, 1, 6) + rank).sin().unsqueeze(1)  # per-region data


def _train(rank: int, world: int, spec: DilocoSpec | None, steps: int, quant: str) -> Any:
    """Inner SGD on each rank (one rank per region), merged by DiLoCo (`spec`) or by the
    textbook merge written out below (None). Returns the weights after every step and the
    steps after which merges landed."""
    topo = Topology.of(make_spec(world, 1), rank)
    groups = make_groups(topo, torch.device("cpu"))
    codec = Codec(CodecSpec(quantize=quant, cipher="sm4-gcm"), KEY)
    sync = HierarchicalAllReduce(topo, groups, codec, "test-run", error_feedback=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    parts = buckets(list(model.parameters()), BUCKET_MB)
    ref = DilocoSpec(every_steps=3)
    d = DiLoCo(parts, spec or ref, sync, twin(sync) if spec and spec.tau else None)
    weights, landed = [], []
    for step in range(steps):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(_batch(rank, step)[0]), _batch(rank, step)[1]).backward()
        opt.step()
        if spec is not None and d.due(step, steps):
            if d.advance(step, steps, _Hash):
                landed.append(step)
        elif spec is None and d.due(step, steps):
            _textbook_merge(d, parts, sync, step)
            landed.append(step)
        weights.append([p.detach().clone() for p in model.parameters()])
    return {"weights": weights, "landed": landed}


def _textbook_merge(d: DiLoCo, buckets: list[Any], sync: HierarchicalAllReduce, step: int) -> None:
    """DiLoCo's merge as first built: every bucket's (global - local) averaged, one outer
    Nesterov step, every replica restarts from the new global weights."""
    gl = iter(d.global_params)
    for b, params in enumerate(buckets):
        gs = [next(gl) for _ in params]
        delta = torch.cat([(g - p.detach()).reshape(-1) for g, p in zip(gs, params, strict=True)])
        avg = sync.all_reduce(delta, step=step, bucket=b)
        i = 0
        for g in gs:
            g.grad = avg[i : i + g.numel()].view_as(g).clone()
            i += g.numel()
    d.outer.step()
    with torch.no_grad():
        for p, g in zip(d.params, d.global_params, strict=True):
            p.copy_(g)


class _Hash:
    def update(self, t: torch.Tensor) -> None:
        pass


def test_one_fragment_without_delay_is_bitwise_the_textbook_diloco_merge() -> None:
    steps = 8
    ref = run_world(_train, 2, None, steps, "int4")
    got = run_world(_train, 2, DilocoSpec(every_steps=3, fragments=1, tau=0), steps, "int4")
    assert got[0]["landed"] == ref[0]["landed"] == [2, 5, 7]
    for r in range(2):
        for s in range(steps):
            assert all(
                torch.equal(a, b)
                for a, b in zip(got[r]["weights"][s], ref[r]["weights"][s], strict=True)
            ), (r, s)


def test_each_fragment_lands_tau_steps_late_and_identical_in_every_region() -> None:
    """H 6, 2 fragments, tau 2, 3 regions, mix 0: fragment 0 is sent
    after step 5 (k = 6) and lands after step 7; fragment 1 sent after step 2, 8."""
    steps, spec = 13, DilocoSpec(every_steps=6, fragments=2, tau=2)
    out = run_world(_train, 3, spec, steps, "int8")
    assert out[0]["landed"] == [4, 7, 10, 12]  # sends at 2 (f1), 5 (f0), 8 (f1); the end
    frag = {0: [0], 1: [1, 2, 3]}  # parameter indices: buckets [w0] | [b0, w1, b1]
    for lands, f in ((4, 1), (7, 0), (10, 1)):
        same = [_equal(out, lands, i) for i in frag[f]]
        before = [_equal(out, lands - 1, i) for i in frag[f]]
        other = [_equal(out, lands, i) for i in frag[1 - f]]
        assert all(same) and not any(before) and not any(other), (lands, same, before, other)
    assert all(_equal(out, steps - 1, i) for i in range(4))  # the end: one model


def _equal(out: list[Any], step: int, i: int) -> bool:
    return all(torch.equal(o["weights"][step][i], out[0]["weights"][step][i]) for o in out)


class _Gated(PerBucket):
    """A one-region reducer (the identity) that blocks until the loop says it stepped on."""

    def __init__(self) -> None:
        self.stepped = threading.Event()
        self.threads: list[str] = []

    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        assert self.stepped.wait(timeout=20), "the loop did not step on while exchanging"
        return x


def test_late_merge_exchanges_on_a_background_thread_while_the_loop_computes() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    gated = _Gated()
    spec = DilocoSpec(every_steps=4, tau=2, outer_lr=1.0, outer_momentum=0.0)
    d = DiLoCo([[p]], spec, gated, gated)
    _local_step(p, 1.0)
    assert d.due(3, 20) and d.advance(3, 20, _Hash) == []  # sent: returns, nothing landed
    _local_step(p, 10.0)  # the next inner step, computed while the exchange is blocked
    gated.stepped.set()
    assert not d.due(4, 20)
    assert d.due(5, 20) and len(d.advance(5, 20, _Hash)) == 1
    assert gated.threads == ["diloco-stream"]
    assert torch.equal(p.detach(), torch.full((3,), 1.0))  # global - delta sent at step 3


class _Slow(PerBucket):
    """The identity, taking `seconds` per bucket (an exchange over slow links)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def test_a_landing_that_waits_for_its_exchange_counts_the_wait_as_a_stall() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    slow = _Slow(0.4)
    d = DiLoCo([[p]], DilocoSpec(every_steps=4, tau=1), slow, slow)
    d.advance(3, 20, _Hash)  # sent after step 3, lands after step 4
    assert d.waited_s == 0.0
    d.advance(4, 20, _Hash)  # step 4 took no time: the landing waits out the exchange
    assert 0.2 < d.waited_s < 5
    waited = d.waited_s
    d.advance(7, 20, _Hash)
    time.sleep(0.6)  # tau steps longer than the exchange: no wait
    d.advance(8, 20, _Hash)
    assert d.waited_s - waited < 0.1
    # both exchanges' own time is known, however long the loop waited for them
    took = d.take_exchange_s()
    assert len(took) == 2 and all(0.35 < s < 5 for s in took)
    assert d.take_exchange_s() == []


def _local_step(p: torch.nn.Parameter, by: float) -> None:
    with torch.no_grad():
        p.add_(by)


class _Identity(PerBucket):
    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        return x


def test_mix_keeps_its_share_of_the_progress_made_while_the_merge_was_in_flight() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    spec = DilocoSpec(every_steps=4, tau=1, mix=0.25, outer_lr=1.0, outer_momentum=0.0)
    d = DiLoCo([[p]], spec, _Identity(), _Identity())
    _local_step(p, 2.0)
    d.advance(3, 20, _Hash)  # sends delta -2 (global 0 - local 2)
    _local_step(p, 4.0)  # progress in flight: 4
    d.advance(4, 20, _Hash)  # lands: global 2, plus 0.25 * 4
    assert torch.equal(p.detach(), torch.full((2,), 3.0))
    assert torch.equal(d.global_params[0], torch.full((2,), 2.0))


def test_fragments_are_staggered_by_h_over_fragments_after_the_warmup() -> None:
    spec = DilocoSpec(every_steps=6, fragments=3, tau=0, warmup_steps=2)
    d = DiLoCo([[torch.nn.Parameter(torch.zeros(2))] for _ in range(3)], spec, _Identity())
    sends = {s + 1 - 2: d.sends(s) for s in range(2, 16) if d.sends(s)}
    assert sends == {2: [1], 4: [2], 6: [0], 8: [1], 10: [2], 12: [0], 14: [1]}
    assert not d.due(1, 16) and d.due(15, 16)


def test_fragments_split_the_buckets_in_contiguous_runs_of_about_equal_size() -> None:
    spec = DilocoSpec(every_steps=10, fragments=3)
    assert split_fragments([4, 4, 4, 4, 4, 4], spec) == [range(0, 2), range(2, 4), range(4, 6)]
    assert split_fragments([10, 1, 1, 1], spec) == [range(0, 1), range(1, 2), range(2, 4)]
    assert split_fragments([5], DilocoSpec()) == [range(0, 1)]
    with pytest.raises(SpecError, match="fragments 3 is more than the model's 2 sync buckets"):
        split_fragments([4, 4], spec)


def _stack(write_stack: Any, **diloco: Any) -> Any:
    def mutate(c: dict[str, Any]) -> None:
        t = c["geotrain:training"]
        t["sync"], t["steps"] = "diloco", 40
        t["diloco"] = {"inner_steps": 10, **diloco}

    return write_stack("local", mutate, name="st")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tau": 10}, "training.diloco.tau: 10 must be < inner_steps (10)"),
        ({"fragments": 11}, "training.diloco.fragments: 11 must be <= inner_steps (10)"),
        ({"mix": 1.5}, "training.diloco.mix"),
        (
            {"fragments": 4},
            "training.diloco.fragments: 4 is more than the 3 sync buckets of deepseek-tiny at "
            "bucket_mb 4",
        ),
    ],
)
def test_streaming_settings_out_of_bounds_are_one_line_errors(
    write_stack: Any, settings: dict[str, Any], message: str
) -> None:
    r = CliRunner().invoke(cli, ["validate", "--stack", str(_stack(write_stack, **settings))])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, (
        r.output
    )


def test_streaming_with_a_throughput_balance_is_a_one_line_error(write_stack: Any) -> None:
    def mutate(c: dict[str, Any]) -> None:
        t = c["geotrain:training"]
        t["sync"], t["balance"] = "diloco", "throughput"
        t["diloco"] = {"inner_steps": 10, "fragments": 2, "tau": 1}

    r = CliRunner().invoke(cli, ["validate", "--stack", str(write_stack("local", mutate))])
    assert r.exit_code == 2 and "training.balance" in r.output, r.output
    assert "fragments: 1 and tau: 0" in r.output and len(r.output.strip().splitlines()) == 1


def test_streaming_with_time_based_merges_is_a_one_line_error(write_stack: Any) -> None:
    def mutate(c: dict[str, Any]) -> None:
        t = c["geotrain:training"]
        t["sync"], t["diloco"] = "diloco", {"interval_minutes": 5, "tau": 1}

    r = CliRunner().invoke(cli, ["validate", "--stack", str(write_stack("local", mutate))])
    assert r.exit_code == 2 and "fragments/tau need step-based merges" in r.output, r.output


def test_render_carries_the_streaming_settings_and_the_launch_spec_checks_them(
    write_stack: Any,
) -> None:
    from infra.model import load_stack
    from infra.plan import build_plan
    from infra.render.runtime import render_launch_spec

    path = _stack(write_stack, fragments=2, tau=3, mix=0.5)
    spec = render_launch_spec(build_plan(load_stack(str(path))))
    assert (spec.diloco.fragments, spec.diloco.tau, spec.diloco.mix) == (2, 3, 0.5)
    assert LaunchSpec.from_json(spec.to_json()).diloco == spec.diloco
    bad = spec.to_json().replace('"tau": 3', '"tau": 10')
    with pytest.raises(
        SpecError, match=r"spec.json: diloco: tau 10 must be in 0..every_steps - 1 \(9\)"
    ):
        LaunchSpec.from_json(bad, "spec.json")
