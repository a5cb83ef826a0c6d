"""`geotrain plan`: how long a stack's training takes, how much crosses borders, and what it
costs, per sync mode: pure arithmetic on the plan, with the formulas shown.

Compute: a training step costs 6 FLOPs per active parameter per token (forward 2,
backward 4), so a run costs C = 6 · N · D FLOPs (N active parameters per token: an MoE
token uses its top-k of E routed experts; D tokens). Bytes: a sync moves every parameter's
value (gradient or pseudo-gradient), routed experts included: N_total, not N (a
DeepSeek-V2-Lite-like MoE, 15.7B total / 2.4B active, sends 6.5x what its compute
suggests). The fleet delivers G · peak · MFU FLOP/s (A100 bf16 dense peak: 312 TFLOPS;
MFU 40% is a good large run).

Cross-region traffic of geotrain's hierarchical sync (training/sync/hier.py): per sync each
region sends every peer N_total/R values in the reduce-scatter and as many in the all-gather, so
each link carries 2 · N_total · b / R bytes per direction (b bytes per value), all links at
once; the R regions send 2 · (R - 1) · N_total · b bytes in all. With `exchange: allgather`
each region sends its whole N_total values, quantized once, to every peer: N_total · b per
link and direction, R · (R - 1) · N_total · b in all (the same with 2 regions), in one round
instead of two (round trips are not modelled here). Per-step all-reduce syncs every step;
DiLoCo every H steps (its pseudo-gradients are as large as the gradients). A sync takes the
link time plus the codec's (quantize, zstd, SM4-GCM: each of a region's L ranks encodes and
decodes its own 1/L, at CODEC_SPEED per core; the fp32 row is a plain all-reduce, no codec;
today's exchange encodes, then sends, so the two add). The sync does not overlap compute,
so a step takes compute + sync; streaming DiLoCo overlaps its fragments with up to tau
steps of compute, so it costs only what does not fit.

Recommendation (`recommend`): utilisation is tokens/s with cross-region sync over tokens/s
without it, compute / (compute + exposed sync): blocking DiLoCo gives H c / (H c + s),
streaming H c / (H c + max(0, s - tau c)) (c: a step's compute, s: a merge's sync). Codecs
are tried from the finest (fp16, int8, int4, ternary); the first whose streaming H reaching
the target is at most H_MAX is recommended, with the least tau (at most TAU_MAX, below H)
that reaches it at that H, and the blocking H for the same codec.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from infra.model.gpus import GPU_TYPES
from infra.plan import Plan
from training.errors import GeotrainError
from training.sync.diloco import rounds_in

SECONDS_PER_DAY = 86_400
TB = 1e12
CODEC_SPEED = {16: (284e6, 291e6), 8: (522e6, 573e6), 4: (848e6, 942e6), 2: (562e6, 1692e6)}
"""bits -> (encode, decode) fp32 bytes/s of one core (quantize + shuffle + zstd-1 +
SM4-GCM): benchmarks/results/codec_and_sync.md, "Codec throughput per core"."""
H_MAX = 100
"""The largest H a recommendation uses: INTELLECT-1 merged every 100 steps (int8) and
Streaming DiLoCo ran H = 100; the committed parity runs go no further (H = 100 int4 was
the worst H of diloco_parity_seeds_stdlib.md)."""
TAU_MAX = 5
"""The largest tau a recommendation uses: Streaming DiLoCo's overlaps go up to 5 steps, and
the committed runs with tau 15 and 30 cost more the later the fragment
(diloco_parity_seeds_stdlib.md)."""
FIDELITY = (16, 8, 4, 2)
"""Codec bits tried by a recommendation, the finest first."""
EVIDENCE_ROWS = 5
"""Rows of committed parity results `geotrain plan` prints (then the range of the rest)."""
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
"""The committed benchmark results (absent in an installed wheel: no measurement)."""


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
    total_params: float | None = None
    """N_total: every parameter, each routed expert's too: what a sync sends (None: a dense
    model, active_params)."""
    codec_cores: int | None = None
    """L: ranks of a region, each coding its 1/L of the traffic (None: gpus / regions)."""

    @property
    def sent_params(self) -> float:
        """Values a sync moves: every parameter."""
        return self.total_params if self.total_params is not None else self.active_params

    def step_seconds(self) -> float:
        """c: a step's compute, 6 N x tokens per step over the fleet."""
        return 6 * self.active_params * self.tokens_per_step / self._fleet()

    def _fleet(self) -> float:
        return self.gpus * self.peak_flops * self.mfu

    def link_bytes(self, bits: int) -> float:
        """Bytes a sync puts on each link, each way: 2 N_total / R values (direct), N_total
        (allgather)."""
        if self.regions == 1:
            return 0.0
        n = self.sent_params
        return (n if self.exchange == "allgather" else 2 * n / self.regions) * bits / 8

    def link_seconds(self, bits: int) -> float:
        """A sync's time on the slowest link."""
        return self.link_bytes(bits) / (self.link_gbps * 1e9 / 8)

    def codec_seconds(self, bits: int) -> float:
        """A sync's encode + decode on one rank (the fp32 row: a plain all-reduce, none)."""
        if self.regions == 1 or bits == 32:
            return 0.0
        R = self.regions
        own = 4 * self.sent_params / (self.codec_cores or max(1, self.gpus // R))  # fp32 B
        # direct: encode R - 1 pieces and one sum (own), decode R - 1 copies of its piece
        # and R - 1 sums (2 (R - 1) / R own); allgather: encode once, decode R - 1 shards
        decoded = own * (R - 1) if self.exchange == "allgather" else own * 2 * (R - 1) / R
        enc, dec = CODEC_SPEED[bits]
        return own / enc + decoded / dec

    def sync_seconds(self, bits: int) -> float:
        """s: one sync, link then codec (today's exchange does not overlap them)."""
        return self.link_seconds(bits) + self.codec_seconds(bits)


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
    compute_s = flops / i._fleet()
    steps = i.tokens / i.tokens_per_step
    step_compute = compute_s / steps
    out = []
    for mode, bits, every, overlap in (
        ("allreduce-fp32", 32, 1, 0),
        (f"allreduce-{_codec(i.bits)}", i.bits, 1, 0),
        (f"diloco-H{i.diloco_h}-{_codec(i.bits)}", i.bits, i.diloco_h, 0),
        (f"streaming-diloco-H{i.diloco_h}-{_codec(i.bits)}", i.bits, i.diloco_h, i.stream_tau),
    ):
        sync_s = i.sync_seconds(bits)
        total_bytes = i.regions * (i.regions - 1) * i.link_bytes(bits)
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
    total, n = _parameters(t.model, t.seq_len)
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
        total_params=total,
        # the region with the fewest ranks codes the most per rank: the sync waits for it
        codec_cores=min(
            sum(x.gpus for x in plan.nodes if x.region == r.name) for r in plan.regions
        ),
    )


def _parameters(ref: str, seq_len: int) -> tuple[float, float]:
    """(total, active) parameters of the stack's model: a preset's (routed experts counted
    at top_k / experts for active), or an hf: directory's total for both (its routing is
    not modelled: a MoE's compute is over-counted); a python: factory's module is known
    only to the workers."""
    from training.models.deepseek import preset

    if ref.startswith("hf:"):
        from training.models.hf import hf_facts

        n = hf_facts(ref[3:], seq_len=seq_len)["num_params"]
        if n is None:
            raise PlanInputError(f"cannot count the parameters of {ref}; plan with a preset")
        return float(n), float(n)
    if ref.startswith("python:"):
        raise PlanInputError(
            f"geotrain plan cannot count the parameters of {ref} (the factory runs on the "
            "hosts); plan with the preset or hf: directory closest in size"
        )
    return parameter_counts(preset(ref))


def active_parameters(config: object) -> float:
    """Parameters one token uses: all of them, less the routed experts it is not sent to."""
    return parameter_counts(config)[1]


def parameter_counts(config: object) -> tuple[float, float]:
    """(total, active) parameters of a preset (counted on the meta device: no memory for
    the weights); active leaves out the routed experts a token is not sent to."""
    import torch

    from training.models.deepseek import DeepSeekLM

    with torch.device("meta"):
        model = DeepSeekLM(config)  # type: ignore[arg-type]
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n)
    k, e = config.top_k, config.experts  # type: ignore[attr-defined]
    return float(total), float(total - routed * (1 - k / e))


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
    if i.total_params is not None and not (
        math.isfinite(i.total_params) and i.total_params >= i.active_params
    ):
        raise PlanInputError(
            f"total_params ({i.total_params!r}) must be at least active_params "
            f"({i.active_params:g}): a token uses some of the parameters, never more"
        )
    if i.codec_cores is not None and i.codec_cores < 1:
        raise PlanInputError(f"codec_cores must be at least 1, got {i.codec_cores}")
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


@dataclass(frozen=True)
class Recommendation:
    """The settings `recommend` picks for a target utilisation, with what they give."""

    target: float
    """Utilisation asked for: tokens/s with cross-region sync over tokens/s without."""
    bits: int
    """The codec's bits per value."""
    h: int
    """Streaming DiLoCo's inner steps between merges."""
    tau: int
    """Streaming DiLoCo's overlap: steps a merge may arrive late (below h)."""
    utilisation: float
    """Predicted utilisation of streaming DiLoCo at (h, tau)."""
    blocking_h: int
    """Blocking DiLoCo's (tau = 0) inner steps reaching the target with the same codec."""
    blocking_utilisation: float
    """Predicted utilisation of blocking DiLoCo at blocking_h."""
    step_s: float
    """c: a step's compute."""
    sync_s: float
    """s: one merge, link plus codec."""
    met: bool
    """Whether the target is reached within H_MAX (else: the codec with the least H)."""

    @property
    def codec(self) -> str:
        return _codec(self.bits)


def utilisation(c: float, s: float, h: int, tau: int) -> float:
    """Compute over compute + exposed sync for a merge of s seconds every h steps of c,
    tau steps of which hide it."""
    return h * c / (h * c + max(0.0, s - tau * c))


def _streaming(c: float, s: float, target: float) -> tuple[int, int]:
    """The least h, with tau = min(TAU_MAX, h - 1), reaching target; then the least tau
    that still reaches it at that h."""
    h = next((h for h in range(1, TAU_MAX + 2) if utilisation(c, s, h, h - 1) >= target), 0)
    if not h:  # beyond TAU_MAX + 1: h c / (h c + s - TAU_MAX c) >= target, solved for h
        exposed = s - TAU_MAX * c
        h = max(TAU_MAX + 2, math.ceil(target * exposed / ((1 - target) * c)))
        while utilisation(c, s, h, TAU_MAX) < target:  # float rounding: a step at most
            h += 1
    tau = next(t for t in range(min(TAU_MAX, h - 1) + 1) if utilisation(c, s, h, t) >= target)
    return h, tau


def recommend(i: Inputs, target: float = 0.9, h_max: int = H_MAX) -> Recommendation:
    """Codec, H and tau for `target` utilisation (module doc): the finest codec whose
    streaming H reaching it is at most h_max, else the one with the least H."""
    _check(i)
    if not 0 < target < 1:
        raise PlanInputError(f"--target must be in (0, 1), got {target}; 0.9 is a good aim")
    if h_max < 1:
        raise PlanInputError(f"--max-h must be at least 1, got {h_max}")
    c = i.step_seconds()
    options = []
    for bits in FIDELITY:
        s = i.sync_seconds(bits)
        h, tau = _streaming(c, s, target)
        hb = max(1, math.ceil(target * s / ((1 - target) * c) - 1e-9))
        while utilisation(c, s, hb, 0) < target:
            hb += 1
        rec = Recommendation(
            target,
            bits,
            h,
            tau,
            utilisation(c, s, h, tau),
            hb,
            utilisation(c, s, hb, 0),
            c,
            s,
            h <= h_max,
        )
        if rec.met:
            return rec
        options.append(rec)
    return min(options, key=lambda r: (r.h, -r.bits))


def parity_evidence(bits: int, h: int, results: Path = RESULTS) -> list[str]:
    """What the committed DiLoCo parity results say of this codec near this H: rows of
    benchmarks/results/diloco_parity*.md (eval gap, or the mean over seeds) at the
    nearest H measured with the codec, each named by file; [] when there are none."""
    codec = _codec(bits)
    found: list[tuple[int, str, str, str]] = []
    for path in sorted(results.glob("diloco_parity*.md")) if results.is_dir() else []:
        for run, gap in _gap_rows(path.read_text()):
            m = re.match(rf"(?:diloco )?H=(\d+) {codec}\b", run)
            if m:
                found.append((abs(int(m.group(1)) - h), path.name, run, gap))
    if not found:
        return []
    nearest = min(f[0] for f in found)
    near = [f for f in found if f[0] == nearest]
    seeds = [f for f in near if "over seeds" in f[3]]  # the least noisy first
    shown = (seeds or near)[:EVIDENCE_ROWS]
    lines = [f"{name}: {run}: {gap}" for _, name, run, gap in shown]
    if len(near) > len(shown):
        gaps = sorted(float(g.split()[-1].rstrip("%")) for *_, g in near)
        files = len({f[1] for f in near})
        lines.append(
            f"{len(near)} rows at that H in {files} files (diloco_parity*.md): gaps from "
            f"{gaps[0]:+.2f}% to {gaps[-1]:+.2f}%"
        )
    return lines


def _gap_rows(text: str) -> list[tuple[str, str]]:
    """(run, gap) of every markdown table row under a header with a `run` column and an
    `eval gap` (one run) or `mean` (across seeds) column."""
    out: list[tuple[str, str]] = []
    col = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else []
        if not cells:
            col = None
        elif cells[0] == "run":
            col = next((cells.index(k) for k in ("eval gap", "mean") if k in cells), None)
            label = "eval gap" if "eval gap" in cells else "mean over seeds"
        elif col is not None and not set(cells[0]) <= {"-"} and len(cells) > col:
            out.append((cells[0], f"{label} {cells[col]}"))
    return out


def format_recommendation(i: Inputs, r: Recommendation, h_max: int = H_MAX) -> str:
    lines = [
        f"recommendation for utilisation >= {r.target:.0%} (tokens/s with cross-region sync "
        f"over without; H at most {h_max}, tau at most {TAU_MAX}):",
        f"  codec {r.codec}: a merge is {_num(i.link_bytes(r.bits) / 1e9, '.2f')} GB on the "
        f"slowest link ({_num(i.link_seconds(r.bits), '.1f')} s) + "
        f"{_num(i.codec_seconds(r.bits), '.1f')} s of codec a rank; a step computes "
        f"{_num(r.step_s, '.2f')} s",
        f"  streaming DiLoCo: H = {r.h}, tau = {r.tau}: utilisation {r.utilisation:.1%}",
        f"  blocking DiLoCo: H = {r.blocking_h}: utilisation {r.blocking_utilisation:.1%}",
    ]
    if not r.met:
        lines.append(
            f"  no codec reaches {r.target:.0%} with H <= {h_max}: this is the least H "
            "(more regions' bandwidth, a larger batch or fewer parameters would help)"
        )
    evidence = parity_evidence(r.bits, r.h)
    lines.append(
        "  expected parity cost (no parity table yet, issue 35 item 4): "
        + (
            f"committed measurements of {r.codec} at the nearest H (small models; see each "
            "file's title):"
            if evidence
            else "no measurement"
        )
    )
    lines += [f"    - {e}" for e in evidence]
    return "\n".join(lines)


def format_plan(i: Inputs, rows: list[Estimate]) -> str:
    lines = [
        f"N = {i.active_params:.3g} active parameters per token (compute), N_total = "
        f"{i.sent_params:.3g} parameters (bytes), D = {i.tokens:.3g} tokens, "
        f"{i.tokens_per_step:.3g} tokens per step",
        f"G = {i.gpus} accelerators x {i.peak_flops / 1e12:.0f} TFLOPS peak x MFU {i.mfu:.0%}"
        f" = {i.gpus * i.peak_flops * i.mfu / 1e15:.1f} PFLOP/s",
        f"compute: 6 x N x D = {6 * i.active_params * i.tokens:.3g} FLOPs",
        f"sync: each of R = {i.regions} regions sends "
        f"{'N_total x bits / 8' if i.exchange == 'allgather' else '2 x N_total x bits / 8 / R'}"
        " bytes on each link "
        f"(slowest {i.link_gbps:g} Gbit/s) per sync, then encodes and decodes its 1/L on each "
        f"of L = {i.codec_cores or max(1, i.gpus // i.regions)} ranks a region; DiLoCo syncs "
        f"every H = {i.diloco_h} "
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
