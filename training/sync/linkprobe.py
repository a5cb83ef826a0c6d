"""Cross-region link measurements: a probe at start, then the sync's own transfers.

A link is a pair of regions. Each rank keeps an estimate of every link between its region
and a peer region: the bandwidth its own transfers get (bytes/s) and the round-trip time.
- At start (`probe`) the region leaders measure each link over the transport the sync
  uses (their gloo cross group): a ping-pong of small messages for the RTT (the fastest
  of PROBE_PINGS), then PROBE_BYTES both ways for the bandwidth, four times more while a
  transfer takes under PROBE_SECONDS (up to PROBE_MAX_BYTES: a small transfer over a long
  fast path measures TCP's slow start, not the link; the side that pings decides and tells
  the other, so both send the same sizes). Pairs take turns (a
  round-robin tournament) so a leader measures one link at a time. The leaders send the
  numbers to their region; the L ranks of a region share its links (each cross group is
  one of L parallel flows), so every rank starts from 1/L of the probed bandwidth.
- Every exchange (`exchange`) then times each payload it receives, from posting the
  receive to its completion: bandwidth sample = bytes / (seconds - RTT / 2), folded into
  an EWMA. Gloo's receive has no completion poll, so the receives are waited on in the
  order the estimates predict they finish; a receive that finished earlier is timed when
  its turn comes (an underestimate of that link, corrected as the order settles).

Links are assumed symmetric: a rank times what it receives from region j and uses it for
what it sends there (every tunnel of a stack has one bandwidth both ways). The RTT comes
from the probe only: a sync's one-way transfers do not show it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from training.comm.topology import Topology
from training.errors import TransientReject

LENGTH = 8
"""Bytes of the length that leads a message of a bounded exchange (big-endian)."""
EWMA_ALPHA = 0.3
"""Weight of a new bandwidth sample (about the last 3 transfers dominate)."""
MIN_SAMPLE_BYTES = 16 * 1024
"""Smaller transfers say more about latency than bandwidth: not sampled."""
PROBE_PINGS = 5
"""Ping-pongs per link at start; the RTT is the fastest."""
PROBE_BYTES = 256 * 1024
"""Bytes each side sends per bandwidth probe (0.1 s at 20 Mbit/s)."""
PROBE_ROUNDS = 2
"""Bandwidth probes per link and size; the best is kept (the first may pay connection
set-up)."""
PROBE_SECONDS = 0.2
"""A bandwidth probe faster than this is repeated with four times the bytes."""
PROBE_MAX_BYTES = 4 * 1024 * 1024
"""The largest bandwidth probe (0.17 s at 200 Mbit/s)."""


@dataclass
class Link:
    """This rank's estimate of one cross-region link."""

    bandwidth: float = 0.0
    """Bytes per second this rank's transfers get (0: not measured yet)."""
    rtt: float = 0.0
    """Round-trip seconds from the probe (0: not probed)."""
    samples: int = 0
    """Transfers folded into `bandwidth` (the probe counts as one)."""
    probed: float = 0.0
    """Bytes per second the start probe measured (kept: the sync's samples of a link can
    only underestimate it, see the module doc)."""

    def observe(self, nbytes: int, seconds: float, alpha: float = EWMA_ALPHA) -> None:
        """Fold in one transfer of `nbytes` that took `seconds`."""
        if nbytes < MIN_SAMPLE_BYTES:
            return
        sample = nbytes / max(seconds - self.rtt / 2, 1e-6)
        self.bandwidth = (
            sample if not self.samples else alpha * sample + (1 - alpha) * (self.bandwidth)
        )
        self.samples += 1

    def seconds(self, nbytes: float) -> float:
        """Predicted time to move `nbytes` (0 bandwidth: unknown, predicted 0)."""
        return self.rtt / 2 + (nbytes / self.bandwidth if self.bandwidth else 0.0)


@dataclass
class LinkMonitor:
    """Every link of this rank's region, measured through its cross group."""

    topo: Topology
    group: Any
    """This rank's cross-region gloo group."""
    links: dict[int, Link] = field(default_factory=dict)
    """Peer region index -> the link between it and this rank's region."""

    def __post_init__(self) -> None:
        me = self.topo.region_index
        self.links = {j: Link() for j in range(self.topo.regions) if j != me}

    # -- at start ---------------------------------------------------------------------
    def probe(self, intra: Any, device: torch.device) -> None:
        """Leaders measure every link, then tell their region (a collective over every
        rank: call it on all of them, once the groups exist)."""
        R, me = self.topo.regions, self.topo.region_index
        table = torch.zeros(R, 2, dtype=torch.float64)  # (R, [bandwidth, rtt])
        if self.topo.local_rank == 0:
            for pair in (p for rnd in pairings(R) for p in rnd if me in p):
                peer = pair[0] + pair[1] - me
                table[peer] = torch.tensor(self._probe(peer, me < peer), dtype=torch.float64)
        if self.topo.local_size > 1:  # the leader's numbers, to the whole region
            t = table.to(device)
            dist.broadcast(t, src=self.topo.region_ranks(me)[0], group=intra)
            table = t.cpu()
        for j, link in self.links.items():
            link.bandwidth = float(table[j, 0]) / self.topo.cross_size  # ranks sharing it
            link.probed = link.bandwidth
            link.rtt = float(table[j, 1])
            link.samples = 1

    def _probe(self, peer: int, first: bool) -> tuple[float, float]:
        """(bandwidth bytes/s, rtt s) of the link to region `peer`; `first`: this side
        pings (the other answers)."""
        dst = peer  # region j is rank j of a cross group (and of a quorum's group)
        ping = torch.zeros(8, dtype=torch.uint8)
        rtts = []
        for _ in range(PROBE_PINGS):
            t0 = time.perf_counter()
            if first:
                dist.send(ping, group=self.group, group_dst=dst)
                dist.recv(ping, group=self.group, group_src=dst)
            else:
                dist.recv(ping, group=self.group, group_src=dst)
                dist.send(ping, group=self.group, group_dst=dst)
            rtts.append(time.perf_counter() - t0)
        rtt = min(rtts) if first else min(rtts[1:] or rtts)  # the answerer's first waits
        size, best = PROBE_BYTES, 0.0
        while True:
            best = max(best, self._bandwidth(dst, size, rtt))
            go = size * 4 <= PROBE_MAX_BYTES and size / best < PROBE_SECONDS
            more = torch.tensor([go], dtype=torch.uint8)
            if first:  # the pinger decides; both sides must send the same sizes
                dist.send(more, group=self.group, group_dst=dst)
            else:
                dist.recv(more, group=self.group, group_src=dst)
            if not more.item():
                return best, rtt
            size *= 4

    def _bandwidth(self, dst: int, size: int, rtt: float) -> float:
        """Bytes/s of the best of PROBE_ROUNDS transfers of `size` bytes both ways."""
        out = torch.zeros(size, dtype=torch.uint8)
        best = 0.0
        for _ in range(PROBE_ROUNDS):
            back = torch.empty(size, dtype=torch.uint8)
            t0 = time.perf_counter()
            works = [_irecv(back, dst, self.group), _isend(out, dst, self.group)]
            for w in works:
                w.wait()
            best = max(best, size / max(time.perf_counter() - t0 - rtt / 2, 1e-6))
        return best

    # -- during the run ---------------------------------------------------------------
    def exchange(self, payloads: list[bytes], limits: list[int] | None = None) -> list[bytes]:
        """payloads[j] to region j of the cross group; returns what each region sent to
        me (b"" from myself), timing every receive into its link's estimate. `limits`:
        the most bytes region i can send me (training.sync.codec.Codec.max_payload), so the
        exchange takes one round (`_exchange_bounded`) instead of two (the sizes, then
        the payloads)."""
        if limits is not None:
            return self._exchange_bounded(payloads, limits)
        R, me = self.topo.regions, self.topo.region_index
        sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
        got = torch.empty(R, dtype=torch.int64)
        dist.all_to_all_single(got, sizes, group=self.group)
        n = got.tolist()
        bufs = {i: torch.empty(n[i], dtype=torch.uint8) for i in range(R) if i != me and n[i]}
        t0 = time.perf_counter()
        recvs = {i: _irecv(b, i, self.group) for i, b in bufs.items()}
        sends = [
            _isend(torch.frombuffer(bytearray(p), dtype=torch.uint8), j, self.group)
            for j, p in enumerate(payloads)
            if j != me and p
        ]
        for i in sorted(recvs, key=lambda i: self.links[i].seconds(n[i])):
            recvs[i].wait()
            self.links[i].observe(n[i], time.perf_counter() - t0)
        for s in sends:
            s.wait()
        return [bufs[i].numpy().tobytes() if i in bufs else b"" for i in range(R)]

    def _exchange_bounded(self, payloads: list[bytes], limits: list[int]) -> list[bytes]:
        """One round: each message is its length (LENGTH bytes) then the payload, received
        into a buffer of the peer's limit (gloo delivers a shorter message into a longer
        buffer). Over 120-280 ms links the sizes' own round is half an exchange's time."""
        R, me = self.topo.regions, self.topo.region_index
        t0 = time.perf_counter()
        recvs, sends = post_bounded(payloads, limits, self.group, me)
        out = [b""] * R
        for i in sorted(recvs, key=lambda i: self.links[i].seconds(limits[i])):
            work, buf = recvs[i]
            work.wait()
            out[i] = payload_of(buf, limits[i], self.topo.region_names[i])
            self.links[i].observe(len(out[i]), time.perf_counter() - t0)
        for s in sends:
            s.wait()
        return out

    def report(self) -> list[dict[str, Any]]:
        """Every link as {src, dst, bandwidth (bytes/s), rtt (s), samples}: src is the
        peer region (what this rank times is what it receives)."""
        names, me = self.topo.region_names, self.topo.region
        return [
            {
                "src": names[j],
                "dst": me,
                "bandwidth": round(link.bandwidth, 1),
                "rtt": round(link.rtt, 6),
                "samples": link.samples,
            }
            for j, link in sorted(self.links.items())
        ]


def post_bounded(
    payloads: list[bytes], limits: list[int], group: Any, me: int
) -> tuple[dict[int, tuple[Any, torch.Tensor]], list[Any]]:
    """One round of a bounded exchange, posted: from every other rank i of `group` a
    receive of LENGTH + limits[i] bytes, to every other rank j `message(payloads[j])`.
    Returns ({i: (the receive, its buffer)}, the sends); the caller waits on them and
    reads each buffer with `payload_of`."""
    bufs = {
        i: torch.empty(LENGTH + limits[i], dtype=torch.uint8)
        for i in range(len(payloads))
        if i != me
    }
    recvs = {i: (_irecv(b, i, group), b) for i, b in bufs.items()}
    sends = [_isend(message(p), j, group) for j, p in enumerate(payloads) if j != me]
    return recvs, sends


def bounded_all_to_all(
    payloads: list[bytes], limits: list[int], group: Any, me: int, names: Sequence[str]
) -> list[bytes]:
    """payloads[j] to rank j of `group` in one round, at most limits[i] bytes from rank i
    (named names[i] in errors); returns what every rank sent me (b"" from myself)."""
    recvs, sends = post_bounded(payloads, limits, group, me)
    out = [b""] * len(payloads)
    for i, (work, buf) in recvs.items():
        work.wait()
        out[i] = payload_of(buf, limits[i], names[i])
    for s in sends:
        s.wait()
    return out


def message(payload: bytes) -> torch.Tensor:
    """A bounded exchange's message: the payload's length (LENGTH bytes), then it."""
    return torch.frombuffer(
        bytearray(len(payload).to_bytes(LENGTH, "big") + payload), dtype=torch.uint8
    )


def payload_of(buf: torch.Tensor, limit: int, region: str) -> bytes:
    """The payload of a `message` received into `buf` (LENGTH + limit bytes). The length
    is not authenticated (the payload is): one over the limit is refused here, and a
    shorter message than it claims fails at the payload's tag."""
    raw = buf.numpy()
    n = int.from_bytes(raw[:LENGTH].tobytes(), "big")
    if n > limit:
        raise TransientReject(
            f"region {region} sent a message of {n} bytes where at most {limit} can come: "
            "damaged in transit or forged; nothing of it is used"
        )
    return raw[LENGTH : LENGTH + n].tobytes()


def _irecv(buf: torch.Tensor, src: int, group: Any) -> Any:
    """From rank `src` of `group`: group ranks, so groups that c10d did not create (a
    torchft quorum's) need no translation from global ranks."""
    work = dist.irecv(buf, group=group, group_src=src)
    assert work is not None  # None only for a rank outside the group
    return work


def _isend(buf: torch.Tensor, dst: int, group: Any) -> Any:
    work = dist.isend(buf, group=group, group_dst=dst)
    assert work is not None  # None only for a rank outside the group
    return work


def pairings(regions: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair once (the circle method): in each
    round a region meets at most one other."""
    players: list[int | None] = list(range(regions))
    if regions % 2:
        players.append(None)
    n = len(players)
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = players[i], players[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(pairs)
        players = [players[0], players[-1], *players[1:-1]]
    return rounds
