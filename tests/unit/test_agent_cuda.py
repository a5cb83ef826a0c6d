"""The agent installs the torch build the host's NVIDIA driver runs (issue #36, item 5):
a fake `nvidia-smi` on PATH plays the driver. An old driver stops with one line naming
both versions; a GPU host gets torch from PyTorch's index for its CUDA; a host without a
driver installs as before (the default index)."""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from geotrain.agent import bootstrap, cuda
from geotrain.agent.bootstrap import AgentError

Driver = Callable[[str | None], None]


@pytest.fixture
def driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Driver:
    """set(version): an nvidia-smi on PATH that reports `version`; None: no nvidia-smi and
    no /proc/driver/nvidia (a CPU host)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(cuda, "PROC_VERSION", tmp_path / "no-such-proc-file")

    def set_(version: str | None) -> None:
        smi = bin_dir / "nvidia-smi"
        if version is None:
            smi.unlink(missing_ok=True)
            return
        smi.write_text(
            "#!/bin/sh\n"
            '[ "$1" = --query-gpu=driver_version ] && [ "$2" = --format=csv,noheader ] || exit 9\n'
            f"echo {version}\necho {version}\n"  # one line per GPU
        )
        smi.chmod(0o755)

    return set_


def _wheel(tmp_path: Path, torch: str = "2.13.0") -> Path:
    w = tmp_path / "geotrain-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr(
            "geotrain-0.1.0.dist-info/METADATA",
            f"Name: geotrain\nRequires-Dist: numpy>=1.26\nRequires-Dist: torch=={torch}\n",
        )
    return w


@pytest.mark.parametrize(
    "version, tag",
    [("570.124.06", "cu128"), ("570.26", "cu128"), ("580.95.05", "cu130"), ("560.35.03", "cu126")],
)
def test_a_gpu_host_gets_the_newest_cuda_build_its_driver_runs(
    driver: Driver, version: str, tag: str
) -> None:
    driver(version)
    got = bootstrap.torch_build("bj-0", "2.13.0")
    assert got is not None
    assert got[1].tag == tag and got[1].index_url == f"https://download.pytorch.org/whl/{tag}"


def test_a_driver_older_than_every_build_stops_with_one_line_naming_both(driver: Driver) -> None:
    driver("550.54.15")
    with pytest.raises(AgentError) as e:
        bootstrap.torch_build("bj-0", "2.13.0")
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("host bj-0: step runtime: NVIDIA driver 550.54.15")
    assert "torch 2.13.0" in line and "cu126" in line and ">= 560.28.03" in line
    assert "nvidia-driver-580-server" in line


def test_a_host_without_a_driver_installs_torch_as_before(driver: Driver) -> None:
    driver(None)
    assert cuda.driver_version() is None
    assert bootstrap.torch_build("bj-0", "2.13.0") is None


def test_the_kernel_modules_version_serves_where_nvidia_smi_is_missing(
    driver: Driver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver(None)
    proc = tmp_path / "version"
    proc.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 06:54:38 UTC 2025\n"
    )
    monkeypatch.setattr(cuda, "PROC_VERSION", proc)
    assert cuda.driver_version() == (580, 65, 6)


def _runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_tag: str | None
) -> tuple[dict[str, Any], list[list[str]]]:
    """A fake venv (torch/version.py with `torch_tag`) and a record of every command."""
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages" / "torch"
    site.mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").write_text("")
    if torch_tag:
        (site / "version.py").write_text(f"__version__ = '2.13.0+{torch_tag}'\n")
    monkeypatch.setattr(bootstrap, "VENV", venv)
    ident = {"version": "0.1.0", "source_digest": "d" * 64}
    identities = iter([None, ident])
    monkeypatch.setattr(bootstrap, "runtime_identity", lambda v: next(identities))
    ran: list[list[str]] = []
    monkeypatch.setattr(bootstrap, "_run", lambda node, step, argv, hint: ran.append(argv))
    wheel = _wheel(tmp_path)
    manifest = {"runtime": {**ident, "wheel": wheel.name}}
    return manifest, ran


def test_the_cuda_build_is_installed_before_the_wheel_so_its_pin_is_already_met(
    driver: Driver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver("570.124.06")
    manifest, ran = _runtime(tmp_path, monkeypatch, torch_tag=None)
    bootstrap.ensure_runtime(tmp_path, manifest, "bj-0")
    torch_cmd = next(i for i, a in enumerate(ran) if "torch==2.13.0+cu128" in a)
    assert ran[torch_cmd][-2:] == ["--index-url", "https://download.pytorch.org/whl/cu128"]
    wheel_cmds = [i for i, a in enumerate(ran) if a[-1].endswith(".whl")]
    assert wheel_cmds and torch_cmd < min(wheel_cmds)


def test_a_cpu_host_installs_the_wheel_alone_as_before(
    driver: Driver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver(None)
    manifest, ran = _runtime(tmp_path, monkeypatch, torch_tag=None)
    bootstrap.ensure_runtime(tmp_path, manifest, "bj-0")
    assert not any("--index-url" in a for a in ran)
    assert [a[-1].endswith(".whl") for a in ran] == [True, True]


def test_a_read_only_venv_whose_torch_the_driver_cannot_run_is_refused(
    driver: Driver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver("570.124.06")
    monkeypatch.setattr(bootstrap, "VENV", tmp_path / "venv")
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "torch"
    site.mkdir(parents=True)
    (site / "version.py").write_text("__version__ = '2.13.0+cu130'\n")
    with pytest.raises(
        AgentError, match=r"holds torch build cu130, which NVIDIA driver 570\.124\.06"
    ):
        bootstrap.ensure_torch("bj-0", "2.13.0", writable=False)
    (site / "version.py").write_text("__version__ = '2.13.0+cu128'\n")
    bootstrap.ensure_torch("bj-0", "2.13.0", writable=False)  # runs: nothing to do


def test_the_wheel_pins_the_torch_the_agent_asks_for() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    pinned = re.search(r'"torch==([0-9.]+)"', pyproject)
    assert pinned is not None
    from infra.render.bundle import runtime_wheel

    assert bootstrap.torch_pin(runtime_wheel()) == pinned.group(1)


def test_every_driver_branch_the_clouds_pin_runs_a_torch_build() -> None:
    from infra.model.clouds import CLOUDS, NVIDIA_DRIVER_BRANCH

    branches = {NVIDIA_DRIVER_BRANCH}
    branches |= {m for c in CLOUDS.values() for m in re.findall(r"nvidia-(\d{3})", c.image.ref)}
    for b in sorted(branches):
        assert cuda.build_for_branch(b) is not None, f"driver branch {b} runs no torch build"
    assert cuda.build_for_branch(cuda.DRIVER_BRANCH) == cuda.TORCH_CUDA_BUILDS[0]
    assert cuda.build_for_branch("570") == cuda.build_of_tag("cu128")
    assert cuda.build_for_branch("550") is None


def test_a_pools_mirrors_replace_the_public_indexes(
    driver: Driver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from geotrain.agent.hostspec import Mirrors

    driver("570.124.06")
    manifest, ran = _runtime(tmp_path, monkeypatch, torch_tag=None)
    mirrors = Mirrors(
        pip_index_url="https://mirrors.aliyun.com/pypi/simple/",
        torch_index_url="https://mirrors.aliyun.com/pytorch-wheels/",
    )
    bootstrap.ensure_runtime(tmp_path, manifest, "bj-0", mirrors)
    torch_cmd = next(a for a in ran if "torch==2.13.0+cu128" in a)
    assert torch_cmd[-2:] == ["--index-url", "https://mirrors.aliyun.com/pytorch-wheels/cu128"]
    deps = ran[-1]  # the wheel with its dependencies, from the PyPI mirror
    assert deps[-3].endswith(".whl")
    assert deps[-2:] == ["--index-url", "https://mirrors.aliyun.com/pypi/simple/"]
    assert not any("download.pytorch.org" in x or "pypi.org" in x for a in ran for x in a)
