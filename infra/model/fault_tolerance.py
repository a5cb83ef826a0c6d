"""`geotrain:training.fault_tolerance`: regions as torchft replica groups (training.ft.quorum).

The stack places the Lighthouse on a region (its first node) or on a named node, and the
plan advertises it on that node's private (overlay) address; the launch spec carries the
resolved `host:port` (infra.render.runtime). Checks: infra.model.checks.fault_tolerance."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FaultTolerance(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lighthouse: str
    """Region (its first node) or node that runs the Lighthouse; a neutral host is a
    region of its own."""
    min_replicas: int | None = Field(default=None, ge=1)
    """Regions a quorum needs (default: a majority); fewer and the job restarts."""
    port: int = Field(default=29510, ge=1024, le=65000)
    """Port of the Lighthouse on its node."""
    store_port: int = Field(default=29520, ge=1024, le=65000)
    """Region i's rendezvous store listens on its first node at store_port + i."""
    heartbeat_timeout_s: float = Field(default=5.0, gt=0)
    """A region silent this long is left out of the next quorum."""
    join_timeout_s: float = Field(default=30.0, gt=0)
    """How long the Lighthouse waits for a live (heartbeating) region before a smaller
    quorum. At least a round plus a heal: torchft counts it from the first region that
    asks, so when a left-out region waits longer, the next quorum forms the moment a second
    region asks, leaving out the third, which is then behind and heals, every round. A
    dead or cut-off region's heartbeat stops: nobody waits for it."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Cross-region collectives and heals: a dead peer fails a round after at most this."""
    quorum_timeout_s: float = Field(default=600.0, gt=0)
    """How long a region waits for a quorum; with diloco, longer than a merge interval."""

    def replicas(self, regions: int) -> int:
        """min_replicas, or a majority of `regions`."""
        return self.min_replicas if self.min_replicas is not None else regions // 2 + 1
