"""Issue 18 benchmark: what the signed training ledger costs the training loop.

One process, the local stack's model and batch (deepseek-tiny, batch 4 x seq 64, one
thread), in one run: the median training step (forward, backward, AdamW), and the median
cost of each ledger record as the worker makes it (training.audit.hooks): SM3 of the
tensors, the Ed25519 signature over DSSE's PAE, one O_APPEND write and an fsync. Reports
each as a share of one step, and per step amortized over the stack's cadence (a record
every `checkpoint.interval_steps` = 20 steps for allreduce; every merge, H = 100 steps by
default, for diloco). Not included: allreduce's in-region all-reduce of the gradient at
recorded steps (one more all-reduce of the model's size inside the region, every 20th
step), which depends on the region's network, not on the ledger.

Run: python benchmarks/ledger_cost.py. Saves benchmarks/results/ledger_cost.md.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from training.audit.ledger import Ledger, TensorHasher, tensors_sm3
from training.data.loader import ByteLoader, load_region_text
from training.gradsync import buckets
from training.models.deepseek import build_model
from training.spec import DilocoSpec
from training.sync.diloco import split_fragments
from training.testing import make_spec

RESULTS = Path(__file__).resolve().parent / "results"
SYNC_EVERY, MERGE_EVERY, FRAGMENTS = 20, 100, 3
"""The local stack's checkpoint interval (allreduce records), diloco's default H, and the
streaming fragments of the lab's measurements (lab_network.md): one record per landing."""


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(steps: int = 30, repeats: int = 15) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = make_spec()
    model = build_model("deepseek-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = ByteLoader.of(load_region_text(spec.regions[0], 0, 3), 4, 64, 0)

    def step() -> None:
        loss = model.loss(loader.next())
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()  # warm-up: lazy optimizer state, allocator
    step_ms = _median_ms(step, steps)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        ledger = Ledger.open(run, run, "beijing", "bench")
        ledger.append("start", {"launch-spec": {"sm3": "0" * 64}}, epoch=0, keys={})

        def merge_record() -> None:  # ledger_hooks.merged: the buckets as merge() sends them
            pg = TensorHasher()
            for bucket in buckets(params, 4.0):
                pg.update(torch.cat([p.detach().reshape(-1) for p in bucket]))
            subject = {"pseudo-gradient/beijing": {"sm3": pg.hexdigest()}}
            subject["params"] = {"sm3": tensors_sm3(params)}
            ledger.append("merge", subject, step=0, merge=0, epoch=0)

        bs = buckets(params, 4.0)
        spec = DilocoSpec(fragments=FRAGMENTS)
        first = split_fragments([sum(p.numel() for p in b) for b in bs], spec)[0]

        def landing_record(whole: bool) -> None:  # a streaming landing: one fragment's merge
            pg = TensorHasher()
            for b in first:
                pg.update(torch.cat([p.detach().reshape(-1) for p in bs[b]]))
            subject = {"pseudo-gradient/beijing": {"sm3": pg.hexdigest()}}
            signed = params if whole else [p for b in first for p in bs[b]]
            subject["params"] = {"sm3": tensors_sm3(signed)}
            ledger.append("merge", subject, step=0, merge=0, epoch=0, fragment=0)

        grad = torch.cat([p.detach().reshape(-1) for p in params])

        def sync_record() -> None:  # ledger_hooks.region_gradient (digest) + synced
            subject = {"gradient/beijing": {"sm3": tensors_sm3([grad])}}
            subject["params"] = {"sm3": tensors_sm3(params)}
            ledger.append("sync", subject, step=0, epoch=0)

        root = run / "ckpt"
        d = root / "step-1" / "n0"
        d.mkdir(parents=True)
        files = {f"__{i}_0.distcp": hashlib.sha256(b"%d" % i).hexdigest() for i in range(2)}
        (d / "manifest.json").write_text(json.dumps({"files": files}))

        def checkpoint_record() -> None:  # ledger_hooks.committed (the writer thread)
            ledger.record_checkpoint(root, "n0", 1, 0)

        sign_only = _median_ms(lambda: ledger.append("dp", {"x": {"sm3": "0"}}), repeats)
        merge_ms = _median_ms(merge_record, repeats)
        # side by side: what a landing hashed before (the whole model) and now (its fragment)
        land_whole_ms = _median_ms(lambda: landing_record(True), repeats)
        land_ms = _median_ms(lambda: landing_record(False), repeats)
        sync_ms = _median_ms(sync_record, repeats)
        ckpt_ms = _median_ms(checkpoint_record, repeats)
        digest_ms = _median_ms(lambda: tensors_sm3(params), repeats)
    pct = 100 / step_ms
    rows = [
        ("median training step", step_ms, 100.0, "-"),
        ("SM3 of the parameters (%.1f MB)" % (4 * n / 1e6), digest_ms, digest_ms * pct, "-"),
        ("sign + append + fsync (empty entry)", sign_only, sign_only * pct, "-"),
        (
            "diloco merge record (pseudo-gradient + params)",
            merge_ms,
            merge_ms * pct,
            f"{merge_ms * pct / MERGE_EVERY:.3f}% (H={MERGE_EVERY})",
        ),
        (
            f"streaming landing record, 1 of {FRAGMENTS} fragments: its params (now)",
            land_ms,
            land_ms * pct,
            f"{land_ms * pct * FRAGMENTS / MERGE_EVERY:.3f}% (H={MERGE_EVERY})",
        ),
        (
            "same, every param (as before; the signed digest of a landing)",
            land_whole_ms,
            land_whole_ms * pct,
            f"{land_whole_ms * pct * FRAGMENTS / MERGE_EVERY:.3f}% (H={MERGE_EVERY})",
        ),
        (
            "allreduce sync record (gradient + params)",
            sync_ms,
            sync_ms * pct,
            f"{sync_ms * pct / SYNC_EVERY:.3f}% (every {SYNC_EVERY})",
        ),
        ("checkpoint record (writer thread, off the loop)", ckpt_ms, ckpt_ms * pct, "0 (async)"),
    ]
    lines = [
        f"# Ledger cost: deepseek-tiny ({n / 1e6:.2f}M params), batch 4 x seq 64, one thread",
        "",
        "| | ms | % of one step | per step, amortized |",
        "|---|---|---|---|",
        *(f"| {name} | {ms:.2f} | {p:.1f}% | {a} |" for name, ms, p, a in rows),
        "",
        f"Medians of {repeats} records and {steps} steps, one run on a shared 2-core machine. "
        f"Streaming records one entry per fragment landing ({FRAGMENTS} per H steps); a "
        "landing's entry signs only its fragment's parameters (training.audit.hooks.merged), "
        f"{land_whole_ms / land_ms:.2f}x less than hashing every parameter at each landing.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ledger_cost.md").write_text(text)


if __name__ == "__main__":
    main()
