"""The topology-aware cross-region exchange (`exchange: topology`): training.sync.hier's
reduce-scatter + all-gather run by an `ExchangePlan` (training.sync.exchange_plan) instead of
equal pieces on direct links.

Agreement: at the cross group's first exchange and then every `replan` exchanges, every
rank of the group contributes its region's row (its link estimates from
training.sync.linkprobe, its codec's measured speeds and wire ratio) to one all-gather; every
rank then holds the same `LinkMatrix` and computes the same plan, so the regions switch
together. Exchanges are counted, not steps: every rank of a group runs the same exchanges
in the same order (bucket by bucket), whatever the sync mode.

One exchange of a shard (S,) in region `me`, piece j = the plan's `sizes` slice j:
  scatter, round 1: piece j (encoded for region j, Address source me -> j, part j) to its
      first hop: j itself, or a relay k. Round 2 (only when the plan relays): k forwards
      the bytes it holds for j, unread (they are encrypted under the me -> j key).
  region j decodes the R - 1 copies of piece j, checking each Address as it would a
      direct payload, and sums them with its own in region order;
  gather, round 1: region j encodes its sum once (destination BROADCAST) and sends it to
      each first hop; round 2: relays forward it. Every region decodes every other piece.
Each round is one `LinkMonitor.exchange`: per peer one blob of length-framed payloads,
in an order both sides derive from the plan (so the framing carries no addresses; a
payload in the wrong place fails its Address check). Every value a region applies comes
out of the decoder, so every region applies bitwise the same sum, as with the direct
exchange; with equal pieces and no relay the bytes are those of the direct exchange.

Error feedback: residuals by position in the shard, (2, S): row 0 for what this region
sends (each position belongs to one piece), row 1 for the sum it gathers out (its own
piece's positions). When a new plan moves the pieces, row 1 outside the region's new
piece is folded into row 0: that error of the sum re-enters it, once, through this
region's next contribution.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from training.errors import SpecError, TransientReject
from training.spec import LaunchSpec, exchange_conflict
from training.sync.codec import Address, Codec
from training.sync.exchange_plan import (
    DEFAULT_SPEED,
    WIRE_RATIO,
    ExchangePlan,
    LinkMatrix,
    first_hops,
    plan,
)

if TYPE_CHECKING:
    from training.sync.hier import HierarchicalAllReduce

SCATTER, GATHER = 0, 1
BROADCAST = 0xFFFFFFFF
"""As in training.sync.hier (which imports this module)."""
MARGIN = 0.1
"""A new plan must be predicted this much faster than the one in force."""


@dataclass
class Counters:
    """This rank's own codec timings: the speeds its matrix row reports."""

    encoded: int = 0
    """fp32 bytes encoded."""
    encode_s: float = 0.0
    decoded: int = 0
    """fp32 bytes decoded."""
    decode_s: float = 0.0
    wire: int = 0
    """Payload bytes encoded."""

    def row(self, quantize: str) -> list[float]:
        """[encode B/s, decode B/s, wire ratio] (defaults until measured)."""
        enc = self.encoded / self.encode_s if self.encode_s else DEFAULT_SPEED
        dec = self.decoded / self.decode_s if self.decode_s else DEFAULT_SPEED
        ratio = self.wire / self.encoded if self.encoded else WIRE_RATIO[quantize]
        return [enc, dec, ratio]


@dataclass
class TopologyExchange:
    """One cross group's planned exchange (set on HierarchicalAllReduce.planner)."""

    replan: int = 20
    """Exchanges between two plans (the first exchange plans too)."""
    relays: bool = True
    """Whether plans may relay (False: piece weights only; benchmarks compare the two)."""
    plan: ExchangePlan | None = None
    """The plan in force (None before the first exchange)."""
    exchanges: int = 0
    residuals: dict[int, tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=dict)
    """bucket -> (the piece sizes they are laid out for, residuals (2, S))."""
    counters: Counters = field(default_factory=Counters)
    history: list[tuple[int, str]] = field(default_factory=list)
    """(exchange, plan description) at every plan change."""
    relayed_bytes: int = 0
    """Bytes this rank forwarded for other regions."""
    matrix: LinkMatrix | None = None
    """The last agreed matrix."""

    @staticmethod
    def for_spec(spec: LaunchSpec) -> TopologyExchange | None:
        """The planner a launch spec asks for (None: the direct exchange)."""
        if spec.exchange != "topology":
            return None
        conflict = exchange_conflict(
            spec.exchange,
            secure_aggregation=spec.codec.secure_aggregation,
            adaptive=spec.codec.adaptive is not None,
        )
        if conflict:
            raise SpecError(f"launch spec: exchange: topology {conflict}")
        return TopologyExchange(replan=spec.exchange_replan)

    # -- agreement --------------------------------------------------------------------
    def agree(self, sync: HierarchicalAllReduce, values: int) -> None:
        """Gather every region's row over the cross group; plan from the same matrix."""
        topo = sync.topo
        R = topo.regions
        row = torch.zeros(2 * R + 3, dtype=torch.float64)  # [bandwidth from j, rtt, speeds]
        if sync.links is not None:
            for j, link in sync.links.links.items():  # samples only underestimate (linkprobe)
                row[j], row[R + j] = max(link.bandwidth, link.probed), link.rtt
        row[2 * R :] = torch.tensor(self.counters.row(sync.codec.spec.quantize))
        rows = [torch.empty_like(row) for _ in range(R)]
        dist.all_gather(rows, row, group=sync.groups.cross)
        self.matrix = matrix_of([r.tolist() for r in rows])
        before = self.plan
        self.plan = plan(self.matrix, values, before, MARGIN, self.relays)
        if before is None or (self.plan.weights, self.plan.routes) != (
            before.weights,
            before.routes,
        ):
            self.history.append((self.exchanges, self.plan.describe(topo.region_names)))

    # -- one exchange -----------------------------------------------------------------
    def exchange(
        self, sync: HierarchicalAllReduce, shard: torch.Tensor, step: int, bucket: int
    ) -> torch.Tensor:
        """The cross-region sum of `shard` (S,), identical on every region."""
        if self.exchanges % self.replan == 0:
            self.agree(sync, shard.numel())
        self.exchanges += 1
        assert self.plan is not None  # agreed above
        n = shard.numel()
        sizes = self.plan.sizes(n, sync.codec.spec.block_size)
        ends = [sum(sizes[: j + 1]) for j in range(len(sizes))]
        padded = torch.nn.functional.pad(shard, (0, ends[-1] - n))
        res = self.residual(sync, bucket, sizes)
        run = _Run(self, sync, step, bucket, sizes, ends)
        mine = run.scatter(padded, res[0])
        pieces = run.gather(mine, res[1])
        me, R = sync.topo.region_index, sync.topo.regions
        sync.stats.cross_raw_bytes += 4 * (ends[-1] - sizes[me] + sizes[me] * (R - 1))
        return torch.cat(pieces)[:n]

    def residual(self, sync: HierarchicalAllReduce, bucket: int, sizes: list[int]) -> torch.Tensor:
        """This bucket's residuals laid out for `sizes` (re-laid when the plan moved)."""
        total, key = sum(sizes), tuple(sizes)
        old = self.residuals.get(bucket)
        if old is None:
            res = torch.zeros(2, total)
        elif old[0] == key:
            return old[1]
        else:
            res = relayout(old[1], list(old[0]), sizes, sync.topo.region_index)
        self.residuals[bucket] = (key, res)
        return res

    def clear(self) -> None:
        for _, r in self.residuals.values():
            r.zero_()

    def report(self, names: tuple[str, ...]) -> dict[str, Any]:
        return {
            "plan": self.plan.describe(names) if self.plan else "",
            "changes": self.history,
            "relayed_bytes": self.relayed_bytes,
        }


def relayout(old: torch.Tensor, old_sizes: list[int], sizes: list[int], me: int) -> torch.Tensor:
    """(2, S_old) residuals laid out for `old_sizes` -> (2, S) for `sizes`: positions keep
    their residuals; row 1 outside the new own piece moves into row 0 (module doc)."""
    total = sum(sizes)
    out = torch.zeros(2, total)
    keep = min(total, old.shape[1])
    out[:, :keep] = old[:, :keep]
    lo = sum(sizes[:me])
    hi = lo + sizes[me]
    moved = out[1].clone()
    moved[lo:hi] = 0
    out[0] += moved
    out[1] -= moved
    return out


def matrix_of(rows: list[list[float]]) -> LinkMatrix:
    """Rows gathered from every region (row b: b's estimates of the links from each a, their
    RTTs, b's encode and decode speeds and wire ratio) -> the matrix."""
    R = len(rows)
    bw = tuple(tuple(rows[b][a] if a != b else 0.0 for b in range(R)) for a in range(R))
    rtt = tuple(tuple(rows[b][R + a] if a != b else 0.0 for b in range(R)) for a in range(R))
    ratio = max(r[2 * R + 2] for r in rows)  # the least compressed region's: conservative
    return LinkMatrix(
        bw, rtt, tuple(r[2 * R] for r in rows), tuple(r[2 * R + 1] for r in rows), ratio
    )


# -- framing --------------------------------------------------------------------------
def frame(payloads: list[bytes]) -> bytes:
    """Payloads for one peer in one round: count, lengths, bodies."""
    if not payloads:
        return b""
    head = struct.pack(f">I{len(payloads)}I", len(payloads), *(len(p) for p in payloads))
    return head + b"".join(payloads)


def frame_bound(codec: Codec, numels: list[int]) -> int:
    """The most bytes `frame` makes of payloads of these sizes (values); 0 for none."""
    if not numels:
        return 0
    return 4 + 4 * len(numels) + sum(codec.max_payload(n) for n in numels)


def unframe(blob: bytes, expect: int) -> list[bytes]:
    """The `expect` payloads of a blob; TransientReject on framing that does not match."""
    if expect == 0:
        if blob:
            raise TransientReject(f"relay framing: {len(blob)} bytes where none were due")
        return []
    if len(blob) < 4 or struct.unpack_from(">I", blob)[0] != expect:
        raise TransientReject(f"relay framing: expected {expect} payloads in the blob")
    lengths = struct.unpack_from(f">{expect}I", blob, 4)
    start = 4 + 4 * expect
    if start + sum(lengths) != len(blob):
        raise TransientReject("relay framing: payload lengths do not add up to the blob")
    out = []
    for n in lengths:
        out.append(blob[start : start + n])
        start += n
    return out


@dataclass
class _Run:
    """One exchange under a plan, on this rank (the plan's rounds from its side)."""

    owner: TopologyExchange
    sync: HierarchicalAllReduce
    step: int
    bucket: int
    sizes: list[int]
    ends: list[int]

    @property
    def plan(self) -> ExchangePlan:
        assert self.owner.plan is not None  # set before a run
        return self.owner.plan

    def span(self, j: int) -> tuple[int, int]:
        return self.ends[j] - self.sizes[j], self.ends[j]

    def scatter(self, padded: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        """Stage 1: the sum over regions of this region's piece (its size, maybe 0)."""
        topo, routes = self.sync.topo, self.plan.routes
        R, me = topo.regions, topo.region_index
        peers = topo.peer_ranks(topo.local_rank)
        out: list[list[bytes]] = [[] for _ in range(R)]
        own = torch.zeros(self.sizes[me])
        for j in range(R):  # ascending j: the order each first hop expects
            if not self.sizes[j]:
                continue
            lo, hi = self.span(j)
            to = self._addr(topo.rank, peers[j], j, SCATTER)
            payload, dec = self._encode(padded[lo:hi], res[lo:hi], to, send=j != me)
            if j == me:
                own = dec
            else:
                out[routes[me][j]].append(payload)
        got = self._round(out, [[self.sizes[j] for j in self._scatter_first(i)] for i in range(R)])
        mine, forward = self._split_scatter(got)
        if any(k != j for i, k, j in self.plan.relays() if self.sizes[j]):
            n = self.sizes[me]  # what a relay forwards me: other regions' parts of my piece
            second = self._round(forward, [[n] * len(self._scatter_second(k)) for k in range(R)])
            for k in range(R):
                for i, payload in zip(self._scatter_second(k), second[k], strict=True):
                    mine[i] = payload
        total = torch.zeros_like(own)
        for i in range(R):  # fixed order: every region sums alike
            if i == me:
                total += own
            elif self.sizes[me]:
                frm = self._addr(peers[i], topo.rank, me, SCATTER)
                total += self._decode(mine[i], frm, self.sizes[me])
        return total

    def _scatter_first(self, i: int) -> list[int]:
        """Destinations of what region i sends me in scatter round 1, in its order."""
        me, routes = self.sync.topo.region_index, self.plan.routes
        if i == me:
            return []
        R = len(self.sizes)
        return [j for j in range(R) if j != i and self.sizes[j] and routes[i][j] == me]

    def _scatter_second(self, k: int) -> list[int]:
        """Origins of what relay k forwards me in scatter round 2, ascending."""
        me, routes = self.sync.topo.region_index, self.plan.routes
        if k == me or not self.sizes[me]:
            return []
        return [i for i in range(len(self.sizes)) if i not in (me, k) and routes[i][me] == k]

    def _split_scatter(self, got: list[list[bytes]]) -> tuple[dict[int, bytes], list[list[bytes]]]:
        """Round 1's payloads: mine by origin, and what to forward, per destination (in
        ascending origin order)."""
        R, me = self.sync.topo.regions, self.sync.topo.region_index
        mine: dict[int, bytes] = {}
        forward: list[list[bytes]] = [[] for _ in range(R)]
        for i in range(R):  # ascending origin
            for j, payload in zip(self._scatter_first(i), got[i], strict=True):
                if j == me:
                    mine[i] = payload
                else:
                    forward[j].append(payload)
                    self.owner.relayed_bytes += len(payload)
        return mine, forward

    def gather(self, piece: torch.Tensor, res: torch.Tensor) -> list[torch.Tensor]:
        """Stage 2: every region's summed piece, decoded, in region order."""
        topo, p = self.sync.topo, self.plan
        R, me = topo.regions, topo.region_index
        peers = topo.peer_ranks(topo.local_rank)
        out: list[list[bytes]] = [[] for _ in range(R)]
        mine = piece
        if self.sizes[me]:
            lo, hi = self.span(me)
            to = self._addr(topo.rank, BROADCAST, me, GATHER)
            payload, mine = self._encode(piece, res[lo:hi], to)
            for hop in first_hops(p, me):
                out[hop].append(payload)
        got = self._round(out, [[self.sizes[i]] if self._gets_first(i) else [] for i in range(R)])
        held = {i: got[i][0] for i in range(R) if got[i]}
        if any(self.sizes[i] for i, _, _ in p.relays()):
            forward: list[list[bytes]] = [[] for _ in range(R)]
            for i in sorted(held):
                for j in range(R):
                    if j not in (i, me) and p.routes[i][j] == me:
                        forward[j].append(held[i])
                        self.owner.relayed_bytes += len(held[i])
            second = self._round(
                forward, [[self.sizes[i] for i in self._gather_second(k)] for k in range(R)]
            )
            for k in range(R):
                for i, payload in zip(self._gather_second(k), second[k], strict=True):
                    held.setdefault(i, payload)
        return [
            mine
            if i == me
            else self._decode(held[i], self._addr(peers[i], BROADCAST, i, GATHER), self.sizes[i])
            if self.sizes[i]
            else torch.zeros(0)
            for i in range(R)
        ]

    def _gets_first(self, i: int) -> bool:
        me = self.sync.topo.region_index
        return i != me and bool(self.sizes[i]) and me in first_hops(self.plan, i)

    def _gather_second(self, k: int) -> list[int]:
        """Origins whose sums relay k forwards me in gather round 2, ascending."""
        me, routes = self.sync.topo.region_index, self.plan.routes
        if k == me:
            return []
        return [
            i
            for i in range(len(self.sizes))
            if i not in (me, k) and self.sizes[i] and routes[i][me] == k
        ]

    # -- helpers ------------------------------------------------------------------------
    def _addr(self, src: int, dst: int, part: int, stage: int) -> Address:
        return Address(self.sync.epoch, self.step, src, dst, self.bucket, part=part, stage=stage)

    def _encode(
        self, x: torch.Tensor, res: torch.Tensor, addr: Address, send: bool = True
    ) -> tuple[bytes, torch.Tensor]:
        """(payload, what receivers decode); the same arithmetic as the direct exchange's
        `HierarchicalAllReduce._encode`, with the residual as a view by position."""
        sync, c = self.sync, self.owner.counters
        if sync.error_feedback:
            x = x + res
        if send:
            t0 = time.perf_counter()
            payload, decoded = sync.codec.encode(x, addr)
            c.encode_s += time.perf_counter() - t0
            c.encoded += 4 * x.numel()
            c.wire += len(payload)
        else:  # this region's own piece: quantized, never sent
            payload, decoded = b"", sync.codec.quantized(x)
        if sync.error_feedback:
            res.copy_(x - decoded)
        return payload, decoded

    def _decode(self, payload: bytes, addr: Address, n: int) -> torch.Tensor:
        c = self.owner.counters
        t0 = time.perf_counter()
        out = self.sync.codec.decode(payload, addr, n)
        c.decode_s += time.perf_counter() - t0
        c.decoded += 4 * n
        return out

    def _round(self, out: list[list[bytes]], numels: list[list[int]]) -> list[list[bytes]]:
        """Send each peer its framed payloads; returns each peer's payloads, as many as
        `numels` lists for it, each of that many values. One round: each peer's frame is
        received into a buffer of its bound (`frame_bound`), not after a swap of sizes."""
        sync = self.sync
        blobs = [frame(msgs) for msgs in out]
        stats = sync.stats
        for j, b in enumerate(blobs):
            if b:
                stats.cross_wire_bytes += len(b)
                stats.per_peer_wire[j] = stats.per_peer_wire.get(j, 0) + len(b)
        limits = [frame_bound(sync.codec, n) for n in numels]
        got = sync._all_to_all_bytes(blobs, limits)
        return [unframe(got[i], len(numels[i])) for i in range(len(blobs))]
