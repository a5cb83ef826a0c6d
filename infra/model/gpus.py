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
    peak_bf16_tflops: float = 0.0
    """Dense bf16 peak (vendor datasheets, no sparsity): what `geotrain plan` divides by."""


GPU_TYPES: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("A100-40GB", 40, 3.00, "nvidia", 312),
        GpuType("A100-80GB", 80, 4.10, "nvidia", 312),
        GpuType("H100-80GB", 80, 6.90, "nvidia", 989),
        GpuType("H200", 141, 8.50, "nvidia", 989),
        GpuType("H20", 96, 2.80, "nvidia", 148),
        GpuType("L40S", 48, 1.90, "nvidia", 362),
        GpuType("MI300X", 192, 6.00, "amd", 1307),
        GpuType("cpu", 0, 0.0, "none"),
    )
}
