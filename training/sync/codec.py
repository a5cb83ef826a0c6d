"""The cross-region codec: quantize -> byte-shuffle -> zstd -> SM4-GCM (or AES-GCM).

A payload is `header || body || tag`. The header is readable (for clear errors) and is
the associated data of the AEAD, so every field of it is authenticated: the run (a
digest of its id) and session, the epoch, step, bucket, source and destination ranks,
the piece and exchange stage, the quantizer, the number of values, the block size and
the nonce. `cipher: none` keeps the body in the clear but still authenticates header and
body with HMAC-SHA256 (16-byte tag): a flipped byte is never decoded.

Keys (training.comm.session.derive): one per run, session, source rank, destination rank,
stage and key generation. Nonces are counters: 4 bytes of key generation and 8 of
message counter. A sender moves to the next generation (a new key) after REKEY_MESSAGES
messages or REKEY_BYTES bytes, far below GCM's limits (see docs/security.md for the
arithmetic).

A nonce never repeats under a key, by construction rather than by care: every codec of a
process, whatever its settings (the sync's, secure aggregation's wire codec, a streaming
twin's, another sync object of the same session), draws its nonces from one allocator per
(session salt, source, destination, stage), the process-wide `NONCES`. A key is a function
of those four, the run key, the cipher and the generation, and the allocator hands out each
(generation, counter) once; a key is used by one process only, that of its source rank
(every encoder addresses payloads from its own rank; relays forward sealed bytes), and a
session belongs to one launch (a restart agrees a new one). `bind` therefore resets nothing.

The receiver states what it expects (`decode(payload, addr, numel)`: the address, the
number of values, and through its own spec the quantizer and block size). A payload is
checked in this order, and nothing sized by the header is allocated before the end:
1. framing (length, magic, version): else TransientReject;
2. the header against the expectation; on a difference the payload is authenticated as
   it claims to be: authentic and addressed elsewhere means a replay or redirect of
   honest traffic (ReplayReject, transient: counted, never a reason to stop), authentic
   at this address in a shape no honest sender writes means a misbehaving key holder
   (HostileReject), not authentic means corruption or a forgery (TransientReject);
3. authentication under the expected key: else TransientReject;
4. the body's exact size (zstd's declared content size, then the decompressed bytes):
   an authentic body of the wrong size is HostileReject.

Quantizers work on a flat fp32 tensor (N,):
- fp16 / bf16: a cast; byte-shuffle groups the high and low bytes so zstd finds the
  redundancy (exponent bytes repeat; raw fp16 saves only ~8% under zstd).
- int8: blockwise absmax, q = round(x / (absmax / 127)), fp32 scale per block.
- int4: blockwise absmax with 7 levels each side, two values packed per byte.
- ternary: per block, values with |x| above TERNARY_THRESHOLD x the block's mean |x| become
  +-s, the rest 0, where s is the mean |x| of those kept (the least-squares scale for that
  sign pattern; as Li et al. 2016's ternary weight networks); 2-bit codes, four per byte.
  About a third of Gaussian values are kept, and with zstd a payload takes ~1.4 bits per
  value, its scales and header included (benchmarks/results/codec_and_sync.md: 562 MB/s
  of fp32 in, 24 MB/s out). Meant for DiLoCo's pseudo-gradients with error feedback,
  which carries what a round drops into the next: a merge then sends about half of int4's
  bytes, so H=50 merges move 1/1000 of a per-step fp32 all-reduce (1/1115 with one
  bucket), about a point behind int4 over 3000 steps (benchmarks/results/
  diloco_parity_seeds.md). A gradient every step is better served by int8 or int4.
"""

from __future__ import annotations

import hmac
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from training.comm.session import Session, derive, link_info
from training.errors import (
    HostileReject,
    PayloadRejected,
    ReplayReject,
    SpecError,
    TransientReject,
)
from training.spec import CodecSpec

QUANT = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "int4": 4, "ternary": 5}
CIPHERS = {"none": 0, "sm4-gcm": 1, "aes-gcm": 2}
KEY_BYTES = {"none": 32, "sm4-gcm": 16, "aes-gcm": 32}
"""HMAC-SHA256 key for `none`."""
MAGIC = b"GT"
VERSION = 2
STAGES = ("scatter", "gather", "secagg-scale", "secagg-masked", "allgather")
"""Exchange stage: 0 sends piece j to region j, 1 sends the reduced piece to every region;
2 and 3 carry secure aggregation's scales and masked pieces (training.sync.secagg); 4 sends a
region's whole shard to every region (`exchange: allgather`)."""
# magic, version, quant, cipher, stage, run tag, session, epoch, step, bucket, source rank,
# destination rank, part, numel, block, nonce (generation u32 || counter u64)
HEADER = struct.Struct(">2sBBBB16s16sIQIIIHII12s")
TAG_BYTES = 16
ZSTD_FRAME_MARGIN = 64
"""Bytes allowed over ZSTD_COMPRESSBOUND (frame header and checksum, generously)."""
REKEY_MESSAGES = 1 << 24
"""Messages per key before the sender moves to the next key generation."""
REKEY_BYTES = 1 << 36
"""Bytes per key (2^32 AES/SM4 blocks) before the next generation."""
KEY_CACHE = 4096
"""Derived keys a codec keeps (links x stages x live generations)."""
TERNARY_THRESHOLD = 1.25
"""ternary keeps the values above this multiple of their block's mean |x| (for Gaussian
values: above one standard deviation)."""


@dataclass(frozen=True)
class Address:
    """Where a payload belongs: the receiver rebuilds this and demands an exact match
    (the run and session come from the codec's Session)."""

    epoch: int
    step: int
    source: int
    """Global rank of the sender."""
    dest: int
    """Global rank of the receiver."""
    bucket: int
    part: int = 0
    """Piece of the bucket: the piece sent (scatter) or the piece reduced (gather)."""
    stage: int = 0
    """0 scatter, 1 gather, ... (STAGES)."""


class _Header(NamedTuple):
    """The header's fields after magic and version (a tuple: built for every payload)."""

    quant: int
    cipher: int
    stage: int
    tag: bytes
    session: bytes
    epoch: int
    step: int
    bucket: int
    source: int
    dest: int
    part: int
    numel: int
    block: int
    nonce: bytes

    @property
    def generation(self) -> int:
        return int.from_bytes(self.nonce[:4], "big")

    def address(self) -> Address:
        return Address(
            self.epoch, self.step, self.source, self.dest, self.bucket, self.part, self.stage
        )


@dataclass
class CodecStats:
    """Counters for metrics and benchmarks."""

    raw_bytes: int = 0
    wire_bytes: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    rejected: int = 0


@dataclass
class _Link:
    """A sender's key state for one (session, source, destination, stage)."""

    generation: int = 0
    messages: int = 0
    bytes: int = 0


class NonceAllocator:
    """The process's nonce counters: one `_Link` per (session salt, source, destination,
    stage), shared by every Codec, under one lock. Entries are never dropped (dropping one
    would start its counter over under a live key): a few dozen bytes per link and stage of
    each session this process encrypted in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[tuple[bytes, int, int, int], _Link] = {}

    def next(self, salt: bytes, addr: Address, size: int) -> bytes:
        """generation (4 bytes) || counter (8 bytes) for a payload of `size` body bytes from
        addr.source to addr.dest on addr.stage; moves to the next generation (a new key)
        past REKEY_MESSAGES or REKEY_BYTES."""
        with self._lock:
            k = (salt, addr.source, addr.dest, addr.stage)
            link = self._links.get(k) or self._links.setdefault(k, _Link())
            if link.messages >= REKEY_MESSAGES or link.bytes + size > REKEY_BYTES:
                link.generation, link.messages, link.bytes = link.generation + 1, 0, 0
            nonce = link.generation.to_bytes(4, "big") + link.messages.to_bytes(8, "big")
            link.messages += 1
            link.bytes += size
        return nonce


NONCES = NonceAllocator()
"""The one allocator of this process (module doc: why one)."""


@dataclass
class Codec:
    spec: CodecSpec
    run_key: bytes
    session: Session | None = None
    """The launch's session (training.comm.session.agree); None until `bind` (tools may leave
    it to HierarchicalAllReduce, which binds an unagreed session of its run id)."""
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
        if self.spec.block_size < 1:
            raise SpecError(f"codec.block_size {self.spec.block_size} must be at least 1")
        self._local = threading.local()  # zstd contexts are not thread-safe
        self._keys: OrderedDict[tuple[bytes, int, int, int, int, int], bytes] = OrderedDict()

    def bind(self, session: Session) -> None:
        """Use `session` from now on (its keys, and the process's nonce counters of them)."""
        self.session = session

    # -- public -----------------------------------------------------------------------
    def encode(
        self, x: torch.Tensor, addr: Address, quantize: str | None = None, level: int | None = None
    ) -> tuple[bytes, torch.Tensor]:
        """Encode flat fp32 `x`; returns (payload, what the receiver will decode).
        `quantize` and `level` override the spec's (the adaptive codec, training.sync.adaptive):
        the quantizer travels in the authenticated header, the level is zstd's own."""
        t0 = time.perf_counter()
        s = self._session()
        quant = quantize or self.spec.quantize
        x = x.detach().float().contiguous()
        body, decoded = _quantize(x, quant, self.spec.block_size)
        zc = self._zc(self.spec.zstd_level if level is None else level)
        body = zc.compress(_shuffle(body, _itemsize(quant)))
        nonce = NONCES.next(s.salt(), addr, len(body))
        h = _Header(
            QUANT[quant],
            CIPHERS[self.spec.cipher],
            addr.stage,
            s.tag,
            s.id,
            addr.epoch,
            addr.step,
            addr.bucket,
            addr.source,
            addr.dest,
            addr.part,
            x.numel(),
            self.spec.block_size,
            nonce,
        )
        header = _pack(h)
        payload = header + self._seal(body, h, header, s.salt())
        self.stats.raw_bytes += 4 * x.numel()
        self.stats.wire_bytes += len(payload)
        self.stats.encode_seconds += time.perf_counter() - t0
        return payload, decoded

    def max_payload(self, numel: int) -> int:
        """The most bytes a payload of `numel` values can take under any quantizer (a
        receiver that accepts several, training.sync.adaptive, gets the widest): the body, zstd's
        worst-case expansion of it (ZSTD_COMPRESSBOUND), header and tag. A receiver that
        posts its buffer before it knows the size sizes it by this."""
        raw = max(_raw_size(q, numel, self.spec.block_size) for q in QUANT)
        small = (128 * 1024 - raw) >> 11 if raw < 128 * 1024 else 0
        return HEADER.size + TAG_BYTES + raw + (raw >> 8) + small + ZSTD_FRAME_MARGIN

    def quantized(self, x: torch.Tensor, quantize: str | None = None) -> torch.Tensor:
        """The values a receiver would decode from `encode(x, ...)`, without a payload."""
        x = x.detach().float().contiguous()
        return _quantize(x, quantize or self.spec.quantize, self.spec.block_size)[1]

    def decode(
        self, payload: bytes, expect: Address, numel: int, accept: tuple[str, ...] = ()
    ) -> torch.Tensor:
        """Verify then decode `numel` values sent to `expect`; raises PayloadRejected
        (TransientReject or HostileReject) and never returns unverified data. `accept`:
        quantizers the receiver also takes (the adaptive codec's set), named by the
        header, which the tag authenticates; by default only the spec's."""
        t0 = time.perf_counter()
        try:
            out = self._decode(payload, expect, numel, accept)
        except PayloadRejected:
            self.stats.rejected += 1
            raise
        self.stats.decode_seconds += time.perf_counter() - t0
        return out

    # -- internals --------------------------------------------------------------------
    def _session(self) -> Session:
        if self.session is None:
            raise SpecError("the codec has no session; bind one (training.comm.session.agree)")
        return self.session

    def _key(self, salt: bytes, cipher: str, h: _Header) -> bytes:
        k = (salt, CIPHERS[cipher], h.source, h.dest, h.stage, h.generation)
        key = self._keys.get(k)
        if key is None:
            info = link_info(cipher, h.source, h.dest, h.stage, h.generation)
            key = derive(self.run_key, salt, info, KEY_BYTES[cipher])
            self._keys[k] = key
            if len(self._keys) > KEY_CACHE:
                self._keys.popitem(last=False)
        return key

    def _decode(
        self, payload: bytes, expect: Address, numel: int, accept: tuple[str, ...]
    ) -> torch.Tensor:
        s = self._session()
        if len(payload) < HEADER.size + TAG_BYTES:
            raise TransientReject(
                f"{_where(expect)} is truncated ({len(payload)} bytes); not applied"
            )
        h = _unpack(payload)
        if h is None:
            raise TransientReject(
                f"{_where(expect)} is not a geotrain v{VERSION} payload; not applied"
            )
        quant = _expected_quant(h.quant, self.spec.quantize, accept)
        want = _Header(
            QUANT[quant],
            CIPHERS[self.spec.cipher],
            expect.stage,
            s.tag,
            s.id,
            expect.epoch,
            expect.step,
            expect.bucket,
            expect.source,
            expect.dest,
            expect.part,
            numel,
            self.spec.block_size,
            h.nonce,  # any: it only has to be unique, which the sender's key ensures
        )
        if h != want:
            self._classify(payload, h, want, expect)
        header, sealed = payload[: HEADER.size], payload[HEADER.size :]
        body = self._open(sealed, h, header, s.salt(), self.spec.cipher)
        if body is None:
            raise TransientReject(
                f"{_where(expect)} failed {self.spec.cipher} authentication (corrupted in "
                "transit, or forged without this run's key); not applied"
            )
        raw = self._decompress(body, numel, expect, quant)
        try:
            return _dequantize(
                _unshuffle(raw, _itemsize(quant)), quant, numel, self.spec.block_size
            )
        except _UnusedCode:
            raise HostileReject(
                f"{_where(expect)}: authentic ternary body holds code 3, which no encoder "
                "writes; not applied"
            ) from None

    def _decompress(self, body: bytes, numel: int, expect: Address, quant: str) -> bytes:
        """The authentic `body`, decompressed to exactly the bytes of `numel` values."""
        size = _raw_size(quant, numel, self.spec.block_size)
        try:
            # zstd allocates a frame's declared content size, whatever max_output_size says
            if zstandard.frame_content_size(body) not in (size, -1):
                raise HostileReject(
                    f"{_where(expect)} declares a body of the wrong size; not applied"
                )
            raw = self._zd().decompress(body, max_output_size=size)
        except zstandard.ZstdError as e:
            raise HostileReject(
                f"{_where(expect)}: authentic body does not decompress ({e}); not applied"
            ) from None
        if len(raw) != size:
            raise HostileReject(
                f"{_where(expect)}: authentic body holds {len(raw)} bytes, {numel} "
                f"{quant} values take {size}; not applied"
            )
        return raw

    def _classify(self, payload: bytes, h: _Header, want: _Header, expect: Address) -> None:
        """A header that differs from the expectation: authentic as it claims (a replay,
        a misroute or a key holder's wrong shape) is hostile, else it is garbled."""
        where = _where(expect)
        names = {
            "run": ("tag",),
            "session": ("session",),
            "address": ("epoch", "step", "source", "dest", "bucket", "part", "stage"),
            "numel": ("numel",),
            "block": ("block",),
            "quantizer": ("quant",),
            "cipher": ("cipher",),
        }
        wrong = [k for k, fs in names.items() if any(getattr(h, f) != getattr(want, f) for f in fs)]
        cipher = next((c for c, i in CIPHERS.items() if i == h.cipher), None)
        authentic = (
            cipher is not None
            and self._open(
                payload[HEADER.size :], h, payload[: HEADER.size], h.tag + h.session, cipher
            )
            is not None
        )
        got = h.address()
        detail = (
            f"header says epoch {got.epoch} step {got.step} rank {got.source}->{got.dest} "
            f"bucket {got.bucket} part {got.part} stage {got.stage} numel {h.numel} block "
            f"{h.block}; expected epoch {expect.epoch} step {expect.step} rank "
            f"{expect.source}->{expect.dest} bucket {expect.bucket} part {expect.part} stage "
            f"{expect.stage}"
        )
        if not authentic:
            raise TransientReject(
                f"{where} has a garbled header ({', '.join(wrong)} differ and it does not "
                f"authenticate as it claims); {detail}; not applied"
            )
        if {"run", "session", "address"} & set(wrong):
            # honest traffic replayed or redirected: a keyless party on the path can do
            # it, so it is dropped and counted, never a reason to stop the job
            what = (
                "replayed from another run or session"
                if {"run", "session"} & set(wrong)
                else "replayed (old step)"
                if got.step < expect.step
                else "misaddressed (replayed or redirected)"
            )
            raise ReplayReject(
                f"{where} is an authentic payload {what} ({', '.join(wrong)} differ): "
                f"{detail}; not applied"
            )
        raise HostileReject(  # at this address, a shape no honest sender writes
            f"{where} is an authentic payload of the wrong shape ({', '.join(wrong)} "
            f"differ): {detail}; not applied"
        )

    def _seal(self, body: bytes, h: _Header, header: bytes, salt: bytes) -> bytes:
        key = self._key(salt, self.spec.cipher, h)
        if self.spec.cipher == "none":
            return body + hmac.new(key, header + body, "sha256").digest()[:TAG_BYTES]
        enc = _cipher(self.spec.cipher, key, h.nonce).encryptor()
        enc.authenticate_additional_data(header)
        return enc.update(body) + enc.finalize() + enc.tag

    def _open(
        self, sealed: bytes, h: _Header, header: bytes, salt: bytes, cipher: str
    ) -> bytes | None:
        """The body, or None when it does not authenticate."""
        key = self._key(salt, cipher, h)
        ct, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
        if cipher == "none":
            good = hmac.new(key, header + ct, "sha256").digest()[:TAG_BYTES]
            return ct if hmac.compare_digest(good, tag) else None
        dec = _cipher(cipher, key, h.nonce, tag).decryptor()
        dec.authenticate_additional_data(header)
        try:
            return dec.update(ct) + dec.finalize()
        except InvalidTag:
            return None

    def _zc(self, level: int) -> zstandard.ZstdCompressor:
        if not hasattr(self._local, "c"):
            self._local.c = {}
        c: zstandard.ZstdCompressor | None = self._local.c.get(level)
        if c is None:
            c = self._local.c[level] = zstandard.ZstdCompressor(level=level)
        return c

    def _zd(self) -> zstandard.ZstdDecompressor:
        if not hasattr(self._local, "d"):
            self._local.d = zstandard.ZstdDecompressor()
        return self._local.d


def _expected_quant(got: int, own: str, accept: tuple[str, ...]) -> str:
    """The quantizer the receiver expects: the header's when it is one the receiver
    accepts (its authenticity is checked next, under the key), else its own spec's."""
    for q in accept:
        if QUANT[q] == got:
            return q
    return own


def quant_of(payload: bytes) -> str | None:
    """The quantizer a payload's header names (unauthenticated: for statistics only)."""
    if len(payload) < HEADER.size:
        return None
    got = payload[3]  # after magic (2 bytes) and version (1): the quantizer byte
    return next((q for q, i in QUANT.items() if i == got), None)


def _where(expect: Address) -> str:
    return f"payload from rank {expect.source} (step {expect.step}, bucket {expect.bucket})"


def _cipher(name: str, key: bytes, nonce: bytes, tag: bytes | None = None) -> Cipher:
    alg = algorithms.SM4(key) if name == "sm4-gcm" else algorithms.AES(key)
    return Cipher(alg, modes.GCM(nonce, tag))


def _pack(h: _Header) -> bytes:
    return HEADER.pack(MAGIC, VERSION, *h)


def _unpack(payload: bytes) -> _Header | None:
    fields = HEADER.unpack_from(payload)
    if fields[0] != MAGIC or fields[1] != VERSION:
        return None
    return _Header._make(fields[2:])


def _raw_size(quant: str, n: int, block: int) -> int:
    """Bytes of `n` values quantized with `quant` (what _quantize produces)."""
    if quant in ("none", "fp16", "bf16"):
        return n * _itemsize(quant)
    nb = -(-n // block)
    per_byte = {"int8": 1, "int4": 2, "ternary": 4}[quant]
    return 4 * nb + -(-(nb * block) // per_byte)


def _itemsize(quant: str) -> int:
    return {"none": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 1, "ternary": 1}[quant]


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


def _host(t: torch.Tensor) -> bytes:
    """A tensor's bytes in host memory (`cpu()` returns a CPU tensor itself: no copy)."""
    return t.cpu().numpy().tobytes()


def _quantize(x: torch.Tensor, quant: str, block: int) -> tuple[bytes, torch.Tensor]:
    """Returns (bytes to send, the fp32 values the receiver will reconstruct, on x's
    device). Any device: a CUDA tensor is quantized where it is, and only the quantized
    bytes and scales cross to the host (`_host`): a quarter (int8) or an eighth (int4) of
    the fp32 copy."""
    n = x.numel()
    if quant == "none":
        return _host(x), x
    if quant in ("fp16", "bf16"):
        h = x.to(torch.float16 if quant == "fp16" else torch.bfloat16)
        return _host(h.view(torch.int16)), h.float()
    if quant == "ternary":
        return _ternary(x, block)
    levels = 127 if quant == "int8" else 7
    b = _blocks(x, block)  # (nb, block)
    scale = b.abs().amax(dim=1, keepdim=True) / levels  # (nb, 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(b / safe).clamp_(-levels, levels).to(torch.int8)  # (nb, block)
    decoded = (q.float() * scale).view(-1)[:n]
    if quant == "int8":
        data = _host(q.view(-1))
    else:
        u = (q.view(-1) + 8).to(torch.uint8)  # 1..15
        if u.numel() % 2:
            u = torch.nn.functional.pad(u, (0, 1))
        data = _host(u[0::2] | (u[1::2] << 4))
    return _host(scale.view(-1)) + data, decoded


def _ternary(x: torch.Tensor, block: int) -> tuple[bytes, torch.Tensor]:
    b = _blocks(x, block)  # (nb, block)
    a = b.abs()
    keep = a > TERNARY_THRESHOLD * a.mean(dim=1, keepdim=True)
    kept = keep.sum(dim=1, keepdim=True)
    scale = (a * keep).sum(dim=1, keepdim=True) / kept.clamp(min=1)  # 0 where none kept
    q = torch.sign(b) * keep  # -1, 0, 1
    decoded = (q * scale).view(-1)[: x.numel()]
    u = (q + 1).to(torch.uint8).view(-1)  # codes 0, 1, 2
    u = torch.nn.functional.pad(u, (0, (-u.numel()) % 4)).view(-1, 4)
    data = u[:, 0] | (u[:, 1] << 2) | (u[:, 2] << 4) | (u[:, 3] << 6)
    return _host(scale.view(-1)) + _host(data), decoded


class _UnusedCode(ValueError):
    """A ternary body holds code 3, which no encoder writes."""


def _dequantize(raw: bytes, quant: str, n: int, block: int) -> torch.Tensor:
    """`raw` is exactly _raw_size(quant, n, block) bytes (checked by the caller)."""
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if quant == "none":
        return buf.view(torch.float32).clone()
    if quant in ("fp16", "bf16"):
        return buf.view(torch.float16 if quant == "fp16" else torch.bfloat16).float()
    nb = -(-n // block)
    scale = buf[: 4 * nb].view(torch.float32).view(-1, 1)  # (nb, 1)
    body = buf[4 * nb :]
    if quant == "int8":
        q = body.view(torch.int8).float().view(nb, block)
    elif quant == "ternary":
        codes = torch.stack([(body >> s) & 3 for s in (0, 2, 4, 6)], dim=1).view(-1)
        if bool((codes == 3).any()):
            raise _UnusedCode
        q = (codes[: nb * block].to(torch.int8) - 1).float().view(nb, block)
    else:
        lo = (body & 0x0F).to(torch.int16)
        hi = (body >> 4).to(torch.int16)
        q = (torch.stack((lo, hi), dim=1).view(-1)[: nb * block] - 8).float().view(nb, block)
    return (q * scale).view(-1)[:n].clone()
