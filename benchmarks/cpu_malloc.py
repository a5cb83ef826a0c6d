"""The speed side of the CPU workers' allocator setting (training.launch.launcher.CPU_MALLOC).

Protocol (fixed before the runs): one process per measurement, a fresh interpreter whose
environment sets MALLOC_MMAP_THRESHOLD_ (or leaves glibc's dynamic default), one thread;
the hf example model (examples/tiny-llama, 2.4M parameters) and the deepseek-tiny preset,
AdamW, batch 4 x 128 tokens, 5 warm-up steps then 30 timed steps; the settings interleaved
round by round (5 rounds) so the machine's load falls on all of them alike. Reported: the
median seconds per step over the rounds, its range, and the ratio to the default's median.
The memory side is benchmarks/fsdp_memory.py.

Run: python benchmarks/cpu_malloc.py. Prints a table and saves it to
benchmarks/results/cpu_malloc.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "cpu_malloc.md"
MODELS = (f"hf:{REPO / 'examples' / 'tiny-llama'}", "deepseek-tiny")
SETTINGS = {"glibc default": None, "128 KiB": 128 * 1024, "4 MiB": 4 * 2**20}
ROUNDS, WARMUP, STEPS = 5, 5, 30

STEP = """
import sys, time, torch
from training.models.build import build_model, lm_loss
torch.set_num_threads(1)
torch.manual_seed(0)
model = build_model(sys.argv[1], 128)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 256, (4, 129))
def step():
    opt.zero_grad()
    lm_loss(model, x).backward()
    opt.step()
for _ in range(int(sys.argv[2])):
    step()
t0 = time.perf_counter()
for _ in range(int(sys.argv[3])):
    step()
print((time.perf_counter() - t0) / int(sys.argv[3]))
"""


def one(model: str, threshold: int | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    r = subprocess.run(
        [sys.executable, "-c", STEP, model, str(WARMUP), str(STEPS)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(ROUNDS):
        for model in MODELS:
            for name, threshold in SETTINGS.items():
                times.setdefault((model, name), []).append(one(model, threshold))
    lines = [
        "# CPU step time under the allocator settings (benchmarks/cpu_malloc.py)",
        "",
        f"One process per measurement, 1 thread, batch 4 x 128, {STEPS} timed steps after "
        f"{WARMUP}; settings interleaved over {ROUNDS} rounds.",
        "",
        "| model | MALLOC_MMAP_THRESHOLD_ | median s/step | range | / default |",
        "|---|---|---|---|---|",
    ]
    for model in MODELS:
        base = statistics.median(times[(model, "glibc default")])
        for name in SETTINGS:
            t = times[(model, name)]
            med = statistics.median(t)
            lines.append(
                f"| {Path(model).name if model.startswith('hf:') else model} | {name} | "
                f"{med:.4f} | {min(t):.4f}-{max(t):.4f} | {med / base:.2f}x |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
