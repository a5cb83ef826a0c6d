"""Monitoring from the plan: Prometheus config, alert rules and their promtool tests,
Alertmanager config, Grafana provisioning and dashboard, and where each file goes on its
host. Pure: no I/O; the host agent installs what `monitoring_files` lists.

Alert windows follow the plan's sync cadence (see `alert_windows`): a diloco run that
merges every 30 minutes is healthy 29 minutes after a merge, so "no sync in 10 minutes"
must not page anyone.
"""

from __future__ import annotations

import bisect
import json
import math
import weakref
from dataclasses import dataclass
from typing import Any

import yaml

from infra.plan import Plan, PlanNode
from training.observe import metric_names as mn
from training.spec import metrics_port

RULES_FILE = "rules/geotrain.rules.yml"
"""Relative to prometheus.yml (Prometheus resolves rule_files against the config's dir)."""
RULES_TEST_FILE = "rules/geotrain.rules.test.yml"
RUNTIME_JOB = "geotrain-runtime"
DCGM_JOB = "dcgm-exporter"
DATASOURCE_UID = "geotrain-prometheus"
PROMETHEUS_DIR = "/etc/prometheus"
SECRETS_DIR = "/etc/prometheus/secrets"
GRAFANA_SECRETS_DIR = "/etc/grafana/secrets"
GRAFANA_DASHBOARDS = "/var/lib/grafana/dashboards/geotrain"
DCGM_COUNTERS = "/etc/dcgm-exporter/default-counters.csv"
"""Shipped by NVIDIA's datacenter-gpu-manager-exporter package."""

CONTROL_EVERY_STEPS = 10
"""training.loop.CONTROL_EVERY: time-based merges are agreed on every 10 steps (and applied
CONTROL_LATE = 2 control steps after they are seen)."""
STALL_FLOOR_S = 600
"""Shortest sync-stall threshold: 10 min rides out a slow step, a checkpoint fence and a
restarted rank's first steps."""
THROUGHPUT_FLOOR = 0.1
"""Throughput "collapsed" = below 10% of its own recent average."""
EXCLUDED = (
    f"max by (region) (label_replace({mn.QUORUM_EXCLUDED}, "
    '"region", "$1", "excluded_region", "(.+)"))'
)
"""1 for a region some rank's quorum leaves out, labelled with that region (not the
reporting rank's): GeotrainRegionDown of the same region then inhibits its alert."""
HEALS_PER_HOUR = 4
"""Heals of one region in an hour that alert: one per rejoin is normal, this many is a
region that keeps falling out of the quorum."""


# -- cadence and windows ---------------------------------------------------------------
@dataclass(frozen=True)
class AlertWindows:
    """Alert thresholds derived from the plan's sync and checkpoint cadence."""

    every_steps: int | None
    """Steps between syncs (allreduce: 1; diloco: H); None when merges are time-based."""
    every_s: int | None
    """Seconds between merges for time-based diloco (T x 60); None when step-based."""
    sync_stall_s: int
    """Time-based: seconds without a sync before the alert. Step-based: the floor."""
    throughput_baseline_s: int
    """Window of the per-sync throughput average that the last sync is compared with."""
    checkpoint_stale_s: int
    """Checkpoint age that alerts: two checkpoint intervals."""

    def stall_threshold(self) -> str:
        """PromQL for the seconds after which a region's silence is a stall."""
        if self.every_s is not None:
            return str(self.sync_stall_s)
        # 2 x H steps at the region's current step time, never under the floor; before the
        # first step there is no step time yet: the floor alone (0 x ... keeps the labels)
        step_s = f"max by (region) ({mn.STEP_SECONDS})"
        last = f"max by (region) ({mn.LAST_SYNC})"
        return f"clamp_min((2 * {self.every_steps} * {step_s}) or (0 * {last}), {STALL_FLOOR_S})"


def alert_windows(plan: Plan) -> AlertWindows:
    t = plan.training
    ckpt_s = int(t.checkpoint.interval_minutes * 60)
    every_steps = 1 if t.sync == "allreduce" else t.diloco.every_steps
    if every_steps is not None:
        # Step-based: the merge interval in seconds is H x step time, which only the run
        # knows, so the threshold is computed in PromQL from the exported step time.
        return AlertWindows(every_steps, None, STALL_FLOOR_S, 3600, 2 * ckpt_s)
    every_s = int((t.diloco.interval_minutes or 0) * 60)
    # A merge is due T after the last one, is noticed at the next control step (every 10
    # steps), applied two control steps later (training.loop.CONTROL_LATE), and then takes
    # one merge: gaps are T + a few minutes. Margin: half of T, at
    # least the floor. T = 30 min: 1800 + max(900, 600) = 2700 s (45 min).
    stall = every_s + max(every_s // 2, STALL_FLOOR_S)
    # Compare the last merge with the average of the last 6 merges (at least an hour):
    # T = 30 min -> 3 h.
    return AlertWindows(None, every_s, stall, max(3600, 6 * every_s), 2 * ckpt_s)


# -- alert rules -----------------------------------------------------------------------
@dataclass(frozen=True)
class AlertRule:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    """Annotation text; templates use only {{ $labels.region }} / {{ $labels.node }}."""
    probe: str
    """The alert's inner selector: returns data on any live run (the live scrape test)."""
    needs_gpu: bool = False
    """The probe has data only where GPUs are."""
    runbook: str = ""
    """Runbook annotation: what it means, where to look, the fix (no templates)."""


def gpu_selector(plan: Plan) -> str:
    """GPU series from exactly one source, so no device is counted twice."""
    mon = plan.monitoring
    return f'{{job="{DCGM_JOB if mon.gpu_metrics == "dcgm-exporter" else RUNTIME_JOB}"}}'


def alert_rules(plan: Plan) -> list[AlertRule]:
    w = alert_windows(plan)
    up = f'sum by (region) (up{{job="{RUNTIME_JOB}"}})'
    since = f"time() - max by (region) ({mn.LAST_SYNC})"
    tp = f"avg by (region) ({mn.SYNC_THROUGHPUT})"
    base = f"avg by (region) (avg_over_time({mn.SYNC_THROUGHPUT}[{w.throughput_baseline_s}s]))"
    age = f"max by (region) ({mn.CHECKPOINT_AGE})"
    gpu = f"avg by (region) ({mn.GPU_UTIL}{gpu_selector(plan)})"
    cadence = f"every {w.every_s // 60} min" if w.every_s else f"every {w.every_steps} step(s)"
    return [
        AlertRule(
            "GeotrainRegionDown",
            f"{up} == 0",
            "2m",
            "critical",
            "Every runtime target of region {{ $labels.region }} is down.",
            up,
        ),
        AlertRule(
            "GeotrainSyncStalled",
            f"{since} > {w.stall_threshold()}",
            "5m",
            "critical",
            "Region {{ $labels.region }} has finished no cross-region sync for longer than "
            f"its cadence ({cadence}) allows.",
            since,
        ),
        AlertRule(
            "GeotrainCheckpointStale",
            f"{age} > {w.checkpoint_stale_s}",
            "5m",
            "warning",
            "Newest checkpoint in {{ $labels.region }} is older than two intervals "
            f"({w.checkpoint_stale_s}s).",
            age,
        ),
        AlertRule(
            "GeotrainGpuUtilLow",
            f"{gpu} < 20",
            "15m",
            "warning",
            "GPU utilisation in {{ $labels.region }} is below 20% for 15 minutes.",
            gpu,
            needs_gpu=True,
        ),
        AlertRule(
            "GeotrainCrossRegionThroughputCollapsed",
            f"{tp} < {THROUGHPUT_FLOOR} * {base}",
            "10m",
            "warning",
            "Cross-region bytes per second of sync in {{ $labels.region }} fell below "
            f"{THROUGHPUT_FLOOR:.0%} of its average over {w.throughput_baseline_s // 60} min.",
            tp,
        ),
        AlertRule(
            "GeotrainLossNaN",
            f"{mn.LOSS} != {mn.LOSS}",
            "0m",
            "critical",
            "Loss is NaN on {{ $labels.node }} ({{ $labels.region }}).",
            mn.LOSS,
        ),
        # a rejecting rank exits (a transient reject restarts it with the count restored
        # from the event log; a hostile one stops the job after one more scrape), so any
        # increase at all is the signal
        AlertRule(
            "GeotrainPayloadsRejected",
            f"sum by (region) (increase({mn.REJECTED}[10m])) > 0",
            "0m",
            "critical",
            "Region {{ $labels.region }} refused cross-region payloads or control messages "
            "(tampered, replayed or corrupted traffic); see the rejected events in the run's "
            "event log.",
            f"sum by (region) ({mn.REJECTED})",
        ),
        *quorum_rules(plan),
    ]


def quorum_rules(plan: Plan) -> list[AlertRule]:
    """fault_tolerance runs only (the series exist only there): a region left out of the
    quorum, a quorum with no region to spare, a region that keeps healing."""
    ft = plan.training.fault_tolerance
    if ft is None:
        return []
    R = len(plan.regions)
    # the quorum can hold min_replicas regions at the least; with min_replicas = R it never
    # shrinks (a lost region stops every region), so R - 1 never matches
    floor = min(ft.replicas(R), R - 1)
    size = f"min by (region) ({mn.QUORUM_REGIONS})"
    out = EXCLUDED
    heals = f"sum by (region) (increase({mn.HEALS}[1h]))"
    return [
        AlertRule(
            "GeotrainRegionOutOfQuorum",
            f"{out} == 1",
            "15m",
            "warning",
            "Region {{ $labels.region }} has been left out of the training quorum for 15 "
            "minutes: the others train on without its data.",
            out,
            runbook=RUNBOOK_OUT_OF_QUORUM,
        ),
        AlertRule(
            "GeotrainQuorumAtMinimum",
            f"{size} <= {floor}",
            "5m",
            "critical",
            "The training quorum seen from {{ $labels.region }} holds "
            f"{floor} of {R} regions (min_replicas {ft.replicas(R)}): one more region lost "
            "and every region stops.",
            size,
            runbook=RUNBOOK_AT_MINIMUM,
        ),
        AlertRule(
            "GeotrainRegionHealingRepeatedly",
            f"{heals} >= {HEALS_PER_HOUR}",
            "0m",
            "warning",
            "Region {{ $labels.region }} healed from a live peer "
            f"{HEALS_PER_HOUR} or more times in an hour.",
            heals,
            runbook=RUNBOOK_HEALING,
        ),
    ]


RUNBOOK_OUT_OF_QUORUM = (
    "What: the Lighthouse forms every quorum without this region; the others train on and "
    "it contributes nothing. Where: the `quorum` events of the run (excluded), `geotrain "
    "top`, the region's worker logs (QuorumLost, exit 3, restarts). Fix: when its workers "
    "are down, GeotrainRegionDown fires too; when they run, check its links (`wg show`, "
    "`vtysh -c 'show bfd peers'` on its gateway) and that its nodes reach the Lighthouse "
    "(geotrain:training.fault_tolerance.lighthouse). It heals and rejoins by itself once it "
    "reaches a quorum; after max_restarts QuorumLost exits its launcher gives up: start "
    "`geotrain launch` on its nodes again."
)
RUNBOOK_AT_MINIMUM = (
    "What: the quorum has no region to spare; one more lost and every region stops with "
    "QuorumLost (exit 3) and restarts from its checkpoints. Where: GeotrainRegionOutOfQuorum "
    "names the regions out, the `quorum` events list the members. Fix: bring the regions "
    "out back (their workers, links, the path to the Lighthouse); until then make sure "
    "GeotrainCheckpointStale is silent, checkpoints are the fallback."
)
RUNBOOK_HEALING = (
    "What: the region keeps falling behind and copying the whole state from a peer over "
    "the WAN (one heal per rejoin is normal). Where: the `healed` and `quorum` events (the "
    "members alternate between rounds). Fix: when the quorums alternate, raise "
    "geotrain:training.fault_tolerance.join_timeout_s above a round plus a heal (torchft "
    "forms the next quorum without a region that lags longer); otherwise a flapping link "
    "(BFD on its gateway) or workers that keep restarting (the restarts panel)."
)


def render_alert_rules(plan: Plan) -> str:
    rules = [
        {
            "alert": r.name,
            "expr": r.expr,
            "for": r.for_,
            "labels": {"severity": r.severity},
            "annotations": _annotations(r),
        }
        for r in alert_rules(plan)
    ]
    doc = {"groups": [{"name": "geotrain", "rules": rules}]}
    return f"# geotrain {plan.stack}: rendered, do not edit\n" + yaml.safe_dump(
        doc,
        sort_keys=False,
        width=1 << 20,  # one line per expression
    )


def _annotations(r: AlertRule) -> dict[str, str]:
    return {"summary": r.summary, **({"runbook": r.runbook} if r.runbook else {})}


# -- Prometheus ------------------------------------------------------------------------
def render_prometheus(plan: Plan) -> str:
    mon = plan.monitoring
    runtime, node_exp, dcgm = [], [], []
    for n in plan.nodes:
        host = n.private_ip  # overlay/private address (loopback locally)
        labels = {"region": n.region, "node": n.name}
        shared = n.kind == "local"  # every local node is this machine: offset by rank
        ports = [metrics_port(mon.metrics_port, n.first_rank, i, shared) for i in range(n.gpus)]
        runtime.append({"targets": [f"{host}:{p}" for p in ports], "labels": labels})
        if n.kind != "local":  # local runs expose only the runtime; no exporters to assume
            node_exp.append({"targets": [f"{host}:{mon.node_exporter_port}"], "labels": labels})
            if n.device == "cuda" and mon.gpu_metrics == "dcgm-exporter":
                dcgm.append({"targets": [f"{host}:{mon.dcgm_exporter_port}"], "labels": labels})
    mon_ip = plan.monitoring_host.private_ip
    jobs: list[dict[str, Any]] = [
        {"job_name": RUNTIME_JOB, "static_configs": runtime},
        {"job_name": "prometheus", "static_configs": [{"targets": [_addr(plan, "prometheus")]}]},
    ]
    if node_exp:
        jobs.append({"job_name": "node-exporter", "static_configs": node_exp})
    if dcgm:
        jobs.append({"job_name": DCGM_JOB, "static_configs": dcgm})
    interval = f"{mon.scrape_interval_s}s"
    doc = {
        "global": {
            "scrape_interval": interval,
            "evaluation_interval": interval,
            "external_labels": {"stack": plan.stack, "run_id": plan.run_id},
        },
        "alerting": {
            "alertmanagers": [
                {"static_configs": [{"targets": [f"{mon_ip}:{mon.alertmanager_port}"]}]}
            ]
        },
        "rule_files": [RULES_FILE],
        "scrape_configs": jobs,
    }
    return f"# geotrain {plan.stack}: rendered, do not edit\n" + yaml.safe_dump(
        doc, sort_keys=False
    )


def _addr(plan: Plan, service: str) -> str:
    mon = plan.monitoring
    port = {
        "prometheus": mon.prometheus_port,
        "alertmanager": mon.alertmanager_port,
        "grafana": mon.grafana_port,
    }[service]
    return f"{plan.monitoring_host.private_ip}:{port}"


# -- Alertmanager ----------------------------------------------------------------------
@dataclass(frozen=True)
class SecretFile:
    """A secret the host agent writes from Pulumi config; rendered files only name it."""

    config_key: str
    """Secret Pulumi config key (`pulumi config set --secret KEY`)."""
    path: str
    """File on the monitoring host."""
    owner: str
    """user:group that must read it (mode 0640, root-owned directory)."""


def secret_files(plan: Plan) -> list[SecretFile]:
    mon = plan.monitoring
    out = [
        SecretFile(
            mon.grafana_admin_password_config,
            f"{GRAFANA_SECRETS_DIR}/admin-password",
            "root:grafana",
        )
    ]
    for r in mon.receivers:
        if r.webhook_token_config:
            path = f"{SECRETS_DIR}/{r.name}-webhook-token"
            out.append(SecretFile(r.webhook_token_config, path, "root:prometheus"))
        if r.slack_url_config:
            path = f"{SECRETS_DIR}/{r.name}-slack-url"
            out.append(SecretFile(r.slack_url_config, path, "root:prometheus"))
    if mon.smtp is not None and mon.smtp.username:
        path = f"{SECRETS_DIR}/smtp-password"
        out.append(SecretFile(mon.smtp.password_config, path, "root:prometheus"))
    return out


def render_alertmanager(plan: Plan) -> str:
    """Routes by severity to the stack's receivers; secrets only as *_file paths. With no
    receivers the root route ends in `null` (alerts stay visible in Alertmanager's UI)."""
    mon = plan.monitoring
    routes = [
        {
            "receiver": r.name,
            "matchers": [f'severity="{sev}"'],
            "continue": True,  # every receiver of a severity gets it
            "repeat_interval": "1h" if sev == "critical" else "4h",
        }
        for r in mon.receivers
        for sev in r.severities
    ]
    doc: dict[str, Any] = {}
    if mon.smtp is not None:
        doc["global"] = _smtp(plan)
    doc["route"] = {
        "receiver": "null",
        "group_by": ["alertname", "region"],
        "group_wait": "30s",
        "group_interval": "5m",
        "repeat_interval": "4h",
        "routes": routes,
    }
    doc["receivers"] = [{"name": "null"}, *(_receiver(r) for r in mon.receivers)]
    doc["inhibit_rules"] = [
        {  # a region that is down also stalls, ages and idles: page once, for the cause
            "source_matchers": ['alertname="GeotrainRegionDown"'],
            "target_matchers": ['alertname!="GeotrainRegionDown"'],
            "equal": ["region"],
        }
    ]
    return f"# geotrain {plan.stack}: rendered, do not edit\n" + yaml.safe_dump(
        doc, sort_keys=False
    )


def _smtp(plan: Plan) -> dict[str, Any]:
    smtp = plan.monitoring.smtp
    assert smtp is not None  # callers check
    out: dict[str, Any] = {
        "smtp_smarthost": smtp.smarthost,
        "smtp_from": smtp.sender,
        "smtp_require_tls": smtp.require_tls,
    }
    if smtp.username:
        out["smtp_auth_username"] = smtp.username
        out["smtp_auth_password_file"] = f"{SECRETS_DIR}/smtp-password"
    return out


def _receiver(r: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": r.name}
    if r.webhook_url:
        hook: dict[str, Any] = {"url": r.webhook_url, "send_resolved": True}
        if r.webhook_token_config:
            token = f"{SECRETS_DIR}/{r.name}-webhook-token"
            hook["http_config"] = {"authorization": {"type": "Bearer", "credentials_file": token}}
        out["webhook_configs"] = [hook]
    if r.slack_url_config:
        out["slack_configs"] = [
            {"api_url_file": f"{SECRETS_DIR}/{r.name}-slack-url", "send_resolved": True}
        ]
    if r.email:
        out["email_configs"] = [{"to": r.email, "send_resolved": True}]
    return out


# -- Grafana ---------------------------------------------------------------------------
def render_grafana_datasource(plan: Plan) -> str:
    mon = plan.monitoring
    doc = {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "geotrain Prometheus",
                "uid": DATASOURCE_UID,
                "type": "prometheus",
                "access": "proxy",
                "url": f"http://{_addr(plan, 'prometheus')}",
                "isDefault": True,
                "editable": False,
                "jsonData": {"timeInterval": f"{mon.scrape_interval_s}s"},
            }
        ],
    }
    return yaml.safe_dump(doc, sort_keys=False)


def render_grafana_dashboards(plan: Plan) -> str:
    """The provider that loads the dashboard JSON from GRAFANA_DASHBOARDS."""
    doc = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "geotrain",
                "folder": "geotrain",
                "type": "file",
                "disableDeletion": True,
                "allowUiUpdates": False,  # the rendered JSON is the source of truth
                "options": {"path": GRAFANA_DASHBOARDS},
            }
        ],
    }
    return yaml.safe_dump(doc, sort_keys=False)


def render_grafana_unit(plan: Plan) -> str:
    """systemd drop-in for grafana-server: listen address, port and the admin password
    file (Grafana reads GF_<SECTION>_<KEY>__FILE; it applies on the first start only)."""
    mon = plan.monitoring
    return (
        "# geotrain: rendered, do not edit\n[Service]\n"
        f"Environment=GF_SERVER_HTTP_ADDR={plan.monitoring_host.private_ip}\n"
        f"Environment=GF_SERVER_HTTP_PORT={mon.grafana_port}\n"
        f"Environment=GF_SECURITY_ADMIN_PASSWORD__FILE={GRAFANA_SECRETS_DIR}/admin-password\n"
        "Environment=GF_ANALYTICS_REPORTING_ENABLED=false\n"
    )


# (title, [(expr, legend)], unit): the overview, all regions side by side
OVERVIEW: tuple[tuple[str, list[tuple[str, str]], str], ...] = (
    ("Loss", [(f"avg by (region) ({mn.LOSS})", "{{region}}")], "none"),
    ("Step", [(f"max by (region) ({mn.STEP})", "{{region}}")], "none"),
    ("Tokens/s", [(f"sum by (region) ({mn.TOKENS_PER_SECOND})", "{{region}}")], "none"),
    (
        "Step and sync time",
        [
            (f"avg by (region) ({mn.STEP_SECONDS})", "{{region}} step"),
            (f"avg by (region) ({mn.SYNC_SECONDS})", "{{region}} sync"),
        ],
        "s",
    ),
    ("Since last sync", [(f"time() - max by (region) ({mn.LAST_SYNC})", "{{region}}")], "s"),
    (
        "Syncs and merges per hour",
        [
            (f"avg by (region) (increase({mn.SYNCS}[1h]))", "{{region}} syncs"),
            (f"avg by (region) (increase({mn.MERGES}[1h]))", "{{region}} merges"),
        ],
        "none",
    ),
)
LINKS: tuple[tuple[str, list[tuple[str, str]], str], ...] = (
    (
        "Wire bytes per link",
        [
            (
                f"sum by (region, peer_region) (rate({mn.LINK_BYTES}[5m]))",
                "{{region}} → {{peer_region}}",
            )
        ],
        "Bps",
    ),
    (
        "Cross-region bytes: wire vs fp32",
        [
            (f"sum by (region) (rate({mn.CROSS_WIRE_BYTES}[5m]))", "{{region}} wire"),
            (f"sum by (region) (rate({mn.CROSS_RAW_BYTES}[5m]))", "{{region}} fp32"),
        ],
        "Bps",
    ),
    (
        "Sync throughput (bytes per second of sync)",
        [(f"avg by (region) ({mn.SYNC_THROUGHPUT})", "{{region}}")],
        "Bps",
    ),
    (
        "Compression ratio (fp32 / wire)",
        [(f"avg by (region) ({mn.COMPRESSION_RATIO})", "{{region}}")],
        "none",
    ),
    (
        "Link bandwidth (measured per rank)",
        [
            (
                f"sum by (region, src_region, dst_region) ({mn.LINK_BANDWIDTH})",
                "{{region}}: {{src_region}} → {{dst_region}}",
            )
        ],
        "Bps",
    ),
    (
        "Link RTT (probe)",
        [
            (
                f"max by (region, src_region, dst_region) ({mn.LINK_RTT})",
                "{{region}}: {{src_region}} → {{dst_region}}",
            )
        ],
        "s",
    ),
    (
        "Adaptive codec (bytes per value)",
        [
            (
                f"max by (region, src_region, dst_region) ({mn.LINK_CODEC_BYTES})",
                "{{region}}: {{src_region}} → {{dst_region}}",
            )
        ],
        "none",
    ),
)
HEALTH: tuple[tuple[str, list[tuple[str, str]], str], ...] = (
    ("Targets up", [(f'sum by (region) (up{{job="{RUNTIME_JOB}"}})', "{{region}}")], "none"),
    ("Restarts (1h)", [(f"sum by (region) (increase({mn.RESTARTS}[1h]))", "{{region}}")], "none"),
    (
        "Rejected payloads (1h)",
        [(f"sum by (region) (increase({mn.REJECTED}[1h]))", "{{region}}")],
        "none",
    ),
    (
        "Checkpoint age and save time",
        [
            (f"max by (region) ({mn.CHECKPOINT_AGE})", "{{region}} age"),
            (f"max by (region) ({mn.CHECKPOINT_SECONDS})", "{{region}} save"),
        ],
        "s",
    ),
    (
        "Firing alerts",
        [('sum by (alertname, region) (ALERTS{alertstate="firing"})', "{{alertname}} {{region}}")],
        "none",
    ),
)
PRIVACY_PANELS: tuple[tuple[str, list[tuple[str, str]], str], ...] = (
    (
        "Epsilon spent per region (DP-SGD)",
        [
            (f"max by (region) ({mn.PRIVACY_EPSILON})", "{{region}} spent"),
            (f"max by (region) ({mn.PRIVACY_EPSILON_TARGET})", "{{region}} target"),
        ],
        "none",
    ),
)
"""The epsilon-spent panel (regions without DP have no series, so no line)."""
QUORUM_PANELS: tuple[tuple[str, list[tuple[str, str]], str], ...] = (
    (
        "Quorum size and regions left out",
        [
            (f"min by (region) ({mn.QUORUM_REGIONS})", "{{region}} sees"),
            (f"{EXCLUDED} == 1", "{{region}} left out"),
        ],
        "none",
    ),
    (
        "Heals and failed rounds (1h)",
        [
            (f"sum by (region) (increase({mn.HEALS}[1h]))", "{{region}} heals"),
            (f"sum by (region) (increase({mn.QUORUM_FAILED_ROUNDS}[1h]))", "{{region}} failed"),
        ],
        "none",
    ),
)
"""fault_tolerance (runs without it have no series, so no line)."""


def _region_panels(plan: Plan) -> tuple[tuple[str, list[tuple[str, str]], str], ...]:
    """One region in detail, per node, rank and GPU (the row repeats per region)."""
    sel = '{region="$region"}'
    gpu = gpu_selector(plan)[:-1] + ',region="$region"}'
    rt = f'{{job="{RUNTIME_JOB}",region="$region"}}'
    return (
        ("Loss per rank", [(f"{mn.LOSS}{sel}", "{{node}}/{{rank}}")], "none"),
        ("Step time per rank", [(f"{mn.STEP_SECONDS}{sel}", "{{node}}/{{rank}}")], "s"),
        ("GPU utilisation", [(f"{mn.GPU_UTIL}{gpu}", "{{node}} gpu{{gpu}}")], "percent"),
        ("GPU memory used", [(f"{mn.GPU_MEM_USED}{gpu}", "{{node}} gpu{{gpu}}")], "decmbytes"),
        (
            "Process CPU and memory",
            [
                (f"sum by (node) (rate({mn.PROCESS_CPU}{rt}[5m]))", "{{node}} cores"),
                (f"sum by (node) ({mn.PROCESS_RSS}{rt}) / 2^30", "{{node}} GiB"),
            ],
            "none",
        ),
        (
            "Intra-region bytes",
            [(f"sum by (node) (rate({mn.INTRA_BYTES}{sel}[5m]))", "{{node}}")],
            "Bps",
        ),
    )


def render_dashboard(plan: Plan) -> str:
    rows = [
        ("Overview (all regions)", OVERVIEW, None),
        ("Region $region", _region_panels(plan), "region"),
        ("Links", LINKS, None),
        ("Health", HEALTH, None),
    ]
    if PRIVACY_PANELS:
        rows.append(("Privacy", PRIVACY_PANELS, None))
    rows.append(("Quorum (fault tolerance)", QUORUM_PANELS, None))
    panels: list[dict[str, Any]] = []
    y = 0
    for title, specs, repeat in rows:
        row: dict[str, Any] = {
            "id": len(panels) + 1,
            "type": "row",
            "title": title,
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            "panels": [],
        }
        if repeat:
            row["repeat"] = repeat
        panels.append(row)
        y += 1
        for i, spec in enumerate(specs):
            panels.append(_panel(len(panels) + 1, spec, x=12 * (i % 2), y=y + 8 * (i // 2)))
        y += 8 * math.ceil(len(specs) / 2)
    dash = {
        "title": f"geotrain {plan.stack}",
        "uid": f"geotrain-{plan.stack}"[:40],
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "tags": ["geotrain"],
        "templating": {"list": _variables()},
        "panels": panels,
    }
    return json.dumps(dash, indent=2, ensure_ascii=False) + "\n"


def _panel(
    pid: int, spec: tuple[str, list[tuple[str, str]], str], x: int, y: int
) -> dict[str, Any]:
    title, exprs, unit = spec
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"expr": e, "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (e, legend) in enumerate(exprs)
        ],
    }


def _variables() -> list[dict[str, Any]]:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    return [
        {
            "name": "datasource",
            "type": "datasource",
            "query": "prometheus",
            "current": {"text": "geotrain Prometheus", "value": DATASOURCE_UID},
        },
        {
            "name": "region",
            "type": "query",
            "datasource": ds,
            "query": f'label_values(up{{job="{RUNTIME_JOB}"}}, region)',
            "refresh": 2,
            "multi": True,
            "includeAll": True,
        },
    ]


# -- files per host --------------------------------------------------------------------
@dataclass(frozen=True)
class MonitoringFile:
    artifact: str
    """Path under `geotrain render --out DIR`."""
    content: str
    node: str
    """Host that receives it."""
    host_path: str | None
    """Where the host agent installs it (None: CI only, e.g. the rule tests)."""
    unit: str | None
    """systemd unit to restart (or reload) when the file changes."""
    owner: str = "root:root"
    """Owner of the installed file (mode 0644)."""


_RENDERED: tuple[weakref.ref[Plan], list[MonitoringFile]] | None = None
"""The last plan's files: every host's bundle asks for them (48 hosts: 48 renders of the
same promtool tests, 40 s, before this). Plans are frozen, so the same object, same files."""


def monitoring_files(plan: Plan) -> list[MonitoringFile]:
    """Every monitoring file with its host and place. Node-exporter and dcgm-exporter
    settings go to ssh nodes only (local and lab run no exporters)."""
    global _RENDERED
    if _RENDERED is not None and _RENDERED[0]() is plan:
        return list(_RENDERED[1])
    files = _monitoring_files(plan)
    _RENDERED = (weakref.ref(plan), files)
    return list(files)


def _monitoring_files(plan: Plan) -> list[MonitoringFile]:
    mon_node = plan.monitoring_host.name
    mon = plan.monitoring
    prom, am, graf = "prometheus.service", "prometheus-alertmanager.service", "grafana-server"
    g = "monitoring/grafana"
    out = [
        MonitoringFile(
            "monitoring/prometheus.yml",
            render_prometheus(plan),
            mon_node,
            f"{PROMETHEUS_DIR}/prometheus.yml",
            prom,
        ),
        MonitoringFile(
            f"monitoring/{RULES_FILE}",
            render_alert_rules(plan),
            mon_node,
            f"{PROMETHEUS_DIR}/{RULES_FILE}",
            prom,
        ),
        MonitoringFile(
            f"monitoring/{RULES_TEST_FILE}", render_alert_tests(plan), mon_node, None, None
        ),
        MonitoringFile(
            "monitoring/default/prometheus",
            _default_args(f"--web.listen-address={_addr(plan, 'prometheus')}"),
            mon_node,
            "/etc/default/prometheus",
            prom,
        ),
        MonitoringFile(
            "monitoring/alertmanager.yml",
            render_alertmanager(plan),
            mon_node,
            f"{PROMETHEUS_DIR}/alertmanager.yml",
            am,
        ),
        MonitoringFile(
            "monitoring/default/prometheus-alertmanager",
            # one Alertmanager: no gossip cluster port (9094) open on the overlay
            _default_args(
                f"--web.listen-address={_addr(plan, 'alertmanager')} --cluster.listen-address="
            ),
            mon_node,
            "/etc/default/prometheus-alertmanager",
            am,
        ),
        MonitoringFile(
            f"{g}/geotrain-dashboard.json",
            render_dashboard(plan),
            mon_node,
            f"{GRAFANA_DASHBOARDS}/geotrain.json",
            None,  # the file provider rescans; no restart
        ),
        MonitoringFile(
            f"{g}/provisioning/datasources/geotrain.yaml",
            render_grafana_datasource(plan),
            mon_node,
            "/etc/grafana/provisioning/datasources/geotrain.yaml",
            graf + ".service",
            "root:grafana",
        ),
        MonitoringFile(
            f"{g}/provisioning/dashboards/geotrain.yaml",
            render_grafana_dashboards(plan),
            mon_node,
            "/etc/grafana/provisioning/dashboards/geotrain.yaml",
            graf + ".service",
            "root:grafana",
        ),
        MonitoringFile(
            f"{g}/{graf}.service.d/geotrain.conf",
            render_grafana_unit(plan),
            mon_node,
            f"/etc/systemd/system/{graf}.service.d/geotrain.conf",
            graf + ".service",
        ),
    ]
    for n in plan.nodes:
        if n.kind == "ssh":
            out += _exporter_files(plan, n, mon.gpu_metrics == "dcgm-exporter")
    return out


def _exporter_files(plan: Plan, n: PlanNode, dcgm: bool) -> list[MonitoringFile]:
    mon = plan.monitoring
    out = [
        MonitoringFile(
            f"nodes/{n.name}/default/prometheus-node-exporter",
            _default_args(f"--web.listen-address={n.private_ip}:{mon.node_exporter_port}"),
            n.name,
            "/etc/default/prometheus-node-exporter",
            "prometheus-node-exporter.service",
        )
    ]
    if dcgm and n.device == "cuda":
        unit = "nvidia-dcgm-exporter.service"
        out.append(
            MonitoringFile(
                f"nodes/{n.name}/systemd/{unit}.d/geotrain.conf",
                # the packaged unit listens on :9400, the runtime's first metrics port
                "# geotrain: rendered, do not edit\n[Service]\nExecStart=\n"
                f"ExecStart=/usr/bin/dcgm-exporter -f {DCGM_COUNTERS} "
                f"-a {n.private_ip}:{mon.dcgm_exporter_port}\n",
                n.name,
                f"/etc/systemd/system/{unit}.d/geotrain.conf",
                unit,
            )
        )
    return out


def _default_args(args: str) -> str:
    """/etc/default/<service> of Debian's Prometheus packages: the unit runs `$ARGS`."""
    return f'# geotrain: rendered, do not edit\nARGS="{args}"\n'


# -- promtool rule tests ---------------------------------------------------------------
# A simulated run at one-minute resolution, per region: every series the rules read, at
# the plan's cadence. The healthy run must raise nothing at any minute; each fault (in the
# first region only) must raise exactly its alert, for exactly that region, on time.


@dataclass(frozen=True)
class _Run:
    """Shape of a simulated healthy run."""

    minutes: int
    step_s: float
    """Seconds per step (also the exported step time)."""
    syncs: tuple[float, ...]
    """Times (s) at which a sync finishes."""
    merge_s: float
    """Seconds a diloco merge keeps the GPU idle (0 for allreduce)."""
    ckpt_s: int
    """Seconds between checkpoints (the plan's upper bound)."""


def _simulated_run(plan: Plan) -> _Run:
    w = alert_windows(plan)
    ckpt_s = w.checkpoint_stale_s // 2
    if w.every_s is not None:
        # a merge is due T after the last, is seen at the next control step and applied
        # two control steps later (up to 3 x 10 x 5 s), then runs 3 minutes: T + 330 s
        step_s, merge_s = 5.0, 180.0
        gap = w.every_s + 3 * CONTROL_EVERY_STEPS * step_s + merge_s
    elif w.every_steps == 1:
        step_s, merge_s = 30.0, 0.0
        gap = step_s
    else:
        step_s, merge_s = 1200.0 / (w.every_steps or 1), 180.0  # merges ~20 min apart
        gap = (w.every_steps or 1) * step_s
    minutes = max(240, (w.throughput_baseline_s + 4 * int(gap) + 3600) // 60)
    syncs, t, k = [], 0.0, 0
    while t <= minutes * 60:
        t += gap * (1 + 0.1 * ((k % 3) - 1)) if merge_s else gap  # diloco: +-10% jitter
        syncs.append(t)
        k += 1
    return _Run(minutes, step_s, tuple(syncs), merge_s, ckpt_s)


@dataclass(frozen=True)
class _Fault:
    alert: str
    at: int
    """Minute the fault starts."""


def _region_series(plan: Plan, region: str, run: _Run, fault: _Fault | None) -> list[Any]:
    """(series selector, values) of one region's node, rank 0."""
    node = plan.region(region).nodes[0].name
    lab = f'job="{RUNTIME_JOB}",region="{region}",node="{node}",rank="0"'
    gpu_job = DCGM_JOB if plan.monitoring.gpu_metrics == "dcgm-exporter" else RUNTIME_JOB
    gpu_lab = f'job="{gpu_job}",region="{region}",node="{node}",gpu="0"'
    f = fault.alert if fault else ""
    at = fault.at * 60 if fault else math.inf
    cols: dict[str, list[float | None]] = {
        k: [] for k in ("up", "last", "tp", "age", "gpu", "loss", "rejected")
    }
    last_ckpt = 0.0
    stop = at if f == "GeotrainSyncStalled" else math.inf
    for m in range(run.minutes + 1):
        t = m * 60.0
        done = bisect.bisect_right(run.syncs, min(t, stop))  # syncs finished by t
        last = run.syncs[done - 1] if done else 0.0  # 0: process start
        cols["up"].append(0 if f == "GeotrainRegionDown" and t >= at else 1)
        cols["last"].append(last)
        slow = f == "GeotrainCrossRegionThroughputCollapsed" and done and last >= at
        noise = 1 + 0.1 * ((done % 3) - 1)
        cols["tp"].append((5e6 if slow else 1e8 * noise) if done else None)
        if t - last_ckpt >= run.ckpt_s and not (f == "GeotrainCheckpointStale" and t >= at):
            last_ckpt = t
        cols["age"].append(t - last_ckpt)
        nxt = bisect.bisect_left(run.syncs, t)  # the next merge to finish, at or after t
        merging = run.merge_s > 0 and nxt < len(run.syncs) and run.syncs[nxt] - run.merge_s <= t
        low = (f == "GeotrainGpuUtilLow" and t >= at) or merging
        cols["gpu"].append(5.0 if low else 85.0)
        cols["loss"].append(math.nan if f == "GeotrainLossNaN" and t >= at else 3.0 - t / 1e5)
        cols["rejected"].append(1 if f == "GeotrainPayloadsRejected" and t >= at else 0)
    return [
        (f"up{{{lab}}}", cols["up"]),
        (f"{mn.LAST_SYNC}{{{lab}}}", cols["last"]),
        (f"{mn.STEP_SECONDS}{{{lab}}}", [run.step_s] * (run.minutes + 1)),
        (f"{mn.SYNC_THROUGHPUT}{{{lab}}}", cols["tp"]),
        (f"{mn.CHECKPOINT_AGE}{{{lab}}}", cols["age"]),
        (f"{mn.GPU_UTIL}{{{gpu_lab}}}", cols["gpu"]),
        (f"{mn.LOSS}{{{lab}}}", cols["loss"]),
        (f"{mn.REJECTED}{{{lab}}}", cols["rejected"]),
        *_quorum_series(plan, region, lab, run, fault),
    ]


def _quorum_series(plan: Plan, region: str, lab: str, run: _Run, fault: _Fault | None) -> list[Any]:
    """fault_tolerance: every region in the quorum, no heal. The faults: the first region
    left out (the others report it), this region's quorum at the floor, a heal every 5
    minutes."""
    if plan.training.fault_tolerance is None:
        return []
    R = len(plan.regions)
    f, at = (fault.alert, fault.at) if fault else ("", run.minutes + 1)
    ms = range(run.minutes + 1)
    floor = min(plan.training.fault_tolerance.replicas(R), R - 1)
    size = [floor if f == "GeotrainQuorumAtMinimum" and m >= at else R for m in ms]
    heal = f == "GeotrainRegionHealingRepeatedly"
    heals = [(m - at) // 5 + 1 if heal and m >= at else 0 for m in ms]
    rows: list[Any] = [(f"{mn.QUORUM_REGIONS}{{{lab}}}", size), (f"{mn.HEALS}{{{lab}}}", heals)]
    for other in plan.regions:
        first = plan.regions[0].name
        out = f == "GeotrainRegionOutOfQuorum" and other.name == first != region
        sel = f'{mn.QUORUM_EXCLUDED}{{{lab},excluded_region="{other.name}"}}'
        rows.append((sel, [int(out and m >= at) for m in ms]))
    return rows


def _values(vals: list[float | None]) -> str:
    """promtool's expanded notation: one value per interval, `_` for no sample."""

    def one(v: float | None) -> str:
        if v is None:
            return "_"
        if math.isnan(v):
            return "NaN"
        return str(int(v)) if float(v).is_integer() else repr(float(v))

    return " ".join(one(v) for v in vals)


def _fire_window(plan: Plan, rule: AlertRule, run: _Run, at: int) -> tuple[int, int]:
    """(last minute still silent, first minute surely firing) for a fault at minute `at`."""
    w = alert_windows(plan)
    for_m = int(rule.for_.removesuffix("m"))
    # conditions are strict (>): the first minute past the threshold
    if rule.name == "GeotrainSyncStalled":
        last = max(s for s in run.syncs if s <= at * 60)
        steps = w.every_steps or 0
        stall = w.sync_stall_s if w.every_s else max(STALL_FLOOR_S, 2 * steps * run.step_s)
        start = math.floor((last + stall) / 60) + 1
    elif rule.name == "GeotrainCheckpointStale":
        last = ((at * 60 - 1) // run.ckpt_s) * run.ckpt_s  # the save due at `at` is missed
        start = math.floor((last + w.checkpoint_stale_s) / 60) + 1
    elif rule.name == "GeotrainCrossRegionThroughputCollapsed":
        start = math.ceil(min(s for s in run.syncs if s >= at * 60) / 60)
    elif rule.name == "GeotrainRegionHealingRepeatedly":
        start = at + 5 * (HEALS_PER_HOUR - 1)  # the heal that makes HEALS_PER_HOUR
    else:
        start = at
    return start - 1, start + for_m + 2


def _expected(plan: Plan, rule: AlertRule, region: str) -> list[dict[str, Any]]:
    labels = {"severity": rule.severity, "region": region}
    if rule.name == "GeotrainLossNaN":  # not aggregated: every label of the series
        node = plan.region(region).nodes[0].name
        labels.update({"job": RUNTIME_JOB, "node": node, "rank": "0"})
    summary = rule.summary.replace("{{ $labels.region }}", region)
    summary = summary.replace("{{ $labels.node }}", labels.get("node", ""))
    return [{"exp_labels": labels, "exp_annotations": {**_annotations(rule), "summary": summary}}]


def render_alert_tests(plan: Plan) -> str:
    """`promtool test rules` file for the rendered rules: a healthy run at the plan's
    cadence raises nothing; each fault raises its alert, for its region, on time."""
    rules = alert_rules(plan)
    run = _simulated_run(plan)
    regions = [r.name for r in plan.regions]

    def case(fault: _Fault | None, checks: list[dict[str, Any]]) -> dict[str, Any]:
        series = []
        for r in regions:
            # a region left out is reported by the others
            others = fault is not None and fault.alert == "GeotrainRegionOutOfQuorum"
            own = fault if r == regions[0] or others else None
            series += [
                {"series": s, "values": _values(v)} for s, v in _region_series(plan, r, run, own)
            ]
        return {"interval": "1m", "input_series": series, "alert_rule_test": checks}

    healthy = [
        {"eval_time": f"{m}m", "alertname": r.name, "exp_alerts": []}
        for m in range(5, run.minutes + 1, 5)
        for r in rules
    ]
    tests = [case(None, healthy)]
    at = max(30, 3 * (alert_windows(plan).every_s or 0) // 60)
    for r in rules:
        silent, fired = _fire_window(plan, r, run, at)
        tests.append(
            case(
                _Fault(r.name, at),
                [
                    {"eval_time": f"{silent}m", "alertname": r.name, "exp_alerts": []},
                    {
                        "eval_time": f"{fired}m",
                        "alertname": r.name,
                        "exp_alerts": _expected(plan, r, regions[0]),
                    },
                ],
            )
        )
    doc = {
        "rule_files": [RULES_FILE.rsplit("/", 1)[-1]],  # next to this file
        "evaluation_interval": "1m",
        "tests": tests,
    }
    return f"# geotrain {plan.stack}: rendered, do not edit; `promtool test rules`\n" + (
        yaml.safe_dump(doc, sort_keys=False, width=1 << 20)
    )
