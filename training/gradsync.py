"""Gradient and weight synchronisation of one step: per-step hierarchical all-reduce
(training.hier), the region-only average of DiLoCo's inner steps, and the periodic merge
(training.diloco); the buckets of a sync share its cross-region exchanges."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from training import balance, ledger_hooks
from training.hier import HierarchicalAllReduce, sync_buckets

if TYPE_CHECKING:
    from training.job import Job


class GradBuffer:
    """Every parameter's gradient as a view of one flat tensor, in parameter order (what
    DDP's `gradient_as_bucket_view` does). Backward accumulates into the views in place,
    so a sync bucket (a run of consecutive parameters) is a slice of `flat`: the
    in-region all-reduce works on it in place, and a sync's buckets are read without
    copying every gradient into a new flat tensor and back (benchmarks/grad_buffer.py:
    2 ms less CPU a step at 2.45M parameters, 3 regions x 2 ranks).

    Only steps that flatten gradients use it (`zero_grads`): a one-rank region's inner
    DiLoCo steps keep `zero_grad(set_to_none=True)`, where autograd hands over its
    gradients without a copy. A gradient something else replaced (DP-SGD's noisy mean,
    a test) is no longer its view: `slice` then gives None and the caller copies, and
    the next `zero` puts the view back."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        first = params[0]
        self.params = params
        n = sum(p.numel() for p in params)
        self.flat = torch.zeros(n, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        self.where: dict[int, tuple[int, int]] = {}
        """id(parameter) -> (its index, its first value's offset in `flat`)."""
        at = 0
        for k, p in enumerate(params):
            self.where[id(p)] = (k, at)
            self.views.append(self.flat[at : at + p.numel()].view_as(p))
            at += p.numel()

    @classmethod
    def of(cls, model: torch.nn.Module) -> GradBuffer | None:
        """None where one flat tensor cannot hold every gradient (parameters of several
        dtypes or devices) or there is nothing to hold."""
        params = [p for p in model.parameters() if p.requires_grad]
        kinds = {(p.dtype, p.device) for p in params}
        return cls(params) if len(kinds) == 1 else None

    def zero(self) -> None:
        """Every gradient back to its view, all zeros (for the next backward)."""
        for p, v in zip(self.params, self.views, strict=True):
            if p.grad is not v:
                p.grad = v
        self.flat.zero_()

    def slice(self, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
        """`params`' gradients as one slice of `flat`, or None where they are not a run
        of consecutive parameters whose gradients are still their views."""
        if not params or id(params[0]) not in self.where:
            return None
        k, start = self.where[id(params[0])]
        at = start
        for p in params:
            if self.where.get(id(p)) != (k, at) or p.grad is not self.views[k]:
                return None
            k, at = k + 1, at + p.numel()
        return self.flat[start:at]


def zero_grads(job: Job) -> None:
    """Before a step's backward: into the flat buffer where the step flattens its
    gradients (a per-step sync, or an in-region average over several ranks), else
    set to None."""
    flattens = job.topo.local_size > 1 or job.diloco is None or job.diloco.warming(job.step)
    if job.grads is not None and flattens:
        job.grads.zero()
    else:
        job.opt.zero_grad(set_to_none=True)


def flat_grads(params: list[torch.nn.Parameter], buf: GradBuffer | None = None) -> torch.Tensor:
    """`params`' gradients as one flat tensor (zeros where autograd left none): a slice of
    `buf` where it holds them (no copy: writes to it are the gradients), else a new
    tensor."""
    view = buf.slice(params) if buf is not None else None
    if view is not None:
        return view
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )


def put(params: list[torch.nn.Parameter], flat: torch.Tensor, buf: GradBuffer | None) -> None:
    """Set `params`' gradients to `flat`'s values: one copy into `buf`'s slice where it
    holds them, else per parameter."""
    view = buf.slice(params) if buf is not None else None
    if view is None:
        scatter(flat, grads_of(params))
    elif view.data_ptr() != flat.data_ptr():
        view.copy_(flat)


def scatter(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    i = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[i : i + n].view_as(t))
        i += n


def grads_of(params: list[Any]) -> list[torch.Tensor]:
    """Gradients of `params`, created as zeros where autograd left none (unused experts)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


def buckets(params: list[torch.nn.Parameter], bucket_mb: float) -> list[list[torch.nn.Parameter]]:
    return sync_buckets(params, bucket_mb)


def sync_grads(job: Job) -> None:
    """allreduce mode: every bucket through the hierarchical compressed sync."""
    hierarchical_step(job.model, job.sync, job.step, job.spec.bucket_mb, job.grads)


def hierarchical_step(
    model: torch.nn.Module,
    sync: HierarchicalAllReduce,
    step: int,
    bucket_mb: float,
    buf: GradBuffer | None = None,
) -> None:
    """Replace every gradient by its global average through `sync` (every bucket in one
    sync: its exchanges cross the WAN once per stage, not once per bucket)."""
    groups = buckets(list(model.parameters()), bucket_mb)
    flats = [flat_grads(params, buf) for params in groups]
    synced = sync.all_reduce_many(flats, step, list(range(len(groups))))
    for params, avg in zip(groups, synced, strict=True):
        put(params, avg, buf)


def region_average_grads(job: Job) -> None:
    """diloco inner step: gradients averaged inside the region only. A region of one rank
    has nothing to average: its gradients stay, zeros where autograd left none (as after
    an average). The copy in, the one-rank all-reduce and the copy out cost 4 ms of a
    60 ms step at 2.45M parameters (3 one-rank regions on this 2-core machine). With
    several ranks the all-reduce runs on the gradient buffer in place (`GradBuffer`)."""
    params = list(job.model.parameters())
    if job.topo.local_size == 1:
        grads_of(params)
        return
    flat = flat_grads(params, job.grads)  # the gradients themselves where job.grads holds them
    dist.all_reduce(flat, group=job.groups.intra)
    flat.div_(job.topo.local_size)
    put(params, flat, job.grads)


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
    for applied in done:
        ledger_hooks.merged(job, applied)
        job.metrics.merges.inc()
    return bool(done)
