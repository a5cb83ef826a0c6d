"""DP-SGD on real processes: a region whose privacy budget runs out stops every rank of
every region at the same step, cleanly, with one clear line (exit 2, no restart)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from opacus.accountants import RDPAccountant

from tests.integration.helpers import events, geotrain, two_node_stack
from training.audit.ledger import predicate_type

pytestmark = pytest.mark.timeout(300)


DATA = 8192
"""Bytes of beijing's data: 8192 - 33 windows of seq_len 32 + 1."""


def _with_privacy(path: Path, data: Path, **privacy: float) -> Path:
    doc = yaml.safe_load(path.read_text())
    cfg = doc["config"]
    cfg["geotrain:regions"][0]["privacy"] = privacy  # beijing
    for s in cfg["geotrain:training"]["data_shards"]:
        if s["region"] == "beijing":
            s["uri"] = f"file:{data}"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _opacus_epsilon(sigma: float, rate: float, steps: int, delta: float) -> float:
    acc = RDPAccountant()
    acc.history = [(sigma, rate, steps)]
    return float(acc.get_epsilon(delta))


def test_a_spent_budget_stops_every_region_at_the_same_step_with_a_clear_message(
    tmp_path: Path,
) -> None:
    data = tmp_path / "bj.txt"
    data.write_bytes(bytes(range(32, 128)) * (DATA // 96) + b"." * (DATA % 96))
    # a fixed noise multiplier: this target is spent after 3 of the 6 planned steps
    sigma, rate, delta, target = 1.0, 4 / (DATA - 33), 1e-5, 0.55
    expect = max(n for n in range(7) if n == 0 or _opacus_epsilon(sigma, rate, n, delta) <= target)
    assert 0 < expect < 6
    stack = _with_privacy(
        two_node_stack(tmp_path, "dp", workers=1, steps=6, batch_size=4),
        data,
        target_epsilon=target,
        delta=delta,
        max_grad_norm=1.0,
        noise_multiplier=sigma,
    )
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "region beijing spent its privacy budget" in out
    assert "raise target_epsilon in Pulumi.dp.yaml:geotrain:regions[0].privacy" in out
    ev = events(tmp_path / ".geotrain" / "dp")
    [stop] = [e for e in ev if e["event"] == "privacy_budget_spent"]
    steps = [e for e in ev if e["event"] == "step"]
    assert stop["step"] == expect
    # both regions ran exactly the same steps, and ended (no rank left waiting)
    assert {e["step"] for e in steps if e["region"] == "frankfurt"} == set(
        range(1, stop["step"] + 1)
    )
    eps = [e["epsilon"] for e in steps if e["region"] == "beijing"]
    assert eps == sorted(eps) and len(eps) == expect
    assert eps[-1] == pytest.approx(_opacus_epsilon(sigma, rate, expect, delta), rel=1e-6)
    assert all("epsilon" not in e for e in steps if e["region"] == "frankfurt")
    assert len([e for e in ev if e["event"] == "start"]) == 2  # exit 2: never restarted
    report = json.loads((tmp_path / ".geotrain/dp/report.json").read_text())
    assert report["privacy"]["stopped_by"] == "beijing"
    # the region's signed ledger holds the epsilon it spent, and the whole run verifies
    chain = tmp_path / ".geotrain/dp/ledger/beijing.jsonl"
    statements = [_statement(line) for line in chain.read_text().splitlines()]
    spent = [s["predicate"] for s in statements if s["predicateType"] == predicate_type("dp")]
    assert spent and spent[-1]["epsilon"] == pytest.approx(eps[-1]) and spent[-1]["steps"] == expect
    v = geotrain("ledger", "verify", "--stack", str(stack), cwd=tmp_path)
    assert v.returncode == 0, v.stdout + v.stderr


def _statement(line: str) -> dict[str, Any]:
    """The in-toto statement inside one DSSE envelope (one line) of a ledger chain."""
    return dict(json.loads(base64.b64decode(json.loads(line)["payload"])))
