"""The worker's loop when regions are torchft replica groups (training.ft.quorum): the same
steps as training.loop, with every cross-region round run through the quorum, each
region its own c10d world, and its own checkpoints."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training import gradsync as gs
from training import loop as lp
from training import resume as st
from training.comm.session import Control, agree, wait_for_all
from training.comm.topology import Groups, Topology
from training.ft.quorum import MERGE, STEP, Quorum, region_checkpointer, region_world, validate
from training.job import Job
from training.models.build import lm_loss, precision, to_device
from training.observe.metrics import RuntimeMetrics
from training.setup import RENDEZVOUS_TIMEOUT_S, preflight
from training.spec import LaunchSpec, metrics_endpoint
from training.sync.buckets import GradBuffer, buckets, flat_grads, put
from training.sync.codec import Codec
from training.sync.diloco import DiLoCo
from training.sync.hier import HierarchicalAllReduce
from training.workload import loader_for, model_for


def setup(
    spec: LaunchSpec, node_name: str, local_rank: int, events: Path | None, run_dir: Path | None
) -> tuple[Job, Quorum]:
    validate(spec)
    rank, key, text = preflight(spec, node_name, local_rank)
    region, node = spec.node(node_name)
    topo = Topology.of(spec, rank)
    wait = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    world = region_world(spec, topo, node.host, wait)
    wait_for_all(world.store, topo.local_size, wait)
    device = torch.device("cpu")
    groups = Groups(intra=dist.group.WORLD, cross=None, device=device)
    ckpt = region_checkpointer(spec, topo, node.name, key, run_dir)
    session = agree(key, spec.run_id, ckpt.stored_epoch)  # the region's: checkpoints, flags
    ckpt.start(session)
    # seeded; a region that joins late heals the live weights from a peer (training.ft.heal)
    model, tokenizer = model_for(spec)
    # the region-only sync: holds the run's counters and the checkpointed residuals;
    # the quorum's syncs (training.ft.quorum) do the exchanges
    sync = HierarchicalAllReduce(topo, groups, Codec(spec.codec, key, session), spec.run_id)
    job = Job(
        spec=spec,
        topo=topo,
        groups=groups,
        model=model,
        opt=torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01),
        loader=loader_for(spec, region, text, rank, tokenizer),
        sync=sync,
        ckpt=ckpt,
        metrics=RuntimeMetrics(region.name, node.name, rank),
        events=events,
        node=node.name,
        control=Control(key, session, "steps"),
        grads=GradBuffer.of(model),
    )
    ckpt.on_commit = lambda step: job.emit("committed", node=node.name, step=step)
    if spec.sync == "diloco":
        job.diloco = DiLoCo(buckets(list(model.parameters()), spec.bucket_mb), spec.diloco, sync)
    st.prime(job)
    job.metrics.serve(*metrics_endpoint(spec, node, local_rank))
    q = Quorum(
        spec,
        topo,
        key,
        node.host,
        (world.addr, world.port),
        dist.group.WORLD,
        device,
        sync.stats,
        state=lambda: heal_state(job),
        load=lambda s: load_heal(job, s),
    )
    q.on_quorum = lambda q, healers: quorum_changed(job, q, healers)
    return job, q


# -- heal state -------------------------------------------------------------------------
def heal_state(job: Job) -> dict[str, Any]:
    """What a healer takes from this rank: weights, inner optimizer, DiLoCo's global
    weights and outer optimizer (with scaffold: c and the round's steps), counters.
    Per-rank and per-region state (data position, RNG, residuals, scaffold's c_i) stays:
    it belongs to the donor's region."""
    d = job.diloco
    return {
        "model": job.model.state_dict(),
        "optim": job.opt.state_dict(),
        "global": d.state_dict() if d is not None else {},
        "counters": {"step": job.step, "tokens": job.tokens, "merges": st.merges(job)},
    }


def load_heal(job: Job, state: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    job.model.load_state_dict(state["model"])
    job.opt.load_state_dict(state["optim"])
    if job.diloco is not None:
        job.diloco.load_state_dict(state["global"])
        job.diloco.restart_drift()  # no round of its own yet: no correction until it has one
        job.diloco.merges = int(state["counters"]["merges"])
    c = state["counters"]
    job.step, job.tokens = int(c["step"]), int(c["tokens"])
    job.metrics.heal()
    job.emit("healed", step=job.step, phase=state["phase"], load_s=time.perf_counter() - t0)


def quorum_changed(job: Job, q: Quorum, healers: int) -> None:
    names = job.topo.region_names
    excluded = [names[i] for i in range(job.topo.regions) if i not in q.members]
    job.metrics.quorum([names[i] for i in q.members], excluded)
    if job.leader:
        job.emit(
            "quorum",
            quorum_id=q.pg.quorum_id,
            step=job.step,
            members=[names[i] for i in q.members],
            excluded=excluded,
            healers=healers,
            contributors=q.contributors,
        )


def failed(job: Job, why: str) -> None:
    job.metrics.round_failed()
    if job.leader:
        job.emit("round_failed", step=job.step, reason=why)


# -- steps ------------------------------------------------------------------------------
def all_reduce_grads(job: Job, q: Quorum) -> None:
    """allreduce mode and DiLoCo's warm-up: every bucket through the quorum's sync; the
    gradients are replaced only once the round commits (a failed round runs again)."""
    groups = buckets(list(job.model.parameters()), job.spec.bucket_mb)
    flats = [flat_grads(p, job.grads) for p in groups]

    def exchange(sync: HierarchicalAllReduce) -> list[torch.Tensor]:
        return sync.all_reduce_many(flats, job.step, list(range(len(flats))))

    synced = q.round(exchange, lambda why: failed(job, why))
    for params, avg in zip(groups, synced, strict=True):
        put(params, avg, job.grads)


def merge(job: Job, q: Quorum) -> None:
    """A DiLoCo merge among the quorum. A region healed into this merge holds the donor's
    inner weights: it sends a zero pseudo-gradient, and the average counts only the
    regions that contribute."""
    d = job.diloco
    assert d is not None
    q.begin(MERGE)
    healed = q.healed_phase == MERGE
    if healed:
        with torch.no_grad():
            for p, g in zip(d.params, d.global_params, strict=True):
                p.copy_(g)

    def run(sync: HierarchicalAllReduce) -> None:
        d.sync = sync
        d.merge(job.step)

    q.round(run, lambda why: failed(job, why))
    if healed:  # its zero pseudo-gradient says nothing of its shard: c_i <- c
        d.restart_drift()
    job.metrics.merges.inc()


def train_step(job: Job, q: Quorum) -> None:
    t0 = time.perf_counter()
    before = lp.sync_clock(job) + _open(q)
    d = job.diloco
    crossing = d is None or d.warming(job.step)
    if crossing:
        q.begin(STEP)  # before the forward pass: a healer takes a donor's state here
    if q.healed_phase == MERGE:  # healed into a merge: the donors' step is done
        finish(job, q, float("nan"), t0, before, merge_due=True, compute=0.0)
        return
    tokens = to_device(job.loader.next(), job.groups.device)
    gs.zero_grads(job)
    c0 = time.perf_counter()  # compute: forward, backward, optimizer (utilisation)
    with precision(job.groups.device, job.spec.parallel.autocast):
        loss = lm_loss(job.model, tokens)
    loss.backward()
    compute = time.perf_counter() - c0
    lp.staged(job)
    if crossing:
        all_reduce_grads(job, q)
    else:
        gs.region_average_grads(job)
    c0 = time.perf_counter()
    job.opt.step()
    compute += time.perf_counter() - c0
    if d is not None:
        d.step_done(job.step)
    job.tokens += tokens.numel() - tokens.shape[0]
    finish(job, q, loss.item(), t0, before, merge_due=False, compute=compute)


def finish(
    job: Job, q: Quorum, loss: float, t0: float, before: float, merge_due: bool, compute: float
) -> None:
    merge_due, ckpt_due = lp.due(job) if not merge_due else (True, _ckpt_due(job))
    if merge_due:
        merge(job, q)
    job.step += 1
    if ckpt_due:
        job.ckpt.save(job.step, st.state_dict(job))
        job.last_save = time.monotonic()
    q.flush()
    sync_s = lp.sync_clock(job) - before
    lp.report(job, loss, time.perf_counter() - t0, sync_s, merge_due, compute)


def _ckpt_due(job: Job) -> bool:
    s = job.step + 1
    return s % job.spec.checkpoint.interval_steps == 0 and s != job.spec.steps


def _open(q: Quorum) -> float:
    return q.sync.stats.sync_seconds if q.sync is not None else 0.0


def run(
    spec: LaunchSpec, node: str, local_rank: int, events: Path | None, run_dir: Path | None
) -> None:
    job, q = setup(spec, node, local_rank, events, run_dir)
    job.emit(
        "start",
        pid=os.getpid(),
        node=node,
        params=sum(p.numel() for p in job.model.parameters()),
        world=spec.world_size,
        regions=len(spec.regions),
        sync=spec.sync,
        warmup=spec.diloco.warmup_steps if spec.sync == "diloco" else 0,
        exchange=spec.exchange,
        ft=True,  # sessions are per quorum (training.ft.quorum), not per start
        **json.loads(os.environ.get("GEOTRAIN_TORCHRUN", "{}")),
    )
    try:
        resumed = st.resume(job)
        if resumed is not None:
            job.emit("resume", step=resumed)
        q.manager.load_state_dict({"step": rounds(job), "batches_committed": 0})
        q.begin(STEP)  # join: a region behind the others heals from one of them here
        while job.step < spec.steps:
            train_step(job, q)
        lp.settle(job)
        lp.staged(job)
        job.ckpt.wait()
        # the first region leader to finish: region 0 may be stopped for finishing too
        # late (training.launch.launcher), and a later one must not replace the run's weights
        if run_dir is not None and job.leader and st.first_to_finish(run_dir):
            st.save_final(job, run_dir)
        if job.leader:
            job.emit("done", step=job.step, digest=lp.params_digest(job.model), heals=q.heals)
    finally:
        q.shutdown()
    dist.barrier()
    dist.destroy_process_group()


def rounds(job: Job) -> int:
    """Cross-region rounds committed so far: torchft's step, which decides who heals."""
    d = job.diloco
    if d is None:
        return job.step
    return min(job.step, d.spec.warmup_steps) + d.merges
