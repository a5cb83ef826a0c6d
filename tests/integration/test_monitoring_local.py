"""A real Prometheus scrapes a short local run: every target up, a query returns
cross-region bytes per region, and every alert's inner selector has data (so no alert is
silent only because it reads a series nobody exports)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from geotrain.monitoring import query, wait_ready
from infra.model import load_stack
from infra.plan import build_plan
from infra.render import alert_rules
from tests.integration.helpers import small_stack, start

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("prometheus") is None, reason="prometheus missing (apt-get install prometheus)"
    ),
]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_prometheus_scrapes_every_worker_and_answers_per_region(tmp_path: Path) -> None:
    import yaml

    path = small_stack(tmp_path, "mon", steps=200)
    doc = yaml.safe_load(path.read_text())
    prom_port = _free_ports(1)[0]
    base = prom_port + 10  # 6 consecutive metrics ports, clear of Prometheus and Grafana
    doc["config"]["geotrain:monitoring"].update(
        {
            "metrics_port": base,
            "prometheus_port": prom_port,
            "grafana_port": prom_port + 1,
            "alertmanager_port": prom_port + 2,
        }
    )
    path.write_text(yaml.safe_dump(doc))
    proc = start("train", "--stack", str(path), cwd=tmp_path)
    url = f"http://127.0.0.1:{prom_port}"
    try:
        deadline = time.monotonic() + 200
        regions: dict[str, float] = {}
        up: list[float] = []
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                up = [float(r["value"][1]) for r in query(url, 'up{job="geotrain-runtime"}')]
                res = query(url, "sum by (region) (geotrain_cross_region_wire_bytes_total)")
                regions = {r["metric"]["region"]: float(r["value"][1]) for r in res}
            except OSError:
                pass  # Prometheus not listening yet
            if len(up) == 6 and all(up) and len(regions) == 3 and all(regions.values()):
                break
            time.sleep(0.5)
        if proc.poll() is not None:
            pytest.fail(f"train exited with {proc.returncode}: {proc.communicate()[0]}")
        assert len(up) == 6 and all(up), up
        assert set(regions) == {"beijing", "frankfurt", "silicon-valley"}
        assert all(v > 0 for v in regions.values()), regions
        _every_alert_reads_live_series(url, path, proc)
        managers = _get(url, "/api/v1/alertmanagers")["activeAlertmanagers"]
        assert any(f":{prom_port + 2}/" in m["url"] for m in managers), managers
        if shutil.which("prometheus-alertmanager") or shutil.which("alertmanager"):
            assert wait_ready(f"http://127.0.0.1:{prom_port + 2}", 30), "Alertmanager not ready"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _get(url: str, path: str) -> dict[str, Any]:
    import json
    import urllib.request

    with urllib.request.urlopen(url + path, timeout=5) as resp:
        return dict(json.loads(resp.read())["data"])


def _every_alert_reads_live_series(url: str, stack: Path, proc: subprocess.Popen[str]) -> None:
    """Each alert's probe (its inner selector) returns a series per region; GPU alerts are
    skipped on this CPU-only stack. A healthy run fires nothing."""
    plan = build_plan(load_stack(str(stack)))
    probes = {r.name: r.probe for r in alert_rules(plan) if not r.needs_gpu}
    empty = dict(probes)
    deadline = time.monotonic() + 120
    while empty and time.monotonic() < deadline and proc.poll() is None:
        for name, probe in list(empty.items()):
            got = {r["metric"].get("region") for r in query(url, probe)}
            if {"beijing", "frankfurt", "silicon-valley"} <= got:
                del empty[name]
        time.sleep(1)
    assert not empty, f"no live data for {empty}"
    firing = query(url, 'ALERTS{alertstate="firing"}')
    assert not firing, firing
