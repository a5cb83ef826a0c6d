"""One training rank: `python -m training.worker --spec FILE --node NAME --local-rank I`,
or under torchrun `python -m training.worker --torchrun[=NODE] --spec FILE`
(training.torchrun).

Reads only the launch spec. Every check that can fail on bad input (key file, data shard,
world size) runs before the process group starts, so a bad spec fails fast and clearly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training import balance, gloo, ledger_hooks, streaming, torchrun
from training.balance import Balancer
from training.checkpoint import (
    ALLOW_ROLLBACK_ENV,
    Checkpointer,
    node_group,
    node_root,
    step_of,
)
from training.codec import Codec
from training.data import ByteLoader, load_region_text
from training.diloco import DiLoCo
from training.errors import (
    DataError,
    GeotrainError,
    HostileReject,
    PayloadRejected,
    SpecError,
)
from training.hier import HierarchicalAllReduce, sync_buckets
from training.keys import load_key
from training.ledger import Ledger
from training.metrics import RuntimeMetrics
from training.model import DeepSeekLM, preset
from training.privacy import (
    PoissonLoader,
    RegionPrivacy,
    Stop,
    agreed_stop,
    budget_error,
)
from training.session import Control, agree, rendezvous_store, wait_for_all
from training.spec import LaunchSpec, metrics_endpoint
from training.topology import Groups, Topology, make_groups

RENDEZVOUS_TIMEOUT_S = 600
"""How long the global store waits for every rank to join."""
CONTROL_EVERY = 10
"""Time-based merges/saves are agreed on every this many steps (two flags per rank, MAC'd:
training.session.Control)."""
REJECT_LINGER_S = 30.0
"""After a hostile reject, a rank that serves metrics keeps serving them this long before
it exits, so Prometheus (15 s scrapes by default) records the count and the alert fires."""


@dataclass
class Job:
    spec: LaunchSpec
    topo: Topology
    groups: Groups
    model: DeepSeekLM
    opt: torch.optim.Optimizer
    loader: ByteLoader | PoissonLoader
    sync: HierarchicalAllReduce
    ckpt: Checkpointer
    metrics: RuntimeMetrics
    events: Path | None
    node: str
    diloco: DiLoCo | None = None
    """The global weights, outer optimizer and merge (sync: diloco; None: allreduce)."""
    step: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    last_save: float = field(default_factory=time.monotonic)
    reported: dict[str, int] = field(default_factory=dict)
    """Byte counters already added to the Prometheus counters."""
    control: Control | None = None
    """Authenticated exchange of the time-based flags over every rank (`_due`)."""
    ledger: Ledger | None = None
    """This region's signed training ledger (region leaders with a run dir only)."""
    privacy: RegionPrivacy | None = None
    """DP-SGD of this rank's region (None: the region has no privacy settings)."""
    balance: Balancer | None = None
    """Throughput balance of the batch per rank (None: `balance: off`)."""

    @property
    def leader(self) -> bool:
        return self.topo.local_rank == 0

    def emit(self, event: str, **kw: Any) -> None:
        if self.events is None:
            return
        line = (
            json.dumps(
                {
                    "event": event,
                    "region": self.topo.region,
                    "rank": self.topo.rank,
                    "t": time.time(),
                    **kw,
                }
            )
            + "\n"
        )
        with open(self.events, "a", encoding="utf-8") as f:  # one write(): atomic append
            f.write(line)


def preflight(spec: LaunchSpec, node_name: str, local_rank: int) -> tuple[int, bytes, bytes]:
    """Checks before any collective: returns (rank, key, region text)."""
    region, node = spec.node(node_name)
    if not 0 <= local_rank < node.nprocs:
        raise SpecError(
            f"local rank {local_rank} is outside node {node_name}'s {node.nprocs} workers"
        )
    world = int(os.environ.get("WORLD_SIZE", spec.world_size))
    if world != spec.world_size:
        raise SpecError(
            f"WORLD_SIZE={world} but the spec of run {spec.run_id} has "
            f"{spec.world_size} workers; re-render the spec or fix the launcher"
        )
    key = load_key(spec.key_file)
    idx = [r.name for r in spec.regions].index(region.name)
    text = load_region_text(region, idx, len(spec.regions))
    if len(text) < spec.seq_len + 2:  # a window is seq_len + 1 bytes, drawn from [0, n - it)
        raise DataError(
            f"region {region.name}'s data is {len(text)} bytes, too short for one sequence "
            f"of seq_len {spec.seq_len} plus its target byte; lower "
            "geotrain:training.seq_len or give the region more data"
        )
    return node.first_rank + local_rank, key, text


def build_model(spec: LaunchSpec) -> DeepSeekLM:
    """The spec's preset with a RoPE table that covers seq_len. The table is a
    non-persistent buffer drawn from no RNG: weights and checkpoints do not change."""
    c = preset(spec.model)
    return DeepSeekLM(dataclasses.replace(c, max_seq=max(c.max_seq, spec.seq_len)))


def make_checkpointer(
    spec: LaunchSpec, node_name: str, key: bytes, state_dir: Path | None = None
) -> Checkpointer:
    """Per-node checkpoints (see training.checkpoint). Two dedicated gloo groups: async
    saves never block the training groups. Every rank creates both in the same order.
    `state_dir`: where the node's high-water record lives (the run dir; None: the root)."""
    region, node = spec.node(node_name)
    world = dist.new_group(backend=gloo.backend())
    spans = [
        list(range(n.first_rank, n.first_rank + n.nprocs)) for r in spec.regions for n in r.nodes
    ]
    group = node_group(spans)
    root = node_root(spec.checkpoint.dir, spec.stack, node.name, region.name)
    return Checkpointer(
        root,
        node.name,
        spec.run_id,
        key,
        spec.checkpoint.keep,
        group=group,
        world=world,
        state_dir=state_dir,
        allow_rollback=os.environ.get(ALLOW_ROLLBACK_ENV) == "1",
    )


def setup(
    spec: LaunchSpec,
    node_name: str,
    local_rank: int,
    events: Path | None,
    run_dir: Path | None = None,
) -> Job:
    rank, key, text = preflight(spec, node_name, local_rank)
    region, node = spec.node(node_name)
    # every gloo group listens on, and advertises, the node's private address only (a
    # host's LAN interface may also hold its public address: see training/gloo.py)
    glo = gloo.bind(node.host)
    device = torch.device("cuda", local_rank) if node.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # hosts start their workers as their agents finish, minutes apart on a big fleet;
    # the store waits that long for every rank to join (collectives keep 120 s)
    wait = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    # the store listens on the master address only (TCPStore alone binds every interface)
    store = torchrun.torchrun_store(spec.world_size, wait)
    if store is None:  # under torchrun, its rendezvous already waited for every node
        store = rendezvous_store(
            spec.master_addr, spec.master_port, spec.world_size, rank == 0, wait
        )
        wait_for_all(store, spec.world_size, wait)
    backend = f"cpu:{glo},cuda:nccl" if device.type == "cuda" else glo
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=spec.world_size, timeout=timedelta(seconds=120)
    )
    topo = Topology.of(spec, rank)
    groups = make_groups(topo, device)
    ckpt = make_checkpointer(spec, node_name, key, run_dir)
    # a fresh session every start, and an epoch one past the highest any node recorded
    session = agree(key, spec.run_id, ckpt.stored_epoch)
    ckpt.start(session)
    torch.manual_seed(spec.seed)  # identical initial weights on every rank
    model = build_model(spec).to(device)
    codec = Codec(spec.codec, key, session)
    sync = HierarchicalAllReduce(
        topo, groups, codec, spec.run_id, error_feedback=spec.codec.error_feedback
    )
    sync.probe()  # every cross-region link's bandwidth and RTT (training.linkprobe)
    privacy = RegionPrivacy.for_rank(spec, topo, text, device)
    job = Job(
        spec=spec,
        topo=topo,
        groups=groups,
        model=model,
        opt=torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01),
        loader=privacy.loader
        if privacy
        else ByteLoader.of(text, spec.batch_size, spec.seq_len, spec.seed * 1000 + rank),
        sync=sync,
        ckpt=ckpt,
        metrics=RuntimeMetrics(region.name, node.name, rank),
        events=events,
        node=node.name,
        control=Control(key, session, "steps"),
        privacy=privacy,
        balance=balance.for_job(spec, topo, Control(key, session, "balance")),
    )
    job.metrics.reject(previous_rejects(events, rank))  # the count survives restarts
    job.ledger = ledger_hooks.open_for(spec, topo, key, session, run_dir, node.name)

    def on_commit(step: int) -> None:
        job.emit("committed", node=node.name, step=step)
        ledger_hooks.committed(job, step)

    ckpt.on_commit = on_commit
    if spec.sync == "diloco":
        buckets = _buckets(list(model.parameters()), spec.bucket_mb)
        stream = streaming.twin(sync) if spec.diloco.tau > 0 else None  # its own groups
        job.diloco = DiLoCo(buckets, spec.diloco, sync, stream)
    prime(job)
    job.metrics.serve(*metrics_endpoint(spec, node, local_rank))
    return job


# -- rejects --------------------------------------------------------------------------
def previous_rejects(events: Path | None, rank: int) -> int:
    """This rank's rejected-payload count so far in this run dir's event log (0: none)."""
    from training.report import EventLog

    if events is None:
        return 0
    log = EventLog(events)
    log.poll()
    return max((int(e["total"]) for e in log.of("rejected") if e.get("rank") == rank), default=0)


def rejected(job: Job, e: PayloadRejected) -> None:
    """Count a reject (metric and event log) before the worker exits with it. A hostile
    one stops the job: the rank first keeps its metrics up long enough to be scraped."""
    hostile = isinstance(e, HostileReject)
    total = job.metrics.reject()
    job.emit(
        "rejected",
        kind="hostile" if hostile else "transient",
        reason=str(e)[:500],
        total=total,
        step=job.step,
    )
    if hostile and job.metrics.serving:
        time.sleep(REJECT_LINGER_S)


# -- state ----------------------------------------------------------------------------
def prime_optimizer(opt: torch.optim.Optimizer) -> None:
    """Create the state torch would create lazily on the first step, with the same
    values (zeros), so a checkpoint template has every tensor DCP must fill in."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state[p]:
                continue
            if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
                opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
            elif isinstance(opt, torch.optim.SGD) and group["momentum"]:
                # with dampening 0, buf = momentum * 0 + grad equals torch's first clone
                opt.state[p] = {"momentum_buffer": torch.zeros_like(p)}


def prime(job: Job) -> None:
    """Every stateful part at its final shape before a resume or the first save: DCP
    loads into the template it is given, and silently skips what the template lacks."""
    prime_optimizer(job.opt)
    if job.diloco is not None:
        prime_optimizer(job.diloco.outer)
    if job.sync.error_feedback:
        C = job.topo.cross_size
        R = job.topo.regions
        for b, params in enumerate(_buckets(list(job.model.parameters()), job.spec.bucket_mb)):
            shard = -(-sum(p.numel() for p in params) // C)
            job.sync.residual(b, -(-shard // R))


def state_dict(job: Job) -> dict[str, Any]:
    """Keys say who shares a value: shared by all ranks, by a region, or by one rank
    (DCP stores a key once, so values that differ must have distinct keys)."""
    t = job.topo
    per_rank = {
        "loader": job.loader.state_dict(),
        "rng": torch.get_rng_state(),
        "residuals": dict(job.sync.residuals),
        "counters": {"step": job.step, "tokens": job.tokens, "merges": merges(job)},
    }
    if job.privacy is not None:  # the node's own checkpoint: never leaves the region
        per_rank["privacy"] = job.privacy.state_dict()
    if job.diloco is None:
        return {
            "model": job.model.state_dict(),
            "optim": job.opt.state_dict(),
            f"rank{t.rank}": per_rank,
        }
    return {
        f"region{t.region_index}": {"model": job.model.state_dict(), "optim": job.opt.state_dict()},
        "global": job.diloco.state_dict(),
        f"rank{t.rank}": per_rank,
    }


def merges(job: Job) -> int:
    return job.diloco.merges if job.diloco is not None else 0


def resume(job: Job) -> int | None:
    d = job.ckpt.latest()  # every rank agrees; each gets its own node's directory
    if job.topo.rank == 0:  # every node's fallbacks, gathered: reported once
        for f in job.ckpt.fallbacks:
            job.emit("checkpoint_skipped", **dataclasses.asdict(f))
    if d is None:
        return None
    state = state_dict(job)
    job.ckpt.load(d, state)
    mine = state[f"rank{job.topo.rank}"]
    if job.diloco is None:
        job.model.load_state_dict(state["model"])
        job.opt.load_state_dict(state["optim"])
    else:
        reg = state[f"region{job.topo.region_index}"]
        job.model.load_state_dict(reg["model"])
        job.opt.load_state_dict(reg["optim"])
        job.diloco.load_state_dict(state["global"])
    job.loader.load_state_dict(mine["loader"])
    if job.privacy is not None:
        job.privacy.load_state_dict(mine["privacy"])
    torch.set_rng_state(mine["rng"])
    job.sync.residuals = {int(k): v for k, v in mine["residuals"].items()}
    c = mine["counters"]
    job.step, job.tokens = int(c["step"]), int(c["tokens"])
    if job.diloco is not None:
        job.diloco.merges = int(c["merges"])
    job.metrics.restarts.inc()
    return step_of(d)


# -- steps ----------------------------------------------------------------------------
def _flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )


def _scatter(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    i = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[i : i + n].view_as(t))
        i += n


def _grads(params: list[Any]) -> list[torch.Tensor]:
    """Gradients of `params`, created as zeros where autograd left none (unused experts)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


def _buckets(params: list[torch.nn.Parameter], bucket_mb: float) -> list[list[torch.nn.Parameter]]:
    return sync_buckets(params, bucket_mb)


def sync_grads(job: Job) -> None:
    """allreduce mode: every bucket through the hierarchical compressed sync."""
    hierarchical_step(job.model, job.sync, job.step, job.spec.bucket_mb)


def hierarchical_step(
    model: torch.nn.Module, sync: HierarchicalAllReduce, step: int, bucket_mb: float
) -> None:
    """Replace every gradient by its global average through `sync`, bucket by bucket."""
    for b, params in enumerate(_buckets(list(model.parameters()), bucket_mb)):
        synced = sync.all_reduce(_flat_grads(params), step=step, bucket=b)
        _scatter(synced, _grads(params))


def region_average_grads(job: Job) -> None:
    """diloco inner step: gradients averaged inside the region only."""
    params = list(job.model.parameters())
    flat = _flat_grads(params)
    dist.all_reduce(flat, group=job.groups.intra)
    flat.div_(job.topo.local_size)
    _scatter(flat, _grads(params))


def merge(job: Job, due: bool, settle: bool) -> bool:
    """The periodic global merge (training.diloco) when `due`, each merge applied signed
    into the ledger; `settle`: a checkpoint follows, so merges in flight land now.
    Returns whether a merge was applied. A throughput balance weights the merge by its
    interval's samples (it is refused with streaming, whose fragments land late)."""
    d = job.diloco
    if d is None:
        return False
    done = []
    if due:  # the region's pseudo-gradient, for the ledger
        hasher = functools.partial(ledger_hooks.hasher, job)
        with balance.merging(job.balance, job.sync, job.step, job.spec.diloco.warmup_steps):
            done = d.advance(job.step, job.spec.steps, hasher)
    if settle:  # only streaming has merges in flight, and it runs without a balance
        done += d.settle()
    for pg in done:
        ledger_hooks.merged(job, pg)  # type: ignore[arg-type]  # the hashers made above
        job.metrics.merges.inc()
    return bool(done)


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _due(job: Job) -> tuple[bool, bool]:
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
        views = job.control.gather(mine)  # every rank's flags, each verified
        merge_due = merge_due or any(v[0] for v in views)
        ckpt_due = ckpt_due or any(v[1] for v in views)
    return merge_due, ckpt_due


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


def train_step(job: Job) -> None:
    t0 = time.perf_counter()
    sync_before = job.sync.stats.sync_seconds
    tokens = job.loader.next().to(job.groups.device)
    job.opt.zero_grad(set_to_none=True)
    c0 = time.perf_counter()  # compute: forward, backward, optimizer (utilisation)
    if job.privacy is not None:  # per-record clipped, noised: see training.privacy
        loss = job.privacy.clipped_noisy_grads(job.model, tokens, job.model.loss)
        job.privacy.budget.record()
    else:
        batch_loss = job.model.loss(tokens)
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
    merge_due, ckpt_due = _due(job)
    merged = merge(job, merge_due, ckpt_due)
    job.step += 1
    job.tokens += tokens.numel() - tokens.shape[0]
    if ckpt_due:
        job.ckpt.save(job.step, state_dict(job))
        job.last_save = time.monotonic()
    step_s, sync_s = time.perf_counter() - t0, job.sync.stats.sync_seconds - sync_before
    report(job, loss, step_s, sync_s, merged, compute)
    balance.stepped(job, step_s - sync_s)  # throughput balance: measure, then assign


def report(
    job: Job, loss: float, step_s: float, sync_s: float, merged: bool, compute_s: float
) -> None:
    st, m = job.sync.stats, job.metrics
    stats = torch.tensor(
        [loss, st.cross_wire_bytes, st.cross_raw_bytes, sync_s], dtype=torch.float64
    )
    dist.all_reduce(stats, group=job.groups.intra)  # region totals (never crosses borders)
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
    if job.leader:
        warmed = job.diloco is not None and job.step == job.spec.diloco.warmup_steps
        extra: dict[str, Any] = {"digest": params_digest(job.model)} if merged or warmed else {}
        if job.privacy is not None:
            extra.update(privacy_spent(job))
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
            merged=merged,
            saving=job.ckpt.saving(),
            **extra,
        )


def link_report(job: Job) -> dict[str, Any]:
    """Every link's estimate (training.linkprobe) and, with codec.adaptive, its codec."""
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
    if spec.fault_tolerance is not None:  # regions as torchft replica groups
        from training import ft_loop

        return ft_loop.run(spec, node, local_rank, events, run_dir)
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
    except PayloadRejected as e:
        rejected(job, e)
        raise
    staged(job)
    job.ckpt.wait()
    if job.topo.rank == 0 and run_dir is not None:
        torch.save(job.model.state_dict(), run_dir / "final.pt")
    ledger_hooks.finished(job, run_dir)
    if job.leader:
        job.emit(
            "done",
            step=job.step,
            digest=params_digest(job.model),
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.worker")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--node")
    ap.add_argument("--local-rank", type=int)
    ap.add_argument(
        "--torchrun", nargs="?", const="", help="under torchrun: its env gives the rank (NODE)"
    )
    a = ap.parse_args(argv)
    if a.torchrun is None and (a.node is None or a.local_rank is None):
        ap.error("--node and --local-rank are required (or --torchrun under torchrun)")
    torch.set_num_threads(int(os.environ.get("GEOTRAIN_THREADS", "1")))
    events = os.environ.get("GEOTRAIN_EVENTS")
    run_dir = os.environ.get("GEOTRAIN_RUN_DIR")
    try:
        spec = LaunchSpec.load(a.spec)
        if a.torchrun is not None:  # =NODE: torchrun's rendezvous does not number nodes
            t = torchrun.enter(spec, a.torchrun or None, os.environ)
            a.node, a.local_rank = t.node, t.local_rank
            os.environ["GEOTRAIN_TORCHRUN"] = json.dumps(t.fields())  # for the start event
        run(
            spec,
            a.node,
            a.local_rank,
            Path(events) if events else None,
            Path(run_dir) if run_dir else None,
        )
    except GeotrainError as e:
        print(f"geotrain worker {a.node}/{a.local_rank}: error: {e}", file=sys.stderr)
        torchrun.record_failure(events, a.node, a.local_rank, e)
        _exit(e.exit_code)
    _exit(0)


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown: with torch, gloo and the store loaded it
    took 2.4 s after the last line of a run (measured on the two-node stack), which every
    launcher and restart waits for. Every file the worker writes is closed by then (events,
    ledger, checkpoints); only stdio is buffered."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
