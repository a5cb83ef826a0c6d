"""Monitoring artifacts checked by Prometheus's own promtool, and the runtime's real
metrics exposition."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from geotrain.monitoring import RegionView, _fold, format_top
from infra.model import load_stack
from infra.plan import build_plan
from infra.render import render_alert_rules, render_prometheus
from infra.render.monitoring import RULES_FILE
from training.metrics import RuntimeMetrics

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing (apt-get install prometheus)"
)


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, input=stdin)


def _write_config(tmp: Path, stack: str) -> Path:
    plan = build_plan(load_stack(stack))
    (tmp / "rules").mkdir()
    (tmp / RULES_FILE).write_text(render_alert_rules(plan))
    conf = tmp / "prometheus.yml"
    conf.write_text(render_prometheus(plan))
    return conf


@needs_promtool
@pytest.mark.parametrize("stack", ["local", "lab", "global"])
def test_promtool_accepts_the_rendered_config_and_rules(tmp_path: Path, stack: str) -> None:
    conf = _write_config(tmp_path, stack)
    r = _promtool("check", "config", str(conf))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "6 rules found" in r.stdout + r.stderr


def _summary(alert: str, **labels: str) -> str:
    rules = yaml.safe_load(render_alert_rules(build_plan(load_stack("local"))))
    text = next(r for r in rules["groups"][0]["rules"] if r["alert"] == alert)["annotations"][
        "summary"
    ]
    for k, v in labels.items():
        text = text.replace(f"{{{{ $labels.{k} }}}}", v)
    return str(text)


def _case(
    alert: str, series: list[tuple[str, str]], at: str, fires: dict[str, str], severity: str
) -> dict[str, object]:
    exp = (
        [
            {
                "exp_labels": {"severity": severity, **fires},
                "exp_annotations": {"summary": _summary(alert, **fires)},
            }
        ]
        if fires
        else []
    )
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": exp}],
    }


BJ, FRA = {"region": "beijing"}, {"region": "frankfurt"}
RT = 'job="geotrain-runtime"'
ALERT_TESTS = [
    # (alert, series, eval time, labels it fires with per case: fires / silent)
    _case(
        "GeotrainRegionDown",
        [
            (f'up{{{RT},region="beijing",node="bj-0"}}', "0x10"),
            (f'up{{{RT},region="frankfurt",node="fra-0"}}', "1x10"),
        ],
        "5m",
        BJ,
        "critical",
    ),
    _case(
        "GeotrainRegionDown",
        [(f'up{{{RT},region="frankfurt",node="fra-0"}}', "1x10")],
        "5m",
        {},
        "critical",
    ),
    _case(
        "GeotrainSyncStalled",
        [
            ('geotrain_syncs_total{region="beijing",node="bj-0"}', "5x30"),
            (f'up{{{RT},region="beijing",node="bj-0"}}', "1x30"),
            ('geotrain_syncs_total{region="frankfurt",node="fra-0"}', "0+1x30"),
            (f'up{{{RT},region="frankfurt",node="fra-0"}}', "1x30"),
        ],
        "20m",
        BJ,
        "critical",
    ),
    _case(
        "GeotrainSyncStalled",
        [
            ('geotrain_syncs_total{region="frankfurt",node="fra-0"}', "0+1x30"),
            (f'up{{{RT},region="frankfurt",node="fra-0"}}', "1x30"),
        ],
        "20m",
        {},
        "critical",
    ),
    _case(
        "GeotrainCheckpointStale",
        [
            ('geotrain_checkpoint_age_seconds{region="beijing",node="bj-0"}', "4000x10"),
            ('geotrain_checkpoint_age_seconds{region="frankfurt",node="fra-0"}', "100x10"),
        ],
        "5m",
        BJ,
        "warning",
    ),
    _case(
        "GeotrainGpuUtilLow",
        [
            ('DCGM_FI_DEV_GPU_UTIL{region="beijing",node="bj-0"}', "5x30"),
            ('DCGM_FI_DEV_GPU_UTIL{region="frankfurt",node="fra-0"}', "90x30"),
        ],
        "20m",
        BJ,
        "warning",
    ),
    _case(
        "GeotrainCrossRegionThroughputCollapsed",
        [
            (
                'geotrain_cross_region_wire_bytes_total{region="beijing",node="bj-0"}',
                "0+1000000x70 70000000x30",
            ),
            (
                'geotrain_cross_region_wire_bytes_total{region="frankfurt",node="fra-0"}',
                "0+1000000x100",
            ),
        ],
        "90m",
        BJ,
        "warning",
    ),
    _case(
        "GeotrainLossNaN",
        [
            ('geotrain_loss{region="beijing",node="bj-0"}', "NaN NaN NaN"),
            ('geotrain_loss{region="frankfurt",node="fra-0"}', "2.5x3"),
        ],
        "1m",
        {"region": "beijing", "node": "bj-0"},
        "critical",
    ),
]


@needs_promtool
def test_every_alert_fires_when_it_should_and_stays_silent_otherwise(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(render_alert_rules(build_plan(load_stack("local"))))
    tests = tmp_path / "tests.yml"
    tests.write_text(
        yaml.safe_dump(
            {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": ALERT_TESTS},
            sort_keys=False,
        )
    )
    r = _promtool("test", "rules", str(tests))
    assert r.returncode == 0, r.stdout + r.stderr
    alerts = {t["alert_rule_test"][0]["alertname"] for t in ALERT_TESTS}  # type: ignore[index]
    assert len(alerts) == 6


def _exposition() -> str:
    m = RuntimeMetrics("beijing", "bj-0", 0)
    m.step.set(12)
    m.loss.set(2.5)
    m.cross_wire.inc(1000)
    m.link_bytes("frankfurt", 500)
    m.checkpointed(0.02)
    m.tick()
    return generate_latest(m.registry).decode()


@needs_promtool
def test_promtool_accepts_the_runtime_exposition() -> None:
    r = _promtool("check", "metrics", stdin=_exposition())
    assert r.returncode == 0, r.stdout + r.stderr


def test_runtime_exposition_has_region_node_rank_labels() -> None:
    text = _exposition()
    assert 'geotrain_loss{node="bj-0",rank="0",region="beijing"} 2.5' in text
    assert 'peer_region="frankfurt"' in text
    assert "process_resident_memory_bytes" in text


def test_top_folds_an_exposition_into_a_region_row() -> None:
    v = RegionView(targets=1, up=1)
    _fold(v, _exposition())
    out = format_top({"beijing": v})
    assert "beijing" in out and "1/1" in out and "2.500" in out
