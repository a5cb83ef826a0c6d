"""A picture of a finished run from the workers' event stream (training.job `Job.emit`):
loss per region, cross-region bytes against fp32, and time in sync against compute; and a
one-line unicode sparkline for terminals.

Pure apart from writing the one image file. matplotlib is optional (`pip install
'geotrain[plot]'`): without it `write_run_plot` returns None and the caller prints
INSTALL_HINT. Only matplotlib's object API is used (no pyplot), so no global backend state
is touched.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from training.observe.baseline import flat_ring_cross_bytes

INSTALL_HINT = "run plot skipped: matplotlib is missing; pip install 'geotrain[plot]'"
BLOCKS = "▁▂▃▄▅▆▇█"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def sparkline(values: list[float], width: int) -> str:
    """`values` squeezed (bucket means) or stretched to `width` unicode blocks, lowest to
    highest; NaN and infinities are a space."""
    if not values or width <= 0:
        return ""
    n = len(values)
    # bucket i holds values[i n / width, (i + 1) n / width), at least one value
    cuts = [(i * n // width, max((i + 1) * n // width, i * n // width + 1)) for i in range(width)]
    buckets = [values[a:b] for a, b in cuts]
    means = [sum(b) / len(b) for b in buckets]
    finite = [v for v in means if math.isfinite(v)]
    if not finite:
        return " " * width
    lo, hi = min(finite), max(finite)
    top = len(BLOCKS) - 1
    span = (hi - lo) or 1.0  # a flat series is all lowest blocks
    return "".join(BLOCKS[round((v - lo) / span * top)] if math.isfinite(v) else " " for v in means)


def _series(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step: loss per region, and region sums of bytes and time (the newest event of
    each region and step wins: a restarted region repeats steps)."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        if e.get("event") == "step":
            key = (e["region"], int(e["step"]))
            if key not in latest or e["t"] >= latest[key]["t"]:
                latest[key] = e
    regions = sorted({r for r, _ in latest})
    steps = sorted({s for _, s in latest})
    loss = {r: [(s, latest[(r, s)]["loss"]) for s in steps if (r, s) in latest] for r in regions}
    wire, raw, sync, compute = [], [], [], []
    prev: dict[str, tuple[float, float]] = {}
    for s in steps:
        w = b = sy = co = 0.0
        here = [latest[(r, s)] for r in regions if (r, s) in latest]
        for e in here:
            pw, pr = prev.get(e["region"], (0.0, 0.0))
            # counters are cumulative per process; a restart starts them again at 0
            w += e["cross_wire"] - pw if e["cross_wire"] >= pw else e["cross_wire"]
            b += e["cross_raw"] - pr if e["cross_raw"] >= pr else e["cross_raw"]
            prev[e["region"]] = (e["cross_wire"], e["cross_raw"])
            sy += e["sync_s"]
            co += max(0.0, e["step_s"] - e["sync_s"])
        wire.append(w)
        raw.append(b)
        sync.append(sy / max(1, len(here)))
        compute.append(co / max(1, len(here)))
    return {
        "steps": steps,
        "loss": loss,
        "wire": wire,
        "raw": raw,
        "sync": sync,
        "compute": compute,
    }


def _cumsum(xs: list[float]) -> list[float]:
    out, total = [], 0.0
    for x in xs:
        total += x
        out.append(total)
    return out


def write_run_plot(events: list[dict[str, Any]], out: Path) -> Path | None:
    """Write a three-panel PNG of the run to `out`; None when matplotlib is missing or the
    events hold no training step."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    d = _series(events)
    if not d["steps"]:
        return None
    steps = d["steps"]
    fig = Figure(figsize=(8, 10), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_bytes, ax_time = fig.subplots(3, 1, sharex=True)
    for region, points in d["loss"].items():
        ax_loss.plot([s for s, _ in points], [v for _, v in points], label=region)
    ax_loss.set(title="Loss per region", ylabel="loss")
    ax_loss.legend(fontsize="small")
    _bytes_panel(ax_bytes, events, d)
    ax_time.stackplot(
        steps, d["compute"], d["sync"], labels=["compute", "cross-region sync"], alpha=0.8
    )
    share = sum(d["sync"]) / max(1e-12, sum(d["sync"]) + sum(d["compute"]))
    ax_time.set(
        title=f"Time per step: sync {share:.0%} of the total",
        xlabel="step",
        ylabel="seconds (region mean)",
    )
    ax_time.legend(fontsize="small", loc="upper right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _bytes_panel(ax: Any, events: list[dict[str, Any]], d: dict[str, Any]) -> None:
    """Cumulative bytes, so per-step all-reduce traffic and bursty diloco merges compare
    on one axis; legends give the mean per step."""
    steps, n = d["steps"], len(d["steps"])
    mb = 1e6
    ax.plot(
        steps,
        [v / mb for v in _cumsum(d["wire"])],
        label=f"sent (mean {sum(d['wire']) / n / mb:.2f} MB/step)",
    )
    ax.plot(
        steps,
        [v / mb for v in _cumsum(d["raw"])],
        label=f"same payloads in fp32 (mean {sum(d['raw']) / n / mb:.2f} MB/step)",
    )
    start = next((e for e in events if e.get("event") == "start"), None)
    if start is not None:
        flat = flat_ring_cross_bytes(start["params"], start["world"], start["regions"])
        ax.plot(
            steps,
            [flat * (i + 1) / mb for i in range(n)],
            linestyle="--",
            label=f"flat fp32 all-reduce ({flat / mb:.2f} MB/step)",
        )
    # log: int8/int4 payloads and diloco merges sit orders of magnitude under fp32
    ax.set(title="Cross-region bytes (cumulative)", ylabel="MB", yscale="log")
    ax.legend(fontsize="small")
