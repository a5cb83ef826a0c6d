"""Issue 3 benchmark: the demo model trained with the same seed and steps under six sync
methods, side by side in one run, on a real 3-region x 2-rank gloo world on this machine.

  (a) fp32 flat all-reduce (DDP default)   (b) torch fp16_compress_hook
  (c) torch PowerSGD hook (rank 4)         (d) geotrain fp16 + zstd + SM4-GCM
  (e) geotrain int8 + zstd + SM4-GCM       (f) geotrain int4 + zstd + SM4-GCM

Cross-region bytes: geotrain counts the encoded payloads it sends. DDP's hooks do flat
all-reduces over every rank; for them we count the bytes each hook hands to all_reduce
and apply the cross-region share of a ring all-reduce with ranks ordered by region
(training.report.flat_ring_cross_bytes). Also: codec throughput per core.

Run: python benchmarks/codec_and_sync.py [--steps 60]. Prints a table and saves it to
benchmarks/results/codec_and_sync.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from training.codec import Address, Codec
from training.data import ByteLoader, load_region_text
from training.hier import HierarchicalAllReduce
from training.model import build_model
from training.report import flat_ring_cross_bytes
from training.spec import CodecSpec
from training.testing import make_spec, run_world
from training.topology import Topology, make_groups
from training.worker import hierarchical_step

REGIONS, LOCAL = 3, 2
WORLD = REGIONS * LOCAL
METHODS = [
    "fp32-flat",
    "torch-fp16-hook",
    "torch-powersgd-r4",
    "geotrain-fp16",
    "geotrain-int8",
    "geotrain-int4",
]
RESULTS = Path(__file__).parent / "results"


def train(rank: int, world: int, method: str, steps: int, batch: int, seq: int) -> dict[str, Any]:
    spec = make_spec(REGIONS, LOCAL)
    topo = Topology.of(spec, rank)
    torch.manual_seed(spec.seed)
    model = build_model("deepseek-tiny")
    n_params = sum(p.numel() for p in model.parameters())
    text = load_region_text(spec.regions[topo.region_index], topo.region_index, REGIONS)
    loader = ByteLoader.of(text, batch, seq, spec.seed * 1000 + rank)
    counted = [0]
    if method.startswith("geotrain"):
        quant = method.split("-")[1]
        codec = Codec(CodecSpec(quantize=quant, cipher="sm4-gcm"), bytes(range(32)))
        sync = HierarchicalAllReduce(
            topo, make_groups(topo, torch.device("cpu")), codec, spec.run_id
        )
        net: torch.nn.Module = model
    else:
        real = dist.all_reduce

        def counting(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            counted[0] += tensor.numel() * tensor.element_size()
            return real(tensor, *a, **k)

        dist.all_reduce = counting  # type: ignore[assignment]
        # one bucket: DDP otherwise rebuilds buckets in gradient-ready order, which an MoE
        # makes differ per rank (routing depends on the data), and PowerSGD then hangs
        net = torch.nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=True, bucket_cap_mb=64
        )
        if method == "fp32-flat":  # DDP's default all-reduce, as a Python hook so it is counted
            net.register_comm_hook(None, default_hooks.allreduce_hook)
        elif method == "torch-fp16-hook":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method == "torch-powersgd-r4":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
            )
            net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        loss = (
            model.loss(loader.next())
            if method.startswith("geotrain")
            else _ddp_loss(net, loader.next())
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if method.startswith("geotrain"):
            hierarchical_step(model, sync, step, spec.bucket_mb)
        opt.step()
        losses.append(loss.item())
    wall = time.perf_counter() - t0
    if method.startswith("geotrain"):
        cross = sync.stats.cross_wire_bytes  # this rank's encoded payloads
        codec_s = codec.stats.encode_seconds + codec.stats.decode_seconds
    else:
        # every rank hands `counted` bytes to all-reduce; the ring's border share of it
        cross = flat_ring_cross_bytes(counted[0] // 4, WORLD, REGIONS) / WORLD
        codec_s = 0.0
    return {"losses": losses, "cross": cross, "wall": wall, "params": n_params, "codec_s": codec_s}


def _ddp_loss(net: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = net(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


def codec_throughput(mb: int = 16) -> dict[str, tuple[float, float, float]]:
    """(encode MB/s of fp32 in, wire MB/s out, decode MB/s) per core, SM4-GCM."""
    torch.set_num_threads(1)
    x = torch.randn(mb * 2**20 // 4) * 1e-3
    out = {}
    for q in ("fp16", "int8", "int4"):
        c = Codec(CodecSpec(quantize=q, cipher="sm4-gcm"), bytes(range(32)))
        a = Address("bench", 0, 0, 0, 0)
        c.encode(x, a)  # warm up
        t0 = time.perf_counter()
        for _ in range(3):
            p, _ = c.encode(x, a)
        enc = (time.perf_counter() - t0) / 3
        t0 = time.perf_counter()
        for _ in range(3):
            c.decode(p, a)
        dec = (time.perf_counter() - t0) / 3
        raw = x.numel() * 4 / 1e6
        out[q] = (raw / enc, len(p) / 1e6 / enc, raw / dec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    rows = {}
    for m in METHODS:
        res = run_world(train, WORLD, m, a.steps, a.batch, a.seq, timeout=1800)
        losses = torch.tensor([r["losses"] for r in res]).mean(0)  # (steps,) over ranks
        final = losses[-5:].mean().item()  # last 5 steps: less noise than one step
        cross = sum(r["cross"] for r in res)
        rows[m] = {
            "bytes_per_param_step": cross / res[0]["params"] / a.steps,
            "final_loss": final,
            "wall_s": max(r["wall"] for r in res),
        }
        print(f"{m}: done, final loss {final:.4f}", file=sys.stderr)
    base = rows["fp32-flat"]
    lines = [
        f"# Sync methods, {a.steps} steps, {REGIONS} regions x {LOCAL} ranks, "
        f"demo model ({res[0]['params']:,} params), batch {a.batch}x{a.seq}",
        "",
        "| method | cross-region bytes/param/step | vs fp32 | final loss | gap to fp32 | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for m, r in rows.items():
        gap = (r["final_loss"] - base["final_loss"]) / base["final_loss"]
        lines.append(
            f"| {m} | {r['bytes_per_param_step']:.3f} | "
            f"{r['bytes_per_param_step'] / base['bytes_per_param_step']:.3f} | "
            f"{r['final_loss']:.4f} | {100 * gap:+.2f}% | {r['wall_s']:.1f} |"
        )
    lines += [
        "",
        "## Codec throughput per core (quantize + shuffle + zstd-1 + SM4-GCM)",
        "",
        "| quantize | encode MB/s (fp32 in) | wire MB/s out | decode MB/s | cores to fill "
        "1 Gbit/s |",
        "|---|---|---|---|---|",
    ]
    for q, (enc, wire, dec) in codec_throughput().items():
        lines.append(f"| {q} | {enc:.0f} | {wire:.0f} | {dec:.0f} | {125 / wire:.1f} |")
    lines += [
        "",
        "Cores to fill 1 Gbit/s (125 MB/s): encoders needed in parallel to produce "
        "wire bytes as fast as the link drains them; each local rank encodes its own "
        "1/L of the region's traffic, so a region with at least that many ranks is "
        "link-bound, not CPU-bound.",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "codec_and_sync.md").write_text(table)


if __name__ == "__main__":
    main()
