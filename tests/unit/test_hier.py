"""Hierarchical all-reduce on a real 3-region x 2-rank gloo world (spawned processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from training.comm.topology import Topology, make_groups
from training.errors import PayloadRejected, SpecError
from training.spec import CodecSpec
from training.sync.codec import Codec
from training.sync.hier import HierarchicalAllReduce, HookState, ddp_comm_hook, flat_average
from training.sync.linkprobe import LENGTH, message, payload_of
from training.testing import make_spec, run_world

pytestmark = pytest.mark.timeout(180)
REGIONS, LOCAL = 3, 2
WORLD = REGIONS * LOCAL
KEY = bytes(range(32))


def _sync(
    rank: int, quant: str, cipher: str = "sm4-gcm", ef: bool = True, codec: Codec | None = None
) -> HierarchicalAllReduce:
    spec = make_spec(REGIONS, LOCAL)
    topo = Topology.of(spec, rank)
    groups = make_groups(topo, torch.device("cpu"))
    codec = codec or Codec(CodecSpec(quantize=quant, cipher=cipher, block_size=64), KEY)
    return HierarchicalAllReduce(topo, groups, codec, spec.run_id, error_feedback=ef)


def _compare(rank: int, world: int, quant: str, integer: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + rank)
    n = 4099  # not a multiple of L: exercises padding
    x = (
        torch.randint(-50, 50, (n,), generator=g).float()
        if integer
        else torch.randn(n, generator=g)
    )
    sync = _sync(rank, quant)
    return {
        "hier": sync.all_reduce(x, step=1),
        "flat": flat_average(x),
        "wire": sync.stats.cross_wire_bytes,
        "raw": sync.stats.cross_raw_bytes,
    }


def test_fp32_hierarchical_equals_flat_all_reduce_bitwise_on_exact_values() -> None:
    out = run_world(_compare, WORLD, "none", True)
    for r in out:
        assert torch.equal(r["hier"], r["flat"])
    assert all(torch.equal(out[0]["hier"], r["hier"]) for r in out)


@pytest.mark.parametrize(
    ("quant", "bound"), [("none", 1e-6), ("fp16", 1e-3), ("int8", 2e-2), ("int4", 0.2)]
)
def test_compressed_sync_is_within_bounds_and_identical_on_every_rank(
    quant: str, bound: float
) -> None:
    out = run_world(_compare, WORLD, quant, False)
    for r in out:
        rel = ((r["hier"] - r["flat"]).norm() / r["flat"].norm()).item()
        assert rel <= bound, f"{quant}: {rel}"
        # every region decoded the same payloads and summed in the same order
        assert torch.equal(r["hier"], out[0]["hier"])
    if quant in ("int8", "int4"):
        # small pieces (683 values): headers and scales weigh more than at real sizes
        assert out[0]["wire"] < out[0]["raw"] / (3 if quant == "int8" else 5)


def _feedback(rank: int, world: int, ef: bool) -> list[float]:
    sync = _sync(rank, "int4", ef=ef)
    g = torch.Generator().manual_seed(7 + rank)
    bias = torch.randn(2048, generator=torch.Generator().manual_seed(99)) * 0.1
    err_sum = torch.zeros(2048)
    norms = []
    for step in range(100):
        x = bias + 0.01 * torch.randn(2048, generator=g)  # a persistent gradient direction
        err_sum += sync.all_reduce(x, step=step) - flat_average(x)
        norms.append(err_sum.norm().item())
    return norms


def test_error_feedback_keeps_accumulated_error_bounded_over_100_steps() -> None:
    with_ef = run_world(_feedback, WORLD, True)[0]
    without = run_world(_feedback, WORLD, False)[0]
    assert max(with_ef[50:]) < 2.0 * max(with_ef[:10]) + 1e-6, with_ef[::10]
    assert with_ef[-1] < 0.1 * without[-1], (with_ef[-1], without[-1])


class _Tampering(Codec):
    """Failure injector: flips one ciphertext byte of every payload it sends."""

    def encode(self, x: torch.Tensor, addr: Any) -> Any:
        payload, decoded = super().encode(x, addr)
        b = bytearray(payload)
        b[-20] ^= 0xFF
        return bytes(b), decoded


def _tampered(rank: int, world: int, allgather: bool) -> tuple[str, float]:
    spec = CodecSpec(quantize="int8", cipher="sm4-gcm")
    codec = _Tampering(spec, KEY) if rank == 2 else Codec(spec, KEY)  # a frankfurt worker
    sync = _sync(rank, "int8", codec=codec)
    sync.allgather = allgather
    try:
        y = sync.all_reduce(torch.ones(1000), step=3)
    except PayloadRejected:
        return "rejected", 0.0
    except RuntimeError:  # a peer that rejected left the collective: abort, apply nothing
        return "aborted", 0.0
    return "applied", y.mean().item()


@pytest.mark.parametrize("allgather", [False, True])
def test_a_tampered_payload_is_rejected_by_its_receivers_and_never_applied(
    allgather: bool,
) -> None:
    out = run_world(_tampered, WORLD, allgather)
    # rank 2 (frankfurt, local rank 0) sends to ranks 0 and 4: both must reject it
    assert out[0][0] == "rejected" and out[4][0] == "rejected", out
    for status, value in out:
        if status == "applied":  # only ranks that never received the bad payload
            assert value == pytest.approx(1.0, abs=1e-2)
    assert [s for s, _ in out].count("applied") <= 2


class _Counting(HierarchicalAllReduce):
    """Counts the cross-region exchanges; `damage`: the first length of every frame it
    sends is off by one (a frame damaged in transit)."""

    exchanges = 0
    damage = False

    def _all_to_all_bytes(
        self, payloads: list[bytes], limits: list[int] | None = None
    ) -> list[bytes]:
        self.exchanges += 1
        if self.damage:
            payloads = [p[:3] + bytes([p[3] ^ 1]) + p[4:] if p else p for p in payloads]
        return super()._all_to_all_bytes(payloads, limits)


def _counting(rank: int, quant: str, allgather: bool = False, secure: bool = False) -> _Counting:
    spec = make_spec(REGIONS, LOCAL)
    topo = Topology.of(spec, rank)
    cs = CodecSpec(quantize=quant, cipher="sm4-gcm", block_size=64, secure_aggregation=secure)
    codec = Codec(cs, KEY)
    groups = make_groups(topo, torch.device("cpu"))
    return _Counting(topo, groups, codec, spec.run_id, allgather=allgather)


def _many(rank: int, world: int, quant: str) -> dict[str, Any]:
    many, each = _counting(rank, quant), _counting(rank, quant)
    sizes = (4099, 10, 700)  # uneven, one smaller than the pieces' padding
    out: dict[str, Any] = {"many": [], "each": []}
    for step in range(2):  # the second step carries the first one's residuals
        g = torch.Generator().manual_seed(100 * step + rank)
        xs = [torch.randn(n, generator=g) for n in sizes]
        out["many"] += many.all_reduce_many(xs, step, [0, 1, 2])
        out["each"] += [each.all_reduce(x, step, b) for b, x in enumerate(xs)]
    out["exchanges"] = (many.exchanges, each.exchanges)
    out["wire"] = (many.stats.cross_wire_bytes, each.stats.cross_wire_bytes)
    out["raw"] = (many.stats.cross_raw_bytes, each.stats.cross_raw_bytes)
    return out


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_buckets_synced_together_are_bitwise_those_synced_one_by_one_in_two_exchanges(
    quant: str,
) -> None:
    out = run_world(_many, WORLD, quant)
    for r in out:
        assert all(torch.equal(a, b) for a, b in zip(r["many"], r["each"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(r["many"], out[0]["many"], strict=True))
    for r in out:  # equal regions: every rank is in a cross group
        assert r["exchanges"] == (2 * 2, 2 * 2 * 3)  # 2 steps: 2 stages vs 2 per bucket
        assert r["raw"][0] == r["raw"][1]
        # the frames' headers: 3 lengths of 4 bytes, 2 stages, 2 peers, 2 steps
        assert r["wire"][0] == r["wire"][1] + 4 * 3 * 2 * 2 * 2


def _damaged_frame(rank: int, world: int) -> str:
    sync = _counting(rank, "int8")
    sync.damage = rank == 2  # a frankfurt worker's frames
    try:
        sync.all_reduce_many([torch.ones(300), torch.ones(50)], 0, [0, 1])
    except PayloadRejected as e:
        return "rejected: " + str(e)
    except RuntimeError:  # a peer that rejected left the collective
        return "aborted"
    return "applied"


def test_a_damaged_frame_is_refused_by_its_receivers_and_nothing_of_it_applied() -> None:
    out = run_world(_damaged_frame, WORLD)
    # rank 2 (frankfurt, local rank 0) sends to ranks 0 and 4
    for r in (0, 4):
        assert out[r].startswith("rejected: a frame of 2 payloads from rank 2"), out


def _ddp(rank: int, world: int, hooked: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hooked:
        ddp.register_comm_hook(HookState(_sync(rank, "fp16")), ddp_comm_hook)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().mean().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_ddp_comm_hook_matches_default_ddp_gradients() -> None:
    hooked = run_world(_ddp, WORLD, True)
    plain = run_world(_ddp, WORLD, False)
    for h, p in zip(hooked, plain, strict=True):
        assert ((h - p).norm() / p.norm()).item() < 2e-3
    # and the hook really ran: fp16 quantization leaves a (small) trace in every gradient
    assert all(not torch.equal(h, p) for h, p in zip(hooked, plain, strict=True))


def test_a_bounded_message_that_claims_more_than_its_limit_is_refused() -> None:
    good = message(b"payload")
    assert payload_of(torch.cat([good, torch.zeros(9, dtype=torch.uint8)]), 16, "x") == b"payload"
    forged = good.clone()
    forged[:LENGTH] = torch.frombuffer(bytearray((17).to_bytes(LENGTH, "big")), dtype=torch.uint8)
    with pytest.raises(PayloadRejected, match="region frankfurt sent a message of 17 bytes"):
        payload_of(torch.cat([forged, torch.zeros(10, dtype=torch.uint8)]), 16, "frankfurt")


def _allgather(rank: int, world: int, quant: str) -> dict[str, Any]:
    direct, whole = _counting(rank, quant), _counting(rank, quant, allgather=True)
    sizes = (60_000, 10, 701)  # one large enough that headers and scales weigh little
    out: dict[str, Any] = {"direct": [], "whole": [], "flat": []}
    for step in range(2):  # the second step carries the first one's residuals
        g = torch.Generator().manual_seed(100 * step + rank)
        if quant == "none":  # exact sums: any order gives the same bits
            xs = [torch.randint(-50, 50, (n,), generator=g).float() for n in sizes]
        else:
            xs = [torch.randn(n, generator=g) for n in sizes]
        out["direct"] += direct.all_reduce_many(xs, step, [0, 1, 2])
        out["whole"] += whole.all_reduce_many(xs, step, [0, 1, 2])
        out["flat"] += [flat_average(x) for x in xs]
    for k, s in (("d", direct), ("w", whole)):
        out[k] = (s.exchanges, s.stats.cross_wire_bytes, s.stats.cross_raw_bytes)
    # residuals kept under one exchange (a checkpoint) met by the other restart from zero
    kept = whole.residuals[0]
    out["layouts"] = (tuple(kept.shape), tuple(direct.residuals[0].shape))
    direct.residuals = whole.residuals
    again = direct.residual(0, direct.residuals[0].shape[1] // REGIONS + 1)
    out["restarted"] = (tuple(again.shape), bool(again.abs().sum() == 0), bool(kept.any()))
    return out


@pytest.mark.parametrize("quant", ["none", "int4", "ternary"])
def test_allgather_is_one_exchange_quantizes_once_and_is_identical_on_every_rank(
    quant: str,
) -> None:
    out = run_world(_allgather, WORLD, quant)
    for r in out:
        assert all(torch.equal(a, b) for a, b in zip(r["whole"], out[0]["whole"], strict=True))
        assert r["w"][0] == 2 and r["d"][0] == 4  # 2 steps: one exchange each, not two
        S = 30_000  # the first bucket's shard: 60,000 values over 2 local ranks
        assert r["layouts"] == ((1, S), (REGIONS + 1, S // REGIONS))
        assert r["restarted"] == ((REGIONS + 1, S // REGIONS + 1), True, quant != "none")
        # R / 2 times direct's values: each region's shard whole to 2 peers, not 4/3 of it
        assert r["w"][2] / r["d"][2] == pytest.approx(REGIONS / 2, rel=0.01)
        if quant == "none":  # (zstd packs the small integers of these sums unevenly)
            assert all(torch.equal(a, b) for a, b in zip(r["whole"], r["flat"], strict=True))
            continue
        # on the wire at most R / 2 times (zstd packs the quantized sums a little less)
        assert 1.2 < r["w"][1] / r["d"][1] < 1.02 * REGIONS / 2, (r["w"], r["d"])

        def err(key: str, r: dict[str, Any] = r) -> float:
            pairs = zip(r[key], r["flat"], strict=True)
            return sum(((a - f).norm() / f.norm()).item() for a, f in pairs)

        # a region's values are quantized once; direct quantizes the sums again
        assert err("whole") < 0.9 * err("direct"), (err("whole"), err("direct"))


def _allgather_secure(rank: int, world: int) -> str:
    try:
        _counting(rank, "int8", allgather=True, secure=True)
    except SpecError as e:
        return str(e)
    return "built"


def test_allgather_refuses_secure_aggregation_before_any_exchange() -> None:
    out = run_world(_allgather_secure, WORLD)
    assert all("exchange: allgather cannot be combined with secure_aggregation" in e for e in out)
