"""Parameters cut into sync buckets, and gradients as views of one flat tensor: the
units a sync sends (training.sync.hier) and the flat slices it reads them from."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

T = TypeVar("T", bound=torch.Tensor)


def buckets(params: list[T], bucket_mb: float) -> list[list[T]]:
    """Parameters in order, cut into buckets of at most `bucket_mb` MiB of fp32 (a larger
    parameter alone): the unit one `all_reduce` call sends, its residuals keyed by index."""
    limit = int(bucket_mb * 2**20 / 4)
    out: list[list[T]] = [[]]
    size = 0
    for p in params:
        if out[-1] and size + p.numel() > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


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
