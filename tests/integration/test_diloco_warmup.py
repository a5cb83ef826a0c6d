"""`geotrain train` with a DiLoCo warm-up on real processes (two regions, one rank each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.helpers import events, geotrain, two_node_stack

pytestmark = pytest.mark.timeout(300)


def test_warmup_syncs_every_step_then_merges_count_from_its_end(tmp_path: Path) -> None:
    """warmup 2, H 2, 5 steps: the regions (different data) hold the same weights when the
    warm-up ends, and merge after steps 4 and 5 only."""
    stack = two_node_stack(
        tmp_path,
        "wu",
        workers=1,
        sync="diloco",
        steps=5,
        diloco={"inner_steps": 2, "warmup_steps": 2},
    )
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [e for e in events(tmp_path / ".geotrain/wu") if e["event"] == "step"]
    digests: dict[int, set[str]] = {}
    for e in steps:
        if "digest" in e:
            digests.setdefault(e["step"], set()).add(e["digest"])
    assert sorted(e["step"] for e in steps if e["merged"] and e["region"] == "beijing") == [4, 5]
    assert sorted(digests) == [2, 4, 5]
    assert all(len(d) == 1 for d in digests.values()), digests
    assert len({e["region"] for e in steps}) == 2
    assert "sync mode               diloco after a 2-step all-reduce warm-up" in r.stdout, r.stdout
    assert "global merges           2" in r.stdout and "cross-region bytes" in r.stdout
    ok = geotrain("ledger", "verify", "--stack", str(stack), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
