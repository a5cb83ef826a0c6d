"""Renderers for the training runtime: the launch spec and systemd units (Kubernetes
manifests: infra/render/k8s.py)."""

from __future__ import annotations

from infra.model.names import SERVICE_USER
from infra.model.paths import REMOTE_SPEC_PATH
from infra.plan import Adaptive, Plan, PlanNode, Privacy
from training.spec import (
    AdaptiveSpec,
    CheckpointSpec,
    CodecSpec,
    DilocoSpec,
    FaultToleranceSpec,
    LaunchSpec,
    NodeSpec,
    ParallelSpec,
    PrivacySpec,
    RegionSpec,
    ShardSpec,
)

REMOTE_VENV = "/opt/geotrain/.venv"
REMOTE_STATE_DIR = "/var/lib/geotrain"
"""The workers' working directory on hosts: relative paths of the spec resolve here."""
REMOTE_RUN_DIR = f"{REMOTE_STATE_DIR}/run"


def render_launch_spec(plan: Plan) -> LaunchSpec:
    t = plan.training
    regions = [
        RegionSpec(
            name=r.name,
            jurisdiction=r.jurisdiction,
            nodes=[
                NodeSpec(
                    name=n.name,
                    host=n.private_ip,
                    first_rank=n.first_rank,
                    nprocs=n.gpus,
                    device=n.device,
                    netns=n.netns,
                )
                for n in r.nodes
            ],
            shards=[
                ShardSpec(name=s.name, jurisdiction=s.jurisdiction, uri=s.uri, weight=s.weight)
                for s in t.data_shards
                if s.region == r.name
            ],
            privacy=_privacy(r.privacy),
        )
        for r in plan.regions
    ]
    c = t.compression
    mon = plan.monitoring
    return LaunchSpec(
        run_id=plan.run_id,
        stack=plan.stack,
        master_addr=plan.master_addr,
        master_port=plan.master_port,
        regions=regions,
        model=t.model,
        tokenizer=t.tokenizer,
        sync=t.sync,
        steps=t.steps,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        lr=t.lr,
        seed=t.seed,
        bucket_mb=t.bucket_mb,
        balance=t.balance,
        balance_steps=t.balance_steps,
        exchange=t.exchange,
        exchange_replan=t.exchange_replan,
        codec=CodecSpec(
            quantize=c.quantize,
            block_size=c.block_size,
            error_feedback=c.error_feedback,
            zstd_level=c.zstd_level,
            cipher=c.cipher,
            secure_aggregation=c.secure_aggregation,
            adaptive=_adaptive(c.adaptive),
        ),
        diloco=DilocoSpec(
            every_steps=t.diloco.every_steps,
            every_steps_start=t.diloco.inner_steps_start,
            every_steps_start_for=t.diloco.inner_steps_start_for,
            interval_minutes=t.diloco.interval_minutes,
            outer_lr=t.diloco.outer_lr,
            outer_momentum=t.diloco.outer_momentum,
            warmup_steps=t.diloco.warmup_steps,
            fragments=t.diloco.fragments,
            tau=t.diloco.tau,
            mix=t.diloco.mix,
            drift_correction=t.diloco.drift_correction,
        ),
        checkpoint=CheckpointSpec(
            dir=plan.path(t.checkpoint.dir),
            interval_steps=t.checkpoint.interval_steps,
            interval_minutes=t.checkpoint.interval_minutes,
            keep=t.checkpoint.keep,
        ),
        parallel=ParallelSpec(
            shard=t.parallel.shard,
            param_dtype=t.parallel.param_dtype,
            activation_checkpointing=t.parallel.activation_checkpointing,
            autocast=t.parallel.autocast,
        ),
        key_file=plan.path(t.key_file),
        metrics_port=mon.metrics_port,
        metrics_bind="private" if mon.bind_address == "private" else mon.bind_address,
        max_restarts=t.max_restarts,
        fault_tolerance=_fault_tolerance(plan),
    )


def _fault_tolerance(plan: Plan) -> FaultToleranceSpec | None:
    """The Lighthouse advertised on its node's private address (never a hostname)."""
    ft = plan.training.fault_tolerance
    if ft is None or plan.lighthouse is None:
        return None
    host = plan.lighthouse.private_ip
    return FaultToleranceSpec(
        lighthouse=f"{host}:{ft.port}",
        min_replicas=ft.replicas(len(plan.regions)),
        store_port=ft.store_port,
        join_timeout_s=ft.join_timeout_s,
        heartbeat_timeout_s=ft.heartbeat_timeout_s,
        timeout_s=ft.timeout_s,
        quorum_timeout_s=ft.quorum_timeout_s,
    )


def _adaptive(a: Adaptive | None) -> AdaptiveSpec | None:
    if a is None:
        return None
    return AdaptiveSpec(
        quantize=tuple(a.quantize),
        zstd_levels=tuple(a.zstd_levels),
        budget_seconds=a.budget_seconds,
        budget_fraction=a.budget_fraction,
        margin=a.margin,
        patience=a.patience,
    )


def _privacy(p: Privacy | None) -> PrivacySpec | None:
    if p is None:
        return None
    return PrivacySpec(p.target_epsilon, p.delta, p.max_grad_norm, p.noise_multiplier)


def render_worker_unit(plan: Plan, node: PlanNode) -> str:
    """systemd unit that runs one node's workers (hosts the agent deploys to).

    `geotrain launch` runs the node's torchrun, which restarts its worker group
    (max_restarts), so systemd restarts only a launcher that was killed (on-abnormal), at most
    max_restarts + 1 times an hour; exit 2 (bad input) is never restarted. The start-limit
    keys belong to [Unit] (systemd ignores them in [Service]). Relative paths of the spec
    (checkpoints, key) resolve against WorkingDirectory."""
    restarts = plan.training.max_restarts
    after = ["network-online.target", "geotrain-firewall.service"]
    if node.is_gateway:  # other regions are reachable once tunnels and BGP are up
        after += ["frr.service"] + [
            f"wg-quick@{t.side(node.region).ifname}.service" for t in plan.tunnels_of(node.region)
        ]
    return (
        "[Unit]\n"
        f"Description=geotrain workers of {node.name} ({node.region}, run {plan.run_id})\n"
        "Wants=network-online.target\n"
        f"After={' '.join(after)}\n"
        "StartLimitIntervalSec=3600\n"
        f"StartLimitBurst={restarts + 1}\n"
        "\n[Service]\n"
        "Type=simple\n"
        f"User={SERVICE_USER}\n"
        f"Group={SERVICE_USER}\n"
        f"WorkingDirectory={REMOTE_STATE_DIR}\n"
        "Environment=PYTHONUNBUFFERED=1\n"
        f"ExecStart={REMOTE_VENV}/bin/geotrain launch --spec {REMOTE_SPEC_PATH} "
        f"--node {node.name} --run-dir {REMOTE_RUN_DIR}\n"
        "Restart=on-abnormal\n"
        "RestartSec=10\n"
        "RestartPreventExitStatus=2\n"
        "LimitNOFILE=1048576\n"
        "\n[Install]\n"
        "WantedBy=multi-user.target\n"
    )
