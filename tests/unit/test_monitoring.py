"""Monitoring artifacts checked by Prometheus's own promtool and Alertmanager's amtool; the
runtime's real metrics exposition (one GPU series per device); the dashboard covering every
exported metric; Grafana provisioning; what each host installs; the run picture."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from geotrain.monitoring import RegionView, _fold, format_top
from infra.model import load_stack
from infra.model.load import model_from_config
from infra.plan import Plan, build_plan
from infra.render import (
    alert_rules,
    host_services,
    monitoring_files,
    render_alert_rules,
    render_alertmanager,
    render_dashboard,
    render_grafana_dashboards,
    render_grafana_datasource,
    render_prometheus,
    secret_files,
)
from infra.render.monitoring import GRAFANA_DASHBOARDS, RULES_FILE
from training.errors import ConfigError
from training.observe import metric_names as mn
from training.observe import plot
from training.observe.metrics import RuntimeMetrics

PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing (apt-get install prometheus)"
)
needs_amtool = pytest.mark.skipif(
    AMTOOL is None, reason="amtool missing (apt-get install prometheus-alertmanager)"
)
STACKS = Path(__file__).resolve().parents[2] / "stacks"


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, input=stdin, timeout=60)


def _with_monitoring(stack: str, **monitoring: Any) -> Plan:
    doc = yaml.safe_load((STACKS / f"Pulumi.{stack}.yaml").read_text())
    cfg = doc["config"]
    cfg["geotrain:monitoring"] = {**cfg.get("geotrain:monitoring", {}), **monitoring}
    return build_plan(model_from_config(cfg, stack, f"stacks/Pulumi.{stack}.yaml"))


RECEIVERS = {
    "receivers": [
        {
            "name": "oncall",
            "severities": ["critical"],
            "webhook_url": "https://alerts.example.com/geotrain",
            "webhook_token_config": "geotrain:alertWebhookToken",
        },
        {"name": "chat", "slack_url_config": "geotrain:slackWebhookUrl"},
        {"name": "team", "severities": ["warning"], "email": "ml-platform@example.com"},
    ],
    "smtp": {
        "smarthost": "smtp.example.com:587",
        "sender": "geotrain@example.com",
        "username": "geotrain",
    },
}


# -- Prometheus and Alertmanager configs ------------------------------------------------
@needs_promtool
@pytest.mark.parametrize("stack", ["local", "lab", "global"])
def test_promtool_accepts_the_rendered_config_and_rules(tmp_path: Path, stack: str) -> None:
    plan = build_plan(load_stack(stack))
    (tmp_path / "rules").mkdir()
    (tmp_path / RULES_FILE).write_text(render_alert_rules(plan))
    conf = tmp_path / "prometheus.yml"
    conf.write_text(render_prometheus(plan))
    assert PROMTOOL
    r = _run(PROMTOOL, "check", "config", str(conf))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(alert_rules(plan))} rules found" in r.stdout + r.stderr


def test_prometheus_sends_alerts_to_the_alertmanager_on_the_monitoring_host() -> None:
    plan = _with_monitoring("global", alertmanager_port=9193)
    doc = yaml.safe_load(render_prometheus(plan))
    targets = doc["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert targets == [f"{plan.monitoring_host.private_ip}:9193"]


@needs_amtool
@pytest.mark.parametrize("stack", ["local", "lab", "global"])
def test_amtool_accepts_the_rendered_alertmanager_config(tmp_path: Path, stack: str) -> None:
    for i, plan in enumerate([build_plan(load_stack(stack)), _with_monitoring(stack, **RECEIVERS)]):
        conf = tmp_path / f"alertmanager-{i}.yml"
        conf.write_text(render_alertmanager(plan))
        assert AMTOOL
        r = _run(AMTOOL, "check-config", str(conf))
        assert r.returncode == 0, r.stdout + r.stderr


def test_alerts_route_by_severity_and_a_down_region_pages_once() -> None:
    doc = yaml.safe_load(render_alertmanager(_with_monitoring("global", **RECEIVERS)))
    routes = {(r["receiver"], r["matchers"][0]) for r in doc["route"]["routes"]}
    assert routes == {
        ("oncall", 'severity="critical"'),
        ("chat", 'severity="critical"'),
        ("chat", 'severity="warning"'),
        ("team", 'severity="warning"'),
    }
    assert doc["inhibit_rules"][0]["equal"] == ["region"]


def test_secrets_are_files_the_host_writes_never_rendered_values() -> None:
    plan = _with_monitoring("global", **RECEIVERS)
    text = render_alertmanager(plan)
    files = {s.config_key: s.path for s in secret_files(plan)}
    assert files == {
        "geotrain:grafanaAdminPassword": "/etc/grafana/secrets/admin-password",
        "geotrain:alertWebhookToken": "/etc/prometheus/secrets/oncall-webhook-token",
        "geotrain:slackWebhookUrl": "/etc/prometheus/secrets/chat-slack-url",
        "geotrain:smtpPassword": "/etc/prometheus/secrets/smtp-password",
    }
    for key, path in files.items():
        assert key not in text
        assert path in text or "grafana" in path
    assert "password:" not in text and "api_url:" not in text


@pytest.mark.parametrize(
    ("receiver", "error"),
    [
        ({"name": "ops"}, "set exactly one of webhook_url, slack_url_config, email"),
        ({"name": "ops", "webhook_url": "https://a", "email": "a@b.c"}, "exactly one"),
        ({"name": "ops", "email": "a@b.c"}, "email receivers need geotrain:monitoring.smtp"),
        ({"name": "ops", "webhook_url": "ftp://a"}, r"is not an http\(s\) URL"),
        ({"name": "null", "webhook_url": "https://a"}, "reserved"),
        (
            {"name": "ops", "slack_url_config": "k", "webhook_token_config": "t"},
            "needs webhook_url",
        ),
    ],
)
def test_a_receiver_without_exactly_one_destination_is_rejected(
    receiver: dict[str, Any], error: str
) -> None:
    with pytest.raises(ConfigError, match=error) as e:
        _with_monitoring("global", receivers=[receiver], smtp=None)
    assert "geotrain:monitoring.receivers[0]" in str(e.value)


def test_monitoring_ports_must_differ() -> None:
    with pytest.raises(ConfigError, match="alertmanager_port"):
        _with_monitoring("global", alertmanager_port=9090)


# -- the runtime's exposition ------------------------------------------------------------
class _FakeNvml(types.ModuleType):
    """pynvml for one node of `count` GPUs; device i uses (i + 1) GiB at 10 (i + 1) %."""

    def __init__(self, count: int) -> None:
        super().__init__("pynvml")
        self.count = count

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise RuntimeError(f"no device {i}")
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return types.SimpleNamespace(gpu=10 * (h + 1))

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return types.SimpleNamespace(used=(h + 1) * 2**30)


def _samples(m: RuntimeMetrics) -> list[Any]:
    text = generate_latest(m.registry).decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_gpu_series_are_exported_once_per_device_not_once_per_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(2))
    ranks = [RuntimeMetrics("beijing", "bj-0", rank, gpu=rank) for rank in (0, 1)]
    mem = [s for m in ranks for s in _samples(m) if s.name == mn.GPU_MEM_USED]
    assert sorted(s.labels["gpu"] for s in mem) == ["0", "1"]
    assert sum(s.value for s in mem) == 1024 + 2048  # each device once: 1 GiB + 2 GiB
    util = [s for m in ranks for s in _samples(m) if s.name == mn.GPU_UTIL]
    assert sorted(s.value for s in util) == [10, 20]


def test_a_rank_exports_the_cuda_device_it_selected_and_a_cpu_rank_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(2))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    gpu = [s for s in _samples(RuntimeMetrics("b", "n", 5)) if s.name == mn.GPU_UTIL]
    assert [(s.labels["gpu"], s.value) for s in gpu] == [("1", 20)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert not [s for s in _samples(RuntimeMetrics("b", "n", 5)) if s.name == mn.GPU_UTIL]


def _value(m: RuntimeMetrics, name: str) -> float | None:
    return next((s.value for s in _samples(m) if s.name == name), None)


def test_sync_throughput_is_bytes_over_seconds_of_the_last_sync() -> None:
    m = RuntimeMetrics("beijing", "bj-0", 0)
    started = _value(m, mn.LAST_SYNC)
    assert started is not None and abs(started - time.time()) < 60
    assert _value(m, mn.SYNC_THROUGHPUT) is None  # nothing to say before the first sync
    for _ in range(3):  # diloco inner steps: no cross-region bytes, no sync
        m.sync_s.set(0.0)
        m.cross_wire.inc(0)
    m.sync_s.set(2.0)  # the merge
    m.cross_wire.inc(8e6)
    m.syncs.inc()
    assert _value(m, mn.SYNC_THROUGHPUT) == 4e6
    m.sync_s.set(0.5)
    m.cross_wire.inc(1e6)
    m.syncs.inc()
    assert _value(m, mn.SYNC_THROUGHPUT) == 2e6
    assert (_value(m, mn.LAST_SYNC) or 0) >= started


def test_checkpoint_age_grows_at_scrape_time_even_when_the_loop_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    m = RuntimeMetrics("beijing", "bj-0", 0)
    now[0] += 30
    assert _value(m, mn.CHECKPOINT_AGE) == 30  # no checkpoint yet: since the start
    m.checkpointed(0.1)
    now[0] += 600  # no tick(): the training loop is stuck
    assert _value(m, mn.CHECKPOINT_AGE) == 600


def _exposition(monkeypatch: pytest.MonkeyPatch | None = None) -> str:
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(1))
    m = RuntimeMetrics("beijing", "bj-0", 0, gpu=0 if monkeypatch else None)
    m.step.set(12)
    m.loss.set(2.5)
    m.sync_s.set(0.2)
    m.cross_wire.inc(1000)
    m.syncs.inc()
    m.link_bytes("frankfurt", 500)
    link = {"src": "frankfurt", "dst": "beijing", "bandwidth": 6e6, "rtt": 0.05, "samples": 3}
    m.links({"links": [link], "codecs": {"frankfurt": {"codec": "int8/zstd1"}}})
    m.checkpointed(0.02)
    m.privacy(1.5, 4.0)
    m.quorum(["beijing", "frankfurt"], ["silicon-valley"])
    m.heal()
    m.round_failed()
    m.tick()
    return generate_latest(m.registry).decode()


def _names() -> dict[str, str]:
    return {k: v for k, v in vars(mn).items() if k.isupper() and isinstance(v, str)}


def test_every_metric_name_is_exported_by_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    exported = {
        s.name
        for fam in text_string_to_metric_families(_exposition(monkeypatch))
        for s in fam.samples
    }
    missing = {k: v for k, v in _names().items() if v not in exported}
    assert not missing, missing


@pytest.mark.parametrize("stack", ["local", "global"])
def test_every_metric_name_appears_in_a_panel_or_an_alert(stack: str) -> None:
    plan = build_plan(load_stack(stack))
    dash = json.loads(render_dashboard(plan))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [r.expr for r in alert_rules(plan)]
    unused = {k: v for k, v in _names().items() if not any(v in e for e in exprs)}
    assert not unused, unused


@needs_promtool
def test_promtool_accepts_the_runtime_exposition() -> None:
    assert PROMTOOL
    r = _run(PROMTOOL, "check", "metrics", stdin=_exposition())
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


def test_top_shows_no_numbers_where_no_endpoint_answered_and_says_why(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from geotrain.cli import cli
    from geotrain.commands import free_port
    from geotrain.monitoring import targets

    doc = yaml.safe_load((STACKS / "Pulumi.local.yaml").read_text())
    doc["config"]["geotrain:monitoring"]["metrics_port"] = free_port()  # nothing listens
    f = tmp_path / "Pulumi.quiet.yaml"
    f.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(cli, ["top", "--stack", str(f), "--once"])
    assert r.exit_code == 1, r.output
    beijing = next(line for line in r.output.splitlines() if line.startswith("beijing"))
    assert beijing.split()[1:] == ["0/2", "-", "-", "-", "-", "-"]  # not step 0 at 0 tok/s
    assert "none of the 6 metrics endpoints answered" in r.output
    assert f"geotrain train --stack {f}" in r.output

    hosts = format_top({"beijing": RegionView(targets=8)}, "global", local=False)
    assert "once `pulumi up` has delivered" in hosts and "geotrain train" not in hosts

    doc["config"]["geotrain:monitoring"]["metrics_port"] = 0
    f.write_text(yaml.safe_dump(doc))
    assert targets(build_plan(load_stack(str(f)))) == []
    r = CliRunner().invoke(cli, ["top", "--stack", str(f), "--once"])
    assert r.exit_code == 1 and "monitoring.metrics_port 0" in r.output, r.output


# -- dashboard and Grafana ---------------------------------------------------------------
def test_dashboard_has_overview_region_link_and_health_rows() -> None:
    dash = json.loads(render_dashboard(build_plan(load_stack("global"))))
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == [
        "Overview (all regions)",
        "Region $region",
        "Links",
        "Health",
        "Privacy",
        "Quorum (fault tolerance)",
    ]
    assert rows[1]["repeat"] == "region"
    legends = {t["legendFormat"] for p in dash["panels"] for t in p.get("targets", [])}
    assert "{{region}} → {{peer_region}}" in legends
    titles = {p["title"] for p in dash["panels"]}
    assert {"Restarts (1h)", "Rejected payloads (1h)", "Syncs and merges per hour"} <= titles
    assert all(
        'job="dcgm-exporter"' in t["expr"]
        for p in dash["panels"]
        for t in p.get("targets", [])
        if mn.GPU_UTIL in t["expr"]
    )


def test_grafana_provisioning_points_at_the_stack_prometheus_and_dashboard_dir() -> None:
    plan = build_plan(load_stack("global"))
    ds = yaml.safe_load(render_grafana_datasource(plan))["datasources"][0]
    assert ds["url"] == f"http://{plan.monitoring_host.private_ip}:9090"
    provider = yaml.safe_load(render_grafana_dashboards(plan))["providers"][0]
    assert provider["options"]["path"] == GRAFANA_DASHBOARDS
    placed = {f.artifact: f.host_path for f in monitoring_files(plan)}
    dash_path = placed["monitoring/grafana/geotrain-dashboard.json"]
    assert dash_path is not None and dash_path.startswith(GRAFANA_DASHBOARDS + "/")
    assert placed[f"monitoring/{RULES_FILE}"] == f"/etc/prometheus/{RULES_FILE}"


# -- what each host installs -------------------------------------------------------------
def test_hosts_get_prometheus_alertmanager_grafana_and_exporters_by_role() -> None:
    plan = build_plan(load_stack("global"))
    mon = plan.monitoring_host
    units = {s.unit for s in host_services(plan, mon)}
    assert {
        "prometheus.service",
        "prometheus-alertmanager.service",
        "grafana-server.service",
        "prometheus-node-exporter.service",
        "nvidia-dcgm-exporter.service",
    } == units
    grafana = next(s for s in host_services(plan, mon) if s.unit == "grafana-server.service")
    assert grafana.repo is not None
    assert grafana.repo.sources_line() == (
        "deb [signed-by=/etc/apt/keyrings/grafana.gpg] https://apt.grafana.com stable main"
    )
    worker = plan.node("bj-3")
    assert {s.unit for s in host_services(plan, worker)} == {
        "prometheus-node-exporter.service",
        "nvidia-dcgm-exporter.service",
    }
    files = [f for f in monitoring_files(plan) if f.node == "bj-3"]
    dcgm = next(f for f in files if "dcgm" in f.artifact)
    assert f"-a {worker.private_ip}:9500" in dcgm.content
    local = build_plan(load_stack("local"))
    assert host_services(local, local.monitoring_host) == []


def test_runtime_gpu_metrics_need_no_dcgm_exporter() -> None:
    plan = _with_monitoring("global", gpu_metrics="runtime")
    jobs = {j["job_name"] for j in yaml.safe_load(render_prometheus(plan))["scrape_configs"]}
    assert "dcgm-exporter" not in jobs
    assert all("dcgm" not in s.unit for n in plan.nodes for s in host_services(plan, n))
    gpu = next(r for r in alert_rules(plan) if r.name == "GeotrainGpuUtilLow")
    assert 'job="geotrain-runtime"' in gpu.expr


# -- the run picture ---------------------------------------------------------------------
def test_sparkline_maps_lowest_to_highest_block_and_resamples() -> None:
    assert plot.sparkline([1, 2, 3, 4, 5, 6, 7, 8], 8) == "▁▂▃▄▅▆▇█"
    assert plot.sparkline([0, 10], 4) == "▁▁██"
    assert plot.sparkline([5, 5, 5], 3) == "▁▁▁"
    assert plot.sparkline([1, math.nan, 3], 3) == "▁ █"
    assert plot.sparkline([], 5) == ""
    assert len(plot.sparkline(list(range(100)), 10)) == 10


def _events(sync: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"event": "start", "params": 1000, "world": 4, "regions": 2}]
    for step in range(1, 21):
        merged = sync == "allreduce" or step % 5 == 0
        for i, region in enumerate(("beijing", "frankfurt")):
            out.append(
                {
                    "event": "step",
                    "region": region,
                    "rank": 2 * i,
                    "t": float(step),
                    "step": step,
                    "loss": 5.0 - 0.1 * step - i,
                    "cross_wire": 100.0 * (step if sync == "allreduce" else step // 5),
                    "cross_raw": 400.0 * (step if sync == "allreduce" else step // 5),
                    "sync_s": 0.2 if merged else 0.0,
                    "step_s": 1.0,
                    "merged": merged,
                }
            )
    return out


@pytest.mark.parametrize("sync", ["allreduce", "diloco"])
def test_run_plot_is_a_png_of_loss_bytes_and_time(tmp_path: Path, sync: str) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib missing (pip install 'geotrain[plot]')")
    out = plot.write_run_plot(_events(sync), tmp_path / "run.png")
    assert out == tmp_path / "run.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = plot._series(_events(sync))
    assert sorted(d["loss"]) == ["beijing", "frankfurt"]
    assert sum(d["wire"]) == 2 * 100 * (20 if sync == "allreduce" else 4)


def test_run_plot_without_matplotlib_returns_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    assert plot.write_run_plot(_events("allreduce"), tmp_path / "run.png") is None
    assert not plot.available()
    assert not (tmp_path / "run.png").exists()


@pytest.mark.parametrize(
    ("monitoring", "path", "error"),
    [
        (
            {"receivers": [{"name": "ops", "webhook_url": "https://"}]},
            "receivers[0].webhook_url",
            "a host",
        ),
        (
            {"receivers": [{"name": "ops", "webhook_url": "https://u:p@alerts.example.com/x"}]},
            "receivers[0].webhook_url",
            "carries credentials",
        ),
        (
            {**RECEIVERS, "receivers": [{"name": "ops", "email": "not an email"}]},
            "receivers[0].email",
            "is not an e-mail address",
        ),
        (
            {**RECEIVERS, "smtp": {"smarthost": "smtp.example.com", "sender": "a@b.c"}},
            "smtp.smarthost",
            "is not host:port",
        ),
        (
            {**RECEIVERS, "smtp": {"smarthost": "smtp.example.com:587", "sender": "geotrain"}},
            "smtp.sender",
            "is not an e-mail address",
        ),
    ],
)
def test_alert_destinations_alertmanager_would_refuse_are_rejected(
    monitoring: dict[str, Any], path: str, error: str
) -> None:
    with pytest.raises(ConfigError, match=error) as e:
        _with_monitoring("global", **{"smtp": None, **monitoring})
    assert f"geotrain:monitoring.{path}" in str(e.value)
