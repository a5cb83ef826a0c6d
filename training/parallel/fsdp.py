"""FSDP2 inside a region, and the views of its shards that the sync, DiLoCo, checkpoints
and the ledger need.

`shard` wraps each transformer block (a Hugging Face model's `_no_split_modules`, else
the items of the model's top-level ModuleLists), untied input and output embeddings, and
then the root with `fully_shard` on a 1-D mesh of the region's group. After backward
every gradient is a DTensor whose local tensor is the region's mean of this rank's shard
(FSDP's reduce-scatter); `local_grads` hands those local tensors to the cross-region
sync, which averages each shard with the same shard of the other regions. The optimizer
steps on the sharded parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from training.comm.topology import Groups
from training.errors import SpecError
from training.spec import ParallelSpec


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units to shard one by one: the classes a Hugging Face model names in
    `_no_split_modules` (its decoder layers), else the items of every ModuleList that is
    not inside another ModuleList (a preset's blocks, not their experts)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    out: list[nn.Module] = []
    for name, m in model.named_modules():
        inner = any(part.isdigit() for part in name.split("."))
        if isinstance(m, nn.ModuleList) and not inner:
            out.extend(m)
    return out


def embeddings(model: nn.Module) -> list[nn.Module]:
    """A Hugging Face model's input and output embeddings, each its own unit when they
    share no weight: with a large vocabulary they are the largest modules, and left in the
    root unit both would be gathered whole, with their whole gradients, for the entire
    forward and backward (what torchtitan shards apart too)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if get_in is not None else None
    head = get_out() if get_out is not None else None
    mods = [m for m in (emb, head) if isinstance(m, nn.Module)]
    weights = [getattr(m, "weight", None) for m in mods]
    if len(mods) == 2 and weights[0] is weights[1]:  # tied: one parameter, one unit (root)
        return []
    return mods


def shard(model: nn.Module, groups: Groups, spec: ParallelSpec) -> nn.Module:
    """`model` sharded in place over the region (groups.intra) and returned."""
    mesh = DeviceMesh.from_group(groups.intra, groups.device.type)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if spec.param_dtype == "bf16"
        else MixedPrecisionPolicy()
    )
    if spec.activation_checkpointing:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise SpecError(
                f"parallel.activation_checkpointing needs an hf: model (a {type(model).__name__} "
                "has no gradient_checkpointing_enable); turn it off, or checkpoint inside "
                "your python: factory's module"
            )
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    units = blocks(model) + embeddings(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes reach the DTensor), else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    """Every trainable parameter's gradient as this rank's local shard, zeros created
    where autograd left none (experts no token reached), in parameter order."""
    out = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(local(p.grad))
    return out


def local_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters over this rank's local shards, sharing their storage (DiLoCo keeps its
    global copy and writes the merged weights through them)."""
    return [
        nn.Parameter(local(p).detach(), requires_grad=False)
        for p in model.parameters()
        if p.requires_grad
    ]


def full_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Whole tensors: a DTensor gathered over its mesh (a collective: every rank of the
    region calls it, in the same order), others as they are."""
    return [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as whole CPU tensors (a collective under FSDP)."""
    state = model.state_dict()
    return {k: v.detach().cpu() for k, v in zip(state, full_tensors(state.values()), strict=True)}


def _dt(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Plain local shard `t` as a DTensor laid out like parameter `p` (no copy)."""
    if not isinstance(p, DTensor) or isinstance(t, DTensor) or t.shape != local(p).shape:
        return t
    return DTensor.from_local(
        t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def diloco_dtensors(state: dict[str, Any], like: Sequence[torch.Tensor]) -> dict[str, Any]:
    """DiLoCo's state (training.sync.diloco: `params`, `drift`, `own_drift` and the outer
    optimizer's per-parameter state, each indexed by parameter) with every local shard as
    a DTensor laid out like the model's parameter of that index, so DCP saves each shard
    once per rank and reshards it on load."""
    out = dict(state)
    for key in ("params", "drift", "own_drift"):
        if key in out:
            out[key] = {i: _dt(v, like[int(i)]) for i, v in out[key].items()}
    if "outer" in out:
        outer = dict(out["outer"])
        outer["state"] = {
            i: {k: _dt(v, like[int(i)]) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in outer["state"].items()
        }
        out["outer"] = outer
    return out


def whole(shards: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Local shards laid out like `like`'s parameters, gathered whole (a collective)."""
    return full_tensors(_dt(s, p) for s, p in zip(shards, like, strict=True))


def as_local(tree: Any) -> Any:
    """`tree` with every DTensor replaced by its local shard."""
    if isinstance(tree, dict):
        return {k: as_local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [as_local(v) for v in tree]
    return local(tree) if isinstance(tree, torch.Tensor) else tree
