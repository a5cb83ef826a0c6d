"""Heterogeneous pools: regions of different sizes, the sample-weighted merge, and the
throughput balance's assignment (training.comm.topology, training.sync.hier, training.balance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from infra.model import load_stack
from infra.model.load import STACKS_DIR
from infra.plan import build_plan
from infra.render import render_launch_spec
from training.comm.topology import Topology, make_groups
from training.spec import CodecSpec
from training.sync.balance import Balancer, assign, fit
from training.sync.codec import Codec
from training.sync.hier import HierarchicalAllReduce, flat_average
from training.testing import make_spec, run_world

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))


def _sync(rank: int, sizes: tuple[int, ...], quant: str) -> HierarchicalAllReduce:
    spec = make_spec(len(sizes), sizes)
    topo = Topology.of(spec, rank)
    codec = Codec(CodecSpec(quantize=quant, block_size=64), KEY)
    return HierarchicalAllReduce(topo, make_groups(topo, torch.device("cpu")), codec, "r")


def _uneven(rank: int, world: int, sizes: tuple[int, ...], quant: str) -> dict[str, Any]:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(rank))  # 1001: padding
    sync = _sync(rank, sizes, quant)
    return {"hier": sync.all_reduce(x, step=1), "flat": flat_average(x)}


@pytest.mark.parametrize(("sizes", "quant"), [((1, 2), "none"), ((2, 1, 3), "int8")])
def test_regions_of_different_sizes_average_over_every_rank_identically(
    sizes: tuple[int, ...], quant: str
) -> None:
    out = run_world(_uneven, sum(sizes), sizes, quant)
    bound = 1e-6 if quant == "none" else 2e-2
    for r in out:
        rel = ((r["hier"] - r["flat"]).norm() / r["flat"].norm()).item()
        assert rel <= bound, rel
        assert torch.equal(r["hier"], out[0]["hier"])  # ranks off the cross groups too


BATCHES = (1, 3, 2)
"""Samples per rank of a (1, 2)-region world after a balance: 6 = 3 ranks x batch_size 2."""


def _model_and_data(rank: int) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    g = torch.Generator().manual_seed(10 + rank)
    return (
        model,
        torch.randn(BATCHES[rank], 5, generator=g),
        torch.randn(BATCHES[rank], 3, generator=g),
    )


def _grad(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _weighted(rank: int, world: int) -> dict[str, torch.Tensor]:
    model, x, y = _model_and_data(rank)
    sync = _sync(rank, (1, 2), "none")
    sync.scale = BATCHES[rank] / 2  # samples / the mean per rank (training.balance)
    data = [_model_and_data(r)[1:] for r in range(world)]  # every rank's, for the reference
    whole = _grad(model, torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data]))
    return {"merged": sync.all_reduce(_grad(model, x, y), step=0), "whole": whole}


def test_weighted_merge_of_uneven_batches_equals_the_gradient_over_every_sample() -> None:
    out = run_world(_weighted, 3)
    for r in out:
        torch.testing.assert_close(r["merged"], r["whole"], rtol=1e-5, atol=1e-6)
    # an unweighted average of the ranks' gradients is a different gradient
    plain = torch.stack([_grad(*_model_and_data(r)) for r in range(3)]).mean(0)
    assert not torch.allclose(plain, out[0]["whole"], rtol=1e-3, atol=1e-4)


def test_assignment_keeps_the_global_batch_and_gives_the_fast_region_more() -> None:
    b = assign([(0, 2.0), (0, 1.0)], [1, 2], 6)  # region 0 twice as slow per sample
    assert b == [2, 2]  # 1 x 2 + 2 x 2 = 6; [4, 1] would take 8 s, [2, 2] 4 s
    costs = [(0.0, 3.0), (0.0, 1.0), (0.0, 1.0)]
    b = assign(costs, [2, 2, 2], 24)
    assert sum(2 * x for x in b) == 24 and b[0] < b[1]
    assert max(x * s for x, (_, s) in zip(b, costs, strict=True)) == 6  # the optimum
    assert assign([(0, 1.0), (0, 1.0)], [1, 2], 6) == [2, 2]  # equal speed: equal batches
    # a fixed cost per step (optimizer, codec) moves samples to the other region
    assert assign([(0.2, 0.1), (0.0, 0.1)], [1, 1], 8) == [3, 5]


def test_a_region_time_is_fitted_through_its_two_measurements() -> None:
    assert fit([(4, 0.8)]) == (0.0, 0.2)
    fixed, per_sample = fit([(4, 0.8), (2, 0.6)])
    assert (fixed, per_sample) == pytest.approx((0.4, 0.1))
    assert fit([(4, 0.8), (2, 0.9)]) == pytest.approx((0.0, 0.45))  # noise: proportional


class _Offers:
    """Stands in for the authenticated all-gather: every rank's (region, batch, seconds)
    of each round, checked against what this rank offers."""

    def __init__(self, rounds: list[list[list[float]]]) -> None:
        self.rounds = rounds

    def gather(self, value: Any) -> list[Any]:
        offers = self.rounds.pop(0)
        assert value in offers
        return offers


def test_balancer_assigns_twice_and_weights_a_merge_that_spans_the_batches() -> None:
    rounds = [[[0, 4, 1.6], [1, 4, 0.4], [1, 4, 0.4]], [[0, 2, 1.0], [1, 5, 0.5], [1, 5, 0.5]]]
    bal = Balancer(_Offers(rounds), batch_size=4, sizes=(1, 2), region=0, measure=2)
    bal.started(0, 4)
    assert bal.after_step(0, 9.9) is None  # a batch's first step is not measured
    assert bal.after_step(1, 1.6) is None
    assert bal.after_step(2, 1.6) == 2  # proportional: 0.4 s/sample vs 0.1 -> [2, 5]
    assert bal.assigned == [2, 5] and bal.scale() == 0.5
    assert bal.after_step(3, 5.0) is None  # the new batch's first step
    assert bal.after_step(4, 1.0) is None
    # beijing: 1.0 s at 2 and 1.6 s at 4: 0.4 s fixed + 0.3 s/sample; frankfurt 0.1/sample
    assert bal.after_step(5, 1.0) == 2
    assert bal.assigned == [2, 5] and bal.after_step(7, 1.0) is None  # two rounds only
    # a merge after step 5 covers steps 0..5: 3 steps at batch 4, 3 at batch 2
    assert bal.merge_scale(5, warmup=0) == pytest.approx((3 * 4 + 3 * 2) / (6 * 4))
    assert bal.merge_scale(7, warmup=0) == pytest.approx(0.5)  # steps 6..7 at batch 2


def test_a_stack_of_uneven_regions_renders_a_launch_spec_with_the_balance(
    tmp_path: Path,
) -> None:
    doc = yaml.safe_load((STACKS_DIR / "Pulumi.local.yaml").read_text())
    cfg = doc["config"]
    cfg["geotrain:regions"][0]["pool"]["nodes"][0]["gpus"] = 1
    cfg["geotrain:regions"][2]["pool"]["nodes"][0]["gpus"] = 3
    cfg["geotrain:training"]["balance"] = "throughput"
    path = tmp_path / "Pulumi.uneven.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec = render_launch_spec(build_plan(load_stack(str(path))))
    assert [sum(n.nprocs for n in r.nodes) for r in spec.regions] == [1, 2, 3]
    assert spec.balance == "throughput" and spec.world_size == 6
    topo = Topology.of(spec, 5)
    assert (topo.region, topo.local_rank, topo.cross_size, topo.in_cross) == (
        "silicon-valley",
        2,
        1,
        False,
    )
    assert topo.peer_ranks(0) == [0, 1, 3]
