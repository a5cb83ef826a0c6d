"""Hierarchical, compressed, encrypted all-reduce.

One sync of a flat fp32 tensor (N,), L workers per region, R regions:
  1. reduce-scatter inside the region: rank l holds the region's sum of shard l (N/L,)
  2. add the error-feedback residual, encode (quantize, shuffle, zstd, SM4-GCM)
  3. exchange across regions: all-gather of payload sizes, then of padded payloads,
     in the cross group of local rank l (one peer per region)
  4. verify and decode every region's payload (its own too, so every region sums the
     same values), sum in region order, divide by the world size
  5. all-gather inside the region: every rank gets the full averaged tensor
With codec `none` the values are exactly those of a flat all-reduce (up to float
summation order, which is the only difference).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from training.codec import Address, Codec
from training.topology import Groups, Topology


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


@dataclass
class HierarchicalAllReduce:
    topo: Topology
    groups: Groups
    codec: Codec
    run_id: str
    epoch: int = 0
    error_feedback: bool = True
    stats: SyncStats = field(default_factory=SyncStats)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    """bucket -> quantization residual of this rank's shard, carried to the next step."""

    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        """Average flat `x` (N,) over all ranks; returns a new fp32 tensor on x's device."""
        t0 = time.perf_counter()
        topo, g = self.topo, self.groups
        n = x.numel()
        L = topo.local_size
        padded = torch.nn.functional.pad(x.detach().float().reshape(-1), (0, (-n) % L))
        shard_n = padded.numel() // L
        shard = torch.empty(shard_n, dtype=torch.float32, device=padded.device)
        dist.reduce_scatter_single(shard, padded.to(g.device), group=g.intra)  # (N/L,)
        self.stats.intra_bytes += 4 * shard_n * (L - 1)
        total = self._exchange(shard.cpu(), step, bucket)  # (N/L,) sum over all regions
        total.div_(topo.world_size)
        full = torch.empty(padded.numel(), dtype=torch.float32, device=g.device)
        dist.all_gather_single(full, total.to(g.device), group=g.intra)
        self.stats.intra_bytes += 4 * shard_n * (L - 1)
        self.stats.sync_seconds += time.perf_counter() - t0
        self.stats.syncs += 1
        return full[:n].view_as(x).to(x.device)

    def _exchange(self, shard: torch.Tensor, step: int, bucket: int) -> torch.Tensor:
        topo = self.topo
        if self.error_feedback and bucket in self.residuals:
            shard = shard + self.residuals[bucket]
        me = Address(self.run_id, self.epoch, step, topo.region_index, bucket)
        payload, mine = self.codec.encode(shard, me)
        if self.error_feedback:
            self.residuals[bucket] = shard - mine
        blobs = self._all_gather_bytes(payload)
        total = torch.zeros_like(shard)
        for region, blob in enumerate(blobs):  # fixed order: every region sums alike
            expect = Address(self.run_id, self.epoch, step, region, bucket)
            total += mine if region == topo.region_index else self.codec.decode(blob, expect)
        peers = topo.regions - 1
        self.stats.cross_raw_bytes += 4 * shard.numel() * peers
        self.stats.cross_wire_bytes += len(payload) * peers
        return total

    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        g = self.groups.cross
        R = self.topo.regions
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = torch.empty(R, dtype=torch.int64)
        dist.all_gather_single(sizes, size, group=g)
        most = int(sizes.max())
        buf = torch.zeros(most, dtype=torch.uint8)
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = torch.empty(R * most, dtype=torch.uint8)
        dist.all_gather_single(out, buf, group=g)
        rows = out.view(R, most)
        return [rows[i, : int(sizes[i])].numpy().tobytes() for i in range(R)]


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


Reducer = Callable[[torch.Tensor, int, int], torch.Tensor]


# DDP inspects the hook's annotations as objects; `from __future__ import annotations`
# made them strings, so restore the real types.
ddp_comm_hook.__annotations__.update(
    bucket=dist.GradBucket, state=HookState, **{"return": torch.futures.Future[torch.Tensor]}
)
