"""`geotrain train` with heterogeneous pools: regions of 1 and 2 workers, DiLoCo merges
weighted by samples, and the throughput balance on real processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.integration.helpers import events, geotrain, two_node_stack

pytestmark = pytest.mark.timeout(300)


def test_uneven_regions_balance_keeps_the_global_batch_and_merge_identically(
    tmp_path: Path,
) -> None:
    stack = two_node_stack(
        tmp_path,
        "het",
        sync="diloco",
        steps=9,
        diloco={"inner_steps": 3},
        balance="throughput",
        balance_steps=2,
    )
    doc = yaml.safe_load(stack.read_text())
    doc["config"]["geotrain:regions"][0]["pool"]["nodes"][0]["gpus"] = 1  # beijing: 1, fra: 2
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    ev = events(tmp_path / ".geotrain/het")
    rounds = [e for e in ev if e["event"] == "balance"]
    assert [e["round"] for e in rounds] == [1, 2], rounds
    for e in rounds:  # 3 ranks x batch_size 2, however the batches moved
        b = e["batch_per_rank"]
        assert 1 * b["beijing"] + 2 * b["frankfurt"] == 6, b
    merges: dict[int, set[str]] = {}
    for e in ev:
        if e["event"] == "step" and e["merged"]:
            merges.setdefault(e["step"], set()).add(e["digest"])
    assert sorted(merges) == [3, 6, 9]
    assert all(len(d) == 1 for d in merges.values()), merges  # both regions, same weights
