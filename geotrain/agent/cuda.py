"""Which CUDA build of torch an NVIDIA driver can run: the one table the agent (which torch
to install on a host) and the cloud images (which driver branch to pin) share.

Standard library only, importable without torch: stage one of the agent runs it on the
host's bare python3, before any venv exists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CudaBuild:
    tag: str
    """PyTorch's wheel index and local version label: cu128 -> torch==X+cu128 from
    https://download.pytorch.org/whl/cu128."""
    cuda: tuple[int, int]
    """CUDA version the wheels bundle (major, minor)."""
    min_driver: tuple[int, ...]
    """NVIDIA's minimum Linux x86_64 driver for that CUDA toolkit."""

    @property
    def index_url(self) -> str:
        return f"{TORCH_INDEX}/{self.tag}"


TORCH_INDEX = "https://download.pytorch.org/whl"
PROC_VERSION = Path("/proc/driver/nvidia/version")
"""The kernel module's version, where nvidia-smi is missing."""
CPU_TAG = "cpu"

TORCH_CUDA_BUILDS = (
    CudaBuild("cu130", (13, 0), (580, 65, 6)),
    CudaBuild("cu128", (12, 8), (570, 26)),
    CudaBuild("cu126", (12, 6), (560, 28, 3)),
)
"""The CUDA builds PyTorch publishes for the pinned torch, newest first (check
https://download.pytorch.org/whl/torch/ when the torch pin in pyproject.toml moves).
Minimum drivers: NVIDIA CUDA Toolkit Release Notes, "Table 3: CUDA Toolkit and
Corresponding Driver Versions" (docs.nvidia.com/cuda/cuda-toolkit-release-notes), Linux
x86_64 column, GA rows: CUDA 13.0 GA >= 580.65.06, CUDA 12.8 GA >= 570.26, CUDA 12.6 GA
>= 560.28.03. Those are the drivers each toolkit ships with; CUDA's minor-version
compatibility would let a 12.x build start on an older 12.x driver (>= 525.60.13) with
features missing, which a training run should not find out about mid-run."""

DRIVER_BRANCH = "580"
"""The NVIDIA driver branch the cloud images and cloud-init should pin: R580 is a
long-term support branch (to August 2028, NVIDIA's data center driver lifecycle), and it
runs every build above; R570, the branch pinned before, reached end of life in February
2026 and runs only cu128 and older."""

_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def parse_driver(text: str) -> tuple[int, ...] | None:
    """(major, minor[, patch]) of a driver version such as 570.124.06."""
    m = _VERSION.search(text)
    if m is None:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def show(version: tuple[int, ...]) -> str:
    """570.26 / 580.65.06 as NVIDIA writes them (patch with two digits)."""
    head = f"{version[0]}.{version[1]:02d}"
    return head + (f".{version[2]:02d}" if len(version) > 2 else "")


def driver_version() -> tuple[int, ...] | None:
    """The host's NVIDIA driver version; None on a host without one (CPU-only)."""
    if shutil.which("nvidia-smi") is not None:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if r.returncode == 0 and r.stdout.strip():
            return parse_driver(r.stdout.strip().splitlines()[0])
    try:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  ..."
        text = PROC_VERSION.read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(\d+\.\d+(?:\.\d+)?)", text)
    return parse_driver(m.group(1)) if m else None


def build_for(driver: tuple[int, ...]) -> CudaBuild | None:
    """The newest build this driver runs; None when it is older than every build."""
    return next((b for b in TORCH_CUDA_BUILDS if driver >= b.min_driver), None)


def build_for_branch(branch: str) -> CudaBuild | None:
    """The newest build the drivers of `branch` (e.g. "570") run: each minimum above is
    the driver a toolkit shipped with, the first release of its branch, so every driver
    of that branch or a later one meets it."""
    return next((b for b in TORCH_CUDA_BUILDS if b.min_driver[0] <= int(branch)), None)


def build_of_tag(tag: str) -> CudaBuild | None:
    return next((b for b in TORCH_CUDA_BUILDS if b.tag == tag), None)


def torch_build_of(version_py: str) -> str | None:
    """The local label of an installed torch from its torch/version.py (`__version__ =
    '2.13.0+cu128'`): cu128, cpu, or None when it has none."""
    m = re.search(r"__version__\s*=\s*['\"][^'\"+]*\+([A-Za-z0-9]+)['\"]", version_py)
    return m.group(1) if m else None
