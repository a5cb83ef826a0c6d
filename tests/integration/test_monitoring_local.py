"""A real Prometheus scrapes a short local run: every target up, and a query returns
cross-region bytes per region."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from geotrain.monitoring import query
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
        {"metrics_port": base, "prometheus_port": prom_port, "grafana_port": prom_port + 1}
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
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
