"""Running `geotrain train` on small stacks in a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml

from training.observe.report import complete_events

STACKS = Path(__file__).resolve().parents[2] / "stacks"


def small_stack(tmp: Path, name: str, **training: Any) -> Path:
    """The local stack, shrunk for 2 cores: few steps, short sequences, metrics off."""
    doc = yaml.safe_load((STACKS / "Pulumi.local.yaml").read_text())
    cfg = doc["config"]
    t = cfg["geotrain:training"]
    t.update(
        {
            "steps": 8,
            "batch_size": 2,
            "seq_len": 32,
            "max_restarts": 2,
            "checkpoint": {"interval_steps": 3, "keep": 2},
        }
    )
    for k, v in training.items():
        if isinstance(v, dict) and isinstance(t.get(k), dict):
            t[k] = {**t[k], **v}
        else:
            t[k] = v
    cfg["geotrain:monitoring"]["metrics_port"] = 0
    path = tmp / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def two_node_stack(tmp: Path, name: str, workers: int = 2, **training: Any) -> Path:
    """`small_stack` with two regions of one node each (bj-0, fra-0): the smallest stack
    with two "hosts"."""
    path = small_stack(tmp, name, **training)
    doc = yaml.safe_load(path.read_text())
    cfg = doc["config"]
    cfg["geotrain:regions"] = cfg["geotrain:regions"][:2]
    for r in cfg["geotrain:regions"]:
        r["pool"]["nodes"][0]["gpus"] = workers
    keep = {r["name"] for r in cfg["geotrain:regions"]}
    net = cfg["geotrain:network"]
    net["links"] = [x for x in net["links"] if {x["a"], x["b"]} <= keep]
    t = cfg["geotrain:training"]
    t["data_shards"] = [x for x in t["data_shards"] if x["region"] in keep]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def geotrain(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "geotrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "geotrain", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return complete_events(path.read_bytes())


def committed(root: Path, node: str) -> set[int]:
    """Steps `node` has committed under checkpoint root `root`."""
    return {int(p.parent.parent.name[5:]) for p in root.glob(f"step-*/{node}/COMMITTED")}


def of(log: list[dict[str, Any]], event: str, region: str) -> list[dict[str, Any]]:
    """`region`'s events of kind `event`."""
    return [e for e in log if e["event"] == event and e["region"] == region]


def region_steps(log: list[dict[str, Any]], region: str) -> list[int]:
    return [e["step"] for e in of(log, "step", region)]


def _story(log: list[dict[str, Any]], region: str) -> str:
    """`region`'s events other than its steps, and its steps, for an assertion message."""
    keep = ("event", "step", "phase", "members", "excluded", "t", "reason", "torchrun_restart")
    lines = [
        str({k: e[k] for k in keep if k in e})
        for e in log
        if e["region"] == region and e["event"] != "step"
    ]
    return f"{region} stepped {region_steps(log, region)}; its other events:\n" + "\n".join(lines)


def trained_on_and_healed(
    log: list[dict[str, Any]],
    back: str,
    others: tuple[str, ...],
    steps: int,
    held: tuple[float, float],
) -> dict[str, Any]:
    """fault_tolerance's promise after `back` dropped out: the others trained on (never
    restarted, no step lost or repeated), `back` was restarted once by its own torchrun
    and healed from a live peer at a step, and every region ended at `steps` on the same
    weights. Returns `back`'s heal event.

    The tests hold the others (SIGSTOP from `held[0]` to `held[1]`) while `back`
    restarts, longer than `heartbeat_timeout_s`: the Lighthouse counts them dead until
    their next heartbeat, and a quorum of `back` and whichever of them beats first is
    valid at once (torchft waits for stragglers only among healthy replicas). The other
    then heals from them at its next round and takes their step. So after the hold, one
    survivor may skip steps once, in a heal soon after waking, over steps another region
    trained; no other skip, and no repeat, passes."""
    stop, woke = held
    skipped: dict[str, list[int]] = {}
    for r in others:
        assert len(of(log, "start", r)) == 1, _story(log, r)
        s = region_steps(log, r)  # a region that joined late healed into its first step
        before = [e["step"] for e in of(log, "step", r) if e["t"] < stop]
        assert before == list(range(s[0], s[0] + len(before))), _story(log, r)
        skips = [(a, b) for a, b in pairwise(s) if b != a + 1]
        assert all(a < b for a, b in skips), _story(log, r)  # never a step again
        if skips:
            assert len(skips) == 1, _story(log, r)
            a, b = skips[0]
            took = [e for e in of(log, "healed", r) if e["step"] == b - 1]
            assert took and woke <= took[0]["t"] <= woke + 30, _story(log, r)
            skipped[r] = list(range(a + 1, b))
        assert s[-1] == steps, _story(log, r)
    assert len(skipped) <= 1, skipped  # the first to beat after waking never heals
    for r, lost in skipped.items():
        trained = {e["step"] for e in log if e["event"] == "step" and e["region"] != r}
        assert set(lost) <= trained, (r, lost)  # another region trained what r skipped
    starts = of(log, "start", back)
    assert [e["torchrun_restart"] for e in starts] == [0, 1]
    assert all("torchrun_rank" in e and "torchrun_group_rank" in e for e in starts)
    after = [e for e in log if e["region"] == back and e["t"] >= starts[1]["t"]]
    healed = [e for e in after if e["event"] == "healed"]
    assert healed and healed[0]["phase"] == "step"
    done = {e["region"]: e for e in log if e["event"] == "done"}
    assert set(done) == {back, *others}
    assert len({e["digest"] for e in done.values()}) == 1
    assert {e["step"] for e in done.values()} == {steps}
    return healed[0]
