"""Secure aggregation (training.sync.secagg): masks cancel bitwise, hide each contribution,
never repeat; the masked sync equals the unmasked shared-scale sync; a missing region
aborts the round with a typed error; bad settings are refused."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from infra.model import load_stack
from infra.plan import build_plan
from infra.render.runtime import render_launch_spec
from training.comm.topology import Groups, Topology, make_groups
from training.errors import ConfigError, RoundAborted, RoundReused, SpecError
from training.spec import CodecSpec, LaunchSpec
from training.sync.codec import Codec
from training.sync.hier import HierarchicalAllReduce
from training.sync.secagg import Masker, Round, SecureSum, ring_sum
from training.testing import WorldError, make_spec, run_world

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))
SALT = bytes(32)


def _maskers(parties: int, cipher: str = "sm4-gcm") -> list[Masker]:
    """Every party's masker, from real X25519 exchanges between every pair."""
    privs = [X25519PrivateKey.generate() for _ in range(parties)]
    return [
        Masker(
            i,
            {j: privs[i].exchange(privs[j].public_key()) for j in range(parties) if j != i},
            SALT,
            cipher,
        )
        for i in range(parties)
    ]


def _values(parties: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-127, 128, (n,), generator=g, dtype=torch.int32) for _ in range(parties)]


@pytest.mark.parametrize("parties", [2, 3, 5])
@pytest.mark.parametrize("cipher", ["sm4-gcm", "aes-gcm"])
def test_masks_cancel_bitwise_in_the_sum_of_all_parties(parties: int, cipher: str) -> None:
    ms, q = _maskers(parties, cipher), _values(parties, 4097, parties)
    rnd = Round(epoch=1, step=7, bucket=2)
    masked = [m.mask(qi, rnd, piece=1) for m, qi in zip(ms, q, strict=True)]
    assert torch.equal(ring_sum(masked), torch.stack(q).sum(dim=0))
    assert all(not torch.equal(v.to(torch.int32), qi) for v, qi in zip(masked, q, strict=True))


def _chi2_top_byte(v: torch.Tensor) -> float:
    """Chi-square statistic of the high byte of int16 values over its 256 bins."""
    counts = torch.bincount((v.to(torch.int32) & 0xFFFF) >> 8, minlength=256).double()
    expect = v.numel() / 256
    return float(((counts - expect) ** 2 / expect).sum())


def test_a_masked_vector_of_zeros_and_of_ones_both_look_uniform() -> None:
    ms = _maskers(3)
    n = 1 << 16
    rnd = Round(0, 1, 0)
    zeros = ms[0].mask(torch.zeros(n, dtype=torch.int32), rnd, 0)
    ones = ms[0].mask(torch.ones(n, dtype=torch.int32), replace(rnd, step=2), 0)
    # 255 degrees of freedom: mean 255, sd 22.6; 400 is beyond 6 sd. Unmasked zeros or
    # ones put every value in one bin (statistic ~ 16.7 million).
    assert _chi2_top_byte(zeros) < 400
    assert _chi2_top_byte(ones) < 400


def test_without_one_pairs_key_a_contribution_cannot_be_unmasked() -> None:
    ms, q = _maskers(3), _values(3, 8192, 5)
    rnd = Round(0, 3, 0)
    v0 = ms[0].mask(q[0], rnd, 0)
    # party 2 knows its own pair secret with party 0, not the (0, 1) one: removing the
    # masks it can derive leaves q0 + m01, unrelated to q0
    only_02 = Masker(0, {2: ms[0].secrets[2]}, SALT, "sm4-gcm")
    guess = v0.to(torch.int32) - only_02.mask(torch.zeros(8192, dtype=torch.int32), rnd, 0)
    guess = (guess + (1 << 15)) % (1 << 16) - (1 << 15)
    assert (guess == q[0]).float().mean() < 0.01  # a right guess is ~1 in 65,536 by chance
    # with both secrets it does come out: the test above is not vacuous
    both = v0.to(torch.int32) - ms[0].mask(torch.zeros(8192, dtype=torch.int32), rnd, 0)
    assert torch.equal((both + (1 << 15)) % (1 << 16) - (1 << 15), q[0])


def test_distinct_rounds_and_pieces_never_share_a_mask() -> None:
    m = _maskers(2)[0]
    zero = torch.zeros(64, dtype=torch.int32)
    seen = set()
    for epoch, step, bucket, piece in itertools.product(range(2), range(3), range(3), range(3)):
        seen.add(m.mask(zero, Round(epoch, step, bucket), piece).numpy().tobytes())
    assert len(seen) == 2 * 3 * 3 * 3


@pytest.mark.parametrize(
    ("quantize", "regions", "match"),
    [("fp16", 3, "int8 or int4"), ("none", 3, "int8 or int4"), ("int8", 300, "at most 258")],
)
def test_runtime_refuses_settings_secure_aggregation_cannot_sum(
    quantize: str, regions: int, match: str
) -> None:
    names = tuple(f"r{i}" for i in range(regions))
    topo = Topology(0, regions, regions, 1, 0, 0, names)
    codec = Codec(CodecSpec(quantize=quantize, secure_aggregation=True), KEY)
    with pytest.raises(SpecError, match=match):  # before any collective
        HierarchicalAllReduce(topo, Groups(None, None, torch.device("cpu")), codec, "run")


# -- multi-rank: 3 regions x 2 ranks over gloo ------------------------------------------------
REGIONS, LOCAL = 3, 2


def _sync(rank: int, secure: bool, **spec: Any) -> HierarchicalAllReduce:
    launch = make_spec(REGIONS, LOCAL)
    topo = Topology.of(launch, rank)
    groups = make_groups(topo, torch.device("cpu"))
    cs = CodecSpec(quantize="int8", block_size=64, secure_aggregation=secure, **spec)
    return HierarchicalAllReduce(topo, groups, Codec(cs, KEY), launch.run_id)


def _masked_vs_plain(rank: int, world: int) -> dict[str, Any]:
    masked, plain, classic = _sync(rank, True), _sync(rank, True), _sync(rank, False)
    assert plain.secure is not None
    plain.secure.masked = False
    out: dict[str, Any] = {"masked": [], "plain": [], "classic": []}
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(1001, generator=g)  # not a multiple of L * R: padding
        out["masked"].append(masked.all_reduce(x, step=step))
        out["plain"].append(plain.all_reduce(x, step=step))
        out["classic"].append(classic.all_reduce(x, step=step))
    try:
        masked.all_reduce(torch.zeros(1001), step=2)
    except RoundReused as e:
        out["reused"] = str(e)
    out["residual"] = masked.residuals[0].clone()
    out["wire"] = (masked.stats.cross_wire_bytes, classic.stats.cross_wire_bytes)
    return out


def test_secure_sync_equals_the_unmasked_shared_scale_sync_bitwise_on_every_rank() -> None:
    out = run_world(_masked_vs_plain, REGIONS * LOCAL)
    for r in out:
        for m, p, c in zip(r["masked"], r["plain"], r["classic"], strict=True):
            assert torch.equal(m, p)  # the masks cancel exactly, error feedback included
            assert ((m - c).norm() / c.norm()).item() < 0.05  # and it is still the average
        assert all(torch.equal(a, b) for a, b in zip(r["masked"], out[0]["masked"], strict=True))
        assert "step 2 bucket 0" in r["reused"]
        assert r["residual"].abs().sum() > 0  # error feedback kept the own quantization
        assert r["wire"][0] > r["wire"][1]  # 2-byte masked words cost more than int8


def _rounds(rank: int, world: int) -> tuple[int, int]:
    """(cross-region collectives of the masked scatter, one-round exchanges) of a sync."""
    import torch.distributed as dist

    import training.sync.linkprobe as lp

    sync = _sync(rank, True)
    sync.all_reduce(torch.randn(1001), step=0)  # the keys' exchange: not counted
    swaps, rounds = [0], [0]
    real_a2a, real_post = dist.all_to_all_single, lp.post_bounded

    def a2a(*a: Any, **k: Any) -> Any:
        swaps[0] += k.get("group") is sync.groups.cross
        return real_a2a(*a, **k)

    def post(*a: Any, **k: Any) -> Any:
        rounds[0] += 1
        return real_post(*a, **k)

    dist.all_to_all_single, lp.post_bounded = a2a, post  # type: ignore[assignment]
    assert sync.secure is not None
    sync.secure.scatter_sum(torch.randn(REGIONS, 200), sync.residual(7, 200), 1, 7)
    return swaps[0], rounds[0]


def test_secure_scatter_takes_one_round_per_exchange_and_swaps_no_sizes() -> None:
    """The scales, then the masked pieces: two exchanges, each one bounded round (over
    120-280 ms links a round of sizes first cost as much as the payloads)."""
    assert run_world(_rounds, REGIONS * LOCAL) == [(0, 2)] * (REGIONS * LOCAL)


class _Drops(SecureSum):
    """Region 2 sends nothing in the masked stage (its process died mid-round)."""

    def _exchange(self, xs: list[torch.Tensor], rnd: Round, stage: int) -> Any:
        if stage == 3 and self.topo.region_index == 2:
            from training.sync.linkprobe import bounded_all_to_all

            R = self.topo.regions
            limits = [self._wire_codec().max_payload(xs[2].numel())] * R
            bounded_all_to_all([b""] * R, limits, self.group, 2, self.topo.region_names)
            raise RuntimeError("region 2 injected drop")
        return super()._exchange(xs, rnd, stage)


def _dropped(rank: int, world: int) -> None:
    launch = make_spec(3, 1)
    topo = Topology.of(launch, rank)
    groups = make_groups(topo, torch.device("cpu"))
    codec = Codec(CodecSpec(quantize="int8", secure_aggregation=True), KEY)
    sync = HierarchicalAllReduce(topo, groups, codec, launch.run_id)
    sync.secure = _Drops(topo, groups.cross, codec)
    sync.all_reduce(torch.randn(300), step=4, bucket=1)


def test_a_region_missing_from_the_round_aborts_it_with_region_and_round_named() -> None:
    with pytest.raises(WorldError) as e:
        run_world(_dropped, 3)
    errors = e.value.errors
    assert set(errors) == {0, 1, 2}
    for rank in (0, 1):
        name, msg, _ = errors[rank]
        assert name == RoundAborted.__name__
        assert "region silicon-valley" in msg
        assert "step 4 bucket 1" in msg
        assert "\n" not in msg
    assert RoundAborted.exit_code == 3


# -- the stack setting --------------------------------------------------------------------
def _secure(quantize: str = "int8", regions: int = 3) -> Any:
    def mutate(cfg: dict[str, Any]) -> None:
        c = cfg["geotrain:training"]["compression"]
        c.update(quantize=quantize, secure_aggregation=True)
        del cfg["geotrain:regions"][regions:]
        names = {r["name"] for r in cfg["geotrain:regions"]}
        links = cfg["geotrain:network"]["links"]
        links[:] = [lk for lk in links if {lk["a"], lk["b"]} <= names]
        shards = cfg["geotrain:training"]["data_shards"]
        shards[:] = [s for s in shards if s["region"] in names]

    return mutate


@pytest.mark.parametrize(
    ("quantize", "regions", "words"),
    [
        ("fp16", 3, "needs quantize int8 or int4"),
        ("none", 3, "needs quantize int8 or int4"),
        ("int8", 2, "hides nothing with 2 regions"),
    ],
)
def test_stack_refuses_secure_aggregation_it_cannot_honour(
    write_stack: Any, quantize: str, regions: int, words: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_stack(str(write_stack("local", _secure(quantize, regions))))
    assert e.value.path == "geotrain:training.compression.secure_aggregation"
    assert words in str(e.value)
    assert "\n" not in str(e.value)


def test_stack_setting_reaches_the_launch_spec(write_stack: Any) -> None:
    spec = render_launch_spec(build_plan(load_stack(str(write_stack("local", _secure("int4"))))))
    assert spec.codec.secure_aggregation is True
    assert spec.codec.quantize == "int4"
    assert LaunchSpec.from_json(spec.to_json()).codec.secure_aggregation is True
    default = render_launch_spec(build_plan(load_stack("local")))
    assert default.codec.secure_aggregation is False
