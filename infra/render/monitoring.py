"""Prometheus config, alert rules and the Grafana dashboard, from the plan."""

from __future__ import annotations

import json
from typing import Any

import yaml

from infra.plan import Plan
from training import metric_names as mn
from training.spec import metrics_port

RULES_FILE = "rules/geotrain.rules.yml"


def render_prometheus(plan: Plan) -> str:
    mon = plan.model.monitoring
    runtime, node_exp, dcgm = [], [], []
    for n in plan.nodes:
        host = n.private_ip  # overlay/private address (loopback locally)
        labels = {"region": n.region, "node": n.name}
        shared = n.kind == "local"  # every local node is this machine: offset by rank
        ports = [metrics_port(mon.metrics_port, n.first_rank, i, shared) for i in range(n.gpus)]
        runtime.append({"targets": [f"{host}:{p}" for p in ports], "labels": labels})
        if n.kind != "local":  # local runs expose only the runtime; no exporters to assume
            node_exp.append({"targets": [f"{host}:{mon.node_exporter_port}"], "labels": labels})
            if n.device == "cuda":
                dcgm.append({"targets": [f"{host}:{mon.dcgm_exporter_port}"], "labels": labels})
    interval = f"{mon.scrape_interval_s}s"
    jobs: list[dict[str, Any]] = [
        {"job_name": "geotrain-runtime", "static_configs": runtime},
        {
            "job_name": "prometheus",
            "static_configs": [
                {"targets": [f"{plan.monitoring_host.private_ip}:{mon.prometheus_port}"]}
            ],
        },
    ]
    if node_exp:
        jobs.append({"job_name": "node-exporter", "static_configs": node_exp})
    if dcgm:
        jobs.append({"job_name": "dcgm-exporter", "static_configs": dcgm})
    doc = {
        "global": {
            "scrape_interval": interval,
            "evaluation_interval": interval,
            "external_labels": {"stack": plan.stack, "run_id": plan.run_id},
        },
        "rule_files": [RULES_FILE],
        "scrape_configs": jobs,
    }
    return f"# geotrain {plan.stack}: rendered, do not edit\n" + yaml.safe_dump(
        doc, sort_keys=False
    )


def render_alert_rules(plan: Plan) -> str:
    ckpt_s = int(plan.model.training.checkpoint.interval_minutes * 60)
    rules = [
        _alert(
            "GeotrainRegionDown",
            'sum by (region) (up{job="geotrain-runtime"}) == 0',
            "2m",
            "critical",
            "Every runtime target of region {{ $labels.region }} is down.",
        ),
        _alert(
            "GeotrainSyncStalled",
            f"sum by (region) (increase({mn.SYNCS}[10m])) == 0 and on (region) "
            f'sum by (region) (up{{job="geotrain-runtime"}}) > 0',
            "5m",
            "critical",
            "Region {{ $labels.region }} is up but has finished no sync for 10 minutes.",
        ),
        _alert(
            "GeotrainCheckpointStale",
            f"max by (region) ({mn.CHECKPOINT_AGE}) > {2 * ckpt_s}",
            "1m",
            "warning",
            f"Newest checkpoint in {{{{ $labels.region }}}} is older than two intervals "
            f"({2 * ckpt_s}s).",
        ),
        _alert(
            "GeotrainGpuUtilLow",
            f"avg by (region) ({mn.GPU_UTIL}) < 20",
            "15m",
            "warning",
            "GPU utilisation in {{ $labels.region }} is below 20% for 15 minutes.",
        ),
        _alert(
            "GeotrainCrossRegionThroughputCollapsed",
            f"sum by (region) (rate({mn.CROSS_WIRE_BYTES}[5m])) < 0.1 * "
            f"sum by (region) (rate({mn.CROSS_WIRE_BYTES}[1h] offset 5m))",
            "10m",
            "warning",
            "Cross-region bytes of {{ $labels.region }} fell below 10% of the last hour's.",
        ),
        _alert(
            "GeotrainLossNaN",
            f"{mn.LOSS} != {mn.LOSS}",
            "0m",
            "critical",
            "Loss is NaN on {{ $labels.node }} ({{ $labels.region }}).",
        ),
    ]
    doc = {"groups": [{"name": "geotrain", "rules": rules}]}
    return yaml.safe_dump(doc, sort_keys=False)


def _alert(name: str, expr: str, for_: str, severity: str, summary: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary},
    }


PANELS = (
    ("GPU utilisation %", f"avg by (region) ({mn.GPU_UTIL})"),
    ("GPU memory used MiB", f"sum by (region) ({mn.GPU_MEM_USED})"),
    ("Process CPU (cores)", f"sum by (region) (rate({mn.PROCESS_CPU}[1m]))"),
    ("Cross-region wire MB/s", f"sum by (region) (rate({mn.CROSS_WIRE_BYTES}[1m])) / 1e6"),
    ("Loss", f"avg by (region) ({mn.LOSS})"),
    ("Sync time s", f"avg by (region) ({mn.SYNC_SECONDS})"),
    ("Tokens/s", f"sum by (region) ({mn.TOKENS_PER_SECOND})"),
    ("Checkpoint age s", f"max by (region) ({mn.CHECKPOINT_AGE})"),
)


def render_dashboard(plan: Plan) -> str:
    panels = []
    for i, (title, expr) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "targets": [{"expr": expr, "legendFormat": "{{region}}", "refId": "A"}],
            }
        )
    dash = {
        "title": f"geotrain {plan.stack}",
        "uid": f"geotrain-{plan.stack}"[:40],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["geotrain"],
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]
        },
        "panels": panels,
    }
    return json.dumps(dash, indent=2) + "\n"
