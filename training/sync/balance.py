"""Balance work across heterogeneous regions by measured throughput (`balance: throughput`).

Every sync waits for the slowest region: with equal batches per rank, a region of slower
GPUs (or fewer cores) makes every other region idle. Each rank measures its compute time
per step (step time minus time in the cross-region sync, which holds the wait) over
`balance_steps` steps (the first step of a start is skipped: warm caches), and offers the
median. The offers are all-gathered, authenticated (training.comm.session.Control), and every
rank computes the same assignment from the same numbers: a batch per rank for each region
that minimises the slowest region's step time, with the global batch (sequences per step,
W x batch_size) kept exactly. A region's time is its slowest rank's.

Two rounds: the first assumes time proportional to the batch; the second, measured at the
new batches, fits each region's time as fixed + per-sample x batch through its two
measurements (the optimizer step and the codec do not shrink with the batch) and assigns
again.

The merge stays an average over samples: the sync weights each rank's contribution by its
batch / batch_size (training.sync.hier `scale`), and a DiLoCo merge by the samples the rank
processed since the last merge over the mean per rank (pseudo-gradients weighted by tokens).
The assignment is not checkpointed: a restarted run measures again, and a merge interval
that a restart cut is weighted by the samples since the restart.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from training.comm.topology import Topology
from training.errors import SpecError
from training.spec import LaunchSpec

Cost = tuple[float, float]
"""A region's step time model: (fixed seconds, seconds per sample of a rank's batch)."""
ROUNDS = 2
"""Measure-and-assign rounds (see the module docstring)."""


class Gather(Protocol):
    """Every rank's JSON value, in rank order (training.comm.session.Control)."""

    def gather(self, value: Any) -> list[Any]: ...


def assign(costs: Sequence[Cost], sizes: Sequence[int], total: int) -> list[int]:
    """Batch per rank of each region: integers >= 1 with sum(sizes[r] * b[r]) == total that
    minimise max_r fixed[r] + b[r] * per_sample[r]. Deterministic: the smallest such
    makespan, then each region in order takes the largest batch that leaves the rest
    reachable. `total` must be reachable (W x batch_size always is)."""
    if any(s <= 0 for _, s in costs):  # an unmeasurable region: keep the batches equal
        costs = [(0.0, 1.0)] * len(sizes)
    limits = sorted({a + b * s for a, s in costs for b in range(1, total + 1)})
    lo, hi = 0, len(limits) - 1
    while lo < hi:  # the smallest makespan with an exact assignment
        mid = (lo + hi) // 2
        if _reachable(_caps(limits[mid], costs, sizes, total), sizes, total):
            hi = mid
        else:
            lo = mid + 1
    caps = _caps(limits[lo], costs, sizes, total)
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


def fit(points: Sequence[tuple[int, float]]) -> Cost:
    """A region's (fixed, per sample) through its last two (batch, seconds) measurements;
    proportional (no fixed part) with one batch, or when the line would not be."""
    b1, t1 = points[-1]
    prop = (0.0, t1 / b1)
    if len(points) < 2 or points[-2][0] == b1:
        return prop
    b0, t0 = points[-2]
    slope = (t1 - t0) / (b1 - b0)
    fixed = t1 - slope * b1
    return (fixed, slope) if slope > 0 and fixed >= 0 else prop


def _caps(limit: float, costs: Sequence[Cost], sizes: Sequence[int], total: int) -> list[int]:
    """The largest batch per rank of each region within `limit` seconds per step (0: none)."""
    return [
        max(0, min(int((limit - a) / s + 1e-9), total // n))
        for (a, s), n in zip(costs, sizes, strict=True)
    ]


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
    """Compute seconds of the steps measured so far at the current batch."""
    history: list[tuple[int, int]] = field(default_factory=list)
    """(first step, batch per rank) of every batch this start used."""
    merged_at: int | None = None
    """First step of the current DiLoCo merge interval (None: this start's first)."""
    points: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per region: (batch per rank, its slowest rank's compute seconds) of every round."""
    assigned: list[int] | None = None
    """Batch per rank of every region, once assigned."""
    offers: list[float] = field(default_factory=list)
    """Every rank's offer (median compute seconds per step) of the last round."""

    def started(self, step: int, batch: int) -> None:
        if not self.history:
            self.history.append((step, batch))
            self.batch = batch
            self.points = [[] for _ in self.sizes]

    def scale(self) -> float:
        """This rank's per-step weight in the sync (training.sync.hier `scale`)."""
        return self.batch / self.batch_size

    def after_step(self, step: int, compute_s: float) -> int | None:
        """Record step `step` (0-based, just done); returns the new batch per rank when this
        step ends a round (every rank at the same step), else None."""
        rounds = len(self.history) - 1
        if rounds >= ROUNDS or step == self.history[-1][0]:  # a new batch's first step
            return None  # warms caches and allocators: not measured
        self.samples.append(compute_s)
        if len(self.samples) < self.measure:
            return None
        offers = self.gather.gather([self.region, self.batch, statistics.median(self.samples)])
        self.offers = [float(sec) for _, _, sec in offers]
        self.samples = []
        slowest: dict[int, tuple[int, float]] = {}
        for region, batch, sec in offers:
            if region not in slowest or float(sec) > slowest[region][1]:
                slowest[region] = (int(batch), float(sec))
        for region, point in sorted(slowest.items()):
            self.points[region].append(point)
        costs = [fit(p) for p in self.points]
        self.assigned = assign(costs, self.sizes, sum(self.sizes) * self.batch_size)
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
    if spec.sync == "diloco" and spec.diloco.streaming:
        raise SpecError(
            "balance: throughput weights each merge by the samples of its interval, which "
            "streaming fragments (fragments/tau) do not share; set balance: off, or "
            "fragments: 1 and tau: 0"
        )
    return Balancer(gather, spec.batch_size, topo.sizes, topo.region_index, spec.balance_steps)


def stepped(job: Any, compute_s: float) -> None:
    """After a worker's step (training.loop.train_step; job.step already advanced):
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
        job.emit(
            "balance",
            step=job.step,
            round=len(bal.history) - 1,
            batch_per_rank=per_rank,
            seconds=bal.offers,
        )
