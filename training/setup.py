"""Building a training rank's `Job`: the checks before any collective, the process
groups, the model, the codec's sync, the checkpointer, the ledger and the metrics server."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from training import resume
from training.audit import hooks as ledger_hooks
from training.comm import gloo, iface
from training.comm.session import Control, agree, rendezvous_store, wait_for_all
from training.comm.topology import Topology, make_groups
from training.errors import SpecError
from training.job import Job, previous_rejects
from training.launch import torchrun
from training.observe.metrics import RuntimeMetrics
from training.parallel.fsdp import local_params
from training.parallel.fsdp import shard as fsdp_shard
from training.privacy.dpsgd import RegionPrivacy
from training.spec import LaunchSpec, metrics_endpoint
from training.state.checkpoint import ALLOW_ROLLBACK_ENV, Checkpointer, node_group, node_root
from training.state.keys import load_key
from training.sync import balance, streaming
from training.sync.buckets import GradBuffer, buckets
from training.sync.codec import Codec
from training.sync.diloco import DiLoCo
from training.sync.hier import HierarchicalAllReduce
from training.sync.topo_exchange import TopologyExchange
from training.workload import (
    agree_weights,
    check_autocast,
    check_fsdp,
    data_digests,
    loader_for,
    model_for,
    region_text,
)

RENDEZVOUS_TIMEOUT_S = 600
"""How long the global store waits for every rank to join."""


def preflight(spec: LaunchSpec, node_name: str, local_rank: int) -> tuple[int, bytes, bytes | None]:
    """Checks before any collective: returns (rank, key, region text; None: token shards)."""
    region, node = spec.node(node_name)
    if not 0 <= local_rank < node.nprocs:
        raise SpecError(
            f"local rank {local_rank} is outside node {node_name}'s {node.nprocs} workers"
        )
    world = int(os.environ.get("WORLD_SIZE", spec.world_size))
    # under torchrun, training.launch.torchrun.from_env checked it against its job's world (under
    # fault_tolerance the region's)
    if world != spec.world_size and "TORCHELASTIC_RUN_ID" not in os.environ:
        raise SpecError(
            f"WORLD_SIZE={world} but the spec of run {spec.run_id} has "
            f"{spec.world_size} workers; re-render the spec or fix the launcher"
        )
    key = load_key(spec.key_file)
    text = region_text(spec, region)
    return node.first_rank + local_rank, key, text


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
    # host's LAN interface may also hold its public address: see training/comm/gloo.py)
    glo = gloo.bind(node.host)
    device = torch.device("cuda", local_rank) if node.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # NCCL names interfaces, not addresses: the one of the private address (iface.py)
        iface.apply_socket_env(node.host, node_name)
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
    model, tokenizer = model_for(spec)  # seeded: identical initial weights on every rank
    agree_weights(spec, model, Control(key, session, "weights"))  # loaded weights too
    model = model.to(device)
    check_autocast(spec)
    fsdp = spec.parallel.shard == "fsdp"
    if fsdp:  # parameters, gradients and AdamW's state split over the region's ranks
        check_fsdp(spec)
        model = fsdp_shard(model, groups, spec.parallel)
    codec = Codec(spec.codec, key, session)
    sync = HierarchicalAllReduce(
        topo,
        groups,
        codec,
        spec.run_id,
        error_feedback=spec.codec.error_feedback,
        allgather=spec.exchange == "allgather",
        sharded=fsdp,
    )
    sync.planner = TopologyExchange.for_spec(spec)  # exchange: topology (None: direct)
    sync.probe()  # every cross-region link's bandwidth and RTT (training.sync.linkprobe)
    # token shards with privacy were refused in preflight (region_text)
    privacy = RegionPrivacy.for_rank(spec, topo, text, device) if text is not None else None
    job = Job(
        spec=spec,
        topo=topo,
        groups=groups,
        model=model,
        opt=torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01),
        loader=privacy.loader if privacy else loader_for(spec, region, text, rank, tokenizer),
        sync=sync,
        ckpt=ckpt,
        metrics=RuntimeMetrics(region.name, node.name, rank),
        events=events,
        node=node.name,
        control=Control(key, session, "steps"),
        privacy=privacy,
        balance=balance.for_job(spec, topo, Control(key, session, "balance")),
        grads=GradBuffer.of(model) if privacy is None and not fsdp else None,
    )
    job.metrics.reject(previous_rejects(events, rank))  # the count survives restarts
    data = data_digests(region, text) if run_dir is not None and topo.local_rank == 0 else None
    job.ledger = ledger_hooks.open_for(spec, topo, key, session, run_dir, node.name, data)

    def on_commit(step: int) -> None:
        job.emit("committed", node=node.name, step=step)
        ledger_hooks.committed(job, step)

    ckpt.on_commit = on_commit
    if spec.sync == "diloco":
        # under FSDP DiLoCo's global copy and outer step are of this rank's shards
        mine = local_params(model) if fsdp else list(model.parameters())
        params = buckets(mine, spec.bucket_mb)
        stream = streaming.twin(sync) if spec.diloco.tau > 0 else None  # its own groups
        job.diloco = DiLoCo(params, spec.diloco, sync, stream)
    resume.prime(job)
    job.metrics.serve(*metrics_endpoint(spec, node, local_rank))
    return job
