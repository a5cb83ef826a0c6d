"""The table of accelerator types a stack may name, with the numbers policies and plans use.

Prices are list on-demand USD per GPU-hour, rounded; stacks and the policy pack may
override them (`geotrain:policy.gpu_prices`). `cpu` is a CPU worker process (tests, the
local stack): it costs nothing extra on a machine you already have.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuType:
    name: str
    """Name as written in stack files."""
    memory_gib: int
    """Device memory per GPU (0 for cpu)."""
    usd_per_hour: float
    """Default on-demand price per GPU-hour."""
    vendor: str
    """nvidia | amd | none: decides NCCL/RCCL vs gloo and the exporter."""


GPU_TYPES: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("A100-40GB", 40, 3.00, "nvidia"),
        GpuType("A100-80GB", 80, 4.10, "nvidia"),
        GpuType("H100-80GB", 80, 6.90, "nvidia"),
        GpuType("H200", 141, 8.50, "nvidia"),
        GpuType("H20", 96, 2.80, "nvidia"),
        GpuType("L40S", 48, 1.90, "nvidia"),
        GpuType("MI300X", 192, 6.00, "amd"),
        GpuType("cpu", 0, 0.0, "none"),
    )
}
