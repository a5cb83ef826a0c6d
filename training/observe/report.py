"""Reading the workers' event stream: the live progress (a rich bar on a terminal, plain
lines elsewhere) and the final report (a rich table; plain rows off a terminal)."""

from __future__ import annotations

import io
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

from training.observe.baseline import flat_ring_cross_bytes
from training.observe.plot import sparkline


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
        new, unreadable = _complete(done)
        self.unreadable += unreadable
        self.events += new
        return new

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def complete_events(data: bytes | str) -> list[dict[str, Any]]:
    """The events of an events.jsonl read while workers may still be appending to it.

    A reader can catch a write half copied (the kernel does not lock readers out of an
    append), so a last line without its newline is left out, as are lines that are not
    events (a worker killed mid-write)."""
    if isinstance(data, str):
        data = data.encode()
    return _complete(data[: data.rfind(b"\n") + 1])[0]


def _complete(done: bytes) -> tuple[list[dict[str, Any]], int]:
    events, unreadable = [], 0
    for line in done.splitlines():
        event = _parse(line)
        if event is not None:
            events.append(event)
        elif line.strip():
            unreadable += 1
    return events, unreadable


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None
    return event if isinstance(event, dict) and "event" in event else None


PLAIN_WIDTH = 1000
"""Columns of a console that is not a terminal: wide enough that no report row wraps."""


def console(file: TextIO | None = None) -> Console:
    """The console `geotrain train` writes to. Text from the run (reasons, paths) is never
    read as rich markup or emoji codes; off a terminal there are no control codes and no
    wrapping (log files and tests get one plain line per row)."""
    c = Console(file=file, highlight=False, markup=False, emoji=False)
    if not c.is_terminal:
        c.width = PLAIN_WIDTH
    return c


@dataclass
class Progress:
    """The live progress of `geotrain train` from the event log: a rich progress bar on a
    terminal; elsewhere a plain line every 10 steps and at the last step. Use it as a
    context manager: the bar's live display ends with the block."""

    log: EventLog
    total: int
    out: Console = field(default_factory=console)
    _seen: int = 0
    """Step events shown so far: any new one (another region at the same step) redraws."""
    _said: int = -1
    """The last step a plain line was printed for."""
    _bar: RichProgress | None = None
    _task: TaskID | None = None

    def __enter__(self) -> Progress:
        if self.out.is_terminal:
            self._bar = RichProgress(
                BarColumn(),
                TextColumn("step {task.completed}/{task.total}"),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                console=self.out,
                auto_refresh=False,  # refreshed on each poll of the launcher's loop
                transient=False,
            )
            self._task = self._bar.add_task("train", total=self.total, stats="starting")
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.update()
        if self._bar is not None:
            self._bar.stop()

    def say(self, line: str) -> None:
        """A line above the bar (or between the plain lines)."""
        self.out.print(line, soft_wrap=True)

    def update(self) -> None:
        for e in self.log.poll():
            if e["event"] == "checkpoint_skipped":  # a fallback: say it, whatever the tty
                self.say(f"checkpoint {_fallback(e)}")
        steps = self.log.of("step")
        if len(steps) != self._seen:
            self._seen = len(steps)
            self._show(steps)
        if self._bar is not None:
            self._bar.refresh()  # the elapsed time moves between steps too

    def _show(self, steps: list[dict[str, Any]]) -> None:
        """The bar: the newest step any region reached, each region's newest counters. A
        plain line: a step every region has reached (every 10th and the last), with the
        loss, throughput and bytes of that step, so the last line agrees with the report."""
        newest = _newest(steps)
        if self._bar is not None and self._task is not None:
            step = max(e["step"] for e in newest)
            self._bar.update(self._task, completed=step, stats=_stats(steps, step, newest))
            return
        start = self.log.of("start")
        regions = start[0]["regions"] if start else len(newest)
        if len(newest) < regions:
            return
        done = min(e["step"] for e in newest)
        if done != self._said and (done == self.total or done % 10 == 0):
            self._said = done
            at = _newest([e for e in steps if e["step"] == done])
            self.say(f"step {done}/{self.total}  {_stats(steps, done, at)}")


def _stats(steps: list[dict[str, Any]], step: int, counters: list[dict[str, Any]]) -> str:
    """Loss and throughput of `step` (its regions' events), cross-region bytes summed over
    `counters` (one event a region: the regions' cumulative counters)."""
    latest = _newest([e for e in steps if e["step"] == step])
    loss = sum(e["loss"] for e in latest) / len(latest)
    tps = sum(e["tokens_per_s"] for e in latest)
    return f"loss {loss:.3f}  {tps:,.0f} tok/s  cross-region {_cross_wire(counters) / 1e6:.2f} MB"


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
    compute = sum(e.get("compute_s", 0.0) for e in steps) / max(1, regions)
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
        "compute_seconds": compute,
        "compute_share": compute / step_time if step_time else None,
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
        "tau": start[0].get("tau", 0),
        "exchange": start[0].get("exchange", "direct"),
        "exchange_s": sorted(x for e in steps for x in e.get("exchange_s", ())),
        "median_step_s": statistics.median(e["step_s"] for e in steps),
        # a region leader's peak (CUDA allocator or the process's VmHWM: training.observe)
        "peak_mem_bytes": max((e.get("peak_mem", 0) for e in steps), default=0),
        "privacy": privacy_summary(log),
        "links": links_summary(log),
    }


def links_summary(log: EventLog) -> dict[str, Any]:
    """The region leaders' last word on each link (training.sync.linkprobe) and, with the
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


LABEL_WIDTH = 23
"""Width of the report's label column (the longest label), then one space."""


def report_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The report as (label, value) rows; an empty label continues the row above."""
    curve = "  ".join(f"{s}:{v:.3f}" for s, v in r["loss_curve"].items())
    flat = r["flat_fp32_allreduce_cross_bytes"]
    rows = [
        (
            "trained",
            f"{r['params']:,} parameters on {r['world']} workers in {r['regions']} regions "
            f"for {r['steps']} steps",
        ),
        ("loss curve (step:loss)", curve),
        ("loss, every step", r.get("loss_sparkline", "")),
        (
            "final loss per region",
            "  ".join(f"{k} {v:.3f}" for k, v in r["final_loss_per_region"].items()),
        ),
        (
            "cross-region bytes",
            f"{r['cross_region_wire_bytes'] / 1e6:.2f} MB sent (fp32 flat all-reduce would "
            f"send {flat / 1e6:.2f} MB: {r['bytes_vs_flat_fp32']:.3f}x)"
            if r["bytes_vs_flat_fp32"]
            else "0",
        ),
        (
            "compression ratio",
            f"{r['compression_ratio']:.2f}x (fp32 bytes / wire bytes)"
            if r["compression_ratio"]
            else "-",
        ),
        (
            "time in sync",
            f"{r['sync_seconds']:.1f} s of {r['step_seconds']:.1f} s "
            f"({100 * (r['sync_share'] or 0):.0f}%)",
        ),
        (
            "compute utilisation",
            f"{100 * (r.get('compute_share') or 0):.0f}% (forward, backward and optimizer "
            "over step time)",
        ),
    ]
    if r["resumed_from"]:
        resumed = ", ".join(map(str, r["resumed_from"]))
        rows.append(("restarts", f"{r['restarts']} (resumed from step {resumed})"))
    rows += _sync_rows(r)
    rows += _privacy_lines(r.get("privacy") or {})
    rows += _link_rows(r.get("links") or {})
    for i, f in enumerate(r.get("checkpoint_fallbacks", [])):
        rows.append(("checkpoint fallbacks" if i == 0 else "", _fallback(f)))
    return rows


def _sync_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The chosen sync mode, its cross-region syncs (an all-reduce every step, or DiLoCo's
    warm-up all-reduces and global merges) and the bytes of each."""
    if not r.get("sync"):
        return []
    warmup = min(r.get("warmup") or 0, r["steps"])
    if r["sync"] == "diloco":
        mode = f"diloco after a {warmup}-step all-reduce warm-up" if warmup else "diloco"
        syncs = r["merges"] + warmup
        merges = f"{r['merges']}" + (f" (+ {warmup} warm-up all-reduces)" if warmup else "")
    else:
        mode, syncs = f"{r['sync']}, every step", r["steps"]
        merges = f"{syncs} (an all-reduce per step)"
    if syncs:
        merges += f", {r['cross_region_wire_bytes'] / syncs / 1e6:.2f} MB cross-region each"
    if r.get("exchange", "direct") != "direct":
        mode += f"; cross-region exchange: {r['exchange']}"
    rows = [("sync mode", mode), ("global merges", merges)]
    ex = r.get("exchange_s") or []
    if ex:  # streaming: did tau steps cover each fragment's background exchange?
        tau, step = r.get("tau") or 0, r.get("median_step_s") or 0.0
        rows.append(
            (
                "fragment exchanges",
                f"{len(ex)} landed (all regions), exchange median {statistics.median(ex):.2f} s, "
                f"max {ex[-1]:.2f} s; tau {tau} steps is {tau * step:.2f} s of median steps",
            )
        )
    return rows


def report_table(r: dict[str, Any]) -> Table:
    """The report as a rich table: labels on the left, one row each."""
    table = Table(box=None, show_header=False, padding=(0, 1, 0, 0), pad_edge=False)
    table.add_column(style="bold", no_wrap=True, min_width=LABEL_WIDTH)
    table.add_column(overflow="fold")
    for label, value in report_rows(r):
        table.add_row(Text(label), Text(value))  # Text: never read as markup
    return table


def format_report(r: dict[str, Any]) -> str:
    """The report as plain lines (what a console that is not a terminal prints)."""
    if not r:
        return "no training steps were recorded"
    buf = io.StringIO()
    console(buf).print(report_table(r))
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())  # rich pads each row


def print_report(out: Console, r: dict[str, Any]) -> None:
    """The report on `out`: a table on a terminal, plain rows elsewhere."""
    if r and out.is_terminal:
        out.print(report_table(r))
    else:
        out.print(format_report(r), soft_wrap=True)


def _privacy_lines(p: dict[str, Any]) -> list[tuple[str, str]]:
    spent = p.get("epsilon_per_region") or {}
    if not spent:
        return []
    rows = [
        (
            "privacy (epsilon spent)",
            "  ".join(
                f"{k} {v['epsilon']:.2f}/{v['epsilon_target']:g} (delta {v['delta']:g})"
                for k, v in spent.items()
            ),
        )
    ]
    if p.get("stopped_by"):
        rows.append(
            (
                "privacy budget",
                f"{p['stopped_by']} spent its budget: stopped at step {p['stopped_at']}",
            )
        )
    return rows


def _link_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per measured link, then one per adaptive codec choice."""
    rows = []
    for i, k in enumerate(r.get("links", [])):
        rows.append(
            (
                "links (per rank)" if i == 0 else "",
                f"{k['src']} -> {k['dst']} {k['bandwidth'] / 1e6:.1f} MB/s  "
                f"rtt {1e3 * k['rtt']:.2f} ms",
            )
        )
    for i, (link, c) in enumerate(r.get("codecs", {}).items()):
        uses = ", ".join(f"{k} x{n}" for k, n in c["uses"].items())
        rows.append(
            (
                "adaptive codec" if i == 0 else "",
                f"{link}: {c['codec']} ({c['switches']} switches; {uses})",
            )
        )
    return rows


def _fallback(e: dict[str, Any]) -> str:
    """One line per checkpoint directory that resume skipped: which, why, where it went."""
    where = f"moved to {e['moved_to']}" if e.get("moved_to") else "removed"
    return f"step {e['step']} on node {e['node']} skipped: {e['reason']}; {where}"
