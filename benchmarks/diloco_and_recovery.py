"""Issue 4 benchmark, through the real `geotrain train` path on the local stack (3 regions
x 2 ranks), side by side in one run:

- cross-region bytes per parameter per inner step: per-step fp32 all-reduce (the flat
  ring estimate), geotrain allreduce int8, and diloco with H = 50, 100, 500 (int8, int4),
  with the final loss at equal tokens and its gap to allreduce int8;
- checkpoint stall: ms the training loop waits per save, and as % of a step; and the
  background cost: how much slower the steps are while a save is being written;
- recovery: seconds from kill -9 of a worker to the first step after the resume.

Run: python benchmarks/diloco_and_recovery.py [--steps 500] [--stall-only |
--recovery-only] (re-measure those rows of the saved table only). Saves
benchmarks/results/diloco_and_recovery.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def stack(tmp: Path, name: str, steps: int, **training: Any) -> Path:
    doc = yaml.safe_load((ROOT / "stacks" / "Pulumi.local.yaml").read_text())
    t = doc["config"]["geotrain:training"]
    t.update({"steps": steps, "batch_size": 2, "seq_len": 32, **training})
    doc["config"]["geotrain:monitoring"]["metrics_port"] = 0
    path = tmp / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def events(cwd: Path, name: str) -> list[dict[str, Any]]:
    p = cwd / ".geotrain" / name / "events.jsonl"
    return (
        [json.loads(x) for x in p.read_text().splitlines() if x.endswith("}")] if p.exists() else []
    )


def train(tmp: Path, name: str, steps: int, **training: Any) -> dict[str, Any]:
    path = stack(tmp, name, steps, **training)
    r = subprocess.run(
        [sys.executable, "-m", "geotrain", "train", "--stack", str(path)],
        cwd=tmp,
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise SystemExit(f"{name} failed: {r.stdout}\n{r.stderr}")
    report = json.loads((tmp / ".geotrain" / name / "report.json").read_text())
    ev = events(tmp, name)
    losses: dict[int, list[float]] = {}
    for e in ev:
        if e["event"] == "step":
            losses.setdefault(e["step"], []).append(e["loss"])
    tail = [sum(v) / len(v) for s, v in sorted(losses.items())][-25:]  # (25,) region means
    report["final_loss_tail"] = sum(tail) / len(tail)
    report["events"] = ev
    return report


def recovery(tmp: Path, steps: int) -> tuple[float, int]:
    """kill -9 one worker mid-run; seconds until the first step after the resume."""
    path = stack(tmp, "recover", steps, checkpoint={"interval_steps": 10, "keep": 2})
    proc = subprocess.Popen(
        [sys.executable, "-m", "geotrain", "train", "--stack", str(path)],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_at = random.Random(0).randint(25, 35)
    t_kill = None
    while proc.poll() is None:
        ev = events(tmp, "recover")
        if t_kill is None and any(e["event"] == "step" and e["step"] >= kill_at for e in ev):
            pids = [e["pid"] for e in ev if e["event"] == "start"]
            os.kill(random.Random(1).choice(pids), signal.SIGKILL)
            t_kill = time.time()
        time.sleep(0.05)
    ev = events(tmp, "recover")
    t0 = t_kill or 0.0
    resume = min((e for e in ev if e["event"] == "resume" and e["t"] > t0), key=lambda e: e["t"])
    # the first step of the restarted run, not a late step of the attempt being stopped
    first = min(e["t"] for e in ev if e["event"] == "step" and e["t"] > resume["t"])
    return first - t0, kill_at - resume["step"]


def train_allreduce(tmp: Path, steps: int) -> dict[str, Any]:
    return train(tmp, "ar", steps, sync="allreduce", checkpoint={"interval_steps": 50, "keep": 2})


def stall_rows(run: dict[str, Any]) -> list[str]:
    """What a save costs the loop: the wait inside save(), and the extra time of the steps
    that ran while the save was written in the background (vs. the other steps)."""
    ev = run["events"]
    stalls = [e["stall_s"] for e in ev if e["event"] == "checkpoint"]
    steps = [e for e in ev if e["event"] == "step" and e["step"] > 1]  # past the warm-up
    busy = [e["step_s"] for e in steps if e.get("saving")]
    free = [e["step_s"] for e in steps if not e.get("saving")]
    step_s = sum(free) / len(free)
    stall = sum(stalls) / len(stalls)
    extra = (sum(busy) - len(busy) * step_s) / len(stalls)  # per save, all leaders' view
    return [
        f"| checkpoint stall per save (ms, mean of {len(stalls)}) | {1000 * stall:.1f} |",
        f"| stall as % of one step ({1000 * step_s:.0f} ms) | {100 * stall / step_s:.1f}% |",
        f"| steps per save written in the background | {len(busy) / len(stalls):.1f} |",
        f"| background cost per save: those steps' extra time (ms) | {1000 * extra:.1f} |",
    ]


def recovery_rows(rec_s: float, lost: int) -> list[str]:
    return [
        f"| recovery: kill -9 to first step after resume (s) | {rec_s:.1f} |",
        f"| work lost (steps; interval 10) | {lost} |",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument(
        "--recovery-only",
        action="store_true",
        help="re-measure recovery and update those rows of the saved table",
    )
    ap.add_argument(
        "--stall-only",
        action="store_true",
        help="re-measure the checkpoint stall and update those rows of the saved table",
    )
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="geotrain-bench-"))
    if a.recovery_only or a.stall_only:
        if a.stall_only:
            new = stall_rows(train_allreduce(tmp, a.steps))
        else:
            rec_s, lost = recovery(tmp, 60)
            new = recovery_rows(rec_s, lost)
        path = RESULTS / "diloco_and_recovery.md"
        heads = tuple(row.split(" (")[0].split(" |")[0] for row in new)
        rows: list[str] = []
        for ln in path.read_text().splitlines():  # the new rows where the old ones were
            if not ln.startswith(heads):
                rows.append(ln)
            elif new[0] not in rows:
                rows += new
        path.write_text("\n".join(rows if new[0] in rows else rows + new) + "\n")
        print("\n".join(new))
        return
    runs: dict[str, dict[str, Any]] = {}
    runs["allreduce int8"] = train_allreduce(tmp, a.steps)
    for h in (50, 100, 500):
        for q in ("int8", "int4"):
            runs[f"diloco H={h} {q}"] = train(
                tmp,
                f"dl{h}{q}",
                a.steps,
                sync="diloco",
                diloco={"inner_steps": h},
                compression={"quantize": q},
                checkpoint={"interval_steps": 1000, "keep": 2},
            )
        print(f"H={h} done", file=sys.stderr)
    base = runs["allreduce int8"]
    params, steps = base["params"], base["steps"]
    fp32 = base["flat_fp32_allreduce_cross_bytes"] / params / steps
    lines = [
        f"# allreduce vs diloco, {steps} inner steps, 3 regions x 2 ranks, demo model "
        f"({params:,} params), equal tokens",
        "",
        "| run | cross-region bytes/param/inner step | fewer than fp32 per-step | "
        "final loss (last 25) | gap to allreduce int8 |",
        "|---|---|---|---|---|",
        f"| fp32 flat all-reduce every step (ring estimate) | {fp32:.3f} | 1x | - | - |",
    ]
    for name, r in runs.items():
        b = r["cross_region_wire_bytes"] / params / steps
        gap = (r["final_loss_tail"] - base["final_loss_tail"]) / base["final_loss_tail"]
        lines.append(
            f"| {name} | {b:.4f} | {fp32 / b:,.0f}x | {r['final_loss_tail']:.4f} | "
            f"{100 * gap:+.2f}% |"
        )
    rec_s, lost = recovery(tmp, 60)
    lines += ["", "| checkpoint and recovery | value |", "|---|---|"]
    lines += stall_rows(base) + recovery_rows(rec_s, lost)
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "diloco_and_recovery.md").write_text(table)


if __name__ == "__main__":
    main()
