"""`geotrain plan`: the formulas it shows are the ones it computes with."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from click.testing import CliRunner

from geotrain.cli import cli
from infra.model import load_stack
from infra.plan import build_plan
from infra.planner import (
    Inputs,
    PlanInputError,
    active_parameters,
    estimate,
    format_plan,
    inputs_from_plan,
)
from training.models.deepseek import preset
from training.sync.diloco import rounds_in

BASE = Inputs(
    active_params=7e9,
    tokens=2e12,
    tokens_per_step=4e6,
    gpus=192,
    peak_flops=312e12,
    mfu=0.4,
    regions=3,
    link_gbps=10.0,
    usd_per_gpu_hour=4.1,
    diloco_h=100,
    bits=8,
)


def test_compute_days_are_six_n_d_over_the_fleet() -> None:
    one = dataclasses.replace(BASE, regions=1)
    rows = estimate(one)
    expect = 6 * 7e9 * 2e12 / (192 * 312e12 * 0.4) / 86_400
    assert all(r.days == pytest.approx(expect) and r.tb_per_day == 0 for r in rows)
    assert rows[0].usd == pytest.approx(192 * 4.1 * expect * 24)


def test_diloco_sends_h_times_fewer_bytes_per_step_than_per_step_sync() -> None:
    fp32, int8, diloco, _ = estimate(BASE)
    steps = 2e12 / 4e6
    # per sync the 3 regions send 2 (R - 1) N b bytes in all
    assert int8.tb_per_day * int8.days == pytest.approx(steps * 2 * 2 * 7e9 * 1 / 1e12)
    assert fp32.tb_per_day * fp32.days == pytest.approx(4 * int8.tb_per_day * int8.days)
    assert diloco.tb_per_day * diloco.days == pytest.approx(int8.tb_per_day * int8.days / 100)
    assert fp32.days > int8.days > diloco.days >= diloco.compute_days


def test_early_h_and_warm_up_add_their_syncs_to_the_diloco_rows() -> None:
    """500,000 steps: a warm-up of 1,000 steps synced every step, then H=10 for the first
    5,000 inner steps (500 merges where H=100 would make 50), then H=100."""
    steps = 2e12 / 4e6
    plain = estimate(BASE)[2]
    early = estimate(dataclasses.replace(BASE, diloco_start=10, diloco_start_for=5000))[2]
    warm = estimate(dataclasses.replace(BASE, warmup_steps=1000))[2]
    per_sync = 2 * 2 * 7e9 * 1 / 1e12  # TB, int8 (as in the test above)
    assert plain.tb_per_day * plain.days == pytest.approx(steps / 100 * per_sync)
    assert early.tb_per_day * early.days == pytest.approx((steps / 100 + 450) * per_sync)
    merges = (steps - 1000) / 100
    assert warm.tb_per_day * warm.days == pytest.approx((1000 + merges) * per_sync)
    assert warm.days > plain.days and early.days > plain.days


@pytest.mark.parametrize(
    ("start", "start_for", "h", "ends"),
    [
        (None, None, 10, [10, 20, 30, 40]),
        (3, None, 10, [3, 9, 19, 29, 39]),  # growing: 3, 6, then 10
        (3, 10, 10, [3, 6, 9, 19, 29, 39]),  # early: 3 for 10 steps (9, whole rounds)
    ],
)
def test_the_planner_counts_the_merges_the_runtime_makes(
    start: int | None, start_for: int | None, h: int, ends: list[int]
) -> None:
    """rounds_in's whole part grows exactly at the rounds' ends (the runtime's merges:
    DiLoCo._round_ends reads it; tests/unit/test_diloco.py checks those steps through
    DiLoCo.due), and the planner counts the last round's share."""
    whole = [int(rounds_in(k, h, start, start_for)) for k in range(41)]
    assert [k for k in range(1, 41) if whole[k] > whole[k - 1]] == ends
    assert rounds_in(40, h, start, start_for) == pytest.approx(len(ends) + (40 - ends[-1]) / h)


def test_streaming_hides_a_sync_that_fits_behind_tau_steps() -> None:
    rows = estimate(dataclasses.replace(BASE, link_gbps=1000.0))
    streaming = rows[-1]
    assert streaming.days == pytest.approx(streaming.compute_days)
    assert streaming.sync_share == pytest.approx(0.0)


def test_an_moe_token_counts_only_its_top_k_routed_experts() -> None:
    c = preset("deepseek-base")
    n = active_parameters(c)
    assert 0 < n < 2_201_490_432  # fewer than all parameters (2.2 B)
    tiny = active_parameters(preset("deepseek-tiny"))
    routed = 3 * 128 * 256 * 6 * 3  # w1, w2, w3 of 6 experts in each of the 3 MoE blocks
    assert tiny == pytest.approx(2_452_992 - routed * (1 - 2 / 6))


def test_the_global_stack_plans_its_time_based_merges_as_h_steps() -> None:
    i = inputs_from_plan(build_plan(load_stack("global")), 0.4)
    assert i.gpus == 192 and i.regions == 3 and i.link_gbps == 5.0 and i.bits == 4
    step_s = 6 * i.active_params * i.tokens_per_step / (192 * 312e12 * 0.4)
    assert i.diloco_h == round(30 * 60 / step_s)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--stack", "local"], "runs on cpu workers"),
        (["--stack", "global", "--mfu", "0"], "--mfu must be in (0, 1]"),
        (["--stack", "global", "--tokens", "-5"], "tokens must be a positive number"),
        (["--stack", "global", "--mfu", "1e-310"], "outside what this estimate can count"),
        (["--stack", "global", "--tokens", "1e305"], "outside what this estimate can count"),
        (["--stack", "global", "--tokens", "1"], "less than one step of stack global"),
    ],
)
def test_broken_planner_inputs_are_one_line_exit_2(args: list[str], words: str) -> None:
    r = CliRunner().invoke(cli, ["plan", *args])
    assert r.exit_code == 2, r.output
    assert words in r.output and len(r.output.strip().splitlines()) == 1


def test_bad_inputs_raise_plan_input_error() -> None:
    with pytest.raises(PlanInputError, match="bits must be"):
        estimate(dataclasses.replace(BASE, bits=3))


def test_allgather_sends_r_over_2_times_the_bytes_and_ternary_plans() -> None:
    for regions in (2, 3, 4):
        base = dataclasses.replace(BASE, regions=regions)
        direct = estimate(base)[1]
        gather = estimate(dataclasses.replace(base, exchange="allgather"))[1]
        ratio = (gather.tb_per_day * gather.days) / (direct.tb_per_day * direct.days)
        assert ratio == pytest.approx(regions / 2)
    two = estimate(dataclasses.replace(BASE, bits=2))  # quantize: ternary
    modes = ["allreduce-ternary", "diloco-H100-ternary", "streaming-diloco-H100-ternary"]
    assert [r.mode for r in two][1:] == modes
    with pytest.raises(PlanInputError, match="exchange must be"):
        estimate(dataclasses.replace(BASE, exchange="ring"))


def test_a_run_that_ends_inside_a_round_counts_its_last_merge() -> None:
    """The runtime merges on the last step too: 100 steps at H = 500 make one merge, and
    250 steps at H = 100 three (100, 200, 250)."""
    per_sync = 2 * 2 * 7e9 * 1 / 1e12  # TB, int8
    for steps, h, merges in ((100, 500, 1), (250, 100, 3), (300, 100, 3)):
        i = dataclasses.replace(BASE, tokens=steps * 4e6, diloco_h=h)
        row = estimate(i)[2]
        assert row.tb_per_day * row.days == pytest.approx(merges * per_sync), (steps, h)


@pytest.mark.parametrize(
    ("diloco", "tau"),
    [
        ({"inner_steps": 500, "fragments": 4, "tau": 0}, 0),  # streams, blocking merges
        ({"inner_steps": 500, "fragments": 4, "tau": 20}, 20),
        ({"inner_steps": 500}, 5),  # does not stream: the paper's 5
        ({"inner_steps": 3}, 2),  # ... below H
        ({"inner_steps": 1}, 0),
    ],
)
def test_the_streaming_row_uses_the_stacks_tau_or_one_below_h(
    write_stack: Any, diloco: dict[str, int], tau: int
) -> None:
    def put(c: dict[str, Any]) -> None:
        c["geotrain:training"].update(sync="diloco", diloco=diloco)

    i = inputs_from_plan(build_plan(load_stack(str(write_stack("global", put)))), 0.4)
    assert i.stream_tau == tau
    assert tau < i.diloco_h or tau == 0  # tau < H, the runtime's bound


def test_a_short_run_prints_its_days_not_zero() -> None:
    rows = estimate(dataclasses.replace(BASE, tokens=100 * 4e6))
    text = format_plan(BASE, rows)
    assert "| 0.0 |" not in text and "| diloco-H100-int8 | 0.0082 |" in text
