"""Where the training loop writes the ledger (training.audit.ledger): one call per event, each a
no-op on ranks that hold no ledger (only a region's leader, its local rank 0, writes).

Cadence: diloco records every merge (the region's pseudo-gradient, the merged
parameters); allreduce records every `checkpoint.interval_steps` steps and the last step
(the region's summed gradient, the parameters after the step), since a per-step entry
would sign and fsync on every step. Checkpoints are recorded as each commits, the end
once the run finishes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from training.audit.ledger import Ledger, TensorHasher, activate, sm3, tensors_sm3
from training.comm.session import Control, Session
from training.errors import LedgerError
from training.parallel.fsdp import full_tensors, whole
from training.parallel.fsdp import local_grads as local_grads_of
from training.spec import LaunchSpec

if TYPE_CHECKING:
    from training.comm.topology import Topology
    from training.job import Job
    from training.sync.diloco import Applied

FINAL = "final.pt"
_recording = False
"""Whether this launch keeps a ledger (a run dir): the same on every rank, so the ranks of
a region all join `region_gradient`'s all-reduce, or all skip it."""


def config_digest(spec: LaunchSpec) -> str:
    """SM3 of the launch spec (the rendered stack config) without its rendezvous port,
    which `geotrain train` picks afresh at every launch."""
    return sm3(dataclasses.replace(spec, master_port=0).to_json().encode())


def open_for(
    spec: LaunchSpec,
    topo: Topology,
    run_key: bytes,
    session: Session,
    run_dir: Path | None,
    node: str,
    data: dict[str, str] | None = None,
) -> Ledger | None:
    """A collective on every rank: region leaders open their chain, every rank learns
    every region's public key (authenticated under the run key) and the config digest
    every rank computed, and each leader signs a `start` entry naming them all, with
    `data`: the sha256 of each of its region's data shards (training.workload.data_digests),
    proof of what trained that reveals none of it."""
    global _recording
    _recording = run_dir is not None
    if run_dir is None:
        return None
    leader = topo.local_rank == 0
    ledger = Ledger.open(run_dir, run_dir, topo.region, spec.run_id) if leader else None
    config = config_digest(spec)
    views = Control(run_key, session, "ledger-start").gather(
        [topo.region, ledger.public_hex if ledger else None, config]
    )
    if len({c for _, _, c in views}) != 1:
        raise LedgerError(
            f"the ranks of run {spec.run_id} hold different launch specs; render one spec "
            "and copy it to every node"
        )
    if ledger is not None:
        keys = {r: k for r, k, _ in views if k is not None}
        ledger.append(
            "start",
            {"launch-spec": {"sm3": config}}
            | {f"data/{topo.region}/{k}": {"sha256": v} for k, v in (data or {}).items()},
            epoch=session.epoch,
            session=session.id.hex(),
            node=node,
            keys=keys,
            sync=spec.sync,
            record_every=spec.checkpoint.interval_steps,
        )
    activate(ledger)
    return ledger


def sync_due(spec: LaunchSpec, step: int) -> bool:
    """allreduce: whether the step about to finish (`step` + 1) is recorded."""
    s = step + 1
    return spec.sync == "allreduce" and (s % spec.checkpoint.interval_steps == 0 or s == spec.steps)


def region_gradient(job: Job) -> str | None:
    """allreduce, before the sync, on every rank of the region at recorded steps: SM3
    of the region's summed gradient (one in-region all-reduce; nothing crosses borders).
    The digest on the leader; None elsewhere and at other steps."""
    if not (_recording and sync_due(job.spec, job.step)):
        return None
    if job.sync.sharded:  # FSDP: each rank holds the region's mean of its shard
        local_grads_of(job.model)  # zeros where autograd left none
        grads = full_tensors(p.grad for p in job.model.parameters() if p.grad is not None)
        return tensors_sm3(grads) if job.ledger is not None else None
    grads = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
        for p in job.model.parameters()
    ]
    flat = torch.cat(grads)
    dist.all_reduce(flat, group=job.groups.intra)
    return tensors_sm3([flat]) if job.ledger is not None else None


def synced(job: Job, gradient: str | None) -> None:
    """allreduce, after the optimizer step of a recorded step."""
    if not (_recording and sync_due(job.spec, job.step)):
        return
    params = full_tensors(job.model.parameters())  # a collective under FSDP: every rank
    if job.ledger is None or gradient is None:
        return
    subject = {
        f"gradient/{job.topo.region}": {"sm3": gradient},
        "params": {"sm3": tensors_sm3(params)},
    }
    job.ledger.append("sync", subject, step=job.step + 1, epoch=_epoch(job))


def hasher(job: Job) -> TensorHasher:
    """SM3 of tensors fed one by one (a bucket at a time: no copy of the whole model is
    kept); a no-op on ranks that write no ledger."""
    return TensorHasher(job.ledger is not None)


def merged(job: Job, applied: Applied) -> None:
    """diloco, after a merge: the region's pseudo-gradient (its buckets in order, as
    sent) and the global parameters the merge set, the same in every region: every one,
    or, for a streaming landing, only its fragment's (named in the entry), which saves
    hashing the whole model at every landing."""
    if job.diloco is None:
        return
    d = job.diloco
    merged_params = d.fragment_params(applied.fragment)
    if job.sync.sharded:  # FSDP: the global copy is of shards; whole on every rank
        like = [p for p in job.model.parameters() if p.requires_grad]
        merged_params = whole(merged_params, like)
    if job.ledger is None:
        return
    pg = applied.digest
    assert isinstance(pg, TensorHasher)  # made by `hasher` above
    subject = {
        f"pseudo-gradient/{job.topo.region}": {"sm3": pg.hexdigest()},
        "params": {"sm3": tensors_sm3(merged_params)},
    }
    extra = {} if applied.fragment is None else {"fragment": applied.fragment}
    job.ledger.append(
        "merge", subject, step=job.step + 1, merge=d.merges, epoch=_epoch(job), **extra
    )


def committed(job: Job, step: int) -> None:
    """On the node leader's checkpoint writer thread, once its node committed `step`."""
    if job.ledger is not None:
        job.ledger.record_checkpoint(job.ckpt.root, job.node, step, _epoch(job))


def privacy(job: Job, epsilon: float, delta: float, steps: int) -> None:
    """The region's DP budget spent so far, every checkpoint interval (and, from `finished`,
    at the end): the ledger's cadence, not every step."""
    if job.ledger is not None and job.step % job.spec.checkpoint.interval_steps == 0:
        job.ledger.record_dp(epsilon, delta, steps)


def finished(
    job: Job, run_dir: Path | None, final_state: dict[str, torch.Tensor] | None = None
) -> None:
    """After the run (and `final.pt`, which rank 0 writes from `final_state`): the final DP
    budget, if the region has one, and the `end` entry."""
    if job.ledger is None:
        return
    if job.privacy is not None:
        p = job.privacy
        job.ledger.record_dp(p.budget.epsilon(), p.spec.delta, p.budget.steps)
    final = run_dir / FINAL if run_dir is not None else None
    mine = job.topo.rank == 0 and final is not None and final.exists()
    state = final_state if final_state is not None else job.model.state_dict()
    params = tensors_sm3(state.values())  # final.pt's tensors, in order
    job.ledger.record_end(params, final if mine else None, job.step, _epoch(job))
    activate(None)


def _epoch(job: Any) -> int:
    session = job.sync.codec.session
    return int(session.epoch) if session is not None else 0
