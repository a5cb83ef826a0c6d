"""Issue 19 benchmark: heterogeneous pools, one region slowed, balanced vs unbalanced,
through the real `geotrain train` path on a local stack of 2 regions of different sizes
(beijing 1 rank, frankfurt 2 ranks), side by side in one run.

The slow region is real CPU starvation, not a sleep: its worker processes are moved into a
cgroup with a CPU quota (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` where the cpu
controller is still on v1) as soon as their `start` events appear. Needs root; without it
the script says so and stops.

Per run: wall time per step (after the balance's measurement), each region's compute and
in-sync time per step (a region's leader: step time minus sync time, and the sync time,
which holds the wait for the slower region), its batch per rank, its loss on its own data,
and the loss per sample (region losses weighted by their samples per step). Balancing
moves samples, so it also moves the data mix: the slow region's data weighs less in each
step's gradient, and its own loss can rise while the loss per sample holds.

Run: sudo python benchmarks/heterogeneous.py [--steps 40] [--quota 0.3]. Saves
benchmarks/results/heterogeneous.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SLOW = "beijing"
SEQ = 256
"""Tokens per sequence: enough compute per sample that the batch, not the codec, sets the
step time."""
MEASURE = 5
"""balance_steps: steps measured before the assignment."""


def stack(tmp: Path, name: str, steps: int, balance: str) -> Path:
    doc = yaml.safe_load((ROOT / "stacks" / "Pulumi.local.yaml").read_text())
    cfg = doc["config"]
    regions = cfg["geotrain:regions"][:2]
    regions[0]["pool"]["nodes"][0]["gpus"] = 1  # beijing: 1 rank; frankfurt: 2
    cfg["geotrain:regions"] = regions
    net = cfg["geotrain:network"]
    net["links"] = [x for x in net["links"] if {x["a"], x["b"]} == {"beijing", "frankfurt"}]
    t = cfg["geotrain:training"]
    t["data_shards"] = [s for s in t["data_shards"] if s["region"] in ("beijing", "frankfurt")]
    t.update(
        steps=steps,
        batch_size=4,
        seq_len=SEQ,
        balance=balance,
        balance_steps=MEASURE,
        checkpoint={"interval_steps": 1000, "keep": 2},
    )
    cfg["geotrain:monitoring"]["metrics_port"] = 0
    path = tmp / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def events(tmp: Path, name: str) -> list[dict[str, Any]]:
    p = tmp / ".geotrain" / name / "events.jsonl"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.endswith("}")]


class Quota:
    """A CPU-quota cgroup the slow region's workers are moved into."""

    def __init__(self, share: float) -> None:
        period = 100_000
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "cpu" in v2.read_text().split():
            self.dir = Path(f"/sys/fs/cgroup/geotrain-bench-{os.getpid()}")
            self.dir.mkdir()
            (self.dir / "cpu.max").write_text(f"{int(share * period)} {period}\n")
        else:
            self.dir = Path(f"/sys/fs/cgroup/cpu/geotrain-bench-{os.getpid()}")
            self.dir.mkdir()
            (self.dir / "cpu.cfs_period_us").write_text(f"{period}\n")
            (self.dir / "cpu.cfs_quota_us").write_text(f"{int(share * period)}\n")
        self.kind = "cgroup v2 cpu.max" if v2.exists() else "cgroup v1 cpu.cfs_quota_us"

    def add(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(f"{pid}\n")

    def remove(self) -> None:
        for _ in range(50):  # the workers have exited; the kernel empties the group
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def train(tmp: Path, name: str, steps: int, balance: str, quota: Quota) -> dict[str, Any]:
    path = stack(tmp, name, steps, balance)
    proc = subprocess.Popen(
        [sys.executable, "-m", "geotrain", "train", "--stack", str(path)],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    slowed: set[int] = set()
    while proc.poll() is None:
        for e in events(tmp, name):
            if e["event"] == "start" and e["region"] == SLOW and e["pid"] not in slowed:
                quota.add(e["pid"])
                slowed.add(e["pid"])
        time.sleep(0.02)
    if proc.returncode:
        raise SystemExit(f"{name} failed: {proc.stderr.read() if proc.stderr else ''}")
    return summarise(events(tmp, name), steps)


def summarise(ev: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    first = 2 * MEASURE + 3  # past both rounds of measurement and their assignments
    out: dict[str, Any] = {"regions": {}}
    by_step: dict[int, float] = {}
    for e in ev:
        if e["event"] == "step" and e["step"] >= first:
            r = out["regions"].setdefault(e["region"], {"compute": [], "sync": [], "loss": []})
            r["compute"].append(e["step_s"] - e["sync_s"])
            r["sync"].append(e["sync_s"])
            r["loss"].append(e["loss"])
            by_step[e["step"]] = max(by_step.get(e["step"], 0.0), e["t"])
    done = sorted(by_step)
    out["wall"] = (by_step[done[-1]] - by_step[done[0]]) / (done[-1] - done[0])
    bal = [e for e in ev if e["event"] == "balance"]
    out["batch"] = bal[-1]["batch_per_rank"] if bal else {}
    sizes = {"beijing": 1, "frankfurt": 2}
    samples = {name: sizes[name] * out["batch"].get(name, 4) for name in out["regions"]}
    out["loss"] = sum(
        samples[name] * mean(r["loss"][-10:]) for name, r in out["regions"].items()
    ) / sum(samples.values())
    return out


def table(runs: dict[str, dict[str, Any]], steps: int, quota: float, kind: str) -> str:
    lines = [
        f"# heterogeneous pools: beijing 1 rank (slowed to {quota:.0%} of a core, {kind}), "
        f"frankfurt 2 ranks; {steps} steps, global batch 12 x {SEQ} tokens, allreduce int8",
        "",
        "| run | wall s/step | region | batch/rank | compute s/step | in sync s/step "
        "(comm + wait) | region's loss on its data (last 10) | loss per sample |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        for region, x in r["regions"].items():
            lines.append(
                f"| {name} | {r['wall']:.3f} | {region} | {r['batch'].get(region, 4)} | "
                f"{mean(x['compute']):.3f} | {mean(x['sync']):.3f} | "
                f"{mean(x['loss'][-10:]):.4f} | {r['loss']:.4f} |"
            )
    off, on = runs["unbalanced"]["wall"], runs["balanced"]["wall"]
    load = os.getloadavg()[0]
    lines += [
        "",
        f"balanced / unbalanced wall time per step: {on / off:.2f}x "
        f"(machine load average {load:.1f} on {os.cpu_count()} cores, shared)",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quota", type=float, default=0.15, help="slow region's CPU, in cores")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the slow region is a CPU-quota cgroup")
    tmp = Path(tempfile.mkdtemp(prefix="geotrain-hetero-"))
    runs: dict[str, dict[str, Any]] = {}
    for name, balance in (("unbalanced", "off"), ("balanced", "throughput")):
        quota = Quota(a.quota)
        try:
            runs[name] = train(tmp, name, a.steps, balance, quota)
        finally:
            quota.remove()
        print(f"{name} done", file=sys.stderr)
    text = table(runs, a.steps, a.quota, quota.kind)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "heterogeneous.md").write_text(text)


if __name__ == "__main__":
    main()
