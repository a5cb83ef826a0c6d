"""The baseline every report compares with: what a flat fp32 ring all-reduce (DDP's
default) would send across regions."""

from __future__ import annotations


def flat_ring_cross_bytes(params: int, world: int, regions: int) -> float:
    """Cross-region bytes per step of one flat fp32 ring all-reduce (what DDP does by
    default) with ranks ordered by region: the ring crosses a border `regions` times and
    each ring edge carries 2 (W - 1) / W x 4N bytes."""
    if regions < 2:
        return 0.0
    return regions * 2 * (world - 1) / world * 4 * params
