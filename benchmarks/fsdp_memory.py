"""Peak memory per rank: a whole replica per rank against FSDP2 inside the region
(training.parallel), on a real 2-rank gloo region on this machine.

Protocol (fixed before the runs): a Llama config of 246M parameters (hidden 1024, 16
layers, 16 heads, 4 KV heads, MLP 2816, vocab 32000, untied), fp32 weights, AdamW; 2
ranks per region, batch 1 x 128 tokens, 3 optimizer steps, the same seed in both modes.
`replicated` averages the gradients inside the region with one all-reduce (what
sync: diloco's inner steps do; the cross-region sync adds its buckets on top in both
modes); `fsdp` is `parallel.shard: fsdp` (FSDP's reduce-scatter). Each mode runs in its
own fresh processes, one mode after the other in one invocation. Peak memory is the
kernel's high-water mark of the process (VmHWM), and the growth over the process before
the model was built.

Why this model: replicated, its AdamW state is 16 bytes a parameter (weights, gradients,
two moments) = 3.9 GB a rank; six ranks (3 regions x 2) need ~24 GB before activations
and the interpreter, more than this machine's 24 GB. Target: FSDP's peak per rank at most
0.6x the replicated one.

Run: python benchmarks/fsdp_memory.py. Prints a table and saves it to
benchmarks/results/fsdp_memory.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.comm.topology import Groups
from training.spec import ParallelSpec
from training.testing import run_world

OUT = Path(__file__).parent / "results" / "fsdp_memory.md"
CONFIG = {
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

    torch.set_num_threads(1)
    base = _status("VmRSS")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    n = sum(p.numel() for p in model.parameters())
    group = dist.new_group(list(range(world)))
    if mode == "fsdp":
        model = shard(model, Groups(group, None, torch.device("cpu")), ParallelSpec("fsdp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        opt.zero_grad(set_to_none=True)
        lm_loss(model, tokens).backward()
        if mode == "replicated":
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            at = 0
            for p in model.parameters():
                p.grad.copy_(flat[at : at + p.numel()].view_as(p))
                at += p.numel()
            del flat
        opt.step()
    return {
        "params": n,
        "peak": _status("VmHWM"),
        "growth": _status("VmHWM") - base,
        "step_s": (time.perf_counter() - t0) / STEPS,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows = {mode: run_world(_rank, RANKS, mode, timeout=1800) for mode in ("replicated", "fsdp")}
    gib = 2**30
    n = rows["replicated"][0]["params"]
    lines = [
        "# Peak memory per rank: replicated vs FSDP (benchmarks/fsdp_memory.py)",
        "",
        f"Llama config, {n / 1e6:.1f}M parameters, fp32 + AdamW; {RANKS} ranks per region "
        f"(gloo, CPU), batch {BATCH} x {SEQ} tokens, {STEPS} steps. Peak: the process's "
        "VmHWM; growth: peak less the process before the model was built.",
        "",
        "| mode | rank | peak GiB | growth GiB | s/step |",
        "|---|---|---|---|---|",
    ]
    for mode, ranks in rows.items():
        for r, row in enumerate(ranks):
            lines.append(
                f"| {mode} | {r} | {row['peak'] / gib:.2f} | {row['growth'] / gib:.2f} "
                f"| {row['step_s']:.1f} |"
            )
    peak = {m: max(r["peak"] for r in rs) for m, rs in rows.items()}
    growth = {m: max(r["growth"] for r in rs) for m, rs in rows.items()}
    ratio, gratio = peak["fsdp"] / peak["replicated"], growth["fsdp"] / growth["replicated"]
    six = 6 * peak["replicated"] / gib
    lines += [
        "",
        f"FSDP / replicated, largest rank: peak {ratio:.3f}x, growth {gratio:.3f}x "
        f"(target: peak <= 0.60x: {'met' if ratio <= 0.6 else 'not met'}).",
        f"Six replicated ranks (3 regions x 2) would peak at {six:.1f} GiB together; "
        f"six FSDP ranks at {6 * peak['fsdp'] / gib:.1f} GiB (this machine: 24 GiB).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
