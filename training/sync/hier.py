"""Hierarchical, compressed, encrypted all-reduce.

One sync of a flat fp32 tensor (N,), L_r workers in region r, R regions, C = min_r L_r
cross groups (training.comm.topology):
  0. scale by this rank's share of the global batch (`scale`; 1 when every rank holds as
     many samples), so the result is the average over samples, not over ranks
  1. reduce-scatter inside the region: local rank c < C holds the region's sum of shard c
     (N/C,); local ranks >= C only send (with equal regions C = L: every rank holds one)
  2. across regions, in the cross group of local rank c (one peer per region): a
     reduce-scatter then an all-gather of that shard, each payload error-fed, encoded
     (quantize, shuffle, zstd, SM4-GCM), verified and decoded; see `_exchange`
  3. divide by the world size
  4. all-gather inside the region: every rank gets the full averaged tensor
With codec `none` the values are exactly those of a flat all-reduce (up to float
summation order, which is the only difference).

Every payload is addressed to one link of one cross group: source and destination global
ranks (so a payload of local rank 0's group is refused by local rank 1's), the stage
(scatter: piece j to region j; gather: the reduced piece to every region of the group,
destination `BROADCAST`), the piece, and the number of values the receiver expects (P).

With `codec.secure_aggregation` the scatter stage is `training.sync.secagg.SecureSum`: pieces
quantized with a scale every region agreed on and masked pairwise, so region j learns only
the sum of piece j; the gather stage is unchanged.

With `exchange: topology` the cross-region stage follows a plan agreed from the measured
link matrix instead (training.sync.topo_exchange): uneven pieces, relays through a third region.

With `exchange: allgather` step 2 is one round: each region's shard, error-fed and encoded
once, goes whole to every region, which sums the R decoded shards (`_allgather_sum`). Half
the round trips and no second quantization of a sum, for R / 2 times the bytes (the same
bytes with 2 regions, 1.5x with 3). Measured, it buys the single quantization (ternary
merges 0.8 points closer to per-step sync), not time: over the lab's 50 Mbit/s links the
extra bytes cost about the round trip it saves (benchmarks/results/lab_network.md).

Payloads cross through `training.sync.linkprobe.LinkMonitor.exchange`, which times each one into
its link's bandwidth estimate. With `codec.adaptive` the codec of each payload is chosen
per link from those estimates and the codec's measured speeds (training.sync.adaptive).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from training.comm.session import Session
from training.comm.topology import Groups, Topology
from training.errors import SpecError, TransientReject
from training.spec import exchange_conflict
from training.sync.adaptive import AdaptiveCodec, Choice
from training.sync.codec import Address, Codec
from training.sync.linkprobe import LinkMonitor
from training.sync.secagg import SecureSum, all_to_all_bytes

SCATTER, GATHER, ALLGATHER = 0, 1, 4
"""Exchange stages (training.sync.codec.STAGES)."""
BROADCAST = 0xFFFFFFFF
"""Destination of a gather payload: every region of the sender's cross group (one key per
source and group, so the reduced piece is encrypted once, not once per region)."""


class Planner(Protocol):
    """An exchange other than the direct one: training.sync.topo_exchange.TopologyExchange
    (`exchange: topology`), which imports this module, not the other way round."""

    def exchange(
        self, sync: HierarchicalAllReduce, shard: torch.Tensor, step: int, bucket: int
    ) -> torch.Tensor:
        """Sum `shard` (one bucket) over the regions of this rank's cross group."""
        ...

    def clear(self) -> None:
        """Forget every residual (with the sync's own: DiLoCo's end of warm-up)."""
        ...


@dataclass
class SyncStats:
    intra_bytes: int = 0
    """Bytes this rank sent inside its region (reduce-scatter + all-gather)."""
    cross_raw_bytes: int = 0
    """fp32 bytes this rank's payloads stand for, times the peers they went to."""
    cross_wire_bytes: int = 0
    """Encoded bytes this rank sent across regions."""
    sync_seconds: float = 0.0
    syncs: int = 0
    per_peer_wire: dict[int, int] = field(default_factory=dict)
    """Encoded bytes sent to each peer region (index): the per-link throughput."""


@dataclass
class HierarchicalAllReduce:
    topo: Topology
    groups: Groups
    codec: Codec
    run_id: str = ""
    """Used only when the codec has no session: tools and benchmarks then run under an
    unagreed session of this run id (workers bind the agreed one to the codec)."""
    error_feedback: bool = True
    stats: SyncStats = field(default_factory=SyncStats)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    """bucket -> quantization residuals (R + 1, P), carried to the next step."""

    secure: SecureSum | None = None
    """The masked scatter stage; set from codec.secure_aggregation (training.sync.secagg)."""
    scale: float = 1.0
    """This rank's samples / the mean samples per rank (training.balance): contributions
    are weighted by it, so the result is the average over every sample of the world."""
    links: LinkMonitor | None = None
    """This rank's estimates of its region's links (None: one region)."""
    adaptive: AdaptiveCodec | None = None
    """The per-link codec choice; set from codec.adaptive (training.sync.adaptive)."""
    planner: Planner | None = None
    """The topology-aware exchange (training.sync.topo_exchange; None: the direct one)."""
    sharded: bool = False
    """FSDP inside the region (training.parallel): each rank's x is its own shard, already
    averaged over the region by FSDP's reduce-scatter, so the in-region stages are skipped
    and the cross-region average runs on the shard with the same shard of every region."""
    allgather: bool = False
    """`exchange: allgather`: each region's shard whole to every region, one round (module
    doc); set from the spec, so every region exchanges alike."""

    def __post_init__(self) -> None:
        spec = self.codec.spec
        conflict = exchange_conflict(
            "allgather" if self.allgather else "direct",
            secure_aggregation=spec.secure_aggregation,
            adaptive=spec.adaptive is not None,
        )
        if conflict:
            raise SpecError(f"launch spec: exchange: allgather {conflict}")
        if self.codec.session is None:
            self.codec.bind(Session.unagreed(self.run_id))
        if self.topo.regions > 1:  # every rank: the start probe is a collective over intra
            self.links = LinkMonitor(self.topo, self.groups.cross)
        secure = self.codec.spec.secure_aggregation and self.topo.in_cross
        if secure and self.topo.regions > 1:
            self.secure = SecureSum(self.topo, self.groups.cross, self.codec, self.error_feedback)
        if self.codec.spec.adaptive is not None and self.links is not None and self.topo.in_cross:
            self.adaptive = AdaptiveCodec.of(self.codec, self.links)

    def probe(self) -> None:
        """Measure every cross-region link (a collective: every rank, once, at start)."""
        if self.links is not None:
            self.links.probe(self.groups.intra, self.groups.device)

    @property
    def epoch(self) -> int:
        assert self.codec.session is not None  # bound in __post_init__
        return self.codec.session.epoch

    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        """Average flat `x` (N,) over all ranks; returns a new fp32 tensor on x's device."""
        return self.all_reduce_many([x], step, [bucket])[0]

    def all_reduce_many(
        self, xs: Sequence[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        """`all_reduce` of every flat x (its bucket id: residuals and payload addresses)
        in one sync: the cross-region stages of all of them share one exchange each
        (`coalesced`), so B buckets wait out the WAN's round trips once, not B times.
        Over 120-280 ms links every exchange costs at least a round trip whatever its
        size, so this is most of a merge's or a step's sync time there. The results are
        bitwise those of B `all_reduce` calls."""
        if len(xs) != len(buckets) or len(set(buckets)) != len(buckets):
            raise ValueError(f"all_reduce_many: {len(xs)} tensors for buckets {list(buckets)}")
        if not xs:  # nothing to sync: no collective (every rank passes the same buckets)
            return []
        if not self.coalesced:  # each bucket's exchange on its own (every rank alike)
            pairs = zip(xs, buckets, strict=True)
            return [self._all_reduce_many([x], step, [b])[0] for x, b in pairs]
        return self._all_reduce_many(xs, step, buckets)

    @property
    def coalesced(self) -> bool:
        """Whether buckets share exchanges. Not with secure aggregation (its masked stage
        agrees a scale per bucket), a topology plan (its pieces and relays are per bucket)
        or the adaptive codec (it budgets each bucket's share of the step). Decided from
        the spec, so every rank of a region orders its in-region collectives alike."""
        spec = self.codec.spec
        return self.planner is None and not spec.secure_aggregation and spec.adaptive is None

    def _all_reduce_many(
        self, xs: Sequence[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        if self.adaptive is not None:
            self.adaptive.window.begin(step, sum(x.numel() for x in xs))
        if self.sharded:
            out = self._sharded_many(xs, step, buckets)
        else:
            out = self._hierarchical_many(xs, step, buckets)
        self.stats.sync_seconds += time.perf_counter() - t0
        self.stats.syncs += len(xs)
        if self.adaptive is not None:
            self.adaptive.window.end()
        return out

    def _hierarchical_many(
        self, xs: Sequence[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        """Reduce-scatter in the region, exchange across, all-gather in the region."""
        topo, g = self.topo, self.groups
        n = [x.numel() for x in xs]
        L, C = topo.local_size, topo.cross_size
        shards = []
        for x, k in zip(xs, n, strict=True):
            flat = x.detach().float().reshape(-1)
            if self.scale != 1.0:
                flat = flat * self.scale
            padded = torch.nn.functional.pad(flat, (0, (-k) % C))
            shards.append(self._intra_reduce_scatter(padded.to(g.device)))  # (S,); (0,) off cross
            self.stats.intra_bytes += 4 * (padded.numel() // C) * (L - 1)
        if topo.in_cross:
            totals = self._exchange_many([s.cpu() for s in shards], step, buckets)
            for t in totals:  # (S,) sums over all regions
                t.div_(topo.world_size)
        else:
            totals = [s.cpu() for s in shards]
        out = []
        for x, k, total in zip(xs, n, totals, strict=True):
            S = (k + (-k) % C) // C
            full = self._intra_all_gather(total.to(g.device), S)
            self.stats.intra_bytes += 4 * S * (L - 1)
            out.append(full[:k].view_as(x).to(x.device))
        return out

    def _sharded_many(
        self, xs: Sequence[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        """`sharded`: the region means of this rank's shards, averaged across regions over
        the cross group (every local rank is in one: FSDP needs equal regions)."""
        flats = [x.detach().float().reshape(-1).cpu() for x in xs]
        totals = self._exchange_many(flats, step, buckets)  # (S,) sums over all regions
        return [
            t.div_(self.topo.regions).view_as(x).to(x.device)
            for t, x in zip(totals, xs, strict=True)
        ]

    def _intra_reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(C * S,) -> (S,): the region's sum of this rank's shard; (0,) on a local rank
        >= C. NCCL has a native reduce-scatter (C = L); gloo's is an all-reduce underneath
        (all N values reduced on every rank), so on gloo each rank c < C receives only its
        shard from every peer (one all-to-all, (L - 1) / L of N sent) and sums the L
        copies in rank order."""
        L, C, g = self.topo.local_size, self.topo.cross_size, self.groups
        if L == 1:
            return x
        S = x.numel() // C
        if x.device.type == "cuda" and C == L:
            out = torch.empty(S, dtype=x.dtype, device=x.device)
            dist.reduce_scatter_single(out, x, group=g.intra)
            return out
        mine = self.topo.in_cross
        got = torch.empty(L * S if mine else 0, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(  # row i: rank i's copy of my shard
            got, x, [S if mine else 0] * L, [S] * C + [0] * (L - C), group=g.intra
        )
        return got.view(L, S).sum(dim=0) if mine else got

    def _intra_all_gather(self, shard: torch.Tensor, S: int) -> torch.Tensor:
        """(S,) on local ranks < C ((0,) on the others) -> (C * S,): every shard, in rank
        order. On gloo an all-to-all of the shard to every peer moves the same bytes as a
        ring all-gather in one round."""
        L, C, g = self.topo.local_size, self.topo.cross_size, self.groups
        if L == 1:
            return shard
        out = torch.empty(C * S, dtype=shard.dtype, device=shard.device)
        if shard.device.type == "cuda" and C == L:
            dist.all_gather_single(out, shard, group=g.intra)
            return out
        mine = self.topo.in_cross
        send = shard.expand(L, -1).reshape(-1) if mine else shard
        dist.all_to_all_single(
            out, send, [S] * C + [0] * (L - C), [S if mine else 0] * L, group=g.intra
        )
        return out

    def _exchange_many(
        self, shards: list[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        """Cross-region sum of each bucket's `shard` (S,), identical on every region.

        Reduce-scatter then all-gather across the R regions: the shard is cut into R pieces
        (P,); piece j goes (encoded) to region j, which sums the R decoded copies and sends
        the encoded sum straight to every region (one hop per link; a ring all-gather
        would forward R - 2 of the sums through a third region). Each rank sends
        2 (R - 1) / R of its shard rather than (R - 1) shards. Every value a region uses
        comes out of the decoder (its own contributions too), so all regions apply bitwise
        the same result. Each stage sends every bucket's payload for a region in one frame
        (`frame`): one exchange per stage, however many buckets.
        """
        topo = self.topo
        R, me = topo.regions, topo.region_index
        if R == 1:
            return [s.clone() for s in shards]
        if self.planner is not None:  # not coalesced: one bucket
            plan = self.planner
            return [plan.exchange(self, s, step, b) for s, b in zip(shards, buckets, strict=True)]
        if self.allgather:
            return self._allgather_sum(shards, step, buckets)
        n = [s.numel() for s in shards]
        pad = torch.nn.functional.pad
        pieces = [pad(s, (0, (-k) % R)).view(R, -1) for s, k in zip(shards, n, strict=True)]
        # (R, P) each; residuals (R + 1, P)
        res = [self.residual(b, p.shape[1]) for b, p in zip(buckets, pieces, strict=True)]
        if self.secure is not None:  # stage 1 masked (training.sync.secagg); not coalesced
            piece, sent = self.secure.scatter_sum(pieces[0], res[0], step, buckets[0])
            summed = [piece]
        else:
            summed, sent = self._scatter_sum(pieces, res, step, buckets)
        # stage 2: the sum of piece me, one payload for every region of the group
        rows = [(r, R) for r in res]
        decoded, framed = self._broadcast(summed, rows, step, buckets, GATHER)
        out = []
        for k, parts in enumerate(decoded):
            out.append(torch.cat(parts)[: n[k]])
            self.stats.cross_raw_bytes += 2 * 4 * parts[me].numel() * (R - 1)
        self._count_wire(sent, framed)
        return out

    def _allgather_sum(
        self, shards: list[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        """`exchange: allgather`: each bucket's shard (S,) error-fed and encoded once, the
        same payload to every region (one key per source, as the gather stage), all
        buckets in one frame and one round. Every region sums the R decoded shards, its
        own too, in region order: all apply bitwise the same sum."""
        R = self.topo.regions
        rows = [
            (self.residual(b, s.numel(), rows=1), 0) for b, s in zip(buckets, shards, strict=True)
        ]
        decoded, framed = self._broadcast(shards, rows, step, buckets, ALLGATHER)
        out = []
        for parts in decoded:
            total = torch.zeros_like(parts[0])
            for part in parts:  # fixed order: every region sums alike
                total += part
            out.append(total)
            self.stats.cross_raw_bytes += 4 * total.numel() * (R - 1)
        self._count_wire([0] * R, framed)
        return out

    def _broadcast(
        self,
        xs: Sequence[torch.Tensor],
        rows: Sequence[tuple[torch.Tensor, int]],
        step: int,
        buckets: Sequence[int],
        stage: int,
    ) -> tuple[list[list[torch.Tensor]], int]:
        """Each bucket's x, error-fed from its (residuals, row) and encoded once, to every
        region of the cross group: one payload per bucket under the source's broadcast key,
        all in one frame and one round. Returns per bucket the R decoded tensors in region
        order (this rank's own as its receivers decode it), and the frame's bytes."""
        topo = self.topo
        R, me = topo.regions, topo.region_index
        peers = topo.peer_ranks(topo.local_rank)
        payloads, mine = [], []
        for b, x, (res, row) in zip(buckets, xs, rows, strict=True):
            out_to = Address(self.epoch, step, topo.rank, BROADCAST, b, part=me, stage=stage)
            payload, dec = self._encode(x, res, row, out_to, self._choose("all", x.numel()))
            payloads.append(payload)
            mine.append(dec)
        framed = frame(payloads)
        limit = self._limit([m.numel() for m in mine])
        blobs = self._all_to_all_bytes([b"" if i == me else framed for i in range(R)], [limit] * R)
        got = {i: unframe(blobs[i], len(buckets), peers[i]) for i in range(R) if i != me}
        decoded = []
        for k, (b, own) in enumerate(zip(buckets, mine, strict=True)):
            frm = [
                Address(self.epoch, step, peers[i], BROADCAST, b, part=i, stage=stage)
                for i in range(R)
            ]
            decoded.append(
                [own if i == me else self._decode(got[i][k], frm[i], own.numel()) for i in range(R)]
            )
        return decoded, len(framed)

    def _count_wire(self, sent: Sequence[int], framed: int) -> None:
        """Wire bytes of one exchange: `sent[j]` to region j before, then a frame of
        `framed` bytes to every other region."""
        me, per_peer = self.topo.region_index, self.stats.per_peer_wire
        self.stats.cross_wire_bytes += sum(sent) + framed * (self.topo.regions - 1)
        for j in range(self.topo.regions):
            if j != me:
                per_peer[j] = per_peer.get(j, 0) + sent[j] + framed

    def _scatter_sum(
        self,
        pieces: list[torch.Tensor],
        res: list[torch.Tensor],
        step: int,
        buckets: Sequence[int],
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Stage 1: piece j of every bucket (encoded) to region j, in one frame; returns
        (per bucket, the sum over regions of piece me (P,); bytes sent to each region).
        Own piece: quantized, not sent."""
        topo = self.topo
        R, me = topo.regions, topo.region_index
        peers = topo.peer_ranks(topo.local_rank)
        to_region: list[list[bytes]] = [[] for _ in range(R)]
        own: list[torch.Tensor] = []
        for b, pc, r in zip(buckets, pieces, res, strict=True):
            P = pc.shape[1]
            for j in range(R):
                to = Address(self.epoch, step, topo.rank, peers[j], b, part=j, stage=SCATTER)
                choice = self._choose(topo.region_names[j], P, j) if j != me else None
                payload, dec = self._encode(pc[j], r, j, to, choice, send=j != me)
                to_region[j].append(payload)
                if j == me:
                    own.append(dec)
        sent = [b"" if j == me else frame(p) for j, p in enumerate(to_region)]
        limit = self._limit([pc.shape[1] for pc in pieces])  # the same from every region
        blobs = self._all_to_all_bytes(sent, [limit] * R)
        got = {i: unframe(blobs[i], len(buckets), peers[i]) for i in range(R) if i != me}
        summed = []
        for k, (b, mine) in enumerate(zip(buckets, own, strict=True)):
            piece = torch.zeros_like(mine)
            for i in range(R):  # fixed order: every region sums alike
                if i == me:
                    piece += mine
                    continue
                frm = Address(self.epoch, step, peers[i], topo.rank, b, part=me, stage=SCATTER)
                piece += self._decode(got[i][k], frm, mine.numel())  # decode checks the size
            summed.append(piece)
        return summed, [len(p) for p in sent]

    def clear_residuals(self) -> None:
        """Zero every bucket's residuals (DiLoCo at the end of its warm-up)."""
        for r in self.residuals.values():
            r.zero_()
        if self.planner is not None:
            self.planner.clear()

    def residual(self, bucket: int, piece: int, rows: int | None = None) -> torch.Tensor:
        """Error-feedback residuals of a bucket: row j < R for the piece sent to region j,
        row R for the reduced piece this rank gathers out, (R + 1, P); with `rows` 1 the
        whole shard's (`exchange: allgather`), (1, S). Residuals of another layout (a
        checkpoint of another exchange or region count) start again from zero: they
        belong to pieces this exchange does not send."""
        shape = (self.topo.regions + 1 if rows is None else rows, piece)
        if bucket not in self.residuals or self.residuals[bucket].shape != shape:
            self.residuals[bucket] = torch.zeros(shape)
        return self.residuals[bucket]

    def _encode(
        self,
        x: torch.Tensor,
        res: torch.Tensor,
        row: int,
        addr: Address,
        choice: Choice | None = None,
        send: bool = True,
    ) -> tuple[bytes, torch.Tensor]:
        """(payload to `addr`, the values its receivers decode); with send=False only the
        values. `row`: the residual row (the piece j < R sent, or R for the gather).
        `choice`: the adaptive codec's (None: the spec's)."""
        if self.error_feedback:
            x = x + res[row]
        if send and self.adaptive is not None and choice is not None:
            payload, decoded = self.adaptive.encode(x, addr, choice)
        elif send:
            payload, decoded = self.codec.encode(x, addr)
        else:  # a piece never sent: exact under the adaptive codec
            payload, decoded = b"", self.codec.quantized(x, "none" if self.adaptive else None)
        if self.error_feedback:
            res[row] = x - decoded
        return payload, decoded

    def _choose(self, key: str, n: int, peer: int | None = None) -> Choice | None:
        """The adaptive codec's choice for n values to region `peer` (None: every peer)."""
        if self.adaptive is None:
            return None
        me = self.topo.region_index
        peers = [peer] if peer is not None else [j for j in range(self.topo.regions) if j != me]
        return self.adaptive.choose(key, peers, n)

    def _decode(self, payload: bytes, addr: Address, n: int) -> torch.Tensor:
        if self.adaptive is not None:
            return self.adaptive.decode(payload, addr, n)
        return self.codec.decode(payload, addr, n)

    def _all_to_all_bytes(
        self, payloads: list[bytes], limits: list[int] | None = None
    ) -> list[bytes]:
        """payloads[j] to region j; `limits`: the most bytes each region can send (one
        round instead of two, training.sync.linkprobe.LinkMonitor.exchange)."""
        if self.links is not None:
            return self.links.exchange(payloads, limits)
        return all_to_all_bytes(payloads, self.groups.cross, self.topo.regions)

    def _limit(self, numels: Sequence[int]) -> int:
        """The most bytes of a frame of payloads of these sizes (values)."""
        frame_head = FRAME_LEN * len(numels) if len(numels) > 1 else 0
        return frame_head + sum(self.codec.max_payload(n) for n in numels)


@dataclass
class HookState:
    """State of the DDP communication hook: the sync and the step it is on."""

    sync: HierarchicalAllReduce
    step: int = 0


def ddp_comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """`ddp.register_comm_hook(HookState(sync), ddp_comm_hook)`: DDP's buckets go through
    the hierarchical compressed sync instead of one flat all-reduce. The caller advances
    `state.step` once per optimizer step."""
    buf = bucket.buffer()
    out = state.sync.all_reduce(buf, step=state.step, bucket=bucket.index())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out.to(buf.dtype))
    return fut


def flat_average(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Baseline: one flat all-reduce over every rank (what DDP does by default)."""
    y = x.detach().clone()
    dist.all_reduce(y, group=group)
    return y.div_(dist.get_world_size(group))


# DDP inspects the hook's annotations as objects; `from __future__ import annotations`
# made them strings, so restore the real types.
ddp_comm_hook.__annotations__.update(
    bucket=dist.GradBucket, state=HookState, **{"return": torch.futures.Future[torch.Tensor]}
)


FRAME_LEN = 4
"""Bytes of each payload's length in a frame (big-endian)."""


def frame(payloads: list[bytes]) -> bytes:
    """Several buckets' payloads for one region as one message: their lengths, then the
    payloads. One payload is sent as it is (a sync of one bucket is unchanged on the
    wire). The lengths are not authenticated; each payload is, so a tampered frame
    fails as a framing error or at its payloads' tags."""
    if len(payloads) == 1:
        return payloads[0]
    head = b"".join(len(p).to_bytes(FRAME_LEN, "big") for p in payloads)
    return head + b"".join(payloads)


def unframe(blob: bytes, count: int, source: int) -> list[bytes]:
    """`frame`'s inverse for `count` payloads from global rank `source`; a frame whose
    lengths do not add up to its size is refused (TransientReject: it was damaged in
    transit or forged, and nothing of it is used)."""
    if count == 1:
        return [blob]
    head = FRAME_LEN * count
    lens = [int.from_bytes(blob[i : i + FRAME_LEN], "big") for i in range(0, head, FRAME_LEN)]
    if len(blob) < head or head + sum(lens) != len(blob):
        raise TransientReject(
            f"a frame of {count} payloads from rank {source} is {len(blob)} bytes but its "
            f"header says {head} + {sum(lens)}: damaged in transit or forged; nothing of it "
            "is used (the launcher restarts the group from its newest checkpoint)"
        )
    out, at = [], head
    for k in lens:
        out.append(blob[at : at + k])
        at += k
    return out
