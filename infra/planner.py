"""`geotrain plan`: how long a stack's training takes, how much crosses borders, and what it
costs, per sync mode: pure arithmetic on the plan, with the formulas shown.

Compute: a training step costs 6 FLOPs per active parameter per token (forward 2,
backward 4), so a run costs C = 6 · N · D FLOPs (N active parameters per token: an MoE
token uses its top-k of E routed experts; D tokens). The fleet delivers
G · peak · MFU FLOP/s (A100 bf16 dense peak: 312 TFLOPS; MFU 40% is a good large run).

Cross-region traffic of geotrain's hierarchical sync (training/sync/hier.py): per sync each
region sends every peer N/R values in the reduce-scatter and N/R in the all-gather, so
each link carries 2 · N · b / R bytes per direction (b bytes per value), all links at once;
the R regions send 2 · (R - 1) · N · b bytes in all. With `exchange: allgather` each
region sends its whole N values, quantized once, to every peer: N · b per link and
direction, R · (R - 1) · N · b in all (the same with 2 regions), in one round instead of
two (round trips are not modelled here). Per-step all-reduce syncs every step;
DiLoCo every H steps (its pseudo-gradients are as large as the gradients). The sync does
not overlap compute, so a step takes compute + sync; streaming DiLoCo overlaps its
fragments with up to tau steps of compute, so it costs only what does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.model.gpus import GPU_TYPES
from infra.plan import Plan
from training.errors import GeotrainError
from training.sync.diloco import rounds_in

SECONDS_PER_DAY = 86_400
TB = 1e12


class PlanInputError(GeotrainError):
    """A planner input is missing or out of range."""


@dataclass(frozen=True)
class Inputs:
    """Everything the estimate depends on (each shown in the output)."""

    active_params: float
    """N: parameters a token uses (an MoE token: its top-k routed experts only)."""
    tokens: float
    """D: tokens of the whole run."""
    tokens_per_step: float
    """Tokens of one optimizer step, all regions together."""
    gpus: int
    """G: accelerators."""
    peak_flops: float
    """Peak dense bf16 FLOP/s of one accelerator."""
    mfu: float
    """Model FLOPs utilisation: the share of the peak training really gets."""
    regions: int
    """R: regions."""
    link_gbps: float
    """The slowest cross-region link (Gbit/s): the sync waits for it."""
    usd_per_gpu_hour: float
    """Price of one accelerator-hour."""
    diloco_h: int
    """H: inner steps between DiLoCo merges."""
    bits: int
    """Bits per value the codec sends across regions."""
    stream_tau: int = 5
    """Streaming DiLoCo: steps a fragment may arrive late."""
    diloco_start: int | None = None
    """Growing or early H (diloco.inner_steps_start): the first rounds' H."""
    diloco_start_for: int | None = None
    """Early H (diloco.inner_steps_start_for): inner steps of rounds of diloco_start."""
    warmup_steps: int = 0
    """DiLoCo's warm-up: its first steps sync every step (diloco.warmup_steps)."""
    exchange: str = "direct"
    """The cross-region exchange (training.exchange): allgather sends every value whole."""


@dataclass(frozen=True)
class Estimate:
    mode: str
    """allreduce-fp32, allreduce-<bits>, diloco-H<h>-<bits>, streaming-diloco-..."""
    days: float
    """Wall-clock days."""
    compute_days: float
    """Days of pure compute (the floor)."""
    sync_share: float
    """Share of the wall time spent in sync."""
    tb_per_day: float
    """Cross-region terabytes per day, all links together."""
    usd: float
    """GPU cost of the run."""


def estimate(i: Inputs) -> list[Estimate]:
    _check(i)
    flops = 6 * i.active_params * i.tokens
    fleet = i.gpus * i.peak_flops * i.mfu
    compute_s = flops / fleet
    steps = i.tokens / i.tokens_per_step
    step_compute = compute_s / steps
    link_bytes_per_s = i.link_gbps * 1e9 / 8
    out = []
    for mode, bits, every, overlap in (
        ("allreduce-fp32", 32, 1, 0),
        (f"allreduce-{_codec(i.bits)}", i.bits, 1, 0),
        (f"diloco-H{i.diloco_h}-{_codec(i.bits)}", i.bits, i.diloco_h, 0),
        (f"streaming-diloco-H{i.diloco_h}-{_codec(i.bits)}", i.bits, i.diloco_h, i.stream_tau),
    ):
        if i.regions == 1:
            sync_s = 0.0
            total_bytes = 0.0
        else:
            # values each region sends each peer: 2 N / R (direct), N (allgather)
            sent = i.active_params if i.exchange == "allgather" else 2 * i.active_params / i.regions
            per_link = sent * bits / 8
            sync_s = per_link / link_bytes_per_s
            total_bytes = i.regions * (i.regions - 1) * per_link
        # per-step all-reduce syncs every step; DiLoCo its warm-up's steps, then once a round
        # (growing or early H: more rounds at first); streaming hides a merge behind
        # `overlap` steps
        exposed = max(0.0, sync_s - overlap * step_compute)
        if every == 1:
            syncs = steps
            wall = steps * step_compute + steps * exposed
        else:
            w = min(float(i.warmup_steps), steps)
            # the runtime merges at every round's end and on the last step: a round the
            # run ends inside counts as a whole merge
            rounds = rounds_in(steps - w, every, i.diloco_start, i.diloco_start_for)
            merges = math.ceil(rounds - 1e-9)
            syncs = w + merges
            wall = steps * step_compute + w * sync_s + merges * exposed
        days = wall / SECONDS_PER_DAY
        if not (math.isfinite(wall) and wall > 0 and math.isfinite(total_bytes * syncs / days)):
            raise PlanInputError(
                f"the {mode} row comes out as {wall:.3g} s for {steps:.3g} steps: the inputs "
                "are outside what this estimate can count (check --mfu and --tokens)"
            )
        out.append(
            Estimate(
                mode=mode,
                days=days,
                compute_days=compute_s / SECONDS_PER_DAY,
                sync_share=(wall - compute_s) / wall if wall else 0.0,
                tb_per_day=syncs * total_bytes / TB / days if days else 0.0,
                usd=i.gpus * i.usd_per_gpu_hour * wall / 3600,
            )
        )
    return out


def inputs_from_plan(plan: Plan, mfu: float, tokens: float | None = None) -> Inputs:
    """The estimate's inputs from a stack: its model, fleet, links and codec."""
    if not 0 < mfu <= 1:
        raise PlanInputError(f"--mfu must be in (0, 1], got {mfu}; 0.4 is a good large run")
    t = plan.training
    types = {n.gpu_type for n in plan.nodes}
    gpus = sum(n.gpus for n in plan.nodes)
    peak = min(GPU_TYPES[g].peak_bf16_tflops for g in types) * 1e12
    if peak == 0:
        raise PlanInputError(
            f"stack {plan.stack} runs on cpu workers: there is no accelerator peak to plan "
            "with; plan a stack whose nodes name a GPU type (e.g. --stack global)"
        )
    prices = {**{g: GPU_TYPES[g].usd_per_hour for g in types}, **plan.policy.gpu_prices}
    usd = sum(prices[n.gpu_type] * n.gpus for n in plan.nodes) / gpus
    per_step = gpus * t.batch_size * t.seq_len
    links = [link.bandwidth_mbps / 1000 for link in plan.network.links] or [float("inf")]
    n = _active(t.model, t.seq_len)
    if tokens is not None and 0 < tokens < per_step:  # not positive: estimate() says so
        raise PlanInputError(
            f"--tokens {tokens:g} is less than one step of stack {plan.stack} ({per_step:,} "
            f"tokens: {gpus} workers x batch {t.batch_size} x seq_len {t.seq_len}); give the "
            "whole run's tokens, e.g. 1e12, or leave it out for steps x tokens per step"
        )
    h = t.diloco.every_steps
    if h is None:  # a merge every T minutes: H is T over the step's compute time
        step_s = 6 * n * per_step / (gpus * peak * mfu)
        h = max(1, round(60 * float(t.diloco.interval_minutes or 0) / step_s))
    return Inputs(
        active_params=n,
        tokens=tokens if tokens is not None else float(t.steps * per_step),
        tokens_per_step=float(per_step),
        gpus=gpus,
        peak_flops=peak,
        mfu=mfu,
        regions=len(plan.regions),
        link_gbps=min(links),
        usd_per_gpu_hour=usd,
        diloco_h=h,
        bits=_bits(t.compression.quantize),
        # the stack's tau when it streams (0: blocking merges); else the paper's 5, below H
        stream_tau=t.diloco.tau if t.diloco.fragments > 1 or t.diloco.tau else min(5, h - 1),
        diloco_start=t.diloco.inner_steps_start,
        diloco_start_for=t.diloco.inner_steps_start_for,
        warmup_steps=t.diloco.warmup_steps,
        exchange=t.exchange,
    )


def _active(ref: str, seq_len: int) -> float:
    """Active parameters of the stack's model: a preset's (routed experts counted at
    top_k / experts), or an hf: directory's total (its routing is not modelled: a MoE's
    compute is over-counted); a python: factory's module is known only to the workers."""
    from training.models.deepseek import preset

    if ref.startswith("hf:"):
        from training.models.hf import hf_facts

        n = hf_facts(ref[3:], seq_len=seq_len)["num_params"]
        if n is None:
            raise PlanInputError(f"cannot count the parameters of {ref}; plan with a preset")
        return float(n)
    if ref.startswith("python:"):
        raise PlanInputError(
            f"geotrain plan cannot count the parameters of {ref} (the factory runs on the "
            "hosts); plan with the preset or hf: directory closest in size"
        )
    return active_parameters(preset(ref))


def active_parameters(config: object) -> float:
    """Parameters one token uses: all of them, less the routed experts it is not sent to
    (counted on the meta device: no memory for the weights)."""
    import torch

    from training.models.deepseek import DeepSeekLM

    with torch.device("meta"):
        model = DeepSeekLM(config)  # type: ignore[arg-type]
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
    k, e = config.top_k, config.experts  # type: ignore[attr-defined]
    return float(total - routed * (1 - k / e))


def _bits(quantize: str) -> int:
    return {"none": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4, "ternary": 2}[quantize]


def _codec(bits: int) -> str:
    return {32: "fp32", 16: "fp16", 8: "int8", 4: "int4", 2: "ternary"}[bits]


def _check(i: Inputs) -> None:
    for name, value in (
        ("active_params", i.active_params),
        ("tokens", i.tokens),
        ("tokens_per_step", i.tokens_per_step),
        ("peak_flops", i.peak_flops),
    ):
        if not (value > 0 and math.isfinite(value)):
            raise PlanInputError(f"{name} must be a positive number, got {value!r}")
    if not i.link_gbps > 0:  # inf: one region, no link
        raise PlanInputError(f"link bandwidth must be positive, got {i.link_gbps!r} Gbit/s")
    if not 0 < i.mfu <= 1:
        raise PlanInputError(f"--mfu must be in (0, 1], got {i.mfu}; 0.4 is a good large run")
    if i.gpus < 1 or i.regions < 1 or i.diloco_h < 1:
        raise PlanInputError("gpus, regions and H must be at least 1")
    if i.exchange not in ("direct", "allgather", "topology"):
        raise PlanInputError(f"exchange must be direct, allgather or topology, got {i.exchange}")
    if i.bits not in (2, 4, 8, 16, 32):
        raise PlanInputError(f"bits must be 2 (ternary), 4, 8, 16 or 32, got {i.bits}")


def format_plan(i: Inputs, rows: list[Estimate]) -> str:
    lines = [
        f"N = {i.active_params:.3g} active parameters per token, D = {i.tokens:.3g} tokens, "
        f"{i.tokens_per_step:.3g} tokens per step",
        f"G = {i.gpus} accelerators x {i.peak_flops / 1e12:.0f} TFLOPS peak x MFU {i.mfu:.0%}"
        f" = {i.gpus * i.peak_flops * i.mfu / 1e15:.1f} PFLOP/s",
        f"compute: 6 x N x D = {6 * i.active_params * i.tokens:.3g} FLOPs",
        f"sync: each of R = {i.regions} regions sends "
        f"{'N x bits / 8' if i.exchange == 'allgather' else '2 x N x bits / 8 / R'} bytes on "
        "each link "
        f"(slowest {i.link_gbps:g} Gbit/s) per sync; DiLoCo syncs every H = {i.diloco_h} "
        f"steps{_early(i)}; streaming hides a fragment behind tau = {i.stream_tau} steps",
        "",
        "| sync mode | days | of which sync | cross-region TB/day | GPU cost (USD) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mode} | {_num(r.days, '.1f')} | {r.sync_share:.0%} | "
            f"{_num(r.tb_per_day, '.2f')} | {_num(r.usd, ',.0f')} |"
        )
    return "\n".join(lines)


def _num(v: float, fmt: str) -> str:
    """`v` in `fmt`, or in 2-3 significant digits where `fmt` would print 0.0 or a wall of
    digits (a run of a few steps; inputs far off the usual)."""
    if v != 0 and (abs(v) < 0.05 or abs(v) >= 1e9):
        return f"{v:.2g}"
    return format(v, fmt)


def _early(i: Inputs) -> str:
    """What the DiLoCo rows count besides a merge every H steps."""
    parts = []
    if i.warmup_steps:
        parts.append(f"after {i.warmup_steps} warm-up steps synced every step")
    if i.diloco_start is not None and i.diloco_start_for is not None:
        parts.append(f"H = {i.diloco_start} for the first {i.diloco_start_for} inner steps")
    elif i.diloco_start is not None:
        parts.append(f"growing from H = {i.diloco_start}")
    return f" ({'; '.join(parts)})" if parts else ""
