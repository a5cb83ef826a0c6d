"""Issue 7 benchmark: what Prometheus scraping costs the training loop.

One worker process trains the demo model (single thread) with its metrics endpoint
served, alternating blocks of steps with and without a scraper that fetches /metrics
every 100 ms (150x more often than the default 15 s interval), in one run, and reports
the ratio of median step times.

Run: python benchmarks/scrape_overhead.py. Saves benchmarks/results/scrape_overhead.md.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import torch

from training.data.loader import ByteLoader, load_region_text
from training.models.deepseek import build_model
from training.observe.metrics import RuntimeMetrics
from training.testing import make_spec

RESULTS = Path(__file__).resolve().parent / "results"
INTERVAL_S = 0.1


def main(blocks: int = 6, steps: int = 15) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = make_spec()
    model = build_model("deepseek-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = ByteLoader.of(load_region_text(spec.regions[0], 0, 3), 4, 64, 0)
    m = RuntimeMetrics("beijing", "bj-0", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m.serve("127.0.0.1", port)
    scraping = threading.Event()
    scrapes = [0]

    def scraper() -> None:
        while True:
            scraping.wait()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                r.read()
            scrapes[0] += 1
            time.sleep(INTERVAL_S)

    threading.Thread(target=scraper, daemon=True).start()
    times: dict[bool, list[float]] = {False: [], True: []}
    for b in range(2 * blocks):  # alternate: off, on, off, on ... (noise hits both)
        on = b % 2 == 1
        scraping.set() if on else scraping.clear()
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = model.loss(loader.next())
            opt.zero_grad()
            loss.backward()
            opt.step()
            m.loss.set(loss.item())
            m.step.inc()
            m.tick()
            times[on].append(time.perf_counter() - t0)
    off, on_ = statistics.median(times[False]), statistics.median(times[True])
    from prometheus_client import generate_latest

    t0 = time.perf_counter()
    for _ in range(500):
        generate_latest(m.registry)
    render = (time.perf_counter() - t0) / 500  # CPU the rank spends per scrape
    lines = [
        "# Scrape overhead: one rank, demo model, /metrics fetched every "
        f"{INTERVAL_S * 1000:.0f} ms",
        "",
        "| | value |",
        "|---|---|",
        f"| median step, no scraper ({len(times[False])} steps) | {1000 * off:.1f} ms |",
        f"| median step, scraped ({scrapes[0]} scrapes) | {1000 * on_:.1f} ms |",
        "| A/B difference (within this shared machine's noise) | "
        f"{100 * (on_ - off) / off:+.2f}% |",
        f"| CPU per scrape (render the exposition) | {1000 * render:.2f} ms |",
        f"| share of the loop at the default 15 s interval | {100 * render / 15:.4f}% |",
        "",
    ]
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scrape_overhead.md").write_text(table)


if __name__ == "__main__":
    main()
