"""Checkpoints: commit markers, authenticated manifests, fallback past torn or corrupt
saves, and clear errors for unusable directories."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from training.checkpoint import MANIFEST, MARKER, Checkpointer
from training.errors import CheckpointError
from training.testing import run_world

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))


def _ckpt(root: Path, run_id: str = "run-a", key: bytes = KEY, keep: int = 3) -> Checkpointer:
    return Checkpointer(root, run_id, key, keep, dist.get_rank(), dist.new_group(backend="gloo"))


def _state(value: float, n: int = 1000) -> dict[str, Any]:
    return {"w": torch.full((n,), value), "meta": {"step": int(value)}}


def _save_steps(rank: int, world: int, root: str, steps: list[int], n: int) -> None:
    c = _ckpt(Path(root))
    for s in steps:
        c.save(s, _state(float(s), n))
    c.wait()


def _latest(rank: int, world: int, root: str, run_id: str, key: bytes) -> Any:
    c = _ckpt(Path(root), run_id, key)
    d = c.latest()
    if d is None:
        return None, c.log
    state = _state(0.0)
    c.load(d, state)
    return d.name, c.log, state["w"][0].item()


def _make(tmp: Path, steps: tuple[int, ...] = (1, 2), n: int = 1000) -> Path:
    root = tmp / "ckpt"
    run_world(_save_steps, 1, str(root), list(steps), n)
    return root


def _resume(root: Path, run_id: str = "run-a", key: bytes = KEY) -> Any:
    return run_world(_latest, 1, str(root), run_id, key)[0]


def test_resume_loads_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    name, log, value = _resume(_make(tmp_path))
    assert (name, value, log) == ("step-2", 2.0, [])


def _save_then_change(rank: int, world: int, root: str) -> list[float]:
    """Save, fence, then change the live tensors in place (as the optimizer does) while the
    write is still under way; and a plain value changed right after save()."""
    c = _ckpt(Path(root))
    state = {"w": torch.full((2_000_000,), 1.0), "meta": {"tokens": [1]}}
    c.save(1, state)
    c.fence()
    state["w"].add_(1.0)
    state["meta"]["tokens"].append(2)
    c.wait()
    back = {"w": torch.zeros(2_000_000), "meta": {"tokens": [0]}}
    c.load(Path(root) / "step-1", back)
    return [back["w"].min().item(), back["w"].max().item(), len(back["meta"]["tokens"])]


def test_a_save_holds_the_state_as_of_the_call_once_fenced(tmp_path: Path) -> None:
    assert run_world(_save_then_change, 1, str(tmp_path / "ckpt"))[0] == [1.0, 1.0, 1]


def test_retention_keeps_only_the_newest(tmp_path: Path) -> None:
    root = _make(tmp_path, (1, 2, 3, 4, 5))
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-3", "step-4", "step-5"]


def test_resume_uses_previous_checkpoint_when_latest_is_torn(tmp_path: Path) -> None:
    root = _make(tmp_path)
    (root / "step-2" / MARKER).unlink()
    name, log, value = _resume(root)
    assert (name, value) == ("step-1", 1.0)
    assert "no commit marker" in log[0]


def _corrupt(root: Path) -> None:
    f = next((root / "step-2").glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _drop_shard(root: Path) -> None:
    next((root / "step-2").glob("*.distcp")).unlink()


def _forge_manifest(root: Path) -> None:
    m = root / "step-2" / MANIFEST
    body = json.loads(m.read_text())
    body["step"] = 99
    m.write_text(json.dumps(body))


def _extra_file(root: Path) -> None:
    (root / "step-2" / "evil.pkl").write_bytes(b"\x80\x04N.")


CORRUPTIONS = {
    "corrupt-shard": (_corrupt, "is corrupt"),
    "missing-shard": (_drop_shard, "is missing"),
    "forged-manifest": (_forge_manifest, "does not verify"),
    "extra-file": (_extra_file, "unexpected files"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_newest_checkpoint_is_detected_and_skipped(tmp_path: Path, case: str) -> None:
    root = _make(tmp_path)
    corrupt, words = CORRUPTIONS[case]
    corrupt(root)
    name, log, value = _resume(root)
    assert (name, value) == ("step-1", 1.0)
    assert words in log[0], log


def test_checkpoint_of_another_run_is_never_loaded(tmp_path: Path) -> None:
    root = _make(tmp_path)
    name, log = _resume(root, run_id="run-b")
    assert name is None
    assert all("belongs to run run-a" in line for line in log), log


def test_checkpoint_under_another_key_is_never_loaded(tmp_path: Path) -> None:
    name, log = _resume(_make(tmp_path), key=bytes(32))
    assert name is None and "does not verify" in log[0]


def _save_then_die(rank: int, world: int, root: str) -> None:
    c = _ckpt(Path(root))
    c.save(1, _state(1.0))
    c.wait()
    c.save(2, _state(2.0, n=4_000_000))  # 16 MB: the write is still under way
    os._exit(9)  # killed mid-save: no commit


def test_process_killed_mid_save_leaves_previous_checkpoint_usable(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(Exception):  # noqa: B017 (the worker dies on purpose)
        run_world(_save_then_die, 1, str(root), timeout=60)
    name, _, value = _resume(root)
    assert (name, value) == ("step-1", 1.0)


def _try_save(rank: int, world: int, root: str, n: int, step: int = 1) -> str:
    c = _ckpt(Path(root))
    try:
        c.save(step, _state(1.0, n))
        c.wait()
    except CheckpointError as e:
        return str(e)
    return "saved"


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mount"), reason="needs root to mount a small tmpfs"
)


@needs_root
def test_full_disk_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "small"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        assert run_world(_try_save, 1, str(root / "c"), 1000)[0] == "saved"
        msg = run_world(_try_save, 1, str(root / "c"), 1_000_000, 2)[0]  # 4 MB > 1 MB
        assert "disk full" in msg or "No space" in msg, msg
        name, _, value = _resume(root / "c")
        assert (name, value) == ("step-1", 1.0)
    finally:
        subprocess.run(["umount", str(root)], check=True)


@needs_root
def test_read_only_checkpoint_dir_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(root)], check=True)
    try:
        with pytest.raises(Exception, match="is not writable"):
            run_world(_try_save, 1, str(root / "c"), 10)
    finally:
        subprocess.run(["umount", str(root)], check=True)
