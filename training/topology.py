"""Ranks grouped by region, and the process groups of the hierarchical all-reduce.

Global rank = region_index * L + local_rank (L workers per region, equal in every region).
Intra-region group: NCCL on CUDA, gloo on CPU. Cross-region groups: gloo, one per local
rank l, joining rank l of every region, so every worker carries 1/L of the WAN traffic
rather than one leader per region carrying all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from training import gloo
from training.errors import SpecError
from training.spec import LaunchSpec


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    regions: int
    local_size: int
    region_index: int
    local_rank: int
    region_names: tuple[str, ...]

    @staticmethod
    def of(spec: LaunchSpec, rank: int) -> Topology:
        world = spec.world_size
        if not 0 <= rank < world:
            raise SpecError(f"rank {rank} is outside the spec's world of {world} workers")
        local = world // len(spec.regions)
        return Topology(
            rank=rank,
            world_size=world,
            regions=len(spec.regions),
            local_size=local,
            region_index=rank // local,
            local_rank=rank % local,
            region_names=tuple(r.name for r in spec.regions),
        )

    @property
    def region(self) -> str:
        return self.region_names[self.region_index]

    def region_ranks(self, region: int) -> list[int]:
        return list(range(region * self.local_size, (region + 1) * self.local_size))

    def peer_ranks(self, local_rank: int) -> list[int]:
        return [r * self.local_size + local_rank for r in range(self.regions)]


@dataclass
class Groups:
    intra: Any
    """This rank's region group (NCCL or gloo)."""
    cross: Any
    """This rank's cross-region gloo group (same local rank in every region)."""
    device: torch.device
    """Where intra-region collectives run."""


def make_groups(topo: Topology, device: torch.device) -> Groups:
    """Every rank must create every group in the same order (a c10d rule)."""
    intra_backend = "nccl" if device.type == "cuda" else gloo.backend()
    intra = cross = None
    for r in range(topo.regions):
        g = dist.new_group(topo.region_ranks(r), backend=intra_backend)
        if r == topo.region_index:
            intra = g
    for lr in range(topo.local_size):
        g = dist.new_group(topo.peer_ranks(lr), backend=gloo.backend())
        if lr == topo.local_rank:
            cross = g
    return Groups(intra=intra, cross=cross, device=device)
