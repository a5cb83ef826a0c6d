"""A training rank's setup: the checks before any collective, the process groups, the
model, the codec's sync, the checkpointer, and the `Job` every other part works on."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training import balance, gloo, ledger_hooks, state, streaming, torchrun
from training.balance import Balancer
from training.checkpoint import ALLOW_ROLLBACK_ENV, Checkpointer, node_group, node_root
from training.codec import Codec
from training.data import ByteLoader, load_region_text
from training.diloco import DiLoCo
from training.errors import DataError, HostileReject, PayloadRejected, SpecError
from training.gradsync import GradBuffer, buckets
from training.hier import HierarchicalAllReduce
from training.keys import load_key
from training.ledger import Ledger
from training.metrics import RuntimeMetrics
from training.model import DeepSeekLM, preset
from training.privacy import PoissonLoader, RegionPrivacy
from training.session import Control, Pending, agree, rendezvous_store, wait_for_all
from training.spec import LaunchSpec, metrics_endpoint
from training.topo_exchange import TopologyExchange
from training.topology import Groups, Topology, make_groups

RENDEZVOUS_TIMEOUT_S = 600
"""How long the global store waits for every rank to join."""
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
    """Authenticated exchange of the time-based flags over every rank (`due`)."""
    pending: list[Pending] = field(default_factory=list)
    """The control gathers in flight, oldest first (training.loop.due)."""
    ledger: Ledger | None = None
    """This region's signed training ledger (region leaders with a run dir only)."""
    privacy: RegionPrivacy | None = None
    """DP-SGD of this rank's region (None: the region has no privacy settings)."""
    balance: Balancer | None = None
    """Throughput balance of the batch per rank (None: `balance: off`)."""
    grads: GradBuffer | None = None
    """The gradients as views of one flat tensor (training.gradsync.zero_grads); None with
    DP-SGD, which sets its own."""

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
    # under torchrun, training.torchrun.from_env checked it against its job's world (under
    # fault_tolerance the region's)
    if world != spec.world_size and "TORCHELASTIC_RUN_ID" not in os.environ:
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
        stack=spec.stack,
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
        topo,
        groups,
        codec,
        spec.run_id,
        error_feedback=spec.codec.error_feedback,
        allgather=spec.exchange == "allgather",
    )
    sync.planner = TopologyExchange.for_spec(spec)  # exchange: topology (None: direct)
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
        grads=GradBuffer.of(model) if privacy is None else None,
    )
    job.metrics.reject(previous_rejects(events, rank))  # the count survives restarts
    job.ledger = ledger_hooks.open_for(spec, topo, key, session, run_dir, node.name)

    def on_commit(step: int) -> None:
        job.emit("committed", node=node.name, step=step)
        ledger_hooks.committed(job, step)

    ckpt.on_commit = on_commit
    if spec.sync == "diloco":
        params = buckets(list(model.parameters()), spec.bucket_mb)
        stream = streaming.twin(sync) if spec.diloco.tau > 0 else None  # its own groups
        job.diloco = DiLoCo(params, spec.diloco, sync, stream)
    state.prime(job)
    job.metrics.serve(*metrics_endpoint(spec, node, local_rank))
    return job


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
