"""DiLoCo (Douillard et al. 2023, as in torchft's `local_sgd.DiLoCo`): each region trains
its own replica with in-region gradient averaging, and every H inner steps (or T minutes)
the regions merge. The merge sends each region's pseudo-gradient (global - local) through
the cross-region sync (codec, secure aggregation, error feedback), and an outer optimizer
(SGD, Nesterov when momentum > 0) steps the global copy with the average; every replica then
restarts from the new global weights.

Warm-up: the first `warmup_steps` steps sync every step across regions (as `sync: allreduce`
does); when they end, the global copy is taken from the (identical) weights and the merge
schedule starts counting.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from training.spec import DilocoSpec


class Reducer(Protocol):
    """The cross-region average (training.hier.HierarchicalAllReduce)."""

    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor: ...

    def clear_residuals(self) -> None:
        """Forget the error-feedback residuals: a gradient's must not carry into merges."""


class Digest(Protocol):
    """Fed every bucket's pseudo-gradient as sent (training.ledger_hooks.hasher)."""

    def update(self, t: torch.Tensor) -> Any: ...


class DiLoCo:
    """The global weights, the outer optimizer and the merge of one rank.

    `buckets`: the model's parameters in the buckets the sync sends (fixed for the run);
    every rank of the world must use the same bucketing."""

    def __init__(
        self,
        buckets: Sequence[Sequence[torch.nn.Parameter]],
        spec: DilocoSpec,
        sync: Reducer,
    ) -> None:
        self.buckets = [list(b) for b in buckets]
        self.params = [p for b in self.buckets for p in b]
        self.spec = spec
        self.sync = sync
        self.global_params = [p.detach().clone() for p in self.params]
        m = spec.outer_momentum
        self.outer = torch.optim.SGD(  # Nesterov needs momentum; 0 is a plain outer SGD step
            self.global_params, lr=spec.outer_lr, momentum=m, nesterov=m > 0
        )
        self.merges = 0
        self.last_merge = time.monotonic()

    # -- schedule ---------------------------------------------------------------------
    def warming(self, step: int) -> bool:
        """Whether step `step` (0-based, about to run) syncs gradients across regions."""
        return step < self.spec.warmup_steps

    def due(self, step: int, steps: int) -> bool:
        """Step-based: whether a merge follows step `step` of a run of `steps` steps."""
        s, w, h = step + 1, self.spec.warmup_steps, self.spec.every_steps
        if s <= w:
            return False
        return s == steps or (h is not None and (s - w) % h == 0)

    def time_due(self, step: int, now: float) -> bool:
        """Time-based: whether this rank's clock says a merge is due after step `step`."""
        t = self.spec.interval_minutes
        return (
            t is not None and step + 1 > self.spec.warmup_steps and now - self.last_merge >= 60 * t
        )

    def step_done(self, step: int) -> None:
        """After step `step`'s inner update: the last warm-up step starts DiLoCo from the
        current weights (every rank holds the same ones after synced steps)."""
        if step + 1 != self.spec.warmup_steps:
            return
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params, strict=True):
                g.copy_(p)
        self.sync.clear_residuals()  # gradient residuals do not carry into pseudo-gradients
        self.last_merge = time.monotonic()

    # -- merge ------------------------------------------------------------------------
    def merge(self, step: int, digest: Digest | None = None) -> None:
        """Average (global - local) across regions, one bucket at a time through the sync,
        step the outer optimizer on it, and set every local parameter to the new global."""
        i = 0
        for b, params in enumerate(self.buckets):
            gl = self.global_params[i : i + len(params)]
            delta = torch.cat(
                [(g - p.detach()).reshape(-1) for g, p in zip(gl, params, strict=True)]
            )
            if digest is not None:
                digest.update(delta)
            avg = self.sync.all_reduce(delta, step=step, bucket=b)
            _set_grads(avg, gl)
            i += len(params)
        self.outer.step()
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params, strict=True):
                p.copy_(g)
        self.merges += 1
        self.last_merge = time.monotonic()

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global weights and the outer optimizer (the same on every rank). The
        tensors are the live ones: a checkpoint load fills them in place."""
        return {
            "params": {str(i): p for i, p in enumerate(self.global_params)},
            "outer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.outer.load_state_dict(state["outer"])
        with torch.no_grad():
            for g, v in zip(self.global_params, state["params"].values(), strict=True):
                g.copy_(v)


OUTER_LR_ANCHORS = ((4, 0.6), (8, 0.8))
"""(replicas, best outer lr) anchors of issue #16 for Nesterov momentum 0.9; not measured
by geotrain (docs/architecture.md, "DiLoCo outer optimizer")."""


def suggested_outer_lr(regions: int) -> float:
    """The outer lr rule: 0.6 up to 4 regions (replicas), 0.8 from 8, linear between."""
    (r0, lr0), (r1, lr1) = OUTER_LR_ANCHORS
    if regions <= r0:
        return lr0
    if regions >= r1:
        return lr1
    return lr0 + (lr1 - lr0) * (regions - r0) / (r1 - r0)


def outer_hint(regions: int, outer_lr: float, outer_momentum: float) -> str | None:
    """A `geotrain validate` hint when the outer optimizer is far from the rule (None: near)."""
    lr = suggested_outer_lr(regions)
    if abs(outer_lr - lr) <= 0.1 + 1e-9 and outer_momentum == 0.9:
        return None
    return (
        f"hint: training.diloco outer_lr {outer_lr:g}, outer_momentum {outer_momentum:g} with "
        f"{regions} regions; the rule suggests outer_lr {lr:.2f} with Nesterov momentum 0.9 "
        "(docs/architecture.md, DiLoCo outer optimizer)"
    )


def _set_grads(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Give each tensor its slice of `flat` as gradient (the outer optimizer's input)."""
    i = 0
    for t in tensors:
        n = t.numel()
        t.grad = flat[i : i + n].view_as(t).clone()
        i += n
