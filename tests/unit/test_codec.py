"""The codec: round trips within bounds, and every tampering case is rejected."""

from __future__ import annotations

import pytest
import torch

from training.codec import HEADER, Address, Codec
from training.errors import PayloadRejected
from training.spec import CodecSpec

KEY = bytes(range(32))
ADDR = Address("run-a", epoch=0, step=7, source=1, bucket=2)


def _codec(quant: str = "int8", cipher: str = "sm4-gcm", key: bytes = KEY) -> Codec:
    return Codec(CodecSpec(quantize=quant, cipher=cipher, block_size=64), key)


@pytest.mark.parametrize(
    ("quant", "bound"),
    [("none", 0.0), ("fp16", 1e-3), ("bf16", 8e-3), ("int8", 1.5e-2), ("int4", 0.2)],
)
@pytest.mark.parametrize("cipher", ["sm4-gcm", "aes-gcm", "none"])
def test_round_trip_error_is_within_the_stated_bound(quant: str, bound: float, cipher: str) -> None:
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(0))
    c = _codec(quant, cipher)
    payload, sent = c.encode(x, ADDR)
    got = c.decode(payload, ADDR)
    assert torch.equal(got, sent)  # the receiver sees exactly what the sender accounted
    rel = ((got - x).norm() / x.norm()).item()
    assert rel <= bound, f"{quant}: relative error {rel}"


def test_int4_packs_two_values_per_byte_and_compresses() -> None:
    x = torch.randn(65_536, generator=torch.Generator().manual_seed(1))
    payload, _ = _codec("int4").encode(x, ADDR)
    # 4 bits/value + one fp32 scale per 64 values = 0.5625 bytes/value before zstd
    assert len(payload) < 0.6 * x.numel()


def test_ciphertext_hides_the_plaintext() -> None:
    x = torch.full((4096,), 1.5)
    plain, _ = _codec("none", "none").encode(x, ADDR)
    sealed, _ = _codec("none", "sm4-gcm").encode(x, ADDR)
    assert plain[HEADER.size :] != sealed[HEADER.size : -16]


def _flip(payload: bytes, at: int) -> bytes:
    b = bytearray(payload)
    b[at] ^= 0x01
    return bytes(b)


TAMPER = {
    "flipped-body-byte": lambda p: (_flip(p, len(p) // 2), ADDR),
    "flipped-tag-byte": lambda p: (_flip(p, len(p) - 1), ADDR),
    "flipped-nonce": lambda p: (_flip(p, HEADER.size - 1), ADDR),
    "truncated": lambda p: (p[: len(p) - 20], ADDR),
    "header-only": lambda p: (p[: HEADER.size], ADDR),
    "replayed-old-step": lambda p: (p, Address("run-a", 0, 8, 1, 2)),
    "misaddressed-region": lambda p: (p, Address("run-a", 0, 7, 0, 2)),
    "misaddressed-bucket": lambda p: (p, Address("run-a", 0, 7, 1, 3)),
    "other-epoch": lambda p: (p, Address("run-a", 1, 7, 1, 2)),
    "other-run": lambda p: (p, Address("run-b", 0, 7, 1, 2)),
    "not-a-payload": lambda p: (b"x" * len(p), ADDR),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampered_payload_is_rejected(case: str) -> None:
    c = _codec()
    payload, _ = c.encode(torch.randn(1000), ADDR)
    bad, expect = TAMPER[case](payload)
    with pytest.raises(PayloadRejected, match="not applied"):
        c.decode(bad, expect)
    assert c.stats.rejected == 1


def test_forged_header_fields_fail_authentication() -> None:
    """An attacker rewriting the header's step to match the receiver still fails: the
    header is bound as associated data."""
    c = _codec()
    payload, _ = c.encode(torch.randn(1000), ADDR)
    fields = list(HEADER.unpack_from(payload))
    fields[6] = 8  # step
    forged = HEADER.pack(*fields) + payload[HEADER.size :]
    with pytest.raises(PayloadRejected, match="authentication"):
        c.decode(forged, Address("run-a", 0, 8, 1, 2))


def test_wrong_key_is_rejected() -> None:
    payload, _ = _codec().encode(torch.randn(1000), ADDR)
    with pytest.raises(PayloadRejected, match="wrong key"):
        _codec(key=bytes(32)).decode(payload, ADDR)
