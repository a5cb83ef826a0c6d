"""What Streaming DiLoCo's late merges run on (training.diloco): a background thread that
runs one fragment's exchange while the loop computes the next tau inner steps, and a twin
of the cross-region sync on its own process groups for it to use.

The twin: the loop keeps using its region group every step (gradient averaging, the step
report), and c10d requires a group's collectives to be issued in the same order on every
rank; a second thread issuing collectives on the same groups could interleave differently
on different ranks. So the exchange gets its own intra- and cross-region groups (created by
every rank in the same order: training.comm.topology.make_groups). It shares the sync's codec,
its error-feedback residuals (the checkpoint saves the sync's, and the loop drains every
exchange before a save) and its byte counters (not its seconds: those overlap compute, they
are not a stall). With secure aggregation it builds a SecureSum of its own on its own cross
group: its wire codec draws nonces from the same process-wide allocator as every codec
(training.sync.codec.NONCES: one counter per key, whichever codec or thread seals), and its
key exchange runs on a control channel of its own group, which the sync's cannot replay into.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from training.comm.topology import Groups, make_groups
from training.sync.hier import HierarchicalAllReduce, SyncStats

T = TypeVar("T")


class Background:
    """One daemon thread running submitted calls in order (FIFO), so every rank issues the
    exchanges' collectives in the same order. A daemon: a rank that fails does not wait
    at exit for an exchange whose peers are gone."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="diloco-stream", daemon=True)
            self._thread.start()
        fut: Future[T] = Future()
        self._jobs.put((fut, fn))
        return fut

    def _run(self) -> None:
        while True:
            fut, fn = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # re-raised in the loop by fut.result()
                fut.set_exception(e)


@dataclass
class TwinSync(HierarchicalAllReduce):
    """The sync on other process groups; residuals and byte counters are `main`'s."""

    main: HierarchicalAllReduce | None = None

    def residual(self, bucket: int, piece: int, rows: int | None = None) -> torch.Tensor:
        assert self.main is not None  # set by twin()
        return self.main.residual(bucket, piece, rows)  # each call: resume re-points the dict

    def all_reduce_many(
        self, xs: Sequence[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        assert self.main is not None
        before = dataclasses.replace(self.stats, per_peer_wire=dict(self.stats.per_peer_wire))
        out = super().all_reduce_many(xs, step, buckets)
        _add_bytes(self.main.stats, self.stats, before)
        return out


def twin(sync: HierarchicalAllReduce) -> TwinSync:
    """A collective on every rank (new process groups, in the same order everywhere)."""
    groups: Groups = make_groups(sync.topo, sync.groups.device)
    me = sync.topo.region_index
    for j in range(sync.topo.regions):  # every key now: the loop iterates this dict
        if j != me:
            sync.stats.per_peer_wire.setdefault(j, 0)
    return TwinSync(
        sync.topo,
        groups,
        sync.codec,
        sync.run_id,
        error_feedback=sync.error_feedback,
        allgather=sync.allgather,
        main=sync,
    )


def _add_bytes(to: SyncStats, now: SyncStats, before: SyncStats) -> None:
    """Add what one exchange sent (now - before) to `to`; seconds stay out (they overlap)."""
    to.intra_bytes += now.intra_bytes - before.intra_bytes
    to.cross_raw_bytes += now.cross_raw_bytes - before.cross_raw_bytes
    to.cross_wire_bytes += now.cross_wire_bytes - before.cross_wire_bytes
    to.syncs += now.syncs - before.syncs
    for peer, n in now.per_peer_wire.items():
        to.per_peer_wire[peer] = (
            to.per_peer_wire.get(peer, 0) + n - before.per_peer_wire.get(peer, 0)
        )
