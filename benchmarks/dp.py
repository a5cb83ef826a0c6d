"""Loss at epsilon 1, 4 and 8 against no DP, on the demo model (deepseek-tiny), one
region of the local stack's data, one rank.

Every run starts from the same weights and trains the same steps with AdamW; the DP runs
use the runtime's own code (training.privacy: Poisson sampling, a backward pass per
record, clipping to C, noise calibrated by Opacus's RDP accountant for the planned steps).
Loss is measured on held-out windows (the last 10% of the region's text, never trained
on). Prints a table and saves it to benchmarks/results/dp.md.

    PYTHONPATH=. python benchmarks/dp.py [--steps 30] [--batch 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from training.comm.topology import Topology
from training.data.loader import ByteLoader, load_region_text
from training.models.deepseek import DeepSeekLM, preset
from training.privacy.dpsgd import RegionPrivacy
from training.spec import LaunchSpec, PrivacySpec
from training.testing import make_spec

OUT = Path(__file__).parent / "results" / "dp.md"
EPSILONS = (1.0, 4.0, 8.0)
DELTA = 1e-6
CLIP = 1.0


def _spec(args: argparse.Namespace, eps: float | None) -> LaunchSpec:
    spec = make_spec(
        regions=1, local=1, steps=args.steps, batch_size=args.batch, seq_len=args.seq_len
    )
    privacy = PrivacySpec(eps, DELTA, CLIP) if eps is not None else None
    region = dataclasses.replace(spec.regions[0], privacy=privacy)
    return dataclasses.replace(spec, regions=[region])


def _held_out(text: bytes, seq_len: int, n: int = 32) -> torch.Tensor:
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    starts = torch.linspace(0, data.numel() - seq_len - 2, n).long()
    return data[starts[:, None] + torch.arange(seq_len + 1)[None, :]].long()


def run(args: argparse.Namespace, eps: float | None, train: bytes, test: torch.Tensor) -> dict:
    spec = _spec(args, eps)
    torch.manual_seed(spec.seed)  # the same initial weights for every run
    model = DeepSeekLM(preset(spec.model))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    dp = RegionPrivacy.for_rank(spec, Topology.of(spec, 0), train, torch.device("cpu"))
    loader = dp.loader if dp else ByteLoader.of(train, spec.batch_size, spec.seq_len, 1)
    t0 = time.perf_counter()
    for _ in range(spec.steps):
        tokens = loader.next()
        opt.zero_grad(set_to_none=True)
        if dp is not None:
            dp.clipped_noisy_grads(model, tokens, model.loss)
            dp.budget.record()
        else:
            model.loss(tokens).backward()
        opt.step()
    with torch.no_grad():
        loss = model.loss(test).item()
    return {
        "setting": f"DP, target epsilon {eps:g}" if eps is not None else "no DP",
        "sigma": dp.budget.sigma if dp else None,
        "epsilon": dp.budget.epsilon() if dp else None,
        "rate": dp.budget.rate if dp else None,
        "loss": loss,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data-kb", type=int, default=0, help="cut the region's text (0: all)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec = make_spec(regions=3, local=1)
    text = load_region_text(spec.regions[0], 0, 3)  # beijing's share of the local data
    if args.data_kb:
        text = text[: args.data_kb * 1024]
    cut = len(text) * 9 // 10
    train, test = text[:cut], _held_out(text[cut:], args.seq_len)
    rows = [run(args, None, train, test)] + [run(args, e, train, test) for e in EPSILONS]
    base = rows[0]["loss"]
    d = sum(p.numel() for p in DeepSeekLM(preset("deepseek-tiny")).parameters())
    head = (
        f"deepseek-tiny, {args.steps} steps, batch {args.batch} x {args.seq_len} bytes, "
        f"{len(train):,} training bytes ({len(train) - args.seq_len - 1:,} records), "
        f"delta {DELTA:g}, clip C = {CLIP:g}, AdamW lr {args.lr:g}, RDP accountant. "
        f"Per step the noise has norm about sigma x C x sqrt(d) / B (d = {d:,} parameters) "
        "against at most C for the clipped mean gradient: at epsilon 8, "
        f"{rows[-1]['sigma'] * d**0.5 / args.batch:,.0f}x.\n\n"
    )
    table = (
        "| setting | noise multiplier | sample rate | epsilon spent | held-out loss "
        "| vs no DP | s |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        sigma = f"{r['sigma']:.3f}" if r["sigma"] is not None else "-"
        rate = f"{r['rate']:.2e}" if r["rate"] is not None else "-"
        eps = f"{r['epsilon']:.3f}" if r["epsilon"] is not None else "-"
        table += (
            f"| {r['setting']} | {sigma} | {rate} | {eps} | {r['loss']:.3f} | "
            f"{r['loss'] / base:.3f}x | {r['seconds']:.1f} |\n"
        )
    print(head + table)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("# Differential privacy: loss against epsilon\n\n" + head + table)


if __name__ == "__main__":
    main()
