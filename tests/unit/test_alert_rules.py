"""Alert rules tested by Prometheus's own promtool against a simulated run at the stack's
cadence: every alert fires on its fault and stays silent on a healthy run (allreduce every
step, diloco every H steps or every T minutes)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.model import load_stack
from infra.model.fault_tolerance import FaultTolerance
from infra.plan import Plan, build_plan
from infra.render import alert_rules, alert_windows, render_alert_rules, render_alert_tests
from infra.render.monitoring import RULES_FILE, RULES_TEST_FILE

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing (apt-get install prometheus)"
)


def _variant(stack: str, *, monitoring: dict[str, Any] | None = None, **training: Any) -> Plan:
    m = load_stack(stack)
    t = m.training.model_copy(update=training)
    mon = m.monitoring.model_copy(update=monitoring or {})
    return build_plan(m.model_copy(update={"training": t, "monitoring": mon}))


def _diloco(stack: str, **diloco: Any) -> Plan:
    d = load_stack(stack).training.diloco.model_copy(update=diloco)
    return _variant(stack, sync="diloco", diloco=d)


PLANS = {
    "local (allreduce)": lambda: build_plan(load_stack("local")),
    "lab (allreduce)": lambda: build_plan(load_stack("lab")),
    "global (diloco every 30 min)": lambda: build_plan(load_stack("global")),
    "global (diloco every 500 steps)": lambda: _diloco(
        "global", interval_minutes=None, inner_steps=500
    ),
    "global (gpu series from the runtime)": lambda: _variant(
        "global", monitoring={"gpu_metrics": "runtime"}
    ),
    "local (diloco every 10 min)": lambda: _diloco("local", interval_minutes=10),
    "lab (allreduce, fault tolerance)": lambda: _variant(
        "lab", fault_tolerance=FaultTolerance(lighthouse="frankfurt")
    ),
    "local (diloco every 50 steps, fault tolerance, min_replicas 1)": lambda: _ft_diloco(),
}
QUORUM_ALERTS = {
    "GeotrainRegionOutOfQuorum",
    "GeotrainQuorumAtMinimum",
    "GeotrainRegionHealingRepeatedly",
}


def _ft_diloco() -> Plan:
    m = load_stack("local")
    d = m.training.diloco.model_copy(update={"inner_steps": 50, "interval_minutes": None})
    ft = FaultTolerance(lighthouse="beijing", min_replicas=1)
    t = m.training.model_copy(update={"sync": "diloco", "diloco": d, "fault_tolerance": ft})
    return build_plan(m.model_copy(update={"training": t}))


def _promtool_test(
    tmp: Path, plan: Plan, rules: str | None = None
) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL
    d = tmp / "rules"
    d.mkdir(exist_ok=True)
    (tmp / RULES_FILE).write_text(rules or render_alert_rules(plan))
    (tmp / RULES_TEST_FILE).write_text(render_alert_tests(plan))
    return subprocess.run(
        [PROMTOOL, "test", "rules", RULES_TEST_FILE.rsplit("/", 1)[-1]],
        cwd=d,
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_promtool
@pytest.mark.parametrize("name", list(PLANS))
def test_every_alert_fires_on_its_fault_and_stays_silent_on_a_healthy_run(
    tmp_path: Path, name: str
) -> None:
    r = _promtool_test(tmp_path, PLANS[name]())
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_rule_tests_cover_every_alert_and_the_times_the_tester_saw() -> None:
    plan = build_plan(load_stack("global"))
    doc = yaml.safe_load(render_alert_tests(plan))
    names = {r.name for r in alert_rules(plan)}
    healthy, *faults = doc["tests"]
    checks = healthy["alert_rule_test"]
    assert {c["alertname"] for c in checks} == names
    assert all(c["exp_alerts"] == [] for c in checks)
    times = {c["eval_time"] for c in checks}
    # a healthy 30-minute diloco run paged at 20 min, 55 min and 1 h 50 min before
    assert {"20m", "55m", "110m"} <= times
    assert max(int(t.removesuffix("m")) for t in times) >= 6 * 60
    fired = {c["alertname"] for f in faults for c in f["alert_rule_test"] if c["exp_alerts"]}
    assert fired == names


def test_windows_follow_the_cadence() -> None:
    ar = alert_windows(build_plan(load_stack("local")))
    assert (ar.every_steps, ar.every_s) == (1, None)
    t30 = alert_windows(build_plan(load_stack("global")))
    # merges every 30 min: stall after 30 + 15 min, baseline of 6 merges, 2 saves of 30 min
    assert (t30.every_s, t30.sync_stall_s) == (1800, 2700)
    assert (t30.throughput_baseline_s, t30.checkpoint_stale_s) == (10800, 3600)
    h500 = alert_windows(_diloco("global", interval_minutes=None, inner_steps=500))
    assert (h500.every_steps, h500.every_s) == (500, None)
    assert "2 * 500 * max by (region) (geotrain_step_seconds)" in h500.stall_threshold()


@needs_promtool
def test_a_ten_minute_stall_window_fails_the_healthy_diloco_run(tmp_path: Path) -> None:
    """The rule tests catch the bug the tester found: a window shorter than the merge
    interval pages on a healthy run."""
    plan = build_plan(load_stack("global"))
    rules = render_alert_rules(plan).replace("> 2700", "> 600")
    r = _promtool_test(tmp_path, plan, rules)
    assert r.returncode != 0
    assert "GeotrainSyncStalled" in r.stdout + r.stderr


@needs_promtool
def test_a_throughput_rule_that_compares_bursts_with_averages_fails(tmp_path: Path) -> None:
    """Like the old rule (5-minute byte rate against the hourly rate): counting syncs in 5
    minutes against the hour pages between two diloco merges."""
    plan = build_plan(load_stack("global"))
    tp = "geotrain_cross_region_sync_bytes_per_second"
    doc = yaml.safe_load(render_alert_rules(plan))
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] == "GeotrainCrossRegionThroughputCollapsed":
            rule["expr"] = (
                f"avg by (region) (changes({tp}[5m])) < "
                f"0.1 * avg by (region) (changes({tp}[1h] offset 5m))"
            )
    r = _promtool_test(tmp_path, plan, yaml.safe_dump(doc, sort_keys=False))
    assert r.returncode != 0
    assert "GeotrainCrossRegionThroughputCollapsed" in r.stdout + r.stderr


def test_quorum_alerts_are_rendered_only_for_fault_tolerant_runs_with_a_runbook() -> None:
    plain = {r.name for r in alert_rules(build_plan(load_stack("lab")))}
    assert not plain & QUORUM_ALERTS
    doc = yaml.safe_load(render_alert_rules(PLANS["lab (allreduce, fault tolerance)"]()))
    rules = {r["alert"]: r for r in doc["groups"][0]["rules"]}
    assert set(rules) >= QUORUM_ALERTS
    for name in QUORUM_ALERTS:
        runbook = rules[name]["annotations"]["runbook"]
        assert all(w in runbook for w in ("What:", "Where:", "Fix:")), name
    # 3 regions, a majority of 2: a quorum of 2 has no region to spare
    assert rules["GeotrainQuorumAtMinimum"]["expr"].endswith("<= 2")


@needs_promtool
def test_a_quorum_alert_reading_the_reporting_region_instead_of_the_excluded_one_fails(
    tmp_path: Path,
) -> None:
    """Each rank reports which regions its quorum leaves out; the alert must name the
    region left out (excluded_region), not the rank's own region."""
    plan = PLANS["lab (allreduce, fault tolerance)"]()
    doc = yaml.safe_load(render_alert_rules(plan))
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] == "GeotrainRegionOutOfQuorum":
            rule["expr"] = 'max by (region) (geotrain_quorum_excluded{excluded_region!=""}) == 1'
    r = _promtool_test(tmp_path, plan, yaml.safe_dump(doc, sort_keys=False))
    assert r.returncode != 0
    assert "GeotrainRegionOutOfQuorum" in r.stdout + r.stderr
