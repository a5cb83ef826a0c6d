"""The `geotrain train` progress and report: a rich bar and table on a terminal, plain
lines elsewhere, and the chosen sync mode's merges and bytes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from training.observe.report import (
    EventLog,
    Progress,
    complete_events,
    console,
    format_report,
    summarize,
)

REGIONS = ("beijing", "frankfurt")
REASON = "[bold]torn[/bold] :smile: write"  # text from the run: never rich markup


def _log(tmp: Path, sync: str, steps: int = 12, warmup: int = 0) -> EventLog:
    path = tmp / "events.jsonl"
    _write(path, _events(sync, steps, warmup))
    return EventLog(path)


def _write(path: Path, events: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def _events(sync: str, steps: int, warmup: int) -> list[dict[str, object]]:
    lines: list[dict[str, object]] = [
        {"event": "start", "params": 1000, "world": 4, "regions": 2, "sync": sync, "t": 0}
    ]
    lines[0]["warmup"] = warmup
    for s in range(1, steps + 1):
        for r in REGIONS:
            merged = sync == "diloco" and s > warmup and (s - warmup) % 5 == 0
            wire = 1e6 * (s if sync == "allreduce" else min(s, warmup) + (s - warmup) // 5)
            lines.append(
                {
                    **{"event": "step", "step": s, "region": r, "loss": 3 - 0.1 * s, "t": s},
                    **{"tokens_per_s": 500, "cross_wire": wire, "cross_raw": 4 * wire},
                    **{"sync_s": 0.1, "step_s": 1.0, "compute_s": 0.6, "merged": merged},
                }
            )
    lines.append(
        {
            "event": "checkpoint_skipped",
            "step": 6,
            "node": "fra-0",
            "reason": REASON,
            "moved_to": None,
            "t": 7,
        }
    )
    return lines


@pytest.mark.parametrize(
    ("sync", "warmup", "mode", "merges"),
    [
        ("allreduce", 0, "allreduce, every step", "12 (an all-reduce per step), 2.00 MB"),
        (
            "diloco",
            2,
            "diloco after a 2-step all-reduce warm-up",
            "2 (+ 2 warm-up all-reduces), 2.00 MB",
        ),
    ],
)
def test_report_shows_the_sync_modes_merges_and_their_bytes(
    tmp_path: Path, sync: str, warmup: int, mode: str, merges: str
) -> None:
    text = format_report(summarize(_log(tmp_path, sync, warmup=warmup), 12))
    rows = text.splitlines()
    assert f"{'sync mode':24}{mode}" in rows
    assert any(r.startswith(f"{'global merges':24}{merges} cross-region each") for r in rows)
    assert any(r.startswith(f"{'cross-region bytes':24}") for r in rows), text


def test_plain_report_has_no_control_codes_no_padding_and_keeps_markup_literal(
    tmp_path: Path,
) -> None:
    text = format_report(summarize(_log(tmp_path, "allreduce"), 12))
    assert "\x1b" not in text
    assert all(line == line.rstrip() for line in text.splitlines())
    assert f"{'checkpoint fallbacks':24}step 6 on node fra-0 skipped: {REASON}; removed" in text


def test_progress_off_a_terminal_is_a_plain_line_every_10_steps(tmp_path: Path) -> None:
    out, path, events = io.StringIO(), tmp_path / "events.jsonl", _events("allreduce", 12, 0)
    with Progress(EventLog(path), 12, out=console(out)) as p:
        for upto in (3, 11, 19, 21):  # region lines: steps 1, 5, 9 and 10
            _write(path, events[:upto])
            p.update()
        p.say("worker 3 exited with -9")
        _write(path, events)
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()
    steps = [ln.split("  ")[0] for ln in lines if ln.startswith("step ")]
    assert steps == ["step 10/12", "step 12/12"], lines
    assert f"checkpoint step 6 on node fra-0 skipped: {REASON}; removed" in lines
    assert "worker 3 exited with -9" in lines


def test_the_last_plain_line_waits_for_every_region_and_agrees_with_the_report(
    tmp_path: Path,
) -> None:
    """One region ends (its last step carries the last merge's bytes) before the other:
    no line for step 12 until both did, then its bytes are the report's."""
    out, path, events = io.StringIO(), tmp_path / "events.jsonl", _events("diloco", 12, 0)
    last = [e for e in events if e.get("step") == 12]
    last[0]["cross_wire"] = last[1]["cross_wire"] = 9e6  # the final merge, in both
    with Progress(EventLog(path), 12, out=console(out)) as p:
        _write(path, events[: events.index(last[1])])  # beijing at 12, frankfurt at 11
        p.update()
        assert "step 12/12" not in out.getvalue()
        _write(path, events)
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("step 12/12"))
    report = summarize(EventLog(path), 12)["cross_region_wire_bytes"]
    assert f"cross-region {report / 1e6:.2f} MB" in line and report == 18e6


def test_progress_on_a_terminal_draws_a_rich_bar(tmp_path: Path) -> None:
    out = io.StringIO()
    term = Console(file=out, force_terminal=True, width=120, markup=False, emoji=False)
    with Progress(_log(tmp_path, "allreduce"), 12, out=term):
        pass
    shown = out.getvalue()
    assert "\x1b[" in shown and "━" in shown  # rich's live bar, not a hand-drawn one
    assert "step 12/12" in shown and "cross-region 24.00 MB" in shown


def test_report_gives_compute_utilisation_as_compute_over_step_time(tmp_path: Path) -> None:
    r = summarize(_log(tmp_path, "allreduce"), 12)
    assert r["compute_share"] == pytest.approx(0.6)
    line = next(ln for ln in format_report(r).splitlines() if "compute utilisation" in ln)
    assert "60%" in line


def test_report_sets_streaming_exchange_times_against_tau(tmp_path: Path) -> None:
    """A streaming run's step events carry each landed fragment's background exchange
    time; the report gives their median and max next to tau steps of wall time."""
    events = _events("diloco", 12, 0)
    events[0]["tau"] = 3
    exchanges = iter([[0.5], [2.5], [1.0, 1.5]])
    for e in events:
        if e["event"] == "step" and e.get("merged"):
            e["exchange_s"] = next(exchanges, [])
    path = tmp_path / "events.jsonl"
    _write(path, events)
    text = format_report(summarize(EventLog(path), 12))
    want = "4 landed (all regions), exchange median 1.25 s, max 2.50 s; tau 3 steps is 3.00 s"
    assert f"{'fragment exchanges':24}{want} of median steps" in text.splitlines(), text
    assert "fragment exchanges" not in format_report(summarize(_log(tmp_path, "diloco"), 12))


def test_a_line_still_being_written_waits_and_a_torn_one_is_skipped(tmp_path: Path) -> None:
    # CI caught a reader seeing an append half copied (an event cut at 298 bytes)
    whole = json.dumps({"event": "step", "step": 1, "links": {"a": 1}}) + "\n"
    half = json.dumps({"event": "step", "step": 2, "links": {"a": 2}})[:-9]
    torn = '{"event": "step", "st' + whole  # a worker killed mid-write, then appended to
    for data in (whole + half, (whole + half).encode()):
        assert [e["step"] for e in complete_events(data)] == [1]
    assert complete_events(half) == []
    path = tmp_path / "events.jsonl"
    path.write_text(whole + half)
    log = EventLog(path)
    assert [e["step"] for e in log.poll()] == [1]
    with open(path, "a") as f:  # the rest of the line lands: the next poll takes it
        f.write(json.dumps({"event": "step", "step": 2, "links": {"a": 2}})[-9:] + "\n" + torn)
    assert [e["step"] for e in log.poll()] == [2]
    assert log.unreadable == 1
    assert [e["step"] for e in complete_events(whole + torn)] == [1]
