"""Issue 16 benchmark: how close periodic merging (DiLoCo) gets to per-step sync, and at
how many fewer cross-region bytes, side by side in one run at equal tokens.

Every run: 3 regions x 1 rank (real gloo processes, training.testing.run_world), each
region training on its own shard of the data (non-IID: the regions' text differs), a small
DeepSeekLM (~92k parameters; 8 x 32 bytes per region per step), AdamW inner steps as the
worker runs them, the real sync (training.sync.hier: quantize, zstd, SM4-GCM, error feedback),
the runtime's DiLoCo class (training.diloco) and, for streaming, its background exchange
(training.sync.streaming.twin). The same steps and batch for every run: equal tokens.

Measured per run: cross-region wire bytes against a flat fp32 ring all-reduce every step
(training.observe.baseline.flat_ring_cross_bytes), the eval loss of the final model (every region
holds the same one) on held-out windows of every region's text (the last 10% of each
shard, never trained on; each region evaluates its own, the mean taken), and the mean
training loss of the last 25 steps. Gaps are relative to allreduce int8.

Run: nice -n 10 python benchmarks/diloco_parity.py [--steps 3000] [--only NAME ...]
[--cache FILE]. Saves benchmarks/results/diloco_parity.md once every row is measured (with
--cache, rows measured before are taken from FILE, so a row can be re-measured alone).
With --seeds S ... --only NAME ...: those rows at each seed, saved with their spread to
benchmarks/results/diloco_parity_seeds.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.comm.topology import Topology, make_groups
from training.data.loader import ByteLoader, load_region_text
from training.gradsync import hierarchical_step
from training.models.deepseek import DeepSeekLM, ModelConfig
from training.observe.baseline import flat_ring_cross_bytes
from training.spec import CodecSpec, DilocoSpec
from training.sync.codec import Codec
from training.sync.diloco import DiLoCo
from training.sync.hier import HierarchicalAllReduce, sync_buckets
from training.sync.streaming import twin
from training.testing import make_spec, run_world

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
KEY = bytes(range(32))
MODEL = ModelConfig(
    dim=48,
    layers=2,
    heads=2,
    kv_rank=16,
    nope_dim=16,
    rope_dim=8,
    v_dim=16,
    experts=2,
    top_k=1,
    expert_dim=96,
    max_seq=64,
)
"""~92k parameters: a step of 8 x 32 bytes takes ~30 ms on one core."""


def widened(dim: int) -> ModelConfig:
    """MODEL at width `dim`, its other widths in the same proportions (48: MODEL itself)."""
    if dim < 12 or dim % 6:
        raise SystemExit(f"--dim {dim}: give a multiple of 6, at least 12 (the default is 48)")
    d = dim // 3
    return replace(
        MODEL, dim=dim, kv_rank=d, nope_dim=d, rope_dim=dim // 6, v_dim=d, expert_dim=2 * dim
    )


@dataclass(frozen=True)
class Setup:
    steps: int = 3000
    """Inner steps of every run (equal tokens)."""
    regions: int = 3
    """Regions, one rank each."""
    batch: int = 8
    """Sequences per region per step."""
    seq_len: int = 32
    """Bytes per sequence."""
    lr: float = 3e-3
    """AdamW learning rate (the worker's default)."""
    bucket_mb: float = 0.08
    """Sync bucket size: ~5 buckets, so the model can be cut into 4 fragments."""
    eval_windows: int = 64
    """Held-out windows each region evaluates the final model on."""
    seed: int = 0
    """Initial weights and data order (0: the main table's); the eval windows stay fixed."""
    model: ModelConfig = MODEL
    """The model every run trains (--dim widens it)."""
    corpus: str = "pydoc"
    """pydoc: the stacks' shards (pydoc topics, ~170 KB a region, read up to 6.6 times in
    3000 steps); stdlib: a third of the Python standard library's modules a region (~4 MB,
    each window drawn about once; `stdlib_text`)."""

    @property
    def windows(self) -> int:
        """Held-out windows each region evaluates: more on the larger corpus, whose
        held-out tenth spans more modules."""
        return self.eval_windows if self.corpus == "pydoc" else 8 * self.eval_windows


CORPORA = ("pydoc", "stdlib")
STDLIB_SKIP = {"site-packages", "test", "tests", "idle_test"}
"""Directories of the standard library left out of the stdlib corpus: not the library's
own text (installed packages) or mostly test fixtures."""


def stdlib_files() -> list[Path]:
    """The standard library's .py files in path order (the running Python's: the corpus is
    fixed per Python version, named in the results' header)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        f
        for f in sorted(root.rglob("*.py"))
        if not STDLIB_SKIP & set(f.relative_to(root).parts) and f.is_file()
    ]


def stdlib_text(region: int, regions: int) -> bytes:
    """Region `region`'s shard of the stdlib corpus: the `region`th of `regions` contiguous
    runs of modules, cut where the running size first reaches its share (non-IID: one
    region holds asyncio and email, another http and json, another unittest and xml)."""
    files = stdlib_files()
    sizes = [f.stat().st_size for f in files]
    total, run, out = sum(sizes), 0, []
    for f, n in zip(files, sizes, strict=True):
        if region * total <= run * regions < (region + 1) * total:
            out.append(f.read_bytes())
        run += n
    return b"\n".join(out)


@dataclass(frozen=True)
class Run:
    name: str
    """Row label."""
    sync: str = "diloco"
    """allreduce | diloco."""
    quant: str = "int4"
    """Cross-region codec: int8 | int4 | ternary."""
    h: int = 50
    """Inner steps between merges."""
    warmup: int = 0
    """First steps synced every step."""
    outer_lr: float = 0.6
    """Outer lr; 0.6 is the documented rule for 3 regions (training.diloco)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (0: plain outer SGD)."""
    fragments: int = 1
    """Streaming fragments."""
    tau: int = 0
    """Streaming: steps a fragment's merge lands late."""
    mix: float = 0.0
    """Streaming: share of the in-flight local progress kept."""
    schedule: str = "constant"
    """Inner lr: constant (the worker's), or one cosine schedule over the whole run."""
    lr_scale: float = 1.0
    """Inner lr as a multiple of Setup.lr."""
    drift: str = "none"
    """Drift correction: none | scaffold (training.diloco)."""
    h_start: int | None = None
    """Growing H: the first interval, doubling up to h (None: h throughout)."""
    h_for: int | None = None
    """Early H: rounds of h_start (not doubling) for this many steps, then h."""
    exchange: str = "direct"
    """Cross-region exchange: direct (reduce-scatter, all-gather) | allgather (each
    region's values quantized once, sent whole)."""
    bucket_mb: float | None = None
    """Sync bucket size (None: Setup.bucket_mb, small enough for 4 fragments; the spec's
    default, 4 MB, holds this whole model in one bucket: fewer payload headers)."""


def streamed(avg: Run, tau: int, mix: float = 0.0) -> Run:
    """Plain averaging at H=50, int4, streamed in 4 fragments landing tau steps late."""
    name = f"H=50 int4, averaging, streaming 4 fragments tau {tau}" + (
        f" mix {mix:g}" if mix else ""
    )
    return replace(avg, name=name, fragments=4, tau=tau, mix=mix)


def runs() -> list[Run]:
    out = [Run("allreduce int8", sync="allreduce", quant="int8")]
    for h in (25, 50, 100):
        for q in ("int8", "int4"):
            out.append(Run(f"diloco H={h} {q}", quant=q, h=h))
    base = Run("")
    out += [
        replace(base, name="H=50 int4, warm-up 100", warmup=100),
        replace(base, name="H=50 int4, outer lr 0.4", outer_lr=0.4),
        replace(base, name="H=50 int4, outer lr 0.8", outer_lr=0.8),
        replace(base, name="H=50 int4, outer SGD lr 1 (averaging)", outer_lr=1.0, outer_momentum=0),
        replace(base, name="H=50 int4, streaming 4 fragments tau 5", fragments=4, tau=5),
        replace(
            base, name="H=50 int4, streaming 4 fragments tau 5 mix 0.5", fragments=4, tau=5, mix=0.5
        ),
        Run("allreduce int8, cosine", sync="allreduce", quant="int8", schedule="cosine"),
        replace(base, name="H=50 int4, cosine", schedule="cosine"),
    ]
    # remedies, from what the rows above showed: momentum 0.9 hurts over ~20 outer steps
    avg = replace(base, outer_lr=1.0, outer_momentum=0.0)
    out += [
        replace(avg, name=AVG + " lr 1.4", outer_lr=1.4),
        replace(avg, name="H=50 int4, outer Nesterov lr 1 momentum 0.5", outer_momentum=0.5),
        replace(avg, name="H=25 int4, averaging", h=25),
        replace(avg, name="H=100 int4, averaging", h=100),
        replace(avg, name="H=50 int4, averaging, warm-up 100", warmup=100),
        replace(avg, name="H=50 int4, averaging, cosine", schedule="cosine"),
        streamed(avg, 5),
        # tau long enough to cover a fragment's exchange over the lab's links (lab_network.md)
        streamed(avg, 15),
        # mix 0 drops the progress a fragment made in flight: 15 of every 50 steps' at tau 15
        streamed(avg, 15, mix=0.5),
        streamed(avg, 15, mix=1.0),
        # tau 30: room for the exchange and the regions' drift at the lab's 60-70 ms steps
        # (lab_network.md, one rank a region)
        streamed(avg, 30),
        streamed(avg, 30, mix=0.5),
        replace(avg, name="H=50 int4, averaging, warm-up 20", warmup=20),
        replace(base, name="H=50 int4, outer lr 0.2", outer_lr=0.2),
        # the floor of merging AdamW replicas: their updates averaged after every step
        replace(avg, name="H=1 int4, averaging", h=1),
        replace(avg, name="H=10 int4, averaging", h=10),
        replace(avg, name="H=50 int4, averaging, inner lr / 2", lr_scale=0.5),
    ]
    # client drift on the non-IID shards: SCAFFOLD control variates from the pseudo-gradients
    sc = replace(avg, drift="scaffold")
    out += [
        replace(sc, name="H=50 int4, averaging, scaffold"),
        replace(base, name="H=50 int4, scaffold", drift="scaffold"),
        replace(sc, name="H=50 int4, averaging, scaffold, warm-up 100", warmup=100),
        replace(sc, name="H=10 int4, averaging, scaffold", h=10),
        replace(sc, name="H=25 int4, averaging, scaffold", h=25),
        replace(sc, name="H=50 int8, averaging, scaffold", quant="int8"),
        # a smaller H early on, when the replicas drift fastest: 10, 20, 40, then 50
        replace(avg, name="H=10->50 int4, averaging", h_start=10),
        replace(sc, name="H=10->50 int4, averaging, scaffold", h_start=10),
    ]
    # the bytes target: ternary pseudo-gradients (~1.4 bits per value after zstd), their
    # error feedback carrying what a merge drops into the next
    out += [
        replace(base, name="diloco H=50 ternary", quant="ternary"),
        replace(avg, name="H=50 ternary, averaging", quant="ternary"),
        replace(sc, name="H=50 ternary, averaging, scaffold", quant="ternary"),
        replace(sc, name="H=10->50 ternary, averaging, scaffold", quant="ternary", h_start=10),
    ]
    # quantized once (exchange: allgather): no second quantization of the sums, for 1.5x
    # the bytes with 3 regions
    out += [
        replace(avg, name="H=50 int4, averaging, allgather", exchange="allgather"),
        replace(
            avg, name="H=50 ternary, averaging, allgather", quant="ternary", exchange="allgather"
        ),
        # the spec's default bucket_mb: one bucket, so a merge's payloads carry 2 headers
        # per peer rather than 2 per bucket (~10% of a ternary merge at this model's size)
        replace(avg, name="H=50 ternary, averaging, 4 MB buckets", quant="ternary", bucket_mb=4.0),
        # under one cosine schedule the gap follows H (drift), not the codec
        replace(avg, name="H=25 int4, averaging, cosine", h=25, schedule="cosine"),
        # the early rounds' drift is what costs (H=50 with H 25 or 10 late gained nothing):
        # H=25 for the first third or half of the run, then 50 (every_steps_start_for)
        replace(
            avg,
            name="H=25 for 1000 steps then 50, int4, averaging, cosine",
            h_start=25,
            h_for=1000,
            schedule="cosine",
        ),
        replace(
            avg,
            name="H=25 for 1500 steps then 50, int4, averaging, cosine",
            h_start=25,
            h_for=1500,
            schedule="cosine",
        ),
        # on a corpus that does not repeat (--corpus stdlib) the first rounds cost most:
        # H=10 for the first sixth of the run
        replace(avg, name="H=10 for 500 steps then 50, int4, averaging", h_start=10, h_for=500),
        replace(
            avg,
            name="H=10 for 500 steps then 50, ternary, averaging, 4 MB buckets",
            quant="ternary",
            bucket_mb=4.0,
            h_start=10,
            h_for=500,
        ),
        # the same early rounds within 1000x of the bytes over 6000 steps (14 extra merges)
        replace(
            avg,
            name="H=10 for 200 steps then 50, ternary, averaging, 4 MB buckets",
            quant="ternary",
            bucket_mb=4.0,
            h_start=10,
            h_for=200,
        ),
    ]
    return out


AVG = "H=50 int4, outer SGD"


def _lr_factor(schedule: str, steps: int) -> Any:
    """One schedule for the whole run (not restarted at merges): 5% linear warm-up, then
    cosine to 10% of the peak."""
    warm = max(1, steps // 20)

    def f(step: int) -> float:
        if schedule == "constant":
            return 1.0
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return f


class _NoDigest:
    def update(self, t: torch.Tensor) -> None:
        pass


def _rank(rank: int, world: int, run: Run, setup: Setup) -> dict[str, Any]:
    spec = make_spec(setup.regions, 1)
    topo = Topology.of(spec, rank)
    groups = make_groups(topo, torch.device("cpu"))
    if setup.corpus == "stdlib":
        text = stdlib_text(rank, setup.regions)
    else:
        text = load_region_text(spec.regions[rank], rank, setup.regions)
    cut = len(text) * 9 // 10  # the last 10%: held out for the eval
    loader = ByteLoader.of(text[:cut], setup.batch, setup.seq_len, 1000 + rank + 100 * setup.seed)
    codec = Codec(CodecSpec(quantize=run.quant, cipher="sm4-gcm"), KEY)
    sync = HierarchicalAllReduce(
        topo, groups, codec, "bench", error_feedback=True, allgather=run.exchange == "allgather"
    )
    bucket_mb = run.bucket_mb or setup.bucket_mb
    torch.manual_seed(1234 + setup.seed)  # the same initial weights in every region and run
    model = DeepSeekLM(setup.model)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr * run.lr_scale, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(run.schedule, setup.steps))
    d = None
    if run.sync == "diloco":
        ds = DilocoSpec(
            every_steps=run.h,
            every_steps_start=run.h_start,
            every_steps_start_for=run.h_for,
            outer_lr=run.outer_lr,
            outer_momentum=run.outer_momentum,
            warmup_steps=run.warmup,
            fragments=run.fragments,
            tau=run.tau,
            mix=run.mix,
            drift_correction=run.drift,
        )
        buckets = sync_buckets(list(model.parameters()), bucket_mb)
        d = DiLoCo(buckets, ds, sync, twin(sync) if run.tau else None)
    losses = []
    t0 = time.perf_counter()
    for step in range(setup.steps):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(loader.next())
        loss.backward()
        losses.append(loss.item())
        if d is None or d.warming(step):
            hierarchical_step(model, sync, step, bucket_mb)
        # else: one rank per region, so the in-region average is the gradient itself
        opt.step()
        sched.step()
        if d is not None:
            d.step_done(step)
            if d.due(step, setup.steps):
                d.advance(step, setup.steps, _NoDigest)
    seconds = time.perf_counter() - t0
    held = ByteLoader.of(text[cut:], setup.windows, setup.seq_len, 99)
    with torch.no_grad():
        ev = torch.tensor([model.loss(held.next()).item()])
    dist.all_reduce(ev)  # the mean over regions (a scalar: nothing of the data crosses)
    return {
        "losses": losses,
        "passes": setup.steps * setup.batch * setup.seq_len / cut,
        "eval": ev.item() / world,
        "wire": sync.stats.cross_wire_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "merges": d.merges if d is not None else 0,
        "seconds": seconds,
    }


def measure(run: Run, setup: Setup) -> dict[str, Any]:
    per_rank = run_world(_rank, setup.regions, run, setup, timeout=1800)
    tail = [sum(r["losses"][s] for r in per_rank) / len(per_rank) for s in range(-25, 0)]
    r0 = per_rank[0]
    flat = flat_ring_cross_bytes(r0["params"], setup.regions, setup.regions) * setup.steps
    return {
        "run": asdict(run),
        "eval": r0["eval"],
        "train_tail": sum(tail) / len(tail),
        "bytes_vs_fp32": sum(r["wire"] for r in per_rank) / flat,
        "merges": r0["merges"],
        "seconds": max(r["seconds"] for r in per_rank),
        "params": r0["params"],
        "passes": max(r["passes"] for r in per_rank),
        "steps": setup.steps,
        "corpus": setup.corpus,
    }


def table(results: dict[str, dict[str, Any]], setup: Setup) -> str:
    base = results["allreduce int8"]
    p = base["params"]
    lines = [
        f"# DiLoCo parity: {setup.steps} inner steps, {setup.regions} regions x 1 rank, "
        f"non-IID shards, {p:,}-parameter DeepSeekLM, {setup.batch} x {setup.seq_len} bytes "
        "per region per step (equal tokens)",
        "",
        *_corpus_note(setup),
        f"Each region reads its training text (90% of its shard) up to {_passes(results):.2g} "
        "times over.",
        "",
        "eval: the final model on held-out windows of every region's shard (mean over "
        "regions); train: mean training loss of the last 25 steps. Gaps against allreduce "
        "int8 (the cosine rows: against allreduce int8, cosine). Bytes: cross-region wire "
        "bytes over a flat fp32 ring all-reduce every step. Outer Nesterov momentum 0.9 and "
        "lr 0.6 (the rule for 3 regions) unless the row says otherwise; averaging: outer "
        "SGD lr 1, momentum 0. Merges: streaming rows count fragment merges (a quarter of "
        "the model each). scaffold: drift_correction scaffold; H=10->50: rounds of 10, 20, "
        "40, then 50 steps (every_steps_start); H=h for N steps then 50: rounds of h for "
        "the first N steps (every_steps_start_for). One seed per row "
        f"(diloco_parity_seeds{_suffix(setup.steps, setup.corpus)}.md: several); wall "
        "seconds on a shared 2-core machine, under varying load.",
        "",
        "| run | merges | bytes vs fp32 per step | fewer bytes | eval loss | eval gap | "
        "train loss | train gap | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ref = results.get("allreduce int8, cosine", base) if "cosine" in name else base
        ge = (r["eval"] - ref["eval"]) / ref["eval"]
        gt = (r["train_tail"] - ref["train_tail"]) / ref["train_tail"]
        b = r["bytes_vs_fp32"]
        lines.append(
            f"| {name} | {r['merges']} | {b:.6f} | {1 / b:,.0f}x | {r['eval']:.4f} | "
            f"{100 * ge:+.2f}% | {r['train_tail']:.4f} | {100 * gt:+.2f}% | {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


BOUGHT = (
    ("H 100 -> 50 (int4)", "diloco H=100 int4", "diloco H=50 int4"),
    ("H 50 -> 25 (int4)", "diloco H=50 int4", "diloco H=25 int4"),
    ("int4 -> int8 pseudo-gradients (H=50)", "diloco H=50 int4", "diloco H=50 int8"),
    ("warm-up: 100 per-step steps first", "diloco H=50 int4", "H=50 int4, warm-up 100"),
    ("outer lr 0.6 -> 0.4", "diloco H=50 int4", "H=50 int4, outer lr 0.4"),
    ("outer lr 0.6 -> 0.8", "diloco H=50 int4", "H=50 int4, outer lr 0.8"),
    (
        "Nesterov 0.6/0.9 -> plain averaging",
        "diloco H=50 int4",
        "H=50 int4, outer SGD lr 1 (averaging)",
    ),
    ("streaming, 4 fragments, tau 5", "diloco H=50 int4", "H=50 int4, streaming 4 fragments tau 5"),
    ("streaming, + mix 0.5", "diloco H=50 int4", "H=50 int4, streaming 4 fragments tau 5 mix 0.5"),
    (
        "one cosine inner schedule (gap to cosine allreduce)",
        "diloco H=50 int4",
        "H=50 int4, cosine",
    ),
    ("averaging -> outer SGD lr 1.4", AVG + " lr 1 (averaging)", AVG + " lr 1.4"),
    (
        "averaging -> Nesterov lr 1 momentum 0.5",
        AVG + " lr 1 (averaging)",
        "H=50 int4, outer Nesterov lr 1 momentum 0.5",
    ),
    ("averaging: H 50 -> 25", AVG + " lr 1 (averaging)", "H=25 int4, averaging"),
    ("averaging: H 50 -> 100", AVG + " lr 1 (averaging)", "H=100 int4, averaging"),
    ("averaging + warm-up 100", AVG + " lr 1 (averaging)", "H=50 int4, averaging, warm-up 100"),
    ("averaging + warm-up 20", AVG + " lr 1 (averaging)", "H=50 int4, averaging, warm-up 20"),
    ("outer lr 0.6 -> 0.2", "diloco H=50 int4", "H=50 int4, outer lr 0.2"),
    ("averaging: H 50 -> 1", AVG + " lr 1 (averaging)", "H=1 int4, averaging"),
    ("averaging: H 50 -> 10", AVG + " lr 1 (averaging)", "H=10 int4, averaging"),
    ("averaging, inner lr halved", AVG + " lr 1 (averaging)", "H=50 int4, averaging, inner lr / 2"),
    ("averaging + one cosine schedule", AVG + " lr 1 (averaging)", "H=50 int4, averaging, cosine"),
    (
        "averaging + streaming (4 fragments, tau 5)",
        AVG + " lr 1 (averaging)",
        "H=50 int4, averaging, streaming 4 fragments tau 5",
    ),
    (
        "averaging, streaming: tau 5 -> 15",
        "H=50 int4, averaging, streaming 4 fragments tau 5",
        "H=50 int4, averaging, streaming 4 fragments tau 15",
    ),
    (
        "averaging, streaming tau 15: mix 0 -> 0.5",
        "H=50 int4, averaging, streaming 4 fragments tau 15",
        "H=50 int4, averaging, streaming 4 fragments tau 15 mix 0.5",
    ),
    (
        "averaging, streaming tau 15: mix 0 -> 1",
        "H=50 int4, averaging, streaming 4 fragments tau 15",
        "H=50 int4, averaging, streaming 4 fragments tau 15 mix 1",
    ),
    (
        "averaging, streaming: tau 15 -> 30",
        "H=50 int4, averaging, streaming 4 fragments tau 15",
        "H=50 int4, averaging, streaming 4 fragments tau 30",
    ),
    (
        "averaging, streaming tau 30: mix 0 -> 0.5",
        "H=50 int4, averaging, streaming 4 fragments tau 30",
        "H=50 int4, averaging, streaming 4 fragments tau 30 mix 0.5",
    ),
    (
        "averaging + scaffold drift correction",
        AVG + " lr 1 (averaging)",
        "H=50 int4, averaging, scaffold",
    ),
    ("Nesterov 0.6/0.9 + scaffold", "diloco H=50 int4", "H=50 int4, scaffold"),
    (
        "averaging, warm-up 100: + scaffold",
        "H=50 int4, averaging, warm-up 100",
        "H=50 int4, averaging, scaffold, warm-up 100",
    ),
    ("averaging, H=10: + scaffold", "H=10 int4, averaging", "H=10 int4, averaging, scaffold"),
    ("averaging, H=25: + scaffold", "H=25 int4, averaging", "H=25 int4, averaging, scaffold"),
    (
        "averaging + scaffold: int4 -> int8",
        "H=50 int4, averaging, scaffold",
        "H=50 int8, averaging, scaffold",
    ),
    (
        "averaging: H 50 -> growing 10, 20, 40, 50",
        AVG + " lr 1 (averaging)",
        "H=10->50 int4, averaging",
    ),
    (
        "averaging, growing H: + scaffold",
        "H=10->50 int4, averaging",
        "H=10->50 int4, averaging, scaffold",
    ),
    ("int4 -> ternary pseudo-gradients (H=50)", "diloco H=50 int4", "diloco H=50 ternary"),
    ("averaging: int4 -> ternary", AVG + " lr 1 (averaging)", "H=50 ternary, averaging"),
    (
        "averaging, int4: quantized once (exchange allgather)",
        AVG + " lr 1 (averaging)",
        "H=50 int4, averaging, allgather",
    ),
    (
        "averaging, ternary: quantized once (exchange allgather)",
        "H=50 ternary, averaging",
        "H=50 ternary, averaging, allgather",
    ),
    (
        "averaging, cosine: H 50 -> 25",
        "H=50 int4, averaging, cosine",
        "H=25 int4, averaging, cosine",
    ),
    (
        "averaging: H=10 for the first 500 steps, then 50",
        "H=50 int4, outer SGD lr 1 (averaging)",
        "H=10 for 500 steps then 50, int4, averaging",
    ),
    (
        "averaging, ternary, 4 MB buckets: H=10 for the first 500 steps, then 50",
        "H=50 ternary, averaging, 4 MB buckets",
        "H=10 for 500 steps then 50, ternary, averaging, 4 MB buckets",
    ),
    (
        "averaging, cosine: H=25 for the first 1000 steps, then 50",
        "H=50 int4, averaging, cosine",
        "H=25 for 1000 steps then 50, int4, averaging, cosine",
    ),
    (
        "averaging, cosine: H=25 for the first 1500 steps, then 50",
        "H=50 int4, averaging, cosine",
        "H=25 for 1500 steps then 50, int4, averaging, cosine",
    ),
    (
        "averaging, ternary: one 4 MB bucket per merge (fewer payload headers)",
        "H=50 ternary, averaging",
        "H=50 ternary, averaging, 4 MB buckets",
    ),
    (
        "averaging + scaffold: int4 -> ternary",
        "H=50 int4, averaging, scaffold",
        "H=50 ternary, averaging, scaffold",
    ),
    (
        "growing H + scaffold: int4 -> ternary",
        "H=10->50 int4, averaging, scaffold",
        "H=10->50 ternary, averaging, scaffold",
    ),
)
"""(technique, the row without it, the row with it): the eval-gap change it bought."""


def bought(results: dict[str, dict[str, Any]]) -> str:
    """The table of what each technique bought, over the pairs of BOUGHT measured in
    `results`; empty when none is (a run of a few rows)."""
    rows = []
    for what, a, b in BOUGHT:
        if a in results and b in results:
            ga, gb = _gap(results, a), _gap(results, b)
            rows.append(f"| {what} | {ga:+.2f}% | {gb:+.2f}% | {gb - ga:+.2f} |")
    if not rows:
        return ""
    lines = [
        "",
        "What each technique bought (eval gap to the matching allreduce, in points; "
        "negative closes the gap):",
        "",
        "| technique | without | with | change |",
        "|---|---|---|---|",
        *rows,
    ]
    return "\n".join(lines) + "\n"


def _corpus_note(setup: Setup) -> list[str]:
    """The header's line on the corpus, when it is not the stacks' shards."""
    if setup.corpus == "pydoc":
        return []
    sizes = [len(stdlib_text(r, setup.regions)) / 1e6 for r in range(setup.regions)]
    return [
        f"Corpus: the Python {sys.version.split()[0]} standard library's modules (.py, "
        f"tests left out), cut in {setup.regions} contiguous runs of modules, one a region: "
        f"{', '.join(f'{m:.1f}' for m in sizes)} MB; the eval takes {setup.windows} "
        "held-out windows a region.",
        "",
    ]


def _passes(results: dict[str, dict[str, Any]]) -> float:
    """The most passes a region makes over its training text (the region of the shortest;
    rows measured before this column existed carry none, the allreduce row always has it)."""
    return max(r.get("passes", 0.0) for r in results.values())


def _gap(results: dict[str, dict[str, Any]], name: str) -> float:
    ref = results.get("allreduce int8, cosine") if "cosine" in name else None
    ref = ref or results["allreduce int8"]
    return 100 * (results[name]["eval"] - ref["eval"]) / ref["eval"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--steps",
        type=int,
        default=Setup.steps,
        help="inner steps of every run; other than the default, the table is saved to "
        "diloco_parity_steps<N>.md (and --seeds to diloco_parity_seeds_steps<N>.md)",
    )
    ap.add_argument("--only", nargs="*", help="run only rows whose name contains one of these")
    ap.add_argument(
        "--cache",
        type=Path,
        help="JSON of finished rows: rows found there are not run again (with --only: the "
        "others are taken from it, and the table is saved once every row is there; with "
        "--seeds, rows at each seed)",
    )
    ap.add_argument(
        "--table-only",
        action="store_true",
        help="measure nothing: redraw the table (or, with --seeds, the seeds table) from the "
        "rows in --cache; rows not there are left out",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="measure the --only rows (and allreduce int8) at each of these seeds and save "
        "their spread to diloco_parity_seeds.md instead of the main table",
    )
    ap.add_argument(
        "--corpus",
        choices=CORPORA,
        default="pydoc",
        help="pydoc: the stacks' shards (~170 KB a region, repeated over a run); stdlib: "
        "a third of the Python standard library a region (~4 MB, hardly repeated); other "
        "than pydoc, tables are saved to diloco_parity[_seeds]_<corpus>.md",
    )
    ap.add_argument(
        "--dim",
        type=int,
        default=MODEL.dim,
        help="model width (other widths scale with it); with --only, the rows are saved to "
        "diloco_parity_dim<D>.md next to the allreduce int8 row at that width",
    )
    a = ap.parse_args()
    if a.table_only and not a.cache:
        raise SystemExit(
            "--table-only redraws from the rows in --cache, which is not given: give the "
            "JSON file an earlier run with --cache wrote"
        )
    if a.table_only and not a.cache.exists():
        raise SystemExit(
            f"--table-only redraws from the rows in --cache, and {a.cache} is not there: "
            "give the JSON file an earlier run with --cache wrote"
        )
    _check_args(a)
    if a.seeds:
        return spread(a.only or [], a.seeds, a.steps, a.cache, a.corpus, a.table_only)
    if a.dim != MODEL.dim and a.cache:
        raise SystemExit(f"--dim {a.dim} with --cache: the cache holds rows of width {MODEL.dim}")
    setup = Setup(steps=a.steps, model=widened(a.dim), corpus=a.corpus)
    cached = load_cache(a.cache)
    # rows of another length are measured again (rows from before "steps": 1000)
    cached = {k: v for k, v in cached.items() if v.get("steps", 1000) == a.steps}
    cached = {k: v for k, v in cached.items() if v.get("corpus", "pydoc") == a.corpus}
    results: dict[str, dict[str, Any]] = {}
    for run in runs():
        chosen = a.only is None or any(s in run.name for s in a.only)
        if a.table_only:
            if run.name in cached:
                results[run.name] = cached[run.name]
        elif run.name in cached and not (a.only and chosen):
            results[run.name] = cached[run.name]
        elif chosen or run.name == "allreduce int8":  # the reference of every gap
            results[run.name] = measure(run, setup)
            _progress(run.name, results[run.name])
            if a.cache:
                a.cache.write_text(json.dumps({**cached, **results}, indent=1))
    if "allreduce int8" not in results:  # --table-only from a cache without it
        raise SystemExit(
            f"--table-only: {a.cache} has no allreduce int8 row of {a.steps} steps on "
            f"{a.corpus}, the reference of every gap; measure it (--only 'allreduce int8' "
            "--cache with the same --steps and --corpus)"
        )
    out = table(results, setup) + bought(results)
    print(out)
    if a.dim != MODEL.dim:  # a width study: its rows alone, never the main table
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"diloco_parity_dim{a.dim}.md").write_text(table(results, setup))
        return
    full = len(results) == len(runs())
    if full or (a.corpus != "pydoc" and (a.only or a.table_only)):  # another: rows chosen
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"diloco_parity{_suffix(a.steps, a.corpus)}.md").write_text(out)


MIN_STEPS = 200
"""Rows warm up for up to 100 steps and merge every up to 100: shorter runs lack a round."""


def _check_args(a: argparse.Namespace) -> None:
    """Every argument checked before anything is measured: one line, what and the fix."""
    if a.steps < MIN_STEPS:
        raise SystemExit(
            f"--steps {a.steps}: a run needs at least {MIN_STEPS} (rows warm up for up to 100 "
            "steps and merge every up to 100)"
        )
    if a.only is not None:
        names = [r.name for r in runs()]
        unknown = [o for o in a.only if not any(o in n for n in names)]
        if not a.only or unknown:
            what = f"{unknown} match no row" if unknown else "gives no names"
            raise SystemExit(
                f"--only {what}; give parts of row names, e.g. 'H=50 int4' (rows: "
                f"{', '.join(names[:4])}, ...)"
            )
    if a.seeds is not None and a.dim != MODEL.dim:
        raise SystemExit(
            f"--dim {a.dim} with --seeds: the seeds tables are at width {MODEL.dim}; "
            "drop one of them"
        )
    if a.cache is not None:
        if a.cache.exists() and not a.cache.is_file():
            raise SystemExit(f"--cache {a.cache} is not a file; give a JSON file's path")
        if not a.cache.parent.is_dir():
            raise SystemExit(
                f"--cache {a.cache}: its folder {a.cache.parent} does not exist; create it "
                "or give another path"
            )
        load_cache(a.cache)  # a cache that cannot be read fails now, not after a row


def load_cache(path: Path | None) -> dict[str, Any]:
    """The rows a --cache file holds ({} where there is none yet); one line, and nothing
    measured, for a file that is not one --cache wrote."""
    if path is None or not path.exists():
        return {}
    try:
        rows = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        msg = f"--cache {path} cannot be read as JSON ({e}); give a file --cache wrote"
        raise SystemExit(msg) from None
    if not isinstance(rows, dict) or not all(isinstance(v, dict) for v in rows.values()):
        raise SystemExit(
            f"--cache {path} holds {type(rows).__name__}, not the rows --cache writes (an "
            "object of row name -> result); give a file --cache wrote"
        )
    return rows


def _suffix(steps: int, corpus: str = "pydoc") -> str:
    """The results file's suffix for a run of `steps` on `corpus` (none at the default
    length on the stacks' shards)."""
    length = "" if steps == Setup.steps else f"_steps{steps}"
    return length + ("" if corpus == "pydoc" else f"_{corpus}")


SPREAD = (
    (
        "scaffold (H=50, averaging)",
        "H=50 int4, outer SGD lr 1 (averaging)",
        "H=50 int4, averaging, scaffold",
    ),
    ("scaffold (H=10, averaging)", "H=10 int4, averaging", "H=10 int4, averaging, scaffold"),
    ("scaffold (H=25, averaging)", "H=25 int4, averaging", "H=25 int4, averaging, scaffold"),
    (
        "growing H 10->50 (averaging)",
        "H=50 int4, outer SGD lr 1 (averaging)",
        "H=10->50 int4, averaging",
    ),
    (
        "growing H 10->50 + scaffold (averaging)",
        "H=50 int4, outer SGD lr 1 (averaging)",
        "H=10->50 int4, averaging, scaffold",
    ),
    (
        "scaffold (H=10->50, averaging)",
        "H=10->50 int4, averaging",
        "H=10->50 int4, averaging, scaffold",
    ),
    (
        "scaffold (H=50, averaging, warm-up 100)",
        "H=50 int4, averaging, warm-up 100",
        "H=50 int4, averaging, scaffold, warm-up 100",
    ),
    (
        "int4 -> ternary (H=50, averaging)",
        "H=50 int4, outer SGD lr 1 (averaging)",
        "H=50 ternary, averaging",
    ),
    (
        "Nesterov 0.6/0.9 -> plain averaging (H=50 int4)",
        "diloco H=50 int4",
        "H=50 int4, outer SGD lr 1 (averaging)",
    ),
    (
        "ternary: quantized once (exchange allgather)",
        "H=50 ternary, averaging",
        "H=50 ternary, averaging, allgather",
    ),
    (
        "ternary: one 4 MB bucket per merge",
        "H=50 ternary, averaging",
        "H=50 ternary, averaging, 4 MB buckets",
    ),
    ("ternary: + scaffold", "H=50 ternary, averaging", "H=50 ternary, averaging, scaffold"),
    ("H 50 -> 25 (averaging)", "H=50 int4, outer SGD lr 1 (averaging)", "H=25 int4, averaging"),
    ("H 50 -> 10 (averaging)", "H=50 int4, outer SGD lr 1 (averaging)", "H=10 int4, averaging"),
    (
        "warm-up 100 (H=50, averaging)",
        "H=50 int4, outer SGD lr 1 (averaging)",
        "H=50 int4, averaging, warm-up 100",
    ),
    (
        "H=10 for the first 500 steps, then 50 (averaging)",
        "H=50 int4, outer SGD lr 1 (averaging)",
        "H=10 for 500 steps then 50, int4, averaging",
    ),
    (
        "ternary, 4 MB: H=10 for the first 500 steps, then 50",
        "H=50 ternary, averaging, 4 MB buckets",
        "H=10 for 500 steps then 50, ternary, averaging, 4 MB buckets",
    ),
    (
        "ternary, 4 MB: H=10 for the first 200 steps, then 50",
        "H=50 ternary, averaging, 4 MB buckets",
        "H=10 for 200 steps then 50, ternary, averaging, 4 MB buckets",
    ),
    ("cosine: H 50 -> 25", "H=50 int4, averaging, cosine", "H=25 int4, averaging, cosine"),
    (
        "streaming, 4 fragments, tau 15 (H=50, averaging)",
        "H=50 int4, outer SGD lr 1 (averaging)",
        "H=50 int4, averaging, streaming 4 fragments tau 15",
    ),
    (
        "streaming: tau 15 -> 30 (averaging)",
        "H=50 int4, averaging, streaming 4 fragments tau 15",
        "H=50 int4, averaging, streaming 4 fragments tau 30",
    ),
    (
        "streaming tau 30: mix 0 -> 0.5 (averaging)",
        "H=50 int4, averaging, streaming 4 fragments tau 30",
        "H=50 int4, averaging, streaming 4 fragments tau 30 mix 0.5",
    ),
    (
        "cosine: H=25 for the first 1000 steps, then 50",
        "H=50 int4, averaging, cosine",
        "H=25 for 1000 steps then 50, int4, averaging, cosine",
    ),
    (
        "cosine: H=25 for the first 1500 steps, then 50",
        "H=50 int4, averaging, cosine",
        "H=25 for 1500 steps then 50, int4, averaging, cosine",
    ),
)
"""(technique, the row without it, the row with it) compared seed by seed."""


def spread(
    only: list[str],
    seeds: list[int],
    steps: int,
    cache: Path | None = None,
    corpus: str = "pydoc",
    table_only: bool = False,
) -> None:
    """The chosen rows at several seeds: each eval gap against the same seed's allreduce
    int8, their mean and range, and each technique's change seed by seed (one seed's gap
    differences are within about +-2 points of noise; this says how much). With `cache`,
    (row, seed, steps) measured before are taken from it; `table_only`: rows (and with no
    `only`, every row) the cache holds at every seed, nothing measured."""
    refs = {"allreduce int8"}
    if any("cosine" in s for s in only):  # cosine rows' gaps are to the cosine allreduce
        refs.add("allreduce int8, cosine")
    every = table_only and not only
    chosen = [r for r in runs() if every or r.name in refs or any(s in r.name for s in only)]
    done = load_cache(cache)

    def key_of(name: str, seed: int) -> str:
        key = f"{name} | seed {seed} | {steps} steps"
        return key + ("" if corpus == "pydoc" else f" | {corpus}")

    if table_only:  # only rows measured at every seed
        chosen = [r for r in chosen if all(key_of(r.name, s) in done for s in seeds)]
        if "allreduce int8" not in {r.name for r in chosen}:
            raise SystemExit(
                f"--table-only: {cache} has no allreduce int8 row at every seed of "
                f"{' '.join(map(str, seeds))} ({steps} steps, {corpus}); measure it first"
            )
    gaps: dict[str, dict[int, float]] = {}
    for seed in seeds:
        setup = Setup(steps=steps, seed=seed, corpus=corpus)
        got = {}
        for run in chosen:
            key = key_of(run.name, seed)
            if key not in done:
                done[key] = measure(run, setup)
                _progress(f"{run.name} (seed {seed})", done[key])
                if cache:
                    cache.write_text(json.dumps(done, indent=1))
            got[run.name] = done[key]
        for name, r in got.items():
            cos = "cosine" in name and "allreduce int8, cosine" in got
            ref = got["allreduce int8, cosine" if cos else "allreduce int8"]["eval"]
            gaps.setdefault(name, {})[seed] = 100 * (r["eval"] - ref) / ref
    cols = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        f"# DiLoCo parity across seeds: {steps} inner steps, the setup of "
        f"diloco_parity{_suffix(steps, corpus)}.md",
        "",
        *_corpus_note(Setup(steps=steps, corpus=corpus)),
        "Eval gap to the same seed's allreduce int8 (cosine rows: to its allreduce int8, "
        "cosine; seed: initial weights and data order; the held-out windows are the same). "
        "Seed 0 is the main table's.",
        "",
        f"| run | {cols} | mean | range |",
        "|---|" + "---|" * (len(seeds) + 2),
    ]
    for name, g in gaps.items():
        v = [g[s] for s in seeds]
        cells = " | ".join(f"{x:+.2f}%" for x in v)
        lines.append(f"| {name} | {cells} | {sum(v) / len(v):+.2f}% | {max(v) - min(v):.2f} |")
    changes = []
    for what, a, b in SPREAD:
        if a in gaps and b in gaps:
            d = [gaps[b][s] - gaps[a][s] for s in seeds]
            cells = " | ".join(f"{x:+.2f}" for x in d)
            changes.append(f"| {what} | {cells} | {sum(d) / len(d):+.2f} |")
    if changes:  # only when a pair of SPREAD was measured
        lines += ["", f"| technique | {cols} | mean change |", "|---|" + "---|" * (len(seeds) + 1)]
        lines += changes
    out = "\n".join(lines) + "\n"
    print(out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"diloco_parity_seeds{_suffix(steps, corpus)}.md").write_text(out)


def _progress(name: str, r: dict[str, Any]) -> None:
    print(
        f"{name}: eval {r['eval']:.4f} train {r['train_tail']:.4f} "
        f"bytes {r['bytes_vs_fp32']:.5f} ({r['seconds']:.0f} s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
