"""A rank's state and its resume: what a checkpoint holds (keys say who shares a value), the
templates DCP loads into, and the counters a resume restores."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from training.errors import OutputError, SpecError
from training.parallel.fsdp import as_local, diloco_dtensors, full_state_dict, local
from training.spec import FINAL_CLAIM
from training.state.checkpoint import step_of
from training.sync.buckets import buckets

if TYPE_CHECKING:
    from training.job import Job


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
        # a bucket's shard: 1/C of it after the in-region reduce-scatter, or under FSDP
        # this rank's local shards of it whole
        C = 1 if job.sync.sharded else job.topo.cross_size
        R = job.topo.regions
        mine = [local(p) for p in job.model.parameters() if p.requires_grad]
        for b, params in enumerate(buckets(mine, job.spec.bucket_mb)):
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
    region = {"model": job.model.state_dict(), "optim": job.opt.state_dict()}
    own = job.diloco.region_state_dict()  # scaffold's c_i: the region's, not the world's
    glob = job.diloco.state_dict()
    if job.sync.sharded:  # each rank's shards as DTensors: saved once each, resharded on load
        like = [p for p in job.model.parameters() if p.requires_grad]
        glob = diloco_dtensors(glob, like)
        own = diloco_dtensors(own, like)
    if own:
        region["diloco"] = own
    return {
        f"region{t.region_index}": region,
        "global": glob,
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
    if step_of(d) >= job.spec.steps:  # every rank: latest() agreed on d
        raise SpecError(
            f"the newest checkpoint ({d.parent}) is at step {step_of(d)}, not before the "
            f"run's last step {job.spec.steps}: nothing to train, and its end would replace "
            "the weights saved before; raise the steps, or start over with --fresh (it "
            "deletes the checkpoints)"
        )
    state = state_dict(job)
    own = f"rank{job.topo.rank}"
    stored = job.ckpt.stored(d)
    # the region's rank count changed (FSDP reshards the model and optimizer): a rank
    # keeps what of its own state still fits; residuals are of the old shards
    reshaped = not _fits(state[own], own, stored)
    if reshaped:
        state[own] = {k: v for k, v in state[own].items() if k != "residuals"}
    donor = None
    if not _fits(state[own], own, stored):  # a new rank: the counters (the same on every
        # rank) from a peer; its loader, generator and residuals start fresh
        donor = min({k.split(".")[0] for k in stored if k.startswith("rank")})
        del state[own]
        state[donor] = {"counters": {"step": 0, "tokens": 0, "merges": 0}}
    job.ckpt.load(d, state)
    if reshaped:
        job.emit("resharded", step=step_of(d), counters_from=donor or own)
    if donor is not None:
        c = state[donor]["counters"]
        job.step, job.tokens = int(c["step"]), int(c["tokens"])
        if job.diloco is not None:
            job.diloco.merges = int(c["merges"])
    mine = state[own] if donor is None else None
    if job.diloco is None:
        job.model.load_state_dict(state["model"])
        job.opt.load_state_dict(state["optim"])
    else:
        reg = state[f"region{job.topo.region_index}"]
        job.model.load_state_dict(reg["model"])
        job.opt.load_state_dict(reg["optim"])
        job.diloco.load_state_dict(as_local(state["global"]))
        if "diloco" in reg:
            job.diloco.load_region_state_dict(as_local(reg["diloco"]))
    if mine is not None:  # else: a new rank's loader, generator and residuals start fresh
        job.loader.load_state_dict(mine["loader"])
        if job.privacy is not None:
            job.privacy.load_state_dict(mine["privacy"])
        torch.set_rng_state(mine["rng"])
        if "residuals" in mine:
            job.sync.residuals = {int(k): v for k, v in mine["residuals"].items()}
        c = mine["counters"]
        job.step, job.tokens = int(c["step"]), int(c["tokens"])
        if job.diloco is not None:
            job.diloco.merges = int(c["merges"])
    job.metrics.restarts.inc()
    return step_of(d)


def _fits(tree: Any, prefix: str, stored: dict[str, Any]) -> bool:
    """Whether every leaf of `tree` is stored under its flattened key, tensors in the same
    shape (DCP refuses a template key it does not find)."""
    if isinstance(tree, dict):
        return all(_fits(v, f"{prefix}.{k}", stored) for k, v in tree.items())
    if isinstance(tree, list | tuple):
        return all(_fits(v, f"{prefix}.{i}", stored) for i, v in enumerate(tree))
    meta = stored.get(prefix)
    if meta is None:
        return False
    size = getattr(meta, "size", None)
    return not isinstance(tree, torch.Tensor) or size is None or tuple(size) == tuple(tree.shape)


def final_state(job: Job) -> dict[str, torch.Tensor]:
    """The weights final.pt holds, whole: under FSDP gathered over the region (a
    collective: every rank calls it), else the model's own state."""
    if job.sync.sharded:
        return full_state_dict(job.model)
    return job.model.state_dict()


def save_final(job: Job, run_dir: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """The run's weights at its end (`state`, else the model's), as <run_dir>/final.pt,
    replaced atomically (a kill mid-write leaves the previous file whole: the final step
    is not checkpointed). The caller picks the one writer (`first_to_finish` under fault
    tolerance)."""
    path = run_dir / "final.pt"
    for stale in run_dir.glob(f".{path.name}.*.tmp"):  # a writer killed mid-save
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(state if state is not None else job.model.state_dict(), tmp)
        os.replace(tmp, path)
    # a full disk, the run dir gone: retraining would not help (torch's writer reports
    # them as RuntimeError: "PytorchStreamWriter failed writing file", "Parent directory")
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:120]
        raise OutputError(
            f"cannot write the final weights {path} ({why}); free space or "
            "restore the run dir, then run again: it resumes from the last checkpoint"
        ) from None


def first_to_finish(run_dir: Path) -> bool:
    """fault_tolerance: whether this region leader is the first of this launch to finish,
    so the one to write final.pt. The launcher counts the first region done as the run's
    end; a region finishing later (min_replicas 1 lets one train on alone) must not
    replace those weights with its own."""
    try:
        os.close(os.open(run_dir / FINAL_CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True
