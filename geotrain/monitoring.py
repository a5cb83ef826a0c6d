"""Monitoring for single-machine runs: a real Prometheus (and Alertmanager, when installed)
on the rendered config (local: this machine; lab: inside the monitoring host's namespace),
and `geotrain top`'s reader."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from infra.plan import Plan
from infra.render import render_alert_rules, render_alertmanager, render_prometheus
from infra.render.monitoring import RULES_FILE
from training.observe import metric_names as mn
from training.observe.metric_names import QUORUM_EXCLUDED, QUORUM_REGIONS
from training.spec import metrics_port

INSTALL_HINT = (
    "Prometheus is not installed; `apt-get install prometheus` (Debian/Ubuntu) "
    "or see https://prometheus.io/download/ - training runs without it"
)


@dataclass
class PrometheusProcess:
    proc: subprocess.Popen[bytes]
    url: str
    alertmanager: subprocess.Popen[bytes] | None = None
    """Alertmanager on the rendered config, when it is installed (alerts in its UI)."""
    alertmanager_url: str | None = None

    def stop(self) -> None:
        for p in (self.proc, self.alertmanager):
            if p is None:
                continue
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def start_prometheus(
    plan: Plan, run_dir: Path, port: int | None = None
) -> PrometheusProcess | None:
    """Start Prometheus on the stack's rendered config, or None (with the reason printed
    by the caller) when the binary is missing."""
    binary = shutil.which("prometheus")
    if binary is None or not plan.monitoring.enabled:
        return None
    mon = plan.monitoring
    host = plan.monitoring_host.private_ip
    port = port or mon.prometheus_port
    conf_dir = run_dir / "prometheus"
    (conf_dir / "rules").mkdir(parents=True, exist_ok=True)
    doc = yaml.safe_load(render_prometheus(plan))
    for job in doc["scrape_configs"]:
        if job["job_name"] == "prometheus":
            job["static_configs"] = [{"targets": [f"{host}:{port}"]}]
    doc["global"]["scrape_interval"] = doc["global"]["evaluation_interval"] = "2s"  # short runs
    (conf_dir / "prometheus.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (conf_dir / RULES_FILE).write_text(render_alert_rules(plan))
    cmd = [
        binary,
        f"--config.file={conf_dir / 'prometheus.yml'}",
        f"--storage.tsdb.path={conf_dir / 'data'}",
        f"--web.listen-address={host}:{port}",
    ]
    proc = _spawn(plan, cmd, conf_dir / "prometheus.log")
    am = _start_alertmanager(plan, conf_dir)
    am_url = f"http://{host}:{mon.alertmanager_port}" if am else None
    return PrometheusProcess(proc, f"http://{host}:{port}", am, am_url)


def _start_alertmanager(plan: Plan, conf_dir: Path) -> subprocess.Popen[bytes] | None:
    """Debian names the binary prometheus-alertmanager, upstream alertmanager."""
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        return None
    (conf_dir / "alertmanager.yml").write_text(render_alertmanager(plan))
    addr = f"{plan.monitoring_host.private_ip}:{plan.monitoring.alertmanager_port}"
    cmd = [
        binary,
        f"--config.file={conf_dir / 'alertmanager.yml'}",
        f"--storage.path={conf_dir / 'alertmanager'}",
        f"--web.listen-address={addr}",
        "--cluster.listen-address=",  # one instance: no gossip port
    ]
    return _spawn(plan, cmd, conf_dir / "alertmanager.log")


def _spawn(plan: Plan, cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    netns = plan.monitoring_host.netns
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    log = open(log_path, "ab")  # noqa: SIM115 (owned by the process)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


@dataclass
class RegionView:
    step: float = 0.0
    loss: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    sync_s: list[float] = field(default_factory=list)
    ckpt_age: float | None = None
    targets: int = 0
    up: int = 0
    quorum: float | None = None
    """Regions in the smallest quorum a rank of the region reports (fault_tolerance)."""
    excluded: set[str] = field(default_factory=set)
    """Regions a rank's current quorum leaves out."""


def targets(plan: Plan) -> list[tuple[str, str]]:
    """(region, url) of every runtime metrics endpoint."""
    base = plan.monitoring.metrics_port
    out: list[tuple[str, str]] = []
    if base == 0:  # metrics off: no endpoint (training.spec.metrics_port)
        return out
    for n in plan.nodes:
        for i in range(n.gpus):
            port = metrics_port(base, n.first_rank, i, n.kind == "local")
            out.append((n.region, f"http://{n.private_ip}:{port}/metrics"))
    return out


def scrape(plan: Plan, timeout: float = 1.0) -> dict[str, RegionView]:
    views: dict[str, RegionView] = {r.name: RegionView() for r in plan.regions}
    for region, url in targets(plan):
        v = views[region]
        v.targets += 1
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        v.up += 1
        _fold(v, text)
    return views


def _fold(v: RegionView, text: str) -> None:
    values: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            values[s.name] = s.value
    v.step = max(v.step, values.get(mn.STEP, 0.0))
    if mn.LOSS in values:
        v.loss.append(values[mn.LOSS])
    v.tokens_per_s += values.get(mn.TOKENS_PER_SECOND, 0.0)
    if mn.SYNC_SECONDS in values:
        v.sync_s.append(values[mn.SYNC_SECONDS])
    if values.get(mn.CHECKPOINT_AGE):
        v.ckpt_age = max(v.ckpt_age or 0.0, values[mn.CHECKPOINT_AGE])
    _fold_quorum(v, text)


def _fold_quorum(v: RegionView, text: str) -> None:
    """fault_tolerance series (training.observe.metric_names.QUORUM_*): quorum size and
    excluded regions."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == QUORUM_REGIONS:
                v.quorum = s.value if v.quorum is None else min(v.quorum, s.value)
            elif s.name == QUORUM_EXCLUDED and s.value == 1:
                v.excluded.add(s.labels["excluded_region"])


def format_top(views: dict[str, RegionView], stack: str = "<stack>", local: bool = True) -> str:
    ft = any(v.quorum is not None for v in views.values())
    rows = [
        f"{'region':<16}{'up':>6}{'step':>8}{'loss':>9}{'tok/s':>10}{'sync s':>9}{'ckpt age':>10}"
        + (f"{'quorum':>8}" if ft else "")
    ]
    for name, v in views.items():
        loss = f"{sum(v.loss) / len(v.loss):.3f}" if v.loss else "-"
        sync = f"{sum(v.sync_s) / len(v.sync_s):.3f}" if v.sync_s else "-"
        age = f"{v.ckpt_age:.0f}s" if v.ckpt_age is not None else "-"
        quorum = "" if not ft else f"{v.quorum:>8.0f}" if v.quorum is not None else f"{'-':>8}"
        # no endpoint answered: nothing is known, not step 0 at 0 tokens/s
        step = f"{v.step:.0f}" if v.up else "-"
        rate = f"{v.tokens_per_s:.0f}" if v.up else "-"
        rows.append(
            f"{name:<16}{f'{v.up}/{v.targets}':>6}{step:>8}{loss:>9}"
            f"{rate:>10}{sync:>9}{age:>10}{quorum}"
        )
    out = set().union(*(v.excluded for v in views.values())) if views else set()
    if out:
        rows.append(f"left out of the training quorum: {', '.join(sorted(out))}")
    if not any(v.up for v in views.values()):
        rows.append(silent(views, stack, local))
    return "\n".join(rows)


def silent(views: dict[str, RegionView], stack: str, local: bool) -> str:
    """What `geotrain top` says when no metrics endpoint answered."""
    if not any(v.targets for v in views.values()):
        return (
            "no metrics endpoints: the stack sets monitoring.metrics_port 0 "
            "(set a port, for example 9400, to watch a run)"
        )
    n = sum(v.targets for v in views.values())
    start = (
        f"start one with `geotrain train --stack {stack}`"
        if local
        else "its hosts start it once `pulumi up` has delivered the stack"
    )
    return (
        f"none of the {n} metrics endpoints answered: no run of this stack is training now "
        f"({start}), or they are not reachable from here"
    )


def query(url: str, promql: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Instant query against a Prometheus server."""
    import json
    import urllib.parse

    q = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=timeout) as resp:
        body = json.loads(resp.read())
    return list(body["data"]["result"])


def wait_ready(url: str, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    return False
