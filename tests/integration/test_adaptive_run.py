"""`geotrain train` with the adaptive codec on real processes: the run finishes and its
report names every link's measured bandwidth and RTT and the codec each region used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.helpers import events, geotrain, two_node_stack

pytestmark = pytest.mark.timeout(300)


def test_an_adaptive_run_finishes_and_reports_its_links(tmp_path: Path) -> None:
    adaptive = {"adaptive": {"quantize": ["none", "int8", "int4"], "zstd_levels": [1]}}
    stack = two_node_stack(tmp_path, "ad", workers=1, steps=4, compression=adaptive)
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / ".geotrain/ad/report.json").read_text())
    assert report["steps"] == 4
    links = report["links"]["links"]
    assert {(k["src"], k["dst"]) for k in links} == {
        ("beijing", "frankfurt"),
        ("frankfurt", "beijing"),
    }
    assert all(k["bandwidth"] > 0 and k["rtt"] > 0 and k["samples"] >= 1 for k in links)
    codecs = report["links"]["codecs"]
    assert set(codecs) == {
        "beijing -> frankfurt",
        "beijing -> all",
        "frankfurt -> beijing",
        "frankfurt -> all",
    }
    for c in codecs.values():
        assert c["codec"].split("/")[0] in ("none", "int8", "int4")
        assert sum(c["uses"].values()) == 4 * 3  # 3 buckets of 4 MB: a choice per bucket
    assert "links (per rank)" in r.stdout and "adaptive codec" in r.stdout
    probed = [e for e in events(tmp_path / ".geotrain/ad") if e["event"] == "links"]
    assert len(probed) == 2 and all(e["links"][0]["samples"] == 1 for e in probed)
