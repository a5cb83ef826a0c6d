"""Balance work across heterogeneous regions by measured throughput (`balance: throughput`).

Every sync waits for the slowest region: with equal batches per rank, a region of slower
GPUs (or fewer cores) makes every other region idle. After `balance_steps` measured steps
(the first step of a start is skipped: warm caches), every rank offers its compute seconds
per sample (median step time minus time in the cross-region sync, over its batch); the
offers are all-gathered, authenticated (training.session.Control), and every rank computes
the same assignment from the same numbers: a batch per rank for each region that minimises
the slowest region's step time, with the global batch (sequences per step, W x batch_size)
kept exactly. A region's speed is its slowest rank's.

The merge stays an average over samples: the sync weights each rank's contribution by its
batch / batch_size (training.hier `scale`), and a DiLoCo merge by the samples the rank
processed since the last merge over the mean per rank (pseudo-gradients weighted by tokens).
The assignment is not checkpointed: a restarted run measures again.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from training.errors import SpecError
from training.spec import LaunchSpec
from training.topology import Topology


class Gather(Protocol):
    """Every rank's JSON value, in rank order (training.session.Control)."""

    def gather(self, value: Any) -> list[Any]: ...


def assign(seconds: Sequence[float], sizes: Sequence[int], total: int) -> list[int]:
    """Batch per rank of each region: integers >= 1 with sum(sizes[r] * b[r]) == total that
    minimise max_r b[r] * seconds[r] (seconds per sample of region r's ranks). Deterministic:
    the smallest such makespan, then each region in order takes the largest batch that
    leaves the rest reachable. `total` must be reachable (W x batch_size always is)."""
    if any(s <= 0 for s in seconds):  # an unmeasurable region: keep the batches equal
        seconds = [1.0] * len(sizes)
    limits = sorted({b * s for s in seconds for b in range(1, total + 1)})
    lo, hi = 0, len(limits) - 1
    while lo < hi:  # the smallest makespan with an exact assignment
        mid = (lo + hi) // 2
        if _reachable(_caps(limits[mid], seconds, sizes, total), sizes, total):
            hi = mid
        else:
            lo = mid + 1
    caps = _caps(limits[lo], seconds, sizes, total)
    out: list[int] = []
    left = total
    for r in range(len(sizes)):
        rest = _suffix(caps[r + 1 :], sizes[r + 1 :], left)
        b = next(
            b
            for b in range(caps[r], 0, -1)
            if left - sizes[r] * b >= 0 and rest >> (left - sizes[r] * b) & 1
        )
        out.append(b)
        left -= sizes[r] * b
    return out


def _caps(limit: float, seconds: Sequence[float], sizes: Sequence[int], total: int) -> list[int]:
    """The largest batch per rank of each region within `limit` seconds per step."""
    return [min(int(limit / s + 1e-9), total // n) for s, n in zip(seconds, sizes, strict=True)]


def _suffix(caps: Sequence[int], sizes: Sequence[int], total: int) -> int:
    """Bitset (Python int) of the sample totals regions with these caps can reach."""
    reach = 1
    mask = (1 << (total + 1)) - 1
    for cap, n in zip(caps, sizes, strict=True):
        nxt = 0
        for b in range(1, cap + 1):
            nxt |= reach << (n * b)
        reach = nxt & mask
    return reach


def _reachable(caps: Sequence[int], sizes: Sequence[int], total: int) -> bool:
    return bool(_suffix(caps, sizes, total) >> total & 1)


@dataclass
class Balancer:
    """One rank's measurements, its region's assignment and the merge weights."""

    gather: Gather
    """Authenticated all-gather over every rank."""
    batch_size: int
    """The spec's batch per rank (the mean after balancing)."""
    sizes: tuple[int, ...]
    """Workers per region."""
    region: int
    """This rank's region index."""
    measure: int
    """Steps measured before the assignment."""
    batch: int = 0
    """This rank's batch now (0: not started)."""
    samples: list[float] = field(default_factory=list)
    """Compute seconds per sample of the steps measured so far."""
    history: list[tuple[int, int]] = field(default_factory=list)
    """(first step, batch per rank) of every batch this start used."""
    merged_at: int | None = None
    """First step of the current DiLoCo merge interval (None: this start's first)."""
    assigned: list[int] | None = None
    """Batch per rank of every region, once assigned."""
    offers: list[float] = field(default_factory=list)
    """Every rank's measured compute seconds per sample, in rank order."""

    def started(self, step: int, batch: int) -> None:
        if not self.history:
            self.history.append((step, batch))
            self.batch = batch

    def scale(self) -> float:
        """This rank's per-step weight in the sync (training.hier `scale`)."""
        return self.batch / self.batch_size

    def after_step(self, step: int, compute_s: float) -> int | None:
        """Record step `step` (0-based, just done); returns the new batch per rank when this
        step ends the measurement (every rank at the same step), else None."""
        first = self.history[0][0]
        if self.assigned is not None or step == first:  # the first step warms caches
            return None
        self.samples.append(compute_s / self.batch)
        if len(self.samples) < self.measure:
            return None
        offers = self.gather.gather([self.region, statistics.median(self.samples)])
        slowest = [0.0] * len(self.sizes)
        self.offers = [float(sec) for _, sec in offers]
        for region, sec in offers:
            slowest[region] = max(slowest[region], float(sec))
        self.assigned = assign(slowest, self.sizes, sum(self.sizes) * self.batch_size)
        self.batch = self.assigned[self.region]
        self.history.append((step + 1, self.batch))
        return self.batch

    def merge_scale(self, step: int, warmup: int) -> float:
        """Weight of this rank's pseudo-gradient in the merge after step `step`: its samples
        since the last merge over the mean per rank (the global batch is fixed, so the
        mean is batch_size every step)."""
        first = max(self.merged_at if self.merged_at is not None else 0, warmup)
        first = max(first, self.history[0][0])
        total = sum(self._batch_at(s) for s in range(first, step + 1))
        self.merged_at = step + 1
        return total / (self.batch_size * (step + 1 - first)) if step >= first else self.scale()

    def _batch_at(self, step: int) -> int:
        return next(b for s, b in reversed(self.history) if s <= step)


@contextmanager
def merging(balancer: Balancer | None, sync: Any, step: int, warmup: int) -> Iterator[None]:
    """Weight the sync by the merge interval's samples for one DiLoCo merge."""
    if balancer is None:
        yield
        return
    sync.scale = balancer.merge_scale(step, warmup)
    try:
        yield
    finally:
        sync.scale = balancer.scale()


def for_job(spec: LaunchSpec, topo: Topology, gather: Gather) -> Balancer | None:
    """The rank's balancer (None: `balance: off`)."""
    if spec.balance == "off":
        return None
    if any(r.privacy for r in spec.regions):
        raise SpecError(
            "balance: throughput changes batches, which DP-SGD's sampling rate and privacy "
            "accounting fix per region; set balance: off in a stack with privacy"
        )
    return Balancer(gather, spec.batch_size, topo.sizes, topo.region_index, spec.balance_steps)


def stepped(job: Any, compute_s: float) -> None:
    """After a worker's step (training.worker.train_step; job.step already advanced):
    measure, and on the assignment step set this rank's batch and sync weight."""
    bal: Balancer | None = job.balance
    if bal is None:
        return
    bal.started(job.step - 1, job.loader.batch)
    batch = bal.after_step(job.step - 1, compute_s)
    if batch is None:
        return
    job.loader.batch = batch
    job.sync.scale = bal.scale()
    if job.topo.rank == 0:
        assert bal.assigned is not None  # set by after_step
        per_rank = dict(zip(job.topo.region_names, bal.assigned, strict=True))
        job.emit("balance", step=job.step, batch_per_rank=per_rank, seconds=bal.offers)
