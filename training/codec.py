"""The cross-region codec: quantize -> byte-shuffle -> zstd -> SM4-GCM (or AES-GCM).

A payload is `header || ciphertext+tag`. The header is readable (for clear errors) and the
same fields are bound as GCM associated data together with the run id, so a payload whose
run, epoch, step, source region or bucket differs from what the receiver expects fails
authentication and is never decoded or applied.

Quantizers work on a flat fp32 tensor (N,):
- fp16 / bf16: a cast; byte-shuffle groups the high and low bytes so zstd finds the
  redundancy (exponent bytes repeat; raw fp16 saves only ~8% under zstd).
- int8: blockwise absmax, q = round(x / (absmax / 127)), fp32 scale per block.
- int4: blockwise absmax with 7 levels each side, two values packed per byte.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from dataclasses import dataclass, field

import torch
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from training.errors import PayloadRejected, SpecError
from training.spec import CodecSpec

QUANT = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "int4": 4}
CIPHERS = {"none": 0, "sm4-gcm": 1, "aes-gcm": 2}
MAGIC = b"GT"
VERSION = 1
# magic, version, quant, cipher, flags, epoch, step, bucket, source, part, numel, block, nonce
HEADER = struct.Struct(">2sBBBBIQIHHQI12s")
TAG_BYTES = 16


@dataclass(frozen=True)
class Address:
    """Where a payload belongs: the receiver rebuilds this and demands an exact match."""

    run_id: str
    epoch: int
    step: int
    source: int
    """Index of the source region."""
    bucket: int
    part: int = 0
    """Piece of the bucket (reduce-scatter stage), or R for the gather stage."""

    def aad(self) -> bytes:
        fields = struct.pack(">IQHIH", self.epoch, self.step, self.source, self.bucket, self.part)
        return b"geotrain/v1|" + self.run_id.encode() + b"|" + fields


@dataclass
class CodecStats:
    """Counters for metrics and benchmarks."""

    raw_bytes: int = 0
    wire_bytes: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    rejected: int = 0


def derive_key(run_key: bytes, purpose: str, size: int) -> bytes:
    """A subkey per purpose from the run key (HMAC-SHA256 as a KDF)."""
    return hmac.new(run_key, b"geotrain/" + purpose.encode(), hashlib.sha256).digest()[:size]


@dataclass
class Codec:
    spec: CodecSpec
    run_key: bytes
    stats: CodecStats = field(default_factory=CodecStats)

    def __post_init__(self) -> None:
        if self.spec.quantize not in QUANT:
            raise SpecError(
                f"codec.quantize '{self.spec.quantize}' is not supported; use one "
                f"of {', '.join(QUANT)}"
            )
        if self.spec.cipher not in CIPHERS:
            raise SpecError(
                f"codec.cipher '{self.spec.cipher}' is not supported; use one of "
                f"{', '.join(CIPHERS)}"
            )
        self._key = {
            "sm4-gcm": derive_key(self.run_key, "sm4-gcm", 16),
            "aes-gcm": derive_key(self.run_key, "aes-gcm", 32),
        }.get(self.spec.cipher)
        self._local = threading.local()  # zstd contexts are not thread-safe

    # -- public -----------------------------------------------------------------------
    def encode(self, x: torch.Tensor, addr: Address) -> tuple[bytes, torch.Tensor]:
        """Encode flat fp32 `x`; returns (payload, what the receiver will decode)."""
        t0 = time.perf_counter()
        x = x.detach().float().contiguous()
        body, decoded = _quantize(x, self.spec.quantize, self.spec.block_size)
        body = self._zc().compress(_shuffle(body, _itemsize(self.spec.quantize)))
        nonce = os.urandom(12) if self._key else bytes(12)
        header = HEADER.pack(
            MAGIC,
            VERSION,
            QUANT[self.spec.quantize],
            CIPHERS[self.spec.cipher],
            0,
            addr.epoch,
            addr.step,
            addr.bucket,
            addr.source,
            addr.part,
            x.numel(),
            self.spec.block_size,
            nonce,
        )
        payload = header + self._seal(body, nonce, header, addr)
        self.stats.raw_bytes += 4 * x.numel()
        self.stats.wire_bytes += len(payload)
        self.stats.encode_seconds += time.perf_counter() - t0
        return payload, decoded

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        """The values a receiver would decode from `encode(x, ...)`, without a payload."""
        x = x.detach().float().contiguous()
        return _quantize(x, self.spec.quantize, self.spec.block_size)[1]

    def decode(self, payload: bytes, expect: Address) -> torch.Tensor:
        """Verify then decode; raises PayloadRejected (never returns unverified data)."""
        t0 = time.perf_counter()
        try:
            out = self._decode(payload, expect)
        except PayloadRejected:
            self.stats.rejected += 1
            raise
        self.stats.decode_seconds += time.perf_counter() - t0
        return out

    # -- internals --------------------------------------------------------------------
    def _decode(self, payload: bytes, expect: Address) -> torch.Tensor:
        if len(payload) < HEADER.size + (TAG_BYTES if self._key else 0):
            raise PayloadRejected(
                f"payload from region {expect.source} bucket {expect.bucket} "
                f"is truncated ({len(payload)} bytes); not applied"
            )
        (
            magic,
            version,
            quant,
            cipher,
            _flags,
            epoch,
            step,
            bucket,
            source,
            part,
            numel,
            block,
            nonce,
        ) = HEADER.unpack_from(payload)
        if magic != MAGIC or version != VERSION:
            raise PayloadRejected("payload is not a geotrain v1 payload; not applied")
        got = Address(expect.run_id, epoch, step, source, bucket, part)
        if got != expect:
            why = "replayed (old step)" if step < expect.step else "misaddressed"
            raise PayloadRejected(
                f"payload {why}: header says epoch {epoch} step {step} region {source} "
                f"bucket {bucket} part {part}, expected epoch {expect.epoch} step "
                f"{expect.step} region {expect.source} bucket {expect.bucket} part "
                f"{expect.part}; not applied"
            )
        if cipher != CIPHERS[self.spec.cipher] or quant != QUANT[self.spec.quantize]:
            raise PayloadRejected(
                "payload codec (quant/cipher) differs from this run's; not applied"
            )
        header = payload[: HEADER.size]
        body = self._open(payload[HEADER.size :], nonce, header, expect)
        try:
            raw = self._zd().decompress(body, max_output_size=numel * 4 + 1024)
        except zstandard.ZstdError as e:
            raise PayloadRejected(f"payload body does not decompress ({e}); not applied") from None
        return _dequantize(
            _unshuffle(raw, _itemsize(self.spec.quantize)), self.spec.quantize, numel, block
        )

    def _seal(self, body: bytes, nonce: bytes, header: bytes, addr: Address) -> bytes:
        if not self._key:
            return body
        enc = self._cipher(nonce).encryptor()
        enc.authenticate_additional_data(addr.aad() + header)
        return enc.update(body) + enc.finalize() + enc.tag

    def _open(self, sealed: bytes, nonce: bytes, header: bytes, addr: Address) -> bytes:
        if not self._key:
            return sealed
        ct, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
        dec = self._cipher(nonce, tag).decryptor()
        dec.authenticate_additional_data(addr.aad() + header)
        try:
            return dec.update(ct) + dec.finalize()
        except InvalidTag:
            raise PayloadRejected(
                f"payload from region {addr.source} step {addr.step} bucket {addr.bucket} "
                f"failed {self.spec.cipher} authentication (tampered, truncated, another run "
                "or a wrong key); not applied"
            ) from None

    def _cipher(self, nonce: bytes, tag: bytes | None = None) -> Cipher:
        assert self._key is not None  # only called when a cipher is configured
        alg = (
            algorithms.SM4(self._key)
            if self.spec.cipher == "sm4-gcm"
            else algorithms.AES(self._key)
        )
        return Cipher(alg, modes.GCM(nonce, tag))

    def _zc(self) -> zstandard.ZstdCompressor:
        if not hasattr(self._local, "c"):
            self._local.c = zstandard.ZstdCompressor(level=self.spec.zstd_level)
        return self._local.c

    def _zd(self) -> zstandard.ZstdDecompressor:
        if not hasattr(self._local, "d"):
            self._local.d = zstandard.ZstdDecompressor()
        return self._local.d


def _itemsize(quant: str) -> int:
    return {"none": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 1}[quant]


def _shuffle(data: bytes, itemsize: int) -> bytes:
    """Byte-shuffle: byte k of every element together, (N, k) -> (k, N)."""
    if itemsize == 1:
        return data
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t.view(-1, itemsize).t().contiguous().numpy().tobytes()


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    if itemsize == 1:
        return data
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t.view(itemsize, -1).t().contiguous().numpy().tobytes()


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(N,) -> (ceil(N / block), block), zero-padded."""
    pad = (-x.numel()) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(-1, block)


def _quantize(x: torch.Tensor, quant: str, block: int) -> tuple[bytes, torch.Tensor]:
    """Returns (bytes to send, the fp32 values the receiver will reconstruct)."""
    n = x.numel()
    if quant == "none":
        return x.numpy().tobytes(), x
    if quant in ("fp16", "bf16"):
        h = x.to(torch.float16 if quant == "fp16" else torch.bfloat16)
        return h.view(torch.int16).numpy().tobytes(), h.float()
    levels = 127 if quant == "int8" else 7
    b = _blocks(x, block)  # (nb, block)
    scale = b.abs().amax(dim=1, keepdim=True) / levels  # (nb, 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(b / safe).clamp_(-levels, levels).to(torch.int8)  # (nb, block)
    decoded = (q.float() * scale).view(-1)[:n]
    if quant == "int8":
        data = q.view(-1).numpy().tobytes()
    else:
        u = (q.view(-1) + 8).to(torch.uint8)  # 1..15
        if u.numel() % 2:
            u = torch.nn.functional.pad(u, (0, 1))
        data = (u[0::2] | (u[1::2] << 4)).numpy().tobytes()
    return scale.view(-1).numpy().tobytes() + data, decoded


def _dequantize(raw: bytes, quant: str, n: int, block: int) -> torch.Tensor:
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    try:
        if quant == "none":
            return buf.view(torch.float32)[:n].clone()
        if quant in ("fp16", "bf16"):
            return buf.view(torch.float16 if quant == "fp16" else torch.bfloat16)[:n].float()
        nb = -(-n // block)
        scale = buf[: 4 * nb].view(torch.float32).view(-1, 1)
        body = buf[4 * nb :]
        if quant == "int8":
            q = body.view(torch.int8).float().view(nb, block)
        else:
            lo = (body & 0x0F).to(torch.int16)
            hi = (body >> 4).to(torch.int16)
            q = (torch.stack((lo, hi), dim=1).view(-1)[: nb * block] - 8).float().view(nb, block)
        return (q * scale).view(-1)[:n].clone()
    except RuntimeError as e:
        raise PayloadRejected(
            f"payload body has the wrong size for {n} {quant} values ({e}); not applied"
        ) from None
