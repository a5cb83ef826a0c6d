"""The gradient buffer (training.gradsync.GradBuffer): gradients as views of one flat
tensor give the same values as autograd's own, are read and written in place by the
in-region average and the per-step sync, and a gradient replaced behind its back is
copied instead, never lost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from training.comm.topology import Topology, make_groups
from training.gradsync import (
    GradBuffer,
    buckets,
    flat_grads,
    hierarchical_step,
    put,
    region_average_grads,
)
from training.models.deepseek import build_model
from training.spec import CodecSpec
from training.sync.codec import Codec
from training.sync.hier import HierarchicalAllReduce
from training.testing import make_spec, run_world

pytestmark = pytest.mark.timeout(180)
REGIONS, LOCAL = 3, 2
KEY = bytes(range(32))


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {
            "a": torch.nn.Linear(4, 3),
            "unused": torch.nn.Linear(4, 3),
            "b": torch.nn.Linear(3, 2),
        }
    )


def _backward(model: torch.nn.ModuleDict, seed: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    model["b"](model["a"](x)).square().sum().backward()


def test_gradients_in_the_buffer_equal_autograds_own_and_are_views_of_it() -> None:
    ref, mod = _model(), _model()
    buf = GradBuffer.of(mod)
    assert buf is not None
    for seed in range(3):  # the second and third backward accumulate into zeroed views
        ref.zero_grad(set_to_none=True)
        _backward(ref, seed)
        buf.zero()
        _backward(mod, seed)
        for (n, p), q in zip(ref.named_parameters(), mod.parameters(), strict=True):
            assert q.grad is not None and q.grad.data_ptr() != p.data_ptr(), n
            if p.grad is None:  # the unused layer: zeros in the buffer
                assert torch.count_nonzero(q.grad) == 0, n
            else:
                assert torch.equal(p.grad, q.grad), n
        assert torch.equal(buf.flat, flat_grads(list(mod.parameters())))


def test_a_bucket_is_a_slice_of_the_buffer_unless_its_gradients_were_replaced() -> None:
    mod = _model()
    buf = GradBuffer.of(mod)
    assert buf is not None
    buf.zero()
    _backward(mod, 0)
    params = list(mod.parameters())
    groups = buckets(params, 13 * 4 / 2**20)  # 13 values a bucket: 5 buckets
    assert len(groups) > 2
    for group in groups:
        view = flat_grads(group, buf)
        assert view.data_ptr() >= buf.flat.data_ptr()  # no copy: a slice of the buffer
        assert torch.equal(view, flat_grads(group))
        put(group, torch.full_like(view, 7.0), buf)  # written in place, through the views
        assert all(p.grad is not None and torch.all(p.grad == 7.0) for p in group)
    assert buf.slice([params[1], params[0]]) is None  # not consecutive
    assert buf.slice(params[2:]) is not None
    replaced = torch.full_like(params[3], 5.0)
    params[3].grad = replaced  # as DP-SGD does: the view no longer is the gradient
    assert buf.slice(params[2:]) is None
    flat = flat_grads(params[2:], buf)  # copied from the gradients as they are
    at = params[2].numel()
    assert torch.equal(flat[at : at + replaced.numel()], replaced.reshape(-1))
    put(params[2:], torch.arange(flat.numel(), dtype=flat.dtype), buf)  # per parameter
    assert params[3].grad is replaced and replaced.reshape(-1)[0] == at
    buf.zero()  # the view is the gradient again
    assert params[3].grad is buf.views[3] and buf.slice(params) is not None


def test_no_buffer_for_parameters_of_several_dtypes() -> None:
    mod = _model()
    mod["b"].double()
    assert GradBuffer.of(mod) is None


def _steps(rank: int, world: int) -> dict[str, Any]:
    """Two per-step syncs and two in-region averages of the tiny model's gradients, with
    the buffer and with autograd's own gradients (each with a fresh sync of its own)."""
    spec = make_spec(REGIONS, LOCAL)
    topo = Topology.of(spec, rank)
    groups = make_groups(topo, torch.device("cpu"))
    codec = CodecSpec(quantize="int8", cipher="sm4-gcm", block_size=64)
    out: dict[str, Any] = {}
    for mode in ("buffer", "autograd"):
        torch.manual_seed(0)
        model = build_model("deepseek-tiny")
        buf = GradBuffer.of(model) if mode == "buffer" else None
        sync = HierarchicalAllReduce(topo, groups, Codec(codec, KEY), spec.run_id)
        job = SimpleNamespace(model=model, topo=topo, groups=groups, grads=buf)
        grads = []
        for step in range(4):
            if buf is not None:
                buf.zero()
            else:
                model.zero_grad(set_to_none=True)
            g = torch.Generator().manual_seed(10 * rank + step)
            model.loss(torch.randint(0, 256, (2, 17), generator=g)).backward()
            if step < 2:
                hierarchical_step(model, sync, step, 1.0, buf)
            else:
                region_average_grads(job)  # type: ignore[arg-type]
            grads.append(flat_grads(list(model.parameters())).clone())
            if buf is not None:
                assert all(p.grad is v for p, v in zip(buf.params, buf.views, strict=True))
        out[mode] = grads
    return out


def test_syncs_on_the_buffer_are_bitwise_those_on_autograds_gradients() -> None:
    out = run_world(_steps, REGIONS * LOCAL)
    for r, got in enumerate(out):
        for step, (a, b) in enumerate(zip(got["buffer"], got["autograd"], strict=True)):
            assert torch.equal(a, b), (r, step)
            assert torch.count_nonzero(a) > 0
    for step in range(2):  # the per-step sync: every rank alike
        assert all(torch.equal(o["buffer"][step], out[0]["buffer"][step]) for o in out)
    for step in (2, 3):  # the in-region average: both ranks of a region alike, regions apart
        for reg in range(REGIONS):
            a, b = out[LOCAL * reg]["buffer"][step], out[LOCAL * reg + 1]["buffer"][step]
            assert torch.equal(a, b)
        assert not torch.equal(out[0]["buffer"][step], out[LOCAL]["buffer"][step])
