"""Reading the workers' event stream: the live progress line and the final report."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from training.plot import sparkline


def flat_ring_cross_bytes(params: int, world: int, regions: int) -> float:
    """Cross-region bytes per step of one flat fp32 ring all-reduce (what DDP does by
    default) with ranks ordered by region: the ring crosses a border `regions` times and
    each ring edge carries 2 (W - 1) / W x 4N bytes."""
    if regions < 2:
        return 0.0
    return regions * 2 * (world - 1) / world * 4 * params


@dataclass
class EventLog:
    path: Path
    offset: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0
    """Lines that were not JSON objects (a worker killed mid-write), skipped."""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:  # truncated: start over
                    self.offset = 0
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        # a line still being written has no newline yet: leave it for the next poll
        done = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(done)
        new = []
        for line in done.splitlines():
            event = _parse(line)
            if event is not None:
                new.append(event)
            elif line.strip():
                self.unreadable += 1
        self.events += new
        return new

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None
    return event if isinstance(event, dict) and "event" in event else None


@dataclass
class Progress:
    log: EventLog
    total: int
    out: TextIO = sys.stdout
    last_step: int = -1

    def update(self) -> None:
        for e in self.log.poll():
            if e["event"] == "checkpoint_skipped":  # a fallback: say it, whatever the tty
                lead = "\n" if self.out.isatty() else ""  # off the progress bar's line
                self.out.write(f"{lead}checkpoint {_fallback(e)}\n")
                self.out.flush()
        steps = self.log.of("step")
        if not steps:
            return
        step = max(e["step"] for e in steps)
        if step == self.last_step:
            return
        self.last_step = step
        latest = [e for e in steps if e["step"] == step]
        loss = sum(e["loss"] for e in latest) / len(latest)
        tps = sum(e["tokens_per_s"] for e in latest)
        wire = _cross_wire(steps) / 1e6
        width = 30
        filled = int(width * step / self.total)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total}  "
            f"loss {loss:.3f}  {tps:,.0f} tok/s  cross-region {wire:.2f} MB"
        )
        if self.out.isatty():
            self.out.write("\r" + line)
        elif step == self.total or step % 10 == 0:
            self.out.write(line + "\n")
        self.out.flush()


def _cross_wire(steps: list[dict[str, Any]]) -> float:
    """Region counters are cumulative: the newest per region, summed."""
    return sum(e["cross_wire"] for e in _newest(steps))


def summarize(log: EventLog, spec_steps: int) -> dict[str, Any]:
    log.poll()
    steps = log.of("step")
    start = log.of("start")
    if not steps or not start:
        return {}
    params, world, regions = start[0]["params"], start[0]["world"], start[0]["regions"]
    by_step: dict[int, list[float]] = {}
    for e in steps:
        if e["loss"] == e["loss"]:  # NaN: a DP rank drew an empty Poisson sample
            by_step.setdefault(e["step"], []).append(e["loss"])
    curve = {s: sum(v) / len(v) for s, v in sorted(by_step.items())}
    marks = sorted({1, *(max(1, spec_steps * q // 4) for q in (1, 2, 3)), max(curve)})
    wire = _cross_wire(steps)
    raw = sum(e["cross_raw"] for e in _newest(steps))
    flat = flat_ring_cross_bytes(params, world, regions) * spec_steps
    sync = sum(e["sync_s"] for e in steps) / max(1, regions)
    step_time = sum(e["step_s"] for e in steps) / max(1, regions)
    return {
        "params": params,
        "world": world,
        "regions": regions,
        "steps": max(curve),
        "loss_curve": {s: round(curve[s], 4) for s in marks if s in curve},
        "loss_sparkline": sparkline(list(curve.values()), 40),
        "final_loss_per_region": {
            e["region"]: round(e["loss"], 4) for e in steps if e["step"] == max(curve)
        },
        "cross_region_wire_bytes": wire,
        "cross_region_raw_bytes": raw,
        "flat_fp32_allreduce_cross_bytes": flat,
        "bytes_vs_flat_fp32": wire / flat if flat else None,
        "compression_ratio": raw / wire if wire else None,
        "sync_seconds": sync,
        "step_seconds": step_time,
        "sync_share": sync / step_time if step_time else None,
        "restarts": len(log.of("resume")) // max(1, world),
        "resumed_from": sorted({e["step"] for e in log.of("resume")}),
        "checkpoints": [e["step"] for e in log.of("checkpoint")],
        "checkpoint_fallbacks": [
            {k: e[k] for k in ("step", "node", "reason", "moved_to")}
            for e in log.of("checkpoint_skipped")
        ],
        "merges": sum(1 for e in steps if e.get("merged")) // max(1, regions),
        "sync": start[0].get("sync"),
        "warmup": start[0].get("warmup", 0),
        "privacy": privacy_summary(log),
        "links": links_summary(log),
    }


def links_summary(log: EventLog) -> dict[str, Any]:
    """The region leaders' last word on each link (training.linkprobe) and, with the
    adaptive codec, what each region sent over it: from `done`, else the start probe."""
    latest: dict[str, dict[str, Any]] = {}
    for e in [*log.of("links"), *log.of("done")]:
        if "links" in e:
            latest[e["region"]] = e
    links = [link for e in latest.values() for link in e["links"]]
    codecs = {
        f"{region} -> {peer}": c
        for region, e in sorted(latest.items())
        for peer, c in e.get("codecs", {}).items()
    }
    return {"links": sorted(links, key=lambda k: (k["src"], k["dst"])), "codecs": codecs}


def privacy_summary(log: EventLog) -> dict[str, Any]:
    """Epsilon spent per DP region (its newest step), and the budget stop, if any."""
    spent = {
        e["region"]: {k: e[k] for k in ("epsilon", "epsilon_target", "delta")}
        for e in _newest([e for e in log.of("step") if "epsilon" in e])
    }
    stop = log.of("privacy_budget_spent")
    return {
        "epsilon_per_region": spent,
        "stopped_by": stop[0]["stopped_by"] if stop else None,
        "stopped_at": stop[0]["step"] if stop else None,
    }


def _newest(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    newest: dict[str, dict[str, Any]] = {}
    for e in steps:
        if e["region"] not in newest or e["t"] >= newest[e["region"]]["t"]:
            newest[e["region"]] = e
    return list(newest.values())


def format_report(r: dict[str, Any]) -> str:
    if not r:
        return "no training steps were recorded"
    curve = "  ".join(f"{s}:{v:.3f}" for s, v in r["loss_curve"].items())
    lines = [
        f"trained {r['params']:,} parameters on {r['world']} workers in {r['regions']} "
        f"regions for {r['steps']} steps",
        f"loss curve (step:loss)  {curve}",
        f"loss, every step        {r.get('loss_sparkline', '')}",
        "final loss per region   "
        + "  ".join(f"{k} {v:.3f}" for k, v in r["final_loss_per_region"].items()),
        f"cross-region bytes      {r['cross_region_wire_bytes'] / 1e6:.2f} MB sent "
        f"(fp32 flat all-reduce would send {r['flat_fp32_allreduce_cross_bytes'] / 1e6:.2f} MB"
        f": {r['bytes_vs_flat_fp32']:.3f}x)"
        if r["bytes_vs_flat_fp32"]
        else "cross-region bytes      0",
        f"compression ratio       {r['compression_ratio']:.2f}x (fp32 bytes / wire bytes)"
        if r["compression_ratio"]
        else "compression ratio       -",
        f"time in sync            {r['sync_seconds']:.1f} s of {r['step_seconds']:.1f} s "
        f"({100 * (r['sync_share'] or 0):.0f}%)",
    ]
    if r["resumed_from"]:
        lines.append(
            f"restarts                {r['restarts']} (resumed from step "
            f"{', '.join(map(str, r['resumed_from']))})"
        )
    if r.get("sync"):
        warm = f" after a {r['warmup']}-step all-reduce warm-up" if r.get("warmup") else ""
        lines.append(f"sync mode               {r['sync']}{warm}")
    if r["merges"]:
        lines.append(f"global merges           {r['merges']}")
    lines += _privacy_lines(r.get("privacy") or {})
    lines += _link_lines(r.get("links") or {})
    for i, f in enumerate(r.get("checkpoint_fallbacks", [])):
        lines.append(f"{'checkpoint fallbacks' if i == 0 else '':24}{_fallback(f)}")
    return "\n".join(lines)


def _privacy_lines(p: dict[str, Any]) -> list[str]:
    spent = p.get("epsilon_per_region") or {}
    if not spent:
        return []
    lines = [
        "privacy (epsilon spent) "
        + "  ".join(
            f"{k} {v['epsilon']:.2f}/{v['epsilon_target']:g} (delta {v['delta']:g})"
            for k, v in spent.items()
        )
    ]
    if p.get("stopped_by"):
        lines.append(
            f"privacy budget          {p['stopped_by']} spent its budget: stopped at step "
            f"{p['stopped_at']}"
        )
    return lines


def _link_lines(r: dict[str, Any]) -> list[str]:
    """One line per measured link, then one per adaptive codec choice."""
    lines = []
    for i, k in enumerate(r.get("links", [])):
        lines.append(
            f"{'links (per rank)' if i == 0 else '':24}{k['src']} -> {k['dst']} "
            f"{k['bandwidth'] / 1e6:.1f} MB/s  rtt {1e3 * k['rtt']:.2f} ms"
        )
    for i, (link, c) in enumerate(r.get("codecs", {}).items()):
        uses = ", ".join(f"{k} x{n}" for k, n in c["uses"].items())
        lines.append(
            f"{'adaptive codec' if i == 0 else '':24}{link}: {c['codec']} "
            f"({c['switches']} switches; {uses})"
        )
    return lines


def _fallback(e: dict[str, Any]) -> str:
    """One line per checkpoint directory that resume skipped: which, why, where it went."""
    where = f"moved to {e['moved_to']}" if e.get("moved_to") else "removed"
    return f"step {e['step']} on node {e['node']} skipped: {e['reason']}; {where}"
