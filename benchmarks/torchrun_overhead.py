"""Issue 17 benchmark: what launching through torchrun costs, before and after, side by
side in one run on this machine.

Before: the launcher at git revision BEFORE (default 263aa36, the last one that spawned
`training.worker --node --local-rank` itself and restarted the group on its own), taken
with `git archive` into a temporary directory. After: this tree (one torchrun per node,
c10d rendezvous, training.launch.launcher). Both run the same two-node stack (bj-0, fra-0; two CPU
workers each) with `geotrain train`, alternately:

- startup: a 1-step run; its wall time, and the time from the launcher's start to the
  last worker's `start` event (every rank in the process group, session agreed);
- restart: a 6-step run (commit at step 3) in which one worker is killed with -9 once
  step 3 is committed; the time from the kill to the last rank's `start` of the new
  attempt, and to its last `resume`; and the run's wall time.

Run: python benchmarks/torchrun_overhead.py [--repeat 2] [--before REV]. Prints a table
and saves it to benchmarks/results/torchrun_overhead.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.helpers import two_node_stack  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "torchrun_overhead.md"
WORLD = 4


def _events(run_dir: Path) -> list[dict[str, object]]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _start(code: Path, cwd: Path, stack: Path, steps: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "geotrain", "train", "--stack", str(stack), "--steps", str(steps)]
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def startup(code: Path, work: Path) -> dict[str, float]:
    cwd = Path(tempfile.mkdtemp(dir=work))
    stack = two_node_stack(cwd, "bench")
    t0 = time.time()
    proc = _start(code, cwd, stack, 1)
    out, _ = proc.communicate(timeout=300)
    wall = time.time() - t0
    assert proc.returncode == 0, out
    starts = [float(str(e["t"])) for e in _events(cwd / ".geotrain/bench") if e["event"] == "start"]
    assert len(starts) == WORLD, out
    return {"wall": wall, "to_start": max(starts) - t0}


def restart(code: Path, work: Path) -> dict[str, float]:
    cwd = Path(tempfile.mkdtemp(dir=work))
    stack = two_node_stack(cwd, "bench")
    run_dir = cwd / ".geotrain/bench"
    t0 = time.time()
    proc = _start(code, cwd, stack, 6)
    killed_at = None
    while killed_at is None and proc.poll() is None:
        ev = _events(run_dir)
        nodes = {e["node"] for e in ev if e["event"] == "committed" and e["step"] == 3}
        if len(nodes) == 2:
            victim = next(e for e in ev if e["event"] == "start" and e["rank"] == WORLD - 1)
            os.kill(int(str(victim["pid"])), signal.SIGKILL)
            killed_at = time.time()
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=300)
    wall = time.time() - t0
    assert proc.returncode == 0 and killed_at is not None, out
    ev = _events(run_dir)
    later = [e for e in ev if float(str(e["t"])) > killed_at]
    starts = [float(str(e["t"])) for e in later if e["event"] == "start"]
    resumes = [float(str(e["t"])) for e in later if e["event"] == "resume"]
    assert len(starts) == WORLD and len(resumes) == WORLD, out
    return {
        "wall": wall,
        "to_start": max(starts) - killed_at,
        "to_resume": max(resumes) - killed_at,
    }


def _before(rev: str, work: Path) -> Path:
    code = work / f"before-{rev}"
    code.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive.stdout, check=True)
    return code


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--before", default="263aa36")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="torchrun-bench-"))
    versions = {
        f"before ({a.before}, direct spawn)": _before(a.before, work),
        "after (torchrun)": ROOT,
    }
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in versions}
    for _ in range(a.repeat):
        for name, code in versions.items():  # interleaved: the machine's load hits both
            for k, v in startup(code, work).items():
                rows[name].setdefault(f"startup {k}", []).append(v)
            for k, v in restart(code, work).items():
                rows[name].setdefault(f"restart {k}", []).append(v)
    cols = [
        "startup wall",
        "startup to_start",
        "restart to_start",
        "restart to_resume",
        "restart wall",
    ]
    lines = [
        "| launcher | 1-step run (s) | launch to every rank started (s) | kill -9 to every "
        "rank started again (s) | kill -9 to every rank resumed (s) | 6-step run with a kill (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        cells = [f"{statistics.median(r[c]):.2f}" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    before, after = rows.values()
    ratio = [statistics.median(after[c]) - statistics.median(before[c]) for c in cols]
    lines.append("| after - before | " + " | ".join(f"{d:+.2f}" for d in ratio) + " |")
    text = (
        "# torchrun overhead (issue 17)\n\n"
        f"Two-node stack (bj-0, fra-0; 2 CPU workers each), `geotrain train`, median of "
        f"{a.repeat} interleaved runs per row, on a 2-core machine shared with other jobs.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print(text)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
