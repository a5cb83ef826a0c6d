"""Issue 3 benchmark: the demo model trained with the same seed and steps under seven sync
methods, side by side in one run, on a real 3-region x 2-rank gloo world on this machine.

  (a) fp32 flat all-reduce (DDP default)   (b) torch fp16_compress_hook
  (c) torch PowerSGD hook (rank 4)         (d) geotrain fp16 + zstd + SM4-GCM
  (e) geotrain int8 + zstd + SM4-GCM       (f) geotrain int4 + zstd + SM4-GCM
  (g) geotrain ternary + zstd + SM4-GCM (meant for DiLoCo merges; here every step)

Cross-region bytes: geotrain counts the encoded payloads it sends. DDP's hooks do flat
all-reduces over every rank; for them we count the bytes each hook hands to all_reduce
and apply the cross-region share of a ring all-reduce with ranks ordered by region
(training.observe.baseline.flat_ring_cross_bytes). Also: codec throughput per core.

Run: python benchmarks/codec_and_sync.py [--steps 60]. Prints a table and saves it to
benchmarks/results/codec_and_sync.md.

`--codec-only [--baseline REV]` measures only the codec throughput, this checkout's codec
side by side with training/sync/codec.py at git revision REV (interleaved rounds, best of each:
the machine is shared), and replaces the codec sections of the saved table.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from training.comm.session import Session
from training.comm.topology import Topology, make_groups
from training.data.loader import ByteLoader, load_region_text
from training.gradsync import hierarchical_step
from training.models.deepseek import build_model
from training.observe.baseline import flat_ring_cross_bytes
from training.spec import CodecSpec
from training.sync.codec import Address, Codec
from training.sync.hier import HierarchicalAllReduce
from training.testing import make_spec, run_world

REGIONS, LOCAL = 3, 2
WORLD = REGIONS * LOCAL
METHODS = [
    "fp32-flat",
    "torch-fp16-hook",
    "torch-powersgd-r4",
    "geotrain-fp16",
    "geotrain-int8",
    "geotrain-int4",
    "geotrain-ternary",
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
        sync = HierarchicalAllReduce(  # an unagreed session of the run id (no agreement)
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


QUANTS = ("fp16", "int8", "int4")
NEW = ("ternary",)
"""Quantizers the issue #15 baseline codec does not have: timed now only."""
SMALL = 256
"""Values in the small payload whose fixed cost per payload (headers, keys, checks) the
codec benchmark also times, in microseconds (the `small` entry)."""


def _current(q: str) -> tuple[Any, Any, Any]:
    """(codec, encode(x), decode(payload)) of this checkout's codec."""
    session = Session("bench", bytes(range(16)), 0)
    c = Codec(CodecSpec(quantize=q, cipher="sm4-gcm"), bytes(range(32)), session)
    a = Address(0, 0, 0, 1, 0)
    return c, lambda x: c.encode(x, a)[0], lambda p, n: c.decode(p, a, n)


def _baseline(mod: ModuleType, q: str) -> tuple[Any, Any, Any]:
    """The same for a codec module of an earlier revision (issue #15's `before`)."""
    c = mod.Codec(CodecSpec(quantize=q, cipher="sm4-gcm"), bytes(range(32)))
    a = mod.Address("bench", 0, 0, 0, 0)
    return c, lambda x: c.encode(x, a)[0], lambda p, n: c.decode(p, a)


def _time(encode: Any, decode: Any, x: torch.Tensor, reps: int = 3) -> tuple[float, float, int]:
    """(seconds per encode, seconds per decode, payload bytes)."""
    p = encode(x)  # warm up
    t0 = time.perf_counter()
    for _ in range(reps):
        p = encode(x)
    enc = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        decode(p, x.numel())
    return enc, (time.perf_counter() - t0) / reps, len(p)


def codec_throughput(
    mb: int = 16, baseline: ModuleType | None = None, rounds: int = 15
) -> dict[str, dict[str, tuple[float, float, float]]]:
    """{version: {quant: (encode MB/s of fp32 in, wire MB/s out, decode MB/s)}} per core,
    SM4-GCM; versions interleaved round by round, best round of each kept."""
    torch.set_num_threads(1)
    x = torch.randn(mb * 2**20 // 4) * 1e-3
    raw = x.numel() * 4 / 1e6
    makers = {"after": _current}
    if baseline is not None:
        makers = {"before": lambda q: _baseline(baseline, q), "after": _current}
    small = torch.randn(SMALL) * 1e-3
    best: dict[str, dict[str, tuple[float, float, int]]] = {v: {} for v in makers}
    for r in range(rounds):
        for q in (*QUANTS, *NEW, "small"):
            order = [(v, m) for v, m in makers.items() if v == "after" or q not in NEW]
            for v, make in order if r % 2 else reversed(order):  # no version always second
                _, enc, dec = make("int8" if q == "small" else q)
                e, d, n = _time(enc, dec, small, 300) if q == "small" else _time(enc, dec, x)
                old = best[v].get(q)
                best[v][q] = (min(e, old[0]), min(d, old[1]), n) if old else (e, d, n)
    return {
        v: {
            q: (1e6 * e, n, 1e6 * d) if q == "small" else (raw / e, n / 1e6 / e, raw / d)
            for q, (e, d, n) in per.items()
        }
        for v, per in best.items()
    }


def load_codec_at(rev: str) -> ModuleType:
    """training/sync/codec.py as of git revision `rev`, as a module of its own."""
    src = subprocess.run(
        ["git", "show", f"{rev}:training/sync/codec.py"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "codec_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("codec_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod


def codec_lines(rev: str | None) -> list[str]:
    """The codec sections of the table: throughput now, and before/after `rev`."""
    got = codec_throughput(baseline=load_codec_at(rev) if rev else None)
    lines = [
        "## Codec throughput per core (quantize + shuffle + zstd-1 + SM4-GCM)",
        "",
        "| quantize | encode MB/s (fp32 in) | wire MB/s out | decode MB/s | cores to fill "
        "1 Gbit/s |",
        "|---|---|---|---|---|",
    ]
    for q in (*QUANTS, *NEW):
        enc, wire, dec = got["after"][q]
        lines.append(f"| {q} | {enc:.0f} | {wire:.0f} | {dec:.0f} | {125 / wire:.1f} |")
    lines += [
        "",
        "Cores to fill 1 Gbit/s (125 MB/s): encoders needed in parallel to produce "
        "wire bytes as fast as the link drains them; each local rank encodes its own "
        "1/L of the region's traffic, so a region with at least that many ranks is "
        "link-bound, not CPU-bound.",
    ]
    if "before" in got:
        lines += [
            "",
            f"## Security hardening (issue #15): codec before ({rev}) and after, same run",
            "",
            "Per-link HKDF keys (cached), counter nonces, the receiver's shape checks and "
            "the 84-byte v2 header against one run key, random nonces and a 36-byte header. "
            "Interleaved rounds (alternating which goes first), best of 15 each "
            "(16 MiB of fp32, one core).",
            "",
            "| quantize | encode MB/s before | after | after/before | decode MB/s before "
            "| after | after/before |",
            "|---|---|---|---|---|---|---|",
        ]
        ratios = []
        for q in QUANTS:
            eb, _, db = got["before"][q]
            ea, _, da = got["after"][q]
            ratios += [ea / eb, da / db]
            lines.append(
                f"| {q} | {eb:.0f} | {ea:.0f} | {ea / eb:.3f} | {db:.0f} | {da:.0f} | "
                f"{da / db:.3f} |"
            )
        mean = math.prod(ratios) ** (1 / len(ratios))
        (eb, nb, db), (ea, na, da) = got["before"]["small"], got["after"]["small"]
        lines += [
            "",
            f"Geometric mean of the six after/before ratios: {mean:.3f}. Fixed cost of one "
            f"int8 payload of {SMALL} values (header, keys, checks), best of 15 x 300: encode "
            f"{eb:.1f} -> {ea:.1f} us, decode {db:.1f} -> {da:.1f} us, {nb} -> {na} bytes.",
        ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--codec-only", action="store_true", help="only the codec sections")
    ap.add_argument("--baseline", default=None, help="git revision of the `before` codec")
    a = ap.parse_args()
    if a.codec_only:
        saved = RESULTS / "codec_and_sync.md"
        head = saved.read_text().split("## Codec throughput")[0] if saved.exists() else ""
        table = head + "\n".join(codec_lines(a.baseline)) + "\n"
        print(table)
        saved.write_text(table)
        return
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
    lines += ["", *codec_lines(a.baseline)]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "codec_and_sync.md").write_text(table)


if __name__ == "__main__":
    main()
