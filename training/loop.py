"""The training loop of one rank: steps, the agreed merge and checkpoint triggers, metrics
and step events, and the run from setup to the final weights."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.audit import hooks as ledger_hooks
from training.errors import (
    PayloadRejected,
)
from training.gradsync import merge, region_average_grads, sync_grads, zero_grads
from training.job import Job, rejected
from training.models.build import lm_loss, precision, to_device
from training.observe.metrics import peak_memory_bytes
from training.parallel.fsdp import local
from training.privacy.dpsgd import (
    Stop,
    agreed_stop,
    budget_error,
)
from training.resume import final_state, resume, save_final, state_dict
from training.setup import setup
from training.spec import LaunchSpec
from training.sync import balance

CONTROL_EVERY = 10
"""Time-based merges/saves are agreed on every this many steps (two flags per rank, MAC'd:
training.comm.session.Control), CONTROL_LATE rounds late: the flags gathered at one control
step are applied CONTROL_LATE control steps later, so the gather (a ring all-gather over
the WAN, about a second in the lab, on every 10th step) runs under the steps in between
instead of stalling one. A time-based trigger fires less than (CONTROL_LATE + 1) x
CONTROL_EVERY steps after it is due (seen at the next control step, applied
CONTROL_LATE control steps after that)."""
CONTROL_LATE = 2
"""With one round (ten 65 ms steps in the lab) the gather was not always done: 0.03-0.11 s
waits on control steps, most while a streaming fragment's exchange shared the links."""


def params_digest(model: torch.nn.Module) -> str:
    """16 hex of sha256 over the parameters; under FSDP over this rank's shards (rank c of
    every region holds the same shard c, so leaders still compare like with like)."""
    return tensors_digest(local(p) for p in model.parameters())


def tensors_digest(tensors: Iterable[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def due(job: Job) -> tuple[bool, bool]:
    """(merge due, checkpoint due) after the current step; every rank gets the same answer."""
    s, spec, d = job.step + 1, job.spec, job.diloco
    merge_due = d is not None and d.due(job.step, spec.steps)
    ckpt_due = s % spec.checkpoint.interval_steps == 0 and s != spec.steps
    if s % CONTROL_EVERY == 0:  # time-based triggers: agree across ranks (MAX)
        now = time.monotonic()
        mine = [
            d is not None and d.time_due(job.step, now),
            now - job.last_save >= 60 * spec.checkpoint.interval_minutes,
        ]
        assert job.control is not None  # set by setup
        job.pending.append(job.control.start_gather(mine))  # every rank's flags, verified
        views = job.pending.pop(0).result() if len(job.pending) > CONTROL_LATE else []
        merge_due = merge_due or any(v[0] for v in views)
        # never the last step: final.pt holds it, and a checkpoint there would leave a
        # rerun or a restart nothing to train (state.resume refuses it)
        ckpt_due = ckpt_due or (any(v[1] for v in views) and s != spec.steps)
    return merge_due, ckpt_due


def settle(job: Job) -> None:
    """The control gathers still in flight at the end (their flags are no longer needed,
    but every rank completes them before the group goes)."""
    while job.pending:
        job.pending.pop(0).result()


def staged(job: Job) -> None:
    """Wait (if needed) for the last save's copy of the state, then report what the save
    cost the loop."""
    done = job.ckpt.fence()
    if done is None:
        return
    step, stall = done
    job.metrics.checkpointed(stall)
    if job.topo.rank == 0:
        job.emit("checkpoint", step=step, stall_s=stall)


def sync_clock(job: Job) -> float:
    """Seconds this rank's loop has stalled on the cross-region sync: its blocking syncs,
    and the waits at streaming landings for exchanges that outlasted tau steps."""
    waited = job.diloco.waited_s if job.diloco is not None else 0.0
    return job.sync.stats.sync_seconds + waited


def train_step(job: Job) -> None:
    t0 = time.perf_counter()
    sync_before = sync_clock(job)
    tokens = to_device(job.loader.next(), job.groups.device)
    zero_grads(job)
    c0 = time.perf_counter()  # compute: forward, backward, optimizer (utilisation)
    if job.privacy is not None:  # per-record clipped, noised: see training.privacy
        loss = job.privacy.clipped_noisy_grads(job.model, tokens, partial(lm_loss, job.model))
        job.privacy.budget.record()
    else:
        with precision(job.groups.device, job.spec.parallel.autocast):
            batch_loss = lm_loss(job.model, tokens)
        batch_loss.backward()
        loss = batch_loss.item()
    compute = time.perf_counter() - c0
    staged(job)  # the last save's copy of the state must be taken before it changes
    gradient = None
    if job.diloco is None or job.diloco.warming(job.step):
        gradient = ledger_hooks.region_gradient(job)  # None unless a recorded step
        sync_grads(job)
    else:
        region_average_grads(job)
    c0 = time.perf_counter()
    job.opt.step()
    compute += time.perf_counter() - c0
    ledger_hooks.synced(job, gradient)
    if job.diloco is not None:
        job.diloco.step_done(job.step)  # the end of the warm-up takes the global copy
    merge_due, ckpt_due = due(job)
    merged = merge(job, merge_due, ckpt_due)
    job.step += 1
    job.tokens += tokens.numel() - tokens.shape[0]
    if ckpt_due:
        job.ckpt.save(job.step, state_dict(job))
        job.last_save = time.monotonic()
    step_s, sync_s = time.perf_counter() - t0, sync_clock(job) - sync_before
    report(job, loss, step_s, sync_s, merged, compute)
    balance.stepped(job, step_s - sync_s)  # throughput balance: measure, then assign


def report(
    job: Job, loss: float, step_s: float, sync_s: float, merged: bool, compute_s: float
) -> None:
    st, m = job.sync.stats, job.metrics
    stats = torch.tensor(
        [loss, st.cross_wire_bytes, st.cross_raw_bytes, sync_s], dtype=torch.float64
    )
    if job.topo.local_size > 1:  # region totals (never crosses borders)
        dist.all_reduce(stats, group=job.groups.intra)
    L = job.topo.local_size
    batch = job.balance.batch if job.balance is not None else job.spec.batch_size
    tps = (batch * job.spec.seq_len) / step_s
    m.step.set(job.step)
    m.loss.set(loss)
    m.step_s.set(step_s)
    m.sync_s.set(sync_s)
    m.tokens_per_s.set(tps)
    now = {"wire": st.cross_wire_bytes, "raw": st.cross_raw_bytes, "intra": st.intra_bytes}
    m.cross_wire.inc(now["wire"] - job.reported.get("wire", 0))
    m.cross_raw.inc(now["raw"] - job.reported.get("raw", 0))
    m.intra.inc(now["intra"] - job.reported.get("intra", 0))
    for peer, n in st.per_peer_wire.items():
        key = f"link{peer}"
        m.link_bytes(job.topo.region_names[peer], n - job.reported.get(key, 0))
        now[key] = n
    job.reported = now
    m.links(link_report(job))
    if job.diloco is None or merged or job.diloco.warming(job.step - 1):
        m.syncs.inc()
    if st.cross_wire_bytes:
        m.ratio.set(st.cross_raw_bytes / st.cross_wire_bytes)
    m.tick()
    exchanges = job.diloco.take_exchange_s() if job.diloco is not None else []  # every rank
    if job.leader:
        d = job.diloco
        warmed = d is not None and job.step == job.spec.diloco.warmup_steps
        late = d is not None and d.spec.streaming and job.step < job.spec.steps
        # the weights' digest where every region holds the same ones (tests check it; it
        # costs ~4 ms per million parameters on the loop): not where a streaming merge
        # lands, when the other fragments are still each region's own
        whole = merged and not late
        extra: dict[str, Any] = {"digest": params_digest(job.model)} if whole or warmed else {}
        if job.privacy is not None:
            extra.update(privacy_spent(job))
        if exchanges:
            extra["exchange_s"] = exchanges
        job.emit(
            "step",
            step=job.step,
            loss=stats[0].item() / L,
            tokens_per_s=tps * L,
            cross_wire=stats[1].item(),
            cross_raw=stats[2].item(),
            sync_s=stats[3].item() / L,
            step_s=step_s,
            compute_s=compute_s,
            peak_mem=peak_memory_bytes(job.groups.device),
            merged=merged,
            saving=job.ckpt.saving(),
            **extra,
        )


def link_report(job: Job) -> dict[str, Any]:
    """Every link's estimate (training.sync.linkprobe) and, with codec.adaptive, its codec."""
    s = job.sync
    return {
        "links": s.links.report() if s.links else [],
        "codecs": s.adaptive.report() if s.adaptive else {},
    }


def privacy_spent(job: Job) -> dict[str, float]:
    """The region's epsilon so far: metric, ledger entry, and the step event's fields."""
    p = job.privacy
    assert p is not None  # called only with DP on
    eps = p.budget.epsilon()
    job.metrics.privacy(eps, p.spec.target_epsilon)
    ledger_hooks.privacy(job, eps, p.spec.delta, p.budget.steps)
    return {"epsilon": eps, "epsilon_target": p.spec.target_epsilon, "delta": p.spec.delta}


def last_step(job: Job) -> Stop:
    """Steps to run, and the region whose privacy budget ends the run first, if any:
    agreed by every rank once the checkpoint's privacy history is loaded."""
    steps = job.spec.steps
    if not any(r.privacy for r in job.spec.regions):
        return Stop(steps, None)
    offer = job.privacy.offer(steps) if job.privacy else (steps, 0.0, 0.0, 0.0)
    return agreed_stop(offer, job.topo.region_index, steps)


def run(
    spec: LaunchSpec, node: str, local_rank: int, events: Path | None, run_dir: Path | None
) -> None:
    job = setup(spec, node, local_rank, events, run_dir)
    n_params = sum(p.numel() for p in job.model.parameters())
    session = job.sync.codec.session
    assert session is not None  # agreed in setup
    job.emit(
        "start",
        pid=os.getpid(),
        node=node,
        params=n_params,
        world=spec.world_size,
        regions=len(spec.regions),
        sync=spec.sync,
        warmup=spec.diloco.warmup_steps if spec.sync == "diloco" else 0,
        tau=spec.diloco.tau if spec.sync == "diloco" else 0,
        exchange=spec.exchange,
        epoch=session.epoch,
        session=session.id.hex()[:16],
        **json.loads(os.environ.get("GEOTRAIN_TORCHRUN", "{}")),
    )
    if job.leader:
        job.emit("links", **link_report(job))
    try:
        resumed = resume(job)
        if resumed is not None:
            job.emit("resume", step=resumed)
        stop = last_step(job)
        while job.step < stop.step:
            train_step(job)
        merge(job, False, True)  # a run stopped early: no exchange left in flight
        settle(job)
    except PayloadRejected as e:
        rejected(job, e)
        raise
    staged(job)
    job.ckpt.wait()
    final = final_state(job)  # a collective under FSDP: every rank
    if run_dir is not None and job.topo.rank == 0:
        save_final(job, run_dir, final)
    ledger_hooks.finished(job, run_dir, final)
    if job.leader:
        job.emit(
            "done",
            step=job.step,
            digest=tensors_digest(final.values()),  # final.pt's weights, whole
            encode_s=job.sync.codec.stats.encode_seconds,
            decode_s=job.sync.codec.stats.decode_seconds,
            **link_report(job),
        )
    dist.barrier()
    dist.destroy_process_group()
    if stop.region is not None:  # every rank got here at the same step: a clean stop, exit 2
        if job.topo.rank == 0:  # once per run
            name = spec.regions[stop.region].name
            job.emit("privacy_budget_spent", step=job.step, stopped_by=name)
        raise budget_error(stop, spec)
