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
20] [--ranks-per-region 2] [--batch N] [--cpu-per-region CORES] [--only MODE ...]. Prints
a table and writes it into the "Compute utilisation" section of
benchmarks/results/lab_network.md as the table of its settings (ranks per region, batch,
CPU caps, steps when not the default): a rerun replaces its own table, the other tables
there and the rest of that file (benchmarks/lab_network.py) are kept. With --only the
chosen modes run and the table is printed, not saved.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "lab_network.md"
SECTION = "## Compute utilisation"
SUBSECTION = "### 3 regions x "  # one table per settings, each kept across runs
DEFAULT_STEPS, DEFAULT_ALLREDUCE_STEPS = 150, 20
MIN_STEPS = 100
"""Two rounds at H = 50 for every mode."""
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
    "of the runs the issue cites. (6) A region of one rank skips the in-region gradient "
    "average and the step report's in-region all-reduce (a copy of every gradient in and "
    "out): the DiLoCo modes' other time per step at batch 4 went from 0.010-0.012 s to "
    "0.003-0.008 s. "
    "(7) tau 30 rows: room for the exchange and for the regions' drift. Uncapped, the three "
    "workers' speeds wander apart as they share the cores (the last column: how far apart "
    "the regions' clocks are at the same step), and whoever is ahead waits, at a landing or "
    "at the control gather, whichever comes first. With the control flags applied 4 control "
    "rounds late instead of 2 (CONTROL_LATE edited, tau 30, two 300-step runs each, region "
    "medians), other time inside the step fell from 0.005-0.008 s to 0.003 s and sync time rose "
    "from 0.004-0.009 s to 0.013-0.014 s: the waits moved, they did not go. "
    "(8) The 'cores per region' table holds each region's workers to an equal CPU quota "
    "(--cpu-per-region, a cgroup per region), as separate machines would be: a region that "
    "waits does not lend its core to the others. The regions then stay closer together, "
    "and a step's compute takes longer than uncapped (the compute column), which the "
    "utilisation reads in its favour.\n"
)


CGROUP = Path("/sys/fs/cgroup")


class CpuCaps:
    """Each region's workers held to `cores` of CPU time, as if each region had machines of
    its own: a region that waits does not lend its core to the others, and one that gets
    more of the shared cores does not run ahead (uncapped, the three workers' speeds wander
    apart by about a second of steps, and whoever is ahead waits at the next landing or
    control gather). A cgroup per region with a CFS quota (cgroup v2 cpu.max, or v1's
    cpu.cfs_quota_us); the regions' worker processes (found in their nodes' network
    namespaces) are moved into it as they start. The network (wireguard-go, FRR, the delay
    relays) keeps the rest of the machine, uncapped."""

    PERIOD_US = 100_000

    def __init__(self, plan: Any, cores: float) -> None:
        if (CGROUP / "cgroup.controllers").exists():  # v2
            root, quota = CGROUP, "cpu.max"
            ctl = root / "cgroup.subtree_control"
            if "cpu" not in ctl.read_text().split():
                ctl.write_text("+cpu")
        elif (CGROUP / "cpu" / "cpu.cfs_quota_us").exists():  # v1
            root, quota = CGROUP / "cpu", "cpu.cfs_quota_us"
        else:
            raise SystemExit(
                f"--cpu-per-region: no cgroup cpu controller at {CGROUP} (cgroup.controllers "
                "or cpu/cpu.cfs_quota_us); run without it, or mount cgroups"
            )
        us = int(cores * self.PERIOD_US)
        self.groups: dict[str, Path] = {}
        for r in plan.regions:
            g = root / f"geotrain-util-{r.name}"
            g.mkdir(exist_ok=True)
            if quota == "cpu.max":
                (g / quota).write_text(f"{us} {self.PERIOD_US}")
            else:
                (g / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (g / quota).write_text(str(us))
            for n in r.nodes:
                self.groups[str(n.netns)] = g
        self.moved: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for ns, g in self.groups.items():
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
                for pid in pids.stdout.split():
                    if pid in self.moved:
                        continue
                    try:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    except OSError:  # gone
                        continue
                    if b"training.worker" in cmd and b"torch.distributed.run" not in cmd:
                        with contextlib.suppress(OSError):  # it may exit meanwhile
                            (g / "cgroup.procs").write_text(pid)
                            self.moved.add(pid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for g in set(self.groups.values()):  # empty once the workers have exited
            for _ in range(50):
                try:
                    g.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


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
        from training.observe.report import complete_events

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
    # drift: how far apart the regions' clocks are at the same step (whoever is ahead
    # waits for the others at the next landing or control gather)
    at: dict[int, list[float]] = {}
    for e in steps_ev:
        at.setdefault(e["step"], []).append(e["t"])
    drift = [max(ts) - min(ts) for ts in at.values() if len(ts) == len(util)]
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
        "drift_s": statistics.median(drift) if drift else float("nan"),
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
        "cross-region MB per step | fragment exchange (s): median, max; tau steps (s) | "
        "regions apart at a step (s, median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"| {name} | not run: {r['skipped']} | | | | | | | | | |")
            continue
        per = ", ".join(f"{k} {v:.0%}" for k, v in r["per_region"].items())
        ex = "-" if r["exchange"] is None else "{:.2f}, {:.2f}; {:.2f}".format(*r["exchange"])
        lines.append(
            f"| {name} | {r['utilisation']:.0%} | {r['steady']:.0%} | {per} | "
            f"{r['compute_s']:.3f} | "
            f"{r['sync_s']:.3f} | {r['other_s']:.3f} (median {r['other_median_s']:.3f}, "
            f"every {CONTROL_EVERY}th {r['other_control_s']:.3f}, "
            f"between steps {r['between_s']:.3f}) | "
            f"{r['wall_s'] / r['steps']:.2f} | {r['cross_mb'] / r['steps']:.2f} | {ex} | "
            f"{r['drift_s']:.2f} |"
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
        "--cpu-per-region",
        type=float,
        default=None,
        metavar="CORES",
        help="hold each region's workers to this much CPU time (a cgroup quota), as if each "
        "region had its own machines; e.g. 0.55 with 3 regions on 2 cores",
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
    if a.cpu_per_region is not None and not 0.01 <= a.cpu_per_region <= (os.cpu_count() or 1):
        raise SystemExit(
            f"--cpu-per-region {a.cpu_per_region}: give the cores each region's workers may "
            f"use, 0.01 to {os.cpu_count()} (this machine's)"
        )
    if a.batch is not None and a.batch < 1:
        raise SystemExit(f"--batch {a.batch}: give a number of sequences per rank, 1 or more")
    if a.steps < MIN_STEPS:
        raise SystemExit(
            f"--steps {a.steps}: the DiLoCo modes need at least {MIN_STEPS} (a merge every "
            f"50 steps, landing up to 30 late); the default is {DEFAULT_STEPS}"
        )
    if a.allreduce_steps < 2:
        raise SystemExit(f"--allreduce-steps {a.allreduce_steps}: give 2 or more")
    if a.ranks_per_region < 1:
        raise SystemExit(
            f"--ranks-per-region {a.ranks_per_region}: give 1 or more (each region's first "
            "nodes of stacks/Pulumi.lab.yaml)"
        )
    if os.geteuid() != 0:
        raise SystemExit(
            "lab_utilisation.py builds the lab (network namespaces, WireGuard, FRR) and needs "
            "root; run it with sudo"
        )
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
    caps = None
    try:
        rtts = round_trips(plan)
        caps = CpuCaps(plan, a.cpu_per_region) if a.cpu_per_region else None
        results = {}
        for name, s in modes.items():
            before = len(caps.moved) if caps else 0
            steps = a.allreduce_steps if s["sync"] == "allreduce" else a.steps
            results[name] = run_mode(doc, s, steps, a.batch)
            held = len(caps.moved) - before if caps else 0
            if caps and "skipped" not in results[name] and held < len(plan.nodes):
                results[name] = {
                    "skipped": f"the CPU caps held {held} of its {len(plan.nodes)} workers"
                }
    finally:
        if caps is not None:
            caps.close()
        lab.lab_down(plan, state)
    n = a.ranks_per_region
    t = doc["config"]["geotrain:training"]
    key = (
        f"{n} rank{'s' if n > 1 else ''} per region"
        + (f", batch {a.batch}" if a.batch is not None else "")
        + (f", {a.cpu_per_region:g} cores per region" if a.cpu_per_region else "")
        + (f", {a.steps} steps" if a.steps != DEFAULT_STEPS else "")
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
            + (
                f". Each region's workers held to {a.cpu_per_region:g} cores of CPU time "
                "(CpuCaps: a cgroup quota per region, as if each had machines of its own; "
                "the network keeps the rest of the machine)"
                if a.cpu_per_region
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
