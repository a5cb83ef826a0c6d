"""Issue #16 benchmark (root): compute utilisation of real `geotrain train` runs in the lab,
its tunnels shaped to the stack's 50 Mbit/s and delayed by each link's latency.

Utilisation is the time a rank spends in forward, backward and the optimizer step (the
step event's `compute_s`) over the wall time from its first step's start to its last
step's end, per region leader; the table gives the median over regions. Every mode runs
the lab stack's model and batch; utilisation is a rate, so per-step all-reduce runs fewer
steps (each costs several round trips over 60-90 ms links) than the DiLoCo modes, which
need enough steps for several merges:
- allreduce int8: every step's gradient crosses the WAN;
- diloco H=50 int4: a merge every 50 steps;
- streaming diloco H=50 int4 (fragments, tau 5, 15 and 30): each fragment's merge
  overlaps tau inner steps.

With `--ranks-per-region 1` each region's pool is trimmed to its first node (its gateway,
one rank), as tests/integration/test_lab_region_cut.py does: no in-region gradient
all-reduce, fewer processes on the 2 cores, so what is left outside compute is the
cross-region sync and the loop's own work. Each step's time is split from the step event:
compute (`compute_s`), cross-region sync (`sync_s`) and the rest of the wall time (data,
in-region all-reduce, the step report, checkpoint, the time between steps).

Run: sudo .venv/bin/python benchmarks/lab_utilisation.py [--steps 150] [--allreduce-steps
20] [--ranks-per-region 2] [--batch N] [--only MODE ...]. Prints a table and writes it as
its ranks-per-region table of the "Compute utilisation" section of
benchmarks/results/lab_network.md; the other ranks-per-region table there and the rest of
that file (benchmarks/lab_network.py) are kept. With --only the chosen modes run and the
table is printed, not saved.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "lab_network.md"
SECTION = "## Compute utilisation"
SUBSECTION = "### 3 regions x "  # one table per ranks per region, each kept across runs
DEFAULT_STEPS, DEFAULT_ALLREDUCE_STEPS = 150, 20
INT4 = {"quantize": "int4", "zstd_level": 1, "cipher": "sm4-gcm"}
MODES: dict[str, dict[str, Any]] = {
    "allreduce int8": {"sync": "allreduce"},
    "diloco H=50 int4": {"sync": "diloco", "diloco": {"inner_steps": 50}, "compression": INT4},
    "streaming diloco H=50 int4, 3 fragments, tau 5": {
        "sync": "diloco",
        "diloco": {"inner_steps": 50, "fragments": 3, "tau": 5},
        "compression": INT4,
    },
    # tau long enough for a fragment's exchange (two exchanges, each about two round
    # trips of the slowest link: 1.1 s here) to end under the inner steps
    "streaming diloco H=50 int4, 3 fragments, tau 15": {
        "sync": "diloco",
        "diloco": {"inner_steps": 50, "fragments": 3, "tau": 15},
        "compression": INT4,
    },
    # tau 30 of the stack's 60-70 ms steps (about 2 s): room for the exchange and for the
    # regions' drift (a region's exchange ends when the last region has sent its part)
    "streaming diloco H=50 int4, 3 fragments, tau 30": {
        "sync": "diloco",
        "diloco": {"inner_steps": 50, "fragments": 3, "tau": 30},
        "compression": INT4,
    },
}
# exchange: allgather: one round across regions instead of two (each region's values sent
# whole), for 1.5x the bytes with 3 regions
MODES.update(
    {
        f"{name}, allgather": {**MODES[name], "exchange": "allgather"}
        for name in list(MODES)
        if name != "allreduce int8"
    }
)


NOTES = (
    "Userspace wireguard-go, FRR, the latency relays and the workers (six with two ranks "
    "per region, three with one) share this machine's 2 cores. Per-step all-reduce is bound "
    "by the links' round trips. Sync time is the loop's stall on the cross-region sync: "
    "blocking merges and gradient syncs, and waits at streaming landings for exchanges "
    "that outlasted tau steps (before, those waits were counted as other time). Changes "
    "measured by these tables, in order: (1) every 10th step (training.loop.CONTROL_EVERY) "
    "all ranks agree the time-based merge and checkpoint triggers (checkpoint."
    "interval_minutes defaults to 30, so every run has it); that gather stalled the step "
    "(1.1 s with one rank per region, 2.5-2.8 s with two) and now runs under the following "
    "steps, its flags applied CONTROL_LATE = 2 control rounds later (with one round it "
    "still waited 0.03-0.11 s per control step, most while a fragment's exchange shared "
    "the links); (2) the buckets of a merge, a gradient sync or a fragment share one "
    "exchange per stage (HierarchicalAllReduce.all_reduce_many): each exchange costs at "
    "least a round trip of the slowest link whatever its size, so with 3 buckets DiLoCo's "
    "sync per step went from 0.077 to 0.030 s (diloco 39% -> 60%, per-step all-reduce "
    "3.9 -> 2.2 s; batch 4, at commit 9bfb8f8); "
    "(3) each exchange takes one round instead of two (a message leads with its length "
    "and lands in a buffer of the codec's bound, Codec.max_payload; before, the sizes were "
    "swapped first); (4) tau 15 against tau 5: a fragment's exchange (two exchanges) ends "
    "under 15 inner steps; (5) the allgather rows (exchange: allgather): one exchange per "
    "merge or fragment instead of two, for 1.5x the bytes. 'Without the last "
    "step': the run's last step merges every fragment at once, blocking, once per run "
    "however long it is. With the stack's batch (4 x 64 tokens, about 65 ms of compute per "
    "step) what is left per step (the merges' round trips, the step's own work) weighs as "
    "much as compute; batch 16 (about 0.19 s per step) is closer to the seconds-long steps "
    "of the runs the issue cites.\n"
)


def _geotrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geotrain", *args], cwd=cwd, capture_output=True, text=True
    )


def run_mode(
    doc: dict[str, Any], settings: dict[str, Any], steps: int, batch: int | None = None
) -> dict[str, Any]:
    """One `geotrain train` of the lab stack with `settings` (and `batch` per rank, None:
    the stack's); its utilisation per region."""
    d = copy.deepcopy(doc)
    t = d["config"]["geotrain:training"]
    t.update(copy.deepcopy(settings), steps=steps)
    if batch is not None:
        t["batch_size"] = batch
    t["checkpoint"] = {"interval_steps": steps, "keep": 1}  # one save, at the end
    with tempfile.TemporaryDirectory(prefix="geotrain-util-") as tmp:
        cwd = Path(tmp)
        (cwd / "Pulumi.lab.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
        ok = _geotrain("validate", "--stack", "Pulumi.lab.yaml", cwd=cwd)
        if ok.returncode != 0:
            return {"skipped": (ok.stdout + ok.stderr).strip().splitlines()[-1]}
        r = _geotrain("train", "--stack", "Pulumi.lab.yaml", cwd=cwd)
        if r.returncode != 0:  # the other modes' rows still count
            return {"skipped": "failed: " + (r.stdout + r.stderr).strip().splitlines()[-1]}
        from training.report import complete_events

        events = complete_events((cwd / ".geotrain/lab/events.jsonl").read_bytes())
    steps_ev = [e for e in events if e["event"] == "step"]
    from training.loop import CONTROL_EVERY  # steps whose triggers are agreed across ranks

    util, wire, steady = {}, {}, {}
    split: dict[str, list[float]] = {
        k: [] for k in ("compute", "sync", "other", "between", "other_median", "other_control")
    }
    for region in sorted({e["region"] for e in steps_ev}):
        ev = [e for e in steps_ev if e["region"] == region]
        wall = ev[-1]["t"] - (ev[0]["t"] - ev[0]["step_s"])
        compute, sync = sum(e["compute_s"] for e in ev), sum(e["sync_s"] for e in ev)
        util[region] = compute / wall
        # without the last step: it merges every fragment at once (blocking), a cost a run
        # pays once, however long; 150 steps weigh it 50 times more than 7,500 would
        steady[region] = (compute - ev[-1]["compute_s"]) / (wall - ev[-1]["step_s"])
        wire[region] = ev[-1]["cross_wire"]
        # per step: compute + sync + other = wall / steps; "between" (part of other) is the
        # wall time outside train_step (the loop's checks, the event write)
        split["compute"].append(compute / len(ev))
        split["sync"].append(sync / len(ev))
        split["other"].append((wall - compute - sync) / len(ev))
        split["between"].append((wall - sum(e["step_s"] for e in ev)) / len(ev))
        # inside train_step: a typical step's other time, and that of the steps that agree
        # time-based triggers with every rank (a cross-region gather, training.loop.due)
        inside = {e["step"]: e["step_s"] - e["compute_s"] - e["sync_s"] for e in ev}
        split["other_median"].append(statistics.median(inside.values()))
        control = [v for k, v in inside.items() if k % CONTROL_EVERY == 0]
        split["other_control"].append(statistics.mean(control) if control else float("nan"))
    wall_s = max(e["t"] for e in steps_ev) - min(e["t"] - e["step_s"] for e in steps_ev)
    # streaming: each landed fragment's exchange on its background thread, against the
    # tau steps it had (tau x the median step's wall time)
    exchanges = sorted(x for e in steps_ev for x in e.get("exchange_s", ()))
    tau = int(settings.get("diloco", {}).get("tau", 0))
    step_s = statistics.median(e["step_s"] for e in steps_ev)
    out: dict[str, Any] = {
        "exchange": (
            (statistics.median(exchanges), exchanges[-1], tau * step_s) if exchanges else None
        ),
        "utilisation": statistics.median(util.values()),
        "steady": statistics.median(steady.values()),
        "per_region": util,
        "wall_s": wall_s,
        "cross_mb": sum(wire.values()) / 1e6,
        "steps": steps,
    }
    out.update({f"{k}_s": statistics.median(v) for k, v in split.items()})
    return out


def trimmed(doc: dict[str, Any], ranks_per_region: int) -> dict[str, Any]:
    """The lab stack with each region's pool cut to its first `ranks_per_region` nodes (one
    rank each: the lab's nodes have gpus: 1); the first node is the region's gateway."""
    d = copy.deepcopy(doc)
    for r in d["config"]["geotrain:regions"]:
        nodes = r["pool"]["nodes"]
        if ranks_per_region > len(nodes):
            raise SystemExit(
                f"--ranks-per-region {ranks_per_region}: stacks/Pulumi.lab.yaml "
                f"geotrain:regions[{r['name']}].pool.nodes has {len(nodes)}; use 1..{len(nodes)}"
            )
        r["pool"]["nodes"] = nodes[:ranks_per_region]
    return d


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown rows of one ranks-per-region run."""
    from training.loop import CONTROL_EVERY

    lines = [
        "| mode | utilisation | without the last step | per region | compute per step (s) | "
        "sync per step (s) | other per step (s) | wall per step (s) | "
        "cross-region MB per step | fragment exchange (s): median, max; tau steps (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"| {name} | not run: {r['skipped']} | | | | | | | | |")
            continue
        per = ", ".join(f"{k} {v:.0%}" for k, v in r["per_region"].items())
        ex = "-" if r["exchange"] is None else "{:.2f}, {:.2f}; {:.2f}".format(*r["exchange"])
        lines.append(
            f"| {name} | {r['utilisation']:.0%} | {r['steady']:.0%} | {per} | "
            f"{r['compute_s']:.3f} | "
            f"{r['sync_s']:.3f} | {r['other_s']:.3f} (median {r['other_median_s']:.3f}, "
            f"every {CONTROL_EVERY}th {r['other_control_s']:.3f}, "
            f"between steps {r['between_s']:.3f}) | "
            f"{r['wall_s'] / r['steps']:.2f} | {r['cross_mb'] / r['steps']:.2f} | {ex} |"
        )
    return lines


def subsections(section: str) -> dict[str, str]:
    """The tables of an existing section, keyed by their heading after SUBSECTION ("1 rank
    per region", "1 rank per region, batch 16"). A section written before there were two
    (one table, no subheading) was 2 ranks."""
    parts = section.split("\n" + SUBSECTION)
    if len(parts) == 1:
        rows = [x for x in section.splitlines() if x.startswith("|")]
        if not rows:
            return {}
        key = "2 ranks per region"
        return {key: f"{SUBSECTION}{key}\n\nAn earlier run.\n\n" + "\n".join(rows)}
    found = {}
    for part in parts[1:]:
        lines = part.splitlines()
        last_row = max(i for i, x in enumerate(lines) if x.startswith("|"))  # table's end
        found[lines[0]] = SUBSECTION + "\n".join(lines[: last_row + 1])
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="DiLoCo modes' steps")
    ap.add_argument("--allreduce-steps", type=int, default=DEFAULT_ALLREDUCE_STEPS)
    ap.add_argument(
        "--ranks-per-region", type=int, default=2, help="1: each region's first node only"
    )
    ap.add_argument(
        "--batch", type=int, default=None, help="sequences per rank (default: the stack's)"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        help="run only the modes whose name contains one of these; prints the table and "
        "leaves the results file as it is",
    )
    a = ap.parse_args()
    modes = {k: v for k, v in MODES.items() if not a.only or any(x in k for x in a.only)}
    if not modes:
        raise SystemExit(f"--only {' '.join(a.only)}: no mode matches; modes: {', '.join(MODES)}")
    if a.batch is not None and a.batch < 1:
        raise SystemExit(f"--batch {a.batch}: give a number of sequences per rank, 1 or more")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))

    from lab_network import round_trips

    from infra import lab
    from infra.model import load_stack
    from infra.plan import build_plan

    doc = trimmed(
        yaml.safe_load((ROOT / "stacks" / "Pulumi.lab.yaml").read_text()), a.ranks_per_region
    )
    with tempfile.TemporaryDirectory(prefix="geotrain-util-") as tmp:
        stack = Path(tmp) / "Pulumi.lab.yaml"  # the lab stack, trimmed: the plan lab_up builds
        stack.write_text(yaml.safe_dump(doc, sort_keys=False))
        plan = build_plan(load_stack(str(stack)))
    state = ROOT / ".geotrain" / "lab" / "lab"
    lab.lab_up(plan, state)
    try:
        rtts = round_trips(plan)
        results = {
            name: run_mode(
                doc, s, a.allreduce_steps if s["sync"] == "allreduce" else a.steps, a.batch
            )
            for name, s in modes.items()
        }
    finally:
        lab.lab_down(plan, state)
    n = a.ranks_per_region
    t = doc["config"]["geotrain:training"]
    key = f"{n} rank{'s' if n > 1 else ''} per region" + (
        f", batch {a.batch}" if a.batch is not None else ""
    )
    lowered = (a.steps, a.allreduce_steps) != (DEFAULT_STEPS, DEFAULT_ALLREDUCE_STEPS)
    sub = "\n".join(
        [
            f"{SUBSECTION}{key}",
            "",
            f"Batch {a.batch or t['batch_size']} x {t['seq_len']} tokens per rank"
            + ("" if a.batch is None else f" (the stack's: {t['batch_size']})")
            + f"; {a.allreduce_steps} steps of allreduce, {a.steps} of each DiLoCo mode"
            + (
                f" (not the defaults {DEFAULT_ALLREDUCE_STEPS} and {DEFAULT_STEPS})"
                if lowered
                else ""
            )
            + ". Round trips over the overlay between the regions' ranks: "
            + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in rtts.items())
            + ".",
            "",
            *table(results),
        ]
    )
    if a.only:
        print(sub)
        return
    old = RESULTS.read_text() if RESULTS.exists() else ""
    head, _, old_section = old.partition(SECTION)
    subs = subsections(old_section)
    subs[key] = sub
    section = (
        "\n".join(
            [
                intro(plan.tunnels[0].bandwidth_mbps),
                *(subs[k] + "\n" for k in sorted(subs, reverse=True)),
            ]
        )
        + "\n"
        + NOTES
    )
    print(sub)
    head = head.rstrip("\n")
    RESULTS.write_text((head + "\n\n" if head else "") + section)


def intro(mbps: int) -> str:
    return (
        f"{SECTION} at {mbps} Mbit/s (issue #16)\n\n"
        "`geotrain train --stack lab`, the lab stack's model and batch, 3 regions; "
        "utilisation is a rate and does not need equal tokens. Utilisation: time in forward, "
        "backward and optimizer over wall time, median over the regions' leaders; each "
        "step's wall time is split into compute, cross-region sync and other (the rest: "
        "mean per step; in brackets a typical step's, the mean of the steps that agree "
        "time-based triggers across ranks, and the part outside `train_step`), medians over "
        "the regions (benchmarks/lab_utilisation.py).\n"
    )


if __name__ == "__main__":
    main()
