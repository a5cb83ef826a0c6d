"""Ranks grouped by region, and the process groups of the hierarchical all-reduce.

Ranks are contiguous per region: region r holds L_r workers (regions may differ, e.g. 8 GPUs
in one region and 4 in another), from global rank start_r. Intra-region group: NCCL on CUDA,
gloo on CPU. Cross-region groups: gloo, C of them with C = min_r L_r; group c joins local
rank c of every region, so C workers per region share the WAN traffic rather than one
leader per region carrying all of it. With equal regions C = L: every worker carries 1/L.
A region's local ranks >= C take no part in the cross-region exchange; they hand their
share in and get the result back inside the region (training.sync.hier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from training.comm import gloo
from training.errors import SpecError
from training.spec import LaunchSpec


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    regions: int
    local_size: int
    """Workers in this rank's region (L_r)."""
    region_index: int
    local_rank: int
    region_names: tuple[str, ...]
    region_sizes: tuple[int, ...] = ()
    """Workers per region, in region order (empty: every region has local_size)."""

    @staticmethod
    def of(spec: LaunchSpec, rank: int) -> Topology:
        world = spec.world_size
        if not 0 <= rank < world:
            raise SpecError(f"rank {rank} is outside the spec's world of {world} workers")
        sizes = tuple(sum(n.nprocs for n in r.nodes) for r in spec.regions)
        region, start = 0, 0
        while rank >= start + sizes[region]:
            start += sizes[region]
            region += 1
        return Topology(
            rank=rank,
            world_size=world,
            regions=len(spec.regions),
            local_size=sizes[region],
            region_index=region,
            local_rank=rank - start,
            region_names=tuple(r.name for r in spec.regions),
            region_sizes=sizes,
        )

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.region_sizes or (self.local_size,) * self.regions

    @property
    def cross_size(self) -> int:
        """C: cross-region groups, = the smallest region's worker count."""
        return min(self.sizes)

    @property
    def in_cross(self) -> bool:
        """Whether this rank exchanges across regions (local rank < C)."""
        return self.local_rank < self.cross_size

    @property
    def region(self) -> str:
        return self.region_names[self.region_index]

    def region_start(self, region: int) -> int:
        return sum(self.sizes[:region])

    def region_ranks(self, region: int) -> list[int]:
        start = self.region_start(region)
        return list(range(start, start + self.sizes[region]))

    def peer_ranks(self, local_rank: int) -> list[int]:
        return [self.region_start(r) + local_rank for r in range(self.regions)]


@dataclass
class Groups:
    intra: Any
    """This rank's region group (NCCL or gloo)."""
    cross: Any
    """This rank's cross-region gloo group (same local rank in every region; None for a
    local rank >= C)."""
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
    for lr in range(topo.cross_size):
        g = dist.new_group(topo.peer_ranks(lr), backend=gloo.backend())
        if lr == topo.local_rank:
            cross = g
    return Groups(intra=intra, cross=cross, device=device)
