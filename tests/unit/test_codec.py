"""The codec: round trips within bounds, and every tampering case is rejected."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.comm.session import Session
from training.errors import HostileReject, ReplayReject, TransientReject
from training.spec import CodecSpec
from training.sync.codec import HEADER, Address, Codec

KEY = bytes(range(32))
SESSION = Session("run-a", bytes(range(16)), epoch=0)
ADDR = Address(epoch=0, step=7, source=1, dest=4, bucket=2)


def _codec(
    quant: str = "int8", cipher: str = "sm4-gcm", key: bytes = KEY, session: Session = SESSION
) -> Codec:
    return Codec(CodecSpec(quantize=quant, cipher=cipher, block_size=64), key, session)


@pytest.mark.parametrize(
    ("quant", "bound"),
    [
        ("none", 0.0),
        ("fp16", 1e-3),
        ("bf16", 8e-3),
        ("int8", 1.5e-2),
        ("int4", 0.2),
        ("ternary", 0.6),
    ],
)
@pytest.mark.parametrize("cipher", ["sm4-gcm", "aes-gcm", "none"])
def test_round_trip_error_is_within_the_stated_bound(quant: str, bound: float, cipher: str) -> None:
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(0))
    c = _codec(quant, cipher)
    payload, sent = c.encode(x, ADDR)
    got = c.decode(payload, ADDR, x.numel())
    assert torch.equal(got, sent)  # the receiver sees exactly what the sender accounted
    rel = ((got - x).norm() / x.norm()).item()
    assert rel <= bound, f"{quant}: relative error {rel}"


def test_int4_packs_two_values_per_byte_and_compresses() -> None:
    x = torch.randn(65_536, generator=torch.Generator().manual_seed(1))
    payload, _ = _codec("int4").encode(x, ADDR)
    # 4 bits/value + one fp32 scale per 64 values = 0.5625 bytes/value before zstd
    assert len(payload) < 0.6 * x.numel()


def test_ternary_sends_under_two_bits_per_value_with_the_least_squares_scale() -> None:
    x = torch.randn(65_536, generator=torch.Generator().manual_seed(2))
    c = Codec(CodecSpec(quantize="ternary", block_size=256), KEY, SESSION)
    payload, sent = c.encode(x, ADDR)
    # 2-bit codes + a scale per 256 values = 2.125 bits before zstd; most codes are 0
    assert 8 * len(payload) / x.numel() < 1.75
    levels = sent.view(-1, 256).abs()
    assert all(len(set(row.tolist()) - {0.0}) == 1 for row in levels)  # 0 and one +-s
    # s minimises |x - s q| for the sign pattern q: the error is orthogonal to the levels
    err = ((x - sent).view(-1, 256) * sent.view(-1, 256)).sum(dim=1)
    assert err.abs().max().item() < 1e-3


def test_ternary_handles_blocks_and_lengths_off_the_four_value_packing() -> None:
    c = Codec(CodecSpec(quantize="ternary", block_size=6), KEY, SESSION)
    for n in (1, 5, 7, 13):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        payload, sent = c.encode(x, ADDR)
        assert torch.equal(c.decode(payload, ADDR, n), sent)


def test_ternary_with_error_feedback_sends_everything_over_rounds() -> None:
    """A round drops most of a value; the residual carries it into the next, so what the
    rounds deliver tracks what was meant, within one residual (which stays bounded)."""
    c = _codec("ternary")
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    residual, delivered, sizes = torch.zeros_like(x), torch.zeros_like(x), []
    for _ in range(200):
        payload, sent = c.encode(x + residual, ADDR)
        residual = x + residual - sent
        delivered += c.decode(payload, ADDR, x.numel())
        sizes.append((residual.norm() / x.norm()).item())
    assert torch.allclose(delivered + residual, 200 * x, atol=1e-3)
    assert max(sizes) < 3.0 and sizes[-1] < 1.05 * sizes[99]  # levels off (~2.1 here)
    assert ((delivered / 200 - x).norm() / x.norm()).item() < 0.02


def test_an_authentic_ternary_body_with_the_unused_code_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Code 3 is no value: a key holder that sends it misbehaves (HostileReject)."""
    import training.sync.codec as codec

    def code3(x: torch.Tensor, block: int) -> tuple[bytes, torch.Tensor]:
        nb = -(-x.numel() // block)
        return bytes(4 * nb) + b"\xff" * (-(-(nb * block) // 4)), x

    c = _codec("ternary")
    monkeypatch.setattr(codec, "_ternary", code3)
    payload, _ = c.encode(torch.randn(100), ADDR)
    with pytest.raises(HostileReject, match="code 3"):
        c.decode(payload, ADDR, 100)


def test_ciphertext_hides_the_plaintext() -> None:
    x = torch.full((4096,), 1.5)
    plain, _ = _codec("none", "none").encode(x, ADDR)
    sealed, _ = _codec("none", "sm4-gcm").encode(x, ADDR)
    assert plain[HEADER.size : -16] != sealed[HEADER.size : -16]


def _flip(payload: bytes, at: int) -> bytes:
    b = bytearray(payload)
    b[at] ^= 0x01
    return bytes(b)


def _at(**changes: int) -> Address:
    return dataclasses.replace(ADDR, **changes)


# (payload -> (what arrives, what the receiver expects), the class of reject)
TAMPER = {
    "flipped-body-byte": (lambda p: (_flip(p, len(p) // 2), ADDR), TransientReject),
    "flipped-tag-byte": (lambda p: (_flip(p, len(p) - 1), ADDR), TransientReject),
    "flipped-nonce": (lambda p: (_flip(p, HEADER.size - 1), ADDR), TransientReject),
    "flipped-step-in-header": (lambda p: (_flip(p, 46), ADDR), TransientReject),
    "truncated": (lambda p: (p[: len(p) - 20], ADDR), TransientReject),
    "header-only": (lambda p: (p[: HEADER.size], ADDR), TransientReject),
    "not-a-payload": (lambda p: (b"x" * len(p), ADDR), TransientReject),
    "replayed-old-step": (lambda p: (p, _at(step=8)), ReplayReject),
    "misaddressed-source": (lambda p: (p, _at(source=0)), ReplayReject),
    "misaddressed-destination": (lambda p: (p, _at(dest=5)), ReplayReject),
    "misaddressed-bucket": (lambda p: (p, _at(bucket=3)), ReplayReject),
    "other-part": (lambda p: (p, _at(part=1)), ReplayReject),
    "other-stage": (lambda p: (p, _at(stage=1)), ReplayReject),
    "other-epoch": (lambda p: (p, _at(epoch=1)), ReplayReject),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampered_payload_is_rejected(case: str) -> None:
    c = _codec()
    payload, _ = c.encode(torch.randn(1000), ADDR)
    tamper, kind = TAMPER[case]
    bad, expect = tamper(payload)
    with pytest.raises(kind, match="not applied"):
        c.decode(bad, expect, 1000)
    assert c.stats.rejected == 1


def test_payload_of_another_run_or_session_is_rejected_as_a_replay() -> None:
    payload, _ = _codec().encode(torch.randn(1000), ADDR)
    for other in (Session("run-b", SESSION.id, 0), Session("run-a", bytes(16), 0)):
        with pytest.raises(ReplayReject, match="another run or session"):
            _codec(session=other).decode(payload, ADDR, 1000)


def test_forged_header_fields_fail_authentication() -> None:
    """An attacker rewriting the header's step to match the receiver still fails: the
    header is the associated data."""
    c = _codec()
    payload, _ = c.encode(torch.randn(1000), ADDR)
    fields = list(HEADER.unpack_from(payload))
    fields[8] = 8  # step
    forged = HEADER.pack(*fields) + payload[HEADER.size :]
    with pytest.raises(TransientReject, match="authentication"):
        c.decode(forged, _at(step=8), 1000)


def test_wrong_key_is_rejected() -> None:
    payload, _ = _codec().encode(torch.randn(1000), ADDR)
    with pytest.raises(TransientReject, match="without this run's key"):
        _codec(key=bytes(32)).decode(payload, ADDR, 1000)


@pytest.mark.parametrize("quant", ["none", "fp16", "bf16", "int8", "int4", "ternary"])
@pytest.mark.parametrize("n", [1, 63, 64, 4099, 300_000])
def test_max_payload_bounds_every_quantizer_even_on_incompressible_values(
    quant: str, n: int
) -> None:
    """A receiver posts a buffer of max_payload before it knows the size
    (training.sync.linkprobe): no payload may be longer, whatever the values."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e3  # noise: no gain
    payload, _ = _codec(quant).encode(x, ADDR)
    receiver = _codec("int4")  # the bound does not depend on the receiver's own quantizer
    assert len(payload) <= receiver.max_payload(n)
    assert receiver.max_payload(n) < 4 * n + 1.01 * 4 * n // 255 + 2048  # and it is tight
