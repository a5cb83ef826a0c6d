"""Peak memory per rank: a whole replica per rank against FSDP2 inside the region
(training.parallel), on a real 2-rank gloo region on this machine.

Protocol: a Llama config of 246M parameters (hidden 1024, 16 layers, 16 heads, 4 KV heads,
MLP 2816, vocab 32000, untied), fp32 weights, AdamW; 2 ranks per region, batch 1 x 128
tokens, 3 optimizer steps, the same seed in every mode. Each mode is the runtime's own
path: `replicated` keeps the gradients in the runtime's flat buffer (training.sync.buckets.
GradBuffer, DDP's gradient-as-bucket-view) and averages it inside the region with one
in-place all-reduce (what sync: diloco's inner steps do; the cross-region sync adds its
buckets on top in both modes); `fsdp` is `parallel.shard: fsdp` (FSDP's reduce-scatter),
its gradients set to None before each backward as the runtime does. Both run under glibc's
default allocator settings, under the runtime's for CPU workers
(training.launch.launcher.CPU_MALLOC) and under a 128 KiB mmap threshold (lower memory,
slower steps: benchmarks/cpu_malloc.py), side by side, each in its own fresh processes, in
one invocation. Peak memory is the kernel's high-water mark of the process (VmHWM), and the
growth over the process before the model was built.

History: the first version of this script (results of 2026-12-07) averaged a replicated
region's gradients through a fresh concatenated copy of every gradient, which the runtime
never makes; that inflated the replicated peak by ~0.9 GiB and put FSDP at 0.617x. This
version measures the runtime's paths; the table says where each number comes from.

Why this model: replicated, its AdamW state is 16 bytes a parameter (weights, gradients,
two moments) = 3.9 GB a rank; six ranks (3 regions x 2) need ~24 GB before activations
and the interpreter, more than this machine's 24 GB. Target: FSDP's peak per rank at most
0.6x the replicated one, under the allocator settings the runtime gives its workers.

Run: python benchmarks/fsdp_memory.py. Prints a table and saves it to
benchmarks/results/fsdp_memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.comm.topology import Groups
from training.launch.launcher import CPU_MALLOC
from training.spec import ParallelSpec
from training.testing import run_world

OUT = Path(__file__).parent / "results" / "fsdp_memory.md"
CONFIG: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
RANKS, BATCH, SEQ, STEPS = 2, 1, 128, 3


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(rank: int, world: int, mode: str) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.models.build import lm_loss
    from training.parallel.fsdp import shard
    from training.sync.buckets import GradBuffer

    torch.set_num_threads(1)
    base = _status("VmRSS")
    torch.manual_seed(0)
    model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**CONFIG))
    n = sum(p.numel() for p in model.parameters())
    group = dist.new_group(list(range(world)))
    buf = None
    if mode == "fsdp":
        model = shard(model, Groups(group, None, torch.device("cpu")), ParallelSpec("fsdp"))
    else:
        buf = GradBuffer.of(model)
        assert buf is not None  # one dtype, one device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        if buf is not None:
            buf.zero()  # training.gradsync.zero_grads: the views, zeroed
        else:
            opt.zero_grad(set_to_none=True)
        lm_loss(model, tokens).backward()
        if buf is not None:  # the region's mean, in place in the flat buffer
            dist.all_reduce(buf.flat, group=group)
            buf.flat.div_(world)
        opt.step()
    return {
        "params": n,
        "peak": _status("VmHWM"),
        "growth": _status("VmHWM") - base,
        "step_s": (time.perf_counter() - t0) / STEPS,
    }


def _world(mode: str, malloc: dict[str, str]) -> list[dict[str, Any]]:
    """One mode in a fresh interpreter whose environment holds `malloc` and nothing else of
    CPU_MALLOC (glibc reads it at start; run_world's fork server would otherwise hand every
    rank the allocator state of the first run)."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_MALLOC} | malloc
    r = subprocess.run(
        [sys.executable, __file__, "--one", mode], env=env, capture_output=True, text=True
    )
    if r.returncode:
        raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
    rows: list[dict[str, Any]] = json.loads(r.stdout.strip().splitlines()[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=("replicated", "fsdp"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:  # a child of this script: one mode, its rows as JSON
        print(json.dumps(run_world(_rank, RANKS, a.one, timeout=1800)))
        return
    settings = {
        "glibc default": {},
        "runtime (CPU_MALLOC)": CPU_MALLOC,
        "128 KiB": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    }
    rows = {
        (alloc, mode): _world(mode, env)
        for alloc, env in settings.items()
        for mode in ("replicated", "fsdp")
    }
    gib = 2**30
    n = next(iter(rows.values()))[0]["params"]
    lines = [
        "# Peak memory per rank: replicated vs FSDP (benchmarks/fsdp_memory.py)",
        "",
        f"Llama config, {n / 1e6:.1f}M parameters, fp32 + AdamW; {RANKS} ranks per region "
        f"(gloo, CPU), batch {BATCH} x {SEQ} tokens, {STEPS} steps; each mode the runtime's "
        "path (replicated: the flat gradient buffer, one in-place all-reduce). Peak: the "
        "process's VmHWM; growth: peak less the process before the model was built. "
        f"Runtime allocator setting: {', '.join(f'{k}={v}' for k, v in CPU_MALLOC.items())}.",
        "",
        "| allocator | mode | rank | peak GiB | growth GiB | s/step |",
        "|---|---|---|---|---|---|",
    ]
    for (alloc, mode), ranks in rows.items():
        for r, row in enumerate(ranks):
            lines.append(
                f"| {alloc} | {mode} | {r} | {row['peak'] / gib:.2f} | "
                f"{row['growth'] / gib:.2f} | {row['step_s']:.1f} |"
            )
    lines.append("")
    for alloc in settings:
        peak = {m: max(r["peak"] for r in rows[(alloc, m)]) for m in ("replicated", "fsdp")}
        growth = {m: max(r["growth"] for r in rows[(alloc, m)]) for m in ("replicated", "fsdp")}
        ratio = peak["fsdp"] / peak["replicated"]
        lines.append(
            f"{alloc}: FSDP / replicated, largest rank: peak {ratio:.3f}x, growth "
            f"{growth['fsdp'] / growth['replicated']:.3f}x; six ranks (3 regions x 2) "
            f"replicated {6 * peak['replicated'] / gib:.1f} GiB, FSDP "
            f"{6 * peak['fsdp'] / gib:.1f} GiB (this machine: 24 GiB)."
        )
    runtime = "runtime (CPU_MALLOC)"
    peak = {m: max(r["peak"] for r in rows[(runtime, m)]) for m in ("replicated", "fsdp")}
    ratio = peak["fsdp"] / peak["replicated"]
    lines += [
        "",
        f"Target: FSDP peak <= 0.60x replicated under the runtime's setting: {ratio:.3f}x, "
        f"{'met' if ratio <= 0.6 else 'not met'}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
