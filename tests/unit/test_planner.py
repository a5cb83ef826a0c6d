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
    RESULTS,
    Inputs,
    PlanInputError,
    active_parameters,
    estimate,
    format_plan,
    inputs_from_plan,
    parameter_counts,
    parity_evidence,
    recommend,
    utilisation,
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


# -- total parameters for bytes, active ones for compute; the recommendation -------------
V2_LITE = dataclasses.replace(
    BASE, active_params=2.4e9, total_params=15.7e9, gpus=16, regions=2, tokens=1e12
)
"""A DeepSeek-V2-Lite-like MoE (15.7B total, 2.4B active) on 2 regions of 8 A100s."""


def _sent(row: Any) -> float:
    return row.tb_per_day * row.days


def test_an_moe_is_sized_by_total_parameters_for_bytes_and_active_ones_for_compute() -> None:
    dense = dataclasses.replace(V2_LITE, total_params=None)  # as if all 2.4B were the model
    moe, small = estimate(V2_LITE), estimate(dense)
    for m, d in zip(moe, small, strict=True):
        assert m.compute_days == pytest.approx(d.compute_days)  # 6 x 2.4B x D either way
        assert _sent(m) == pytest.approx(_sent(d) * 15.7 / 2.4)
    steps = 1e12 / 4e6  # allreduce int8: 2 (R - 1) N_total b bytes a step, 15.7B values
    assert _sent(moe[1]) == pytest.approx(steps * 2 * 15.7e9 * 1 / 1e12)


def test_a_preset_moe_plans_its_bytes_with_every_routed_expert() -> None:
    total, active = parameter_counts(preset("deepseek-base"))
    assert total == 2_201_490_432 and active < total / 4
    i = inputs_from_plan(build_plan(load_stack("global")), 0.4)
    assert (i.total_params, i.active_params) == (total, active)
    with pytest.raises(PlanInputError, match="at least active_params"):
        estimate(dataclasses.replace(V2_LITE, total_params=1e9))


def _fleet(gbps: float, active: float = 7e9, total: float | None = None) -> Inputs:
    """2 regions of 8 A100s, 2 x 8 x 4 x 4096 tokens a step, a link of `gbps`."""
    return dataclasses.replace(
        BASE,
        active_params=active,
        total_params=total,
        tokens_per_step=2 * 8 * 4 * 4096,
        gpus=16,
        regions=2,
        link_gbps=gbps,
    )


@pytest.mark.parametrize("gbps", [1.0, 10.0])
@pytest.mark.parametrize(("active", "total"), [(1e9, None), (7e9, None), (2.4e9, 15.7e9)])
def test_the_recommendation_reaches_the_target_in_the_planners_own_rows(
    gbps: float, active: float, total: float | None
) -> None:
    """The recommended H and tau, put back into the estimate, give its streaming and
    blocking rows at least the target's utilisation (1 - their sync share); one step less
    of H would not."""
    i = _fleet(gbps, active, total)
    r = recommend(i, 0.9, h_max=10**6)  # no cap: every point can be met
    assert r.met and 0 <= r.tau < max(r.h, 2)
    for h, tau, mode in ((r.h, r.tau, 3), (r.blocking_h, 0, 2)):
        run = dataclasses.replace(
            i, bits=r.bits, diloco_h=h, stream_tau=tau, tokens=1000 * h * i.tokens_per_step
        )
        row = estimate(run)[mode]
        assert 1 - row.sync_share >= 0.9 - 1e-9, (mode, h, tau)
        if h > 1:
            assert utilisation(r.step_s, r.sync_s, h - 1, min(tau, h - 2)) < 0.9


def test_a_ten_times_faster_link_gets_a_finer_codec_or_a_smaller_h() -> None:
    """7B dense: at 1 Gbit/s int8 merges every 68 steps (5 late); at 10 Gbit/s the link
    carries fp16 every 14 (the codec's CPU, 24 s a merge, is then most of the sync)."""
    slow, fast = recommend(_fleet(1.0)), recommend(_fleet(10.0))
    assert (slow.codec, slow.h, slow.tau) == ("int8", 68, 5)
    assert (fast.codec, fast.h, fast.tau) == ("fp16", 14, 5)
    assert fast.blocking_h < slow.blocking_h
    i = _fleet(10.0)
    assert i.codec_seconds(16) > i.link_seconds(16)  # CPU-bound at 10 Gbit/s
    for gbps in (0.1, 1.0, 10.0, 100.0):  # monotone: never a coarser codec on a faster link
        a, b = recommend(_fleet(gbps)), recommend(_fleet(10 * gbps))
        assert a.bits < b.bits or (a.bits == b.bits and a.h >= b.h)


def test_parity_evidence_quotes_committed_rows_and_names_their_files(tmp_path: Any) -> None:
    lines = parity_evidence(8, 68)  # int8: only single runs at H = 50 are committed
    assert lines and all(line.split(":")[0].startswith("diloco_parity") for line in lines)
    for line in lines[:-1] if "rows at that H" in lines[-1] else lines:
        name, run, gap = (x.strip() for x in line.split(":"))
        row = next(r for r in (RESULTS / name).read_text().splitlines() if f"| {run} |" in r)
        assert gap.split()[-1] in row and "H=50 int8" in run
    assert parity_evidence(16, 14) == []  # fp16: no DiLoCo run committed
    (tmp_path / "diloco_parity_x.md").write_text(
        "| run | merges | eval gap |\n|---|---|---|\n| diloco H=20 int4 | 5 | +1.50% |\n"
    )
    assert parity_evidence(4, 30, tmp_path) == [
        "diloco_parity_x.md: diloco H=20 int4: eval gap +1.50%"
    ]
    assert parity_evidence(4, 30, tmp_path / "absent") == []  # an installed wheel


def test_geotrain_plan_prints_the_recommendation_and_no_invented_parity() -> None:
    r = CliRunner().invoke(cli, ["plan", "--stack", "global"])
    assert r.exit_code == 0, r.output
    assert "N_total = 2.2e+09 parameters (bytes)" in r.output
    assert "recommendation for utilisation >= 90%" in r.output
    assert "streaming DiLoCo: H = " in r.output and "blocking DiLoCo: H = " in r.output
    assert "expected parity cost" in r.output
    bad = CliRunner().invoke(cli, ["plan", "--stack", "global", "--target", "1"])
    assert bad.exit_code == 2 and "--target must be in (0, 1)" in bad.output
