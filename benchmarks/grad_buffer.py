"""The gradient buffer (training.gradsync.GradBuffer) against autograd's own gradients, on
a real 3-region x 2-rank gloo world on this machine, the stacks' demo model.

Per step and rank: the zeroing of the gradients, forward and backward, and the sync of
the gradients, with both paths interleaved step by step in the same processes (two
models from one seed; the machine is shared, so the comparison is side by side):
- `diloco inner`: the in-region average of DiLoCo's inner steps (region_average_grads);
- `allreduce int8`: the per-step hierarchical sync (int8 + zstd + SM4-GCM).
`autograd` is the path before the buffer: zero_grad(set_to_none=True), then every
gradient copied into one flat tensor per bucket and back after the collective.

Run: python benchmarks/grad_buffer.py [--steps 60]. Prints a table and saves it to
benchmarks/results/grad_buffer.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from training.comm.topology import Topology, make_groups
from training.gradsync import GradBuffer, flat_grads, hierarchical_step, region_average_grads
from training.models.deepseek import build_model
from training.spec import CodecSpec
from training.sync.codec import Codec
from training.sync.hier import HierarchicalAllReduce
from training.testing import make_spec, run_world

REGIONS, LOCAL = 3, 2
PATHS = ("autograd", "buffer")
SYNCS = ("diloco inner", "allreduce int8")
KINDS = ("zero", "compute", "sync", "compute cpu", "other cpu")
KEY = bytes(range(32))
OUT = Path(__file__).parent / "results" / "grad_buffer.md"


def _rank(rank: int, world: int, steps: int, batch: int, seq: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    spec = make_spec(REGIONS, LOCAL)
    topo = Topology.of(spec, rank)
    groups = make_groups(topo, torch.device("cpu"))
    codec = CodecSpec(quantize="int8", cipher="sm4-gcm")
    out: dict[str, Any] = {}
    for sync_name in SYNCS:
        runs = {}
        for path in PATHS:
            torch.manual_seed(0)
            model = build_model("deepseek-tiny")
            buf = GradBuffer.of(model) if path == "buffer" else None
            sync = HierarchicalAllReduce(topo, groups, Codec(codec, KEY), spec.run_id)
            job = SimpleNamespace(model=model, topo=topo, groups=groups, grads=buf)
            runs[path] = (model, buf, sync, job)
        times: dict[str, dict[str, list[float]]] = {p: {k: [] for k in KINDS} for p in PATHS}
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * rank + step)
            tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
            order = PATHS if step % 2 == 0 else PATHS[::-1]  # who goes first alternates
            for path in order:
                model, buf, sync, job = runs[path]
                t0, c0 = time.perf_counter(), time.process_time()
                if buf is not None:
                    buf.zero()
                else:
                    model.zero_grad(set_to_none=True)
                t1, c1 = time.perf_counter(), time.process_time()
                model.loss(tokens).backward()
                t2, c2 = time.perf_counter(), time.process_time()
                if sync_name == "diloco inner":
                    region_average_grads(job)  # type: ignore[arg-type]
                else:
                    hierarchical_step(model, sync, step, spec.bucket_mb, buf)
                t3, c3 = time.perf_counter(), time.process_time()
                times[path]["zero"].append(t1 - t0)
                times[path]["compute"].append(t2 - t1)
                times[path]["sync"].append(t3 - t2)
                times[path]["compute cpu"].append(c2 - c1)
                times[path]["other cpu"].append(c1 - c0 + c3 - c2)
        last = [flat_grads(list(runs[path][0].parameters())) for path in PATHS]
        same = torch.equal(last[0], last[1])
        out[sync_name] = {"times": times, "same": same}
    return out


def _median(xs: list[float], skip: int) -> float:
    return statistics.median(xs[skip:])


def table(results: list[dict[str, Any]], steps: int, batch: int, seq: int) -> str:
    skip = min(5, steps // 4)  # the first steps allocate and connect
    lines = [
        f"# Gradient buffer: {steps} steps, {REGIONS} regions x {LOCAL} ranks (gloo), "
        f"demo model (2,452,992 params), batch {batch}x{seq}",
        "",
        "Medians over steps (first "
        f"{skip} left out) of each rank, then the median over the {len(results)} ranks; "
        "both paths interleaved step by step in the same processes (who goes first "
        "alternates). `other` = zeroing + sync: the part of the step the buffer changes. "
        "Wall ms wait for the other ranks (six processes share the cores); CPU ms are the "
        "process's CPU time (every thread, gloo's too), what the step costs the machine. "
        "Step CPU: forward+backward and other. Gradients equal: the two paths' last "
        "gradients, bitwise, on every rank.",
        "",
        "| sync | path | zero ms | forward+backward ms | sync ms | other ms | "
        "forward+backward CPU ms | other CPU ms | other CPU / autograd's | step CPU / "
        "autograd's | gradients equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sync_name in SYNCS:
        rows = {
            path: {
                k: statistics.median(_median(r[sync_name]["times"][path][k], skip) for r in results)
                for k in KINDS
            }
            for path in PATHS
        }
        same = all(r[sync_name]["same"] for r in results)
        for path in PATHS:
            per = rows[path]
            ratio = per["other cpu"] / rows["autograd"]["other cpu"]
            base = rows["autograd"]["compute cpu"] + rows["autograd"]["other cpu"]
            whole = (per["compute cpu"] + per["other cpu"]) / base
            lines.append(
                f"| {sync_name} | {path} | {1e3 * per['zero']:.2f} | "
                f"{1e3 * per['compute']:.1f} | {1e3 * per['sync']:.2f} | "
                f"{1e3 * (per['zero'] + per['sync']):.2f} | {1e3 * per['compute cpu']:.1f} | "
                f"{1e3 * per['other cpu']:.2f} | {ratio:.2f} | {whole:.3f} | "
                f"{'yes' if same else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="steps per path and sync (>= 8)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    for name, v, low in (("--steps", a.steps, 8), ("--batch", a.batch, 1), ("--seq", a.seq, 1)):
        if v < low:
            ap.error(f"{name} {v}: must be at least {low}")
    results = run_world(_rank, REGIONS * LOCAL, a.steps, a.batch, a.seq, timeout=1800)
    text = table(results, a.steps, a.batch, a.seq)
    print(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
