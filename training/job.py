"""The `Job`: one training rank's parts (groups, model, optimizer, loader, sync,
checkpointer, metrics, ledger), which the loop and its hooks work on. Built by
training.setup; this module imports only the parts' types, so every hook can import it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.audit.ledger import Ledger
from training.comm.session import Control, Pending
from training.comm.topology import Groups, Topology
from training.data.loader import ByteLoader
from training.data.tokens import MixtureLoader, TokenLoader
from training.errors import HostileReject, PayloadRejected, ReplayReject
from training.observe.metrics import RuntimeMetrics
from training.privacy.dpsgd import PoissonLoader, RegionPrivacy
from training.spec import LaunchSpec
from training.state.checkpoint import Checkpointer
from training.sync.balance import Balancer
from training.sync.buckets import GradBuffer
from training.sync.diloco import DiLoCo
from training.sync.hier import HierarchicalAllReduce

REJECT_LINGER_S = 30.0
"""After a hostile reject, a rank that serves metrics keeps serving them this long before
it exits, so Prometheus (15 s scrapes by default) records the count and the alert fires."""


@dataclass
class Job:
    spec: LaunchSpec
    topo: Topology
    groups: Groups
    model: nn.Module
    opt: torch.optim.Optimizer
    loader: ByteLoader | TokenLoader | MixtureLoader | PoissonLoader
    sync: HierarchicalAllReduce
    ckpt: Checkpointer
    metrics: RuntimeMetrics
    events: Path | None
    node: str
    diloco: DiLoCo | None = None
    """The global weights, outer optimizer and merge (sync: diloco; None: allreduce)."""
    step: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    last_save: float = field(default_factory=time.monotonic)
    reported: dict[str, int] = field(default_factory=dict)
    """Byte counters already added to the Prometheus counters."""
    control: Control | None = None
    """Authenticated exchange of the time-based flags over every rank (`due`)."""
    pending: list[Pending] = field(default_factory=list)
    """The control gathers in flight, oldest first (training.loop.due)."""
    ledger: Ledger | None = None
    """This region's signed training ledger (region leaders with a run dir only)."""
    privacy: RegionPrivacy | None = None
    """DP-SGD of this rank's region (None: the region has no privacy settings)."""
    balance: Balancer | None = None
    """Throughput balance of the batch per rank (None: `balance: off`)."""
    grads: GradBuffer | None = None
    """The gradients as views of one flat tensor (training.gradsync.zero_grads); None with
    DP-SGD, which sets its own."""

    @property
    def leader(self) -> bool:
        return self.topo.local_rank == 0

    def emit(self, event: str, **kw: Any) -> None:
        if self.events is None:
            return
        line = (
            json.dumps(
                {
                    "event": event,
                    "region": self.topo.region,
                    "rank": self.topo.rank,
                    "t": time.time(),
                    **kw,
                }
            )
            + "\n"
        )
        with open(self.events, "a", encoding="utf-8") as f:  # one write(): atomic append
            f.write(line)


def previous_rejects(events: Path | None, rank: int) -> int:
    """This rank's rejected-payload count so far in this run dir's event log (0: none)."""
    from training.observe.report import EventLog

    if events is None:
        return 0
    log = EventLog(events)
    log.poll()
    return max((int(e["total"]) for e in log.of("rejected") if e.get("rank") == rank), default=0)


def rejected(job: Job, e: PayloadRejected) -> None:
    """Count a reject (metric and event log) before the worker exits with it. A hostile
    one stops the job: the rank first keeps its metrics up long enough to be scraped."""
    hostile = isinstance(e, HostileReject)
    total = job.metrics.reject()
    job.emit(
        "rejected",
        kind="hostile" if hostile else "replayed" if isinstance(e, ReplayReject) else "transient",
        reason=str(e)[:500],
        total=total,
        step=job.step,
    )
    if hostile and job.metrics.serving:
        time.sleep(REJECT_LINGER_S)
