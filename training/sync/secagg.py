"""Secure aggregation of the cross-region scatter stage: pairwise masks over a shared scale.

In `HierarchicalAllReduce._exchange_many`, region j sums piece j of every region's shard. With
secure aggregation it receives each piece masked, so it learns only the sum of the other
regions' contributions, never one region's values (with 3 or more regions: with 2, the
sum minus its own contribution is the other's, whatever the protocol).

One round (epoch, step, bucket) in one cross group of R regions, pieces (R, P):
  1. scale agreement: every region sends its per-block max-abs of every piece, (R, nb)
     fp32, to every other region; the shared scale is the max over regions / levels
     (127 int8, 7 int4), identical everywhere. Cost: one extra small exchange per bucket
     (4 bytes per block of 256 values, and one round trip); what it reveals: one max-abs
     per block per region (docs/security.md).
  2. quantize with the shared scale: q = round(x / scale) in [-levels, levels], never
     clipped since scale >= the region's own max-abs / levels. Error feedback keeps
     x - q * scale: the region's own quantization, before masking.
  3. mask: v = q + sum over peers k of (+m_k if my region < k else -m_k) mod 2^16, m_k a
     keystream of (SM4 or AES)-CTR under HKDF(X25519 secret of the pair, salt = run tag
     || session id, info = pair, epoch, step, bucket, piece); a bucket's steps must
     advance within a session (else `RoundReused`), so a mask is never reused.
  4. region j sums the R masked copies of piece j mod 2^16: the masks cancel exactly and
     the sum of q (|sum| <= R * levels < 2^15) comes out as a signed 16-bit value, times
     the shared scale.
Scales and masked pieces travel through a `quantize: none` codec on stages 2 and 3: the
same header checks and SM4-GCM/AES-GCM as every payload, under keys of their own stage, with
nonces from the process's one allocator (training.sync.codec.NONCES), so two SecureSums of a
session (the sync's and a streaming twin's) never seal under one (key, nonce).
Each of the two exchanges takes one round (training.sync.linkprobe.bounded_all_to_all: a
message leads with its length and lands in a buffer of the wire codec's bound).

The X25519 public keys are exchanged once per sync object (a launch or restart), through
`training.comm.session.Control`: the session's HMAC under the run key, like the session
agreement, on a channel of this cross group (its c10d name and ranks) and instance, so the
sync's exchange and its streaming twin's (same ranks, other group) cannot stand in for
each other. A region missing from a round (a failed exchange, an empty payload) aborts it
with `RoundAborted`: its masks cannot be removed without it, and masks are not recovered
(no secret sharing of the keys), so the job restarts from its checkpoint as for any lost
region.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from training.comm.session import Control, Session
from training.comm.topology import Topology
from training.errors import (
    RoundAborted,
    RoundReused,
    SecureAggregationError,
    SpecError,
    clip,
)
from training.sync.codec import Address, Codec
from training.sync.linkprobe import bounded_all_to_all

RING_BITS = 16
"""Masked values live in Z_2^16: 2 bytes each, room for sums of |R * levels| < 2^15."""
LEVELS = {"int8": 127, "int4": 7}
"""Quantizers secure aggregation accepts, and their largest level."""
SCALE, MASKED = 2, 3
"""Codec stages of the scale agreement and the masked pieces (keys of their own)."""


@dataclass(frozen=True)
class Round:
    """One secure sum: masks are derived per round, piece and pair, and never reused."""

    epoch: int
    step: int
    bucket: int


def check_settings(quantize: str, regions: int) -> None:
    """SpecError unless secure aggregation can run with `quantize` over `regions`."""
    if quantize not in LEVELS:
        raise SpecError(
            f"secure_aggregation needs codec.quantize int8 or int4 (masks add integers), "
            f"not '{quantize}'; set quantize: int8"
        )
    if regions * LEVELS[quantize] >= 1 << (RING_BITS - 1):
        raise SpecError(
            f"secure_aggregation sums {regions} regions of {quantize} in Z_2^{RING_BITS}; "
            f"at most {((1 << (RING_BITS - 1)) - 1) // LEVELS[quantize]} regions fit"
        )


def keystream(key: bytes, n: int, cipher: str) -> torch.Tensor:
    """(n,) int32 in [0, 2^16): CTR keystream of SM4 (codec cipher sm4-gcm) or AES-256,
    read as little-endian 16-bit words whatever the host (every party must agree)."""
    alg = algorithms.SM4(key[:16]) if cipher == "sm4-gcm" else algorithms.AES(key)
    raw = Cipher(alg, modes.CTR(bytes(16))).encryptor().update(bytes(2 * n))
    return torch.from_numpy(np.frombuffer(raw, dtype="<u2").astype(np.int32))


def mask_key(secret: bytes, salt: bytes, pair: tuple[int, int], rnd: Round, piece: int) -> bytes:
    """The PRG key of one pair's mask for one piece of one round (HKDF-SHA256)."""
    lo, hi = sorted(pair)
    info = f"geotrain/v2|secagg-mask|{lo}<{hi}|epoch{rnd.epoch}|step{rnd.step}"
    info += f"|bucket{rnd.bucket}|piece{piece}"
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info.encode()).derive(secret)


def wrap(x: torch.Tensor) -> torch.Tensor:
    """int32 -> its value mod 2^16 as a signed int in [-2^15, 2^15) (int32)."""
    half = 1 << (RING_BITS - 1)
    return ((x + half) & ((1 << RING_BITS) - 1)) - half


@dataclass(frozen=True)
class Masker:
    """One party's masks: `secrets` maps each peer region to the X25519 secret of the pair."""

    me: int
    secrets: dict[int, bytes]
    salt: bytes
    cipher: str

    def mask(self, q: torch.Tensor, rnd: Round, piece: int) -> torch.Tensor:
        """(n,) int32 quantized values -> (n,) int16: q plus this party's masks mod 2^16."""
        acc = q.to(torch.int32).clone()
        for peer, secret in sorted(self.secrets.items()):
            m = keystream(
                mask_key(secret, self.salt, (self.me, peer), rnd, piece), q.numel(), self.cipher
            )
            acc += m if self.me < peer else -m
        return wrap(acc).to(torch.int16)


def ring_sum(masked: list[torch.Tensor]) -> torch.Tensor:
    """Sum of int16 vectors mod 2^16, as signed int32 (the plain sum when it fits)."""
    acc = torch.zeros(masked[0].numel(), dtype=torch.int32)
    for v in masked:
        acc += v.to(torch.int32)
    return wrap(acc)


def shared_quantize(
    x: torch.Tensor, scale: torch.Tensor, levels: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) fp32 and per-block scales (nb,) -> (q int32 (P,), q * scale fp32 (P,))."""
    n = x.numel()
    b = torch.nn.functional.pad(x, (0, (-n) % block)).view(-1, block)  # (nb, block)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).view(-1, 1)
    q = torch.round(b / safe).clamp_(-levels, levels)
    return q.view(-1)[:n].to(torch.int32), dequantize(q.view(-1)[:n], scale, block)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """(P,) integers (any dtype) times their block's scale -> (P,) fp32."""
    n = q.numel()
    b = torch.nn.functional.pad(q.float(), (0, (-n) % block)).view(-1, block)
    return (b * scale.view(-1, 1)).view(-1)[:n].clone()


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """(R, P) -> (R, nb): max |x| per block of each piece."""
    pad = torch.nn.functional.pad(x, (0, (-x.shape[1]) % block))
    return pad.view(x.shape[0], -1, block).abs().amax(dim=2)


@dataclass
class SecureSum:
    """The secure scatter stage of one cross group (see the module docstring)."""

    topo: Topology
    group: Any
    """This rank's cross-region gloo group."""
    codec: Codec
    """The sync's codec: run key, session and settings (quantize, block, cipher)."""
    error_feedback: bool = True
    masked: bool = True
    """False: the same shared-scale integer sum without masks (tests and benchmarks)."""
    _priv: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    _masker: Masker | None = None
    _wire: Codec | None = None
    _last: dict[tuple[int, int], int] = field(default_factory=dict)
    """(epoch, bucket) -> the last step masked: steps must advance (O(buckets) memory)."""

    def __post_init__(self) -> None:
        check_settings(self.codec.spec.quantize, self.topo.regions)

    def scatter_sum(
        self, pieces: torch.Tensor, res: torch.Tensor, step: int, bucket: int
    ) -> tuple[torch.Tensor, list[int]]:
        """pieces (R, P), residual rows (R + 1, P) -> (sum over regions of piece `me` (P,),
        bytes sent to each region)."""
        rnd = self._round(step, bucket)
        spec, R, me = self.codec.spec, self.topo.regions, self.topo.region_index
        levels, block = LEVELS[spec.quantize], spec.block_size
        x = pieces + res[:R] if self.error_feedback else pieces  # (R, P)
        scales, sent = self._agree_scale(block_absmax(x, block), rnd)  # (R, nb)
        scale = scales / levels
        q = torch.empty(x.shape, dtype=torch.int32)
        for j in range(R):
            q[j], dec = shared_quantize(x[j], scale[j], levels, block)
            if self.error_feedback:
                res[j] = x[j] - dec  # the region's own quantization, before masking
        total, more = self._masked_sum(q, rnd)
        return dequantize(total, scale[me], block), [a + b for a, b in zip(sent, more, strict=True)]

    # -- internals --------------------------------------------------------------------
    def _round(self, step: int, bucket: int) -> Round:
        wire = self._wire_codec()
        assert wire.session is not None  # bound by _wire_codec
        rnd = Round(wire.session.epoch, step, bucket)
        last = self._last.get((rnd.epoch, bucket))
        if last is not None and step <= last:
            raise RoundReused(
                f"secure aggregation round epoch {rnd.epoch} step {step} bucket {bucket} "
                f"comes after step {last}: masks of a step must not repeat, so it is refused"
            )
        self._last[(rnd.epoch, bucket)] = step
        return rnd

    def _wire_codec(self) -> Codec:
        """A `quantize: none` codec of the same run, session and cipher: it carries scales
        and masked words bit-exactly (int16 pairs as fp32 words). Its nonces come from the
        process's allocator, as every codec's: a second codec costs no nonce safety."""
        s = self.codec.session
        if self._wire is None:
            self._wire = Codec(replace(self.codec.spec, quantize="none"), self.codec.run_key)
        if s is not None and self._wire.session is not s:
            self._wire.bind(s)
            self._masker = None
        return self._wire

    def _agree_scale(self, absmax: torch.Tensor, rnd: Round) -> tuple[torch.Tensor, list[int]]:
        """Everyone's (R, nb) max-abs -> the elementwise max over regions, and bytes sent."""
        views, sizes = self._exchange([absmax.reshape(-1)] * self.topo.regions, rnd, SCALE)
        return torch.stack(views).amax(dim=0).view_as(absmax), sizes

    def _masked_sum(self, q: torch.Tensor, rnd: Round) -> tuple[torch.Tensor, list[int]]:
        """q (R, P) int32 -> sum over regions of piece `me` (P,) int32, and bytes sent."""
        R, P = q.shape
        masker = self._pair_masker() if self.masked else None
        words = []
        for j in range(R):
            v = masker.mask(q[j], rnd, j) if masker else q[j].to(torch.int16)
            v = torch.nn.functional.pad(v, (0, P % 2))  # whole fp32 words
            words.append(v.view(torch.float32))
        got, sizes = self._exchange(words, rnd, MASKED)
        return ring_sum([g.view(torch.int16)[:P] for g in got]), sizes

    def _exchange(
        self, xs: list[torch.Tensor], rnd: Round, stage: int
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Send xs[j] to region j through the wire codec; returns (region i's xs[me] for
        every i, my own unsent; bytes sent to each region). A missing region aborts."""
        wire, topo = self._wire_codec(), self.topo
        R, me = topo.regions, topo.region_index
        peers = topo.peer_ranks(topo.local_rank)

        def addr(src: int, dst: int) -> Address:  # masked: part = the piece, summed by dst
            part = dst if stage == MASKED else 0
            return Address(rnd.epoch, rnd.step, peers[src], peers[dst], rnd.bucket, part, stage)

        sent = [b"" if j == me else wire.encode(xs[j], addr(me, j))[0] for j in range(R)]
        limit = wire.max_payload(xs[me].numel())  # every region sends me a piece of my size
        try:
            blobs = bounded_all_to_all(sent, [limit] * R, self.group, me, topo.region_names)
        except RuntimeError as e:  # gloo: a peer closed, or the timeout passed
            others = [i for i in range(R) if i != me]
            raise self._aborted(rnd, others, f"the exchange failed: {e}") from None
        out = []
        for i in range(R):
            if i == me:
                out.append(xs[me])
            elif not blobs[i]:
                raise self._aborted(rnd, [i], "its payload is missing")
            else:  # a refused payload raises PayloadRejected, counted like any other
                out.append(wire.decode(blobs[i], addr(i, me), xs[me].numel()))
        return out, [len(p) for p in sent]

    def _aborted(self, rnd: Round, regions: list[int], why: str) -> RoundAborted:
        names = ", ".join(self.topo.region_names[i] for i in regions)
        return RoundAborted(
            clip(
                f"secure aggregation round epoch {rnd.epoch} step {rnd.step} bucket "
                f"{rnd.bucket} aborted: no masked contribution from region {names} ({why}); "
                "its masks cannot be removed, so no sum is applied; restart from the newest "
                "checkpoint",
                300,
            )
        )

    def _pair_masker(self) -> Masker:
        """Exchange X25519 public keys over the session's authenticated control channel
        (once per sync object and session) and derive the secret of every pair."""
        wire = self._wire_codec()
        if self._masker is None:
            assert wire.session is not None
            self._masker = exchange_keys(self._priv, self.codec.run_key, wire.session, self)
        return self._masker


def exchange_keys(priv: X25519PrivateKey, run_key: bytes, session: Session, s: SecureSum) -> Masker:
    """A collective of the cross group: every region's X25519 public key, MAC'd under the
    run key's session key (training.comm.session.Control), then the pairwise secrets."""
    topo = s.topo
    me = topo.region_index
    pub = priv.public_key().public_bytes_raw()
    views = Control(run_key, session, "secagg-x25519", s.group).gather(
        {"region": me, "public": pub.hex()}
    )
    secrets = {}
    for i, v in enumerate(views):
        if i == me:
            continue
        try:
            if v["region"] != i:
                raise ValueError(f"claims region {v['region']}")
            peer = X25519PublicKey.from_public_bytes(bytes.fromhex(v["public"]))
            secrets[i] = priv.exchange(peer)  # ValueError on a low-order point
        except (KeyError, TypeError, ValueError) as e:
            raise SecureAggregationError(
                f"secure aggregation key exchange: region {topo.region_names[i]} sent an "
                f"unusable X25519 public key ({e}); stopping"
            ) from None
    return Masker(me, secrets, session.salt(), s.codec.spec.cipher)


def all_to_all_bytes(payloads: list[bytes], group: Any, world: int) -> list[bytes]:
    """payloads[j] to group rank j; returns what every group rank sent to me (gloo)."""
    sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    got = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(got, sizes, group=group)
    send = torch.frombuffer(bytearray(b"".join(payloads)) or bytearray(1), dtype=torch.uint8)
    recv = torch.empty(max(1, int(got.sum())), dtype=torch.uint8)
    dist.all_to_all_single(
        recv[: int(got.sum())],
        send[: int(sizes.sum())],
        output_split_sizes=got.tolist(),
        input_split_sizes=sizes.tolist(),
        group=group,
    )
    out, at = [], 0
    for k in got.tolist():
        out.append(recv[at : at + k].numpy().tobytes())
        at += k
    return out
