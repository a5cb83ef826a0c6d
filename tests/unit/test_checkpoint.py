"""Checkpoints: commit markers, authenticated manifests, fallback past torn or corrupt
saves, and clear errors for unusable directories."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from training.errors import CheckpointError
from training.state.checkpoint import (
    MANIFEST,
    MARKER,
    QUARANTINE,
    REASON,
    Checkpointer,
    node_group,
    node_root,
)
from training.testing import run_world

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))
ONE_NODE = [[0]]
TWO_NODES = [[0], [1]]


def _ckpt(
    root: Path,
    run_id: str = "run-a",
    key: bytes = KEY,
    keep: int = 3,
    nodes: list[list[int]] = ONE_NODE,
    allow_rollback: bool = False,
) -> Checkpointer:
    """This rank's checkpointer; node i holds the ranks nodes[i] and is called n<i>. A
    root with {node} gives every node its own directory, as on separate hosts."""
    world = dist.new_group(backend="gloo")
    group = node_group(nodes)
    i = next(i for i, ranks in enumerate(nodes) if dist.get_rank() in ranks)
    name = f"n{i}"
    return Checkpointer(
        node_root(str(root), "test", name, "r"),
        name,
        run_id,
        key,
        keep,
        group,
        world,
        allow_rollback=allow_rollback,
    )


def _state(value: float, n: int = 1000) -> dict[str, Any]:
    """A value every rank shares (`w`) and one only this rank has."""
    r = dist.get_rank()
    return {
        "w": torch.full((n,), value),
        "meta": {"step": int(value)},
        f"rank{r}": {"x": torch.full((4,), value + r)},
    }


def _save_steps(
    rank: int, world: int, root: str, steps: list[int], n: int, nodes: list[list[int]]
) -> None:
    c = _ckpt(Path(root), nodes=nodes)
    for s in steps:
        c.save(s, _state(float(s), n))
    c.wait()


def _latest(
    rank: int,
    world: int,
    root: str,
    run_id: str,
    key: bytes,
    nodes: list[list[int]],
    allow_rollback: bool = False,
) -> Any:
    c = _ckpt(Path(root), run_id, key, nodes=nodes, allow_rollback=allow_rollback)
    d = c.latest()
    if d is None:
        return None, c.fallbacks
    state = _state(0.0)
    c.load(d, state)
    assert torch.equal(state[f"rank{rank}"]["x"], torch.full((4,), state["w"][0].item() + rank))
    return d.parent.name if nodes == ONE_NODE else str(d), c.fallbacks, state["w"][0].item()


def _make(
    tmp: Path,
    steps: tuple[int, ...] = (1, 2),
    n: int = 1000,
    nodes: list[list[int]] = ONE_NODE,
    root: str = "ckpt",
) -> Path:
    run_world(_save_steps, sum(map(len, nodes)), str(tmp / root), list(steps), n, nodes)
    return tmp / root


def _resume(
    root: Path,
    run_id: str = "run-a",
    key: bytes = KEY,
    nodes: list[list[int]] = ONE_NODE,
    allow_rollback: bool = False,
) -> Any:
    out = run_world(_latest, sum(map(len, nodes)), str(root), run_id, key, nodes, allow_rollback)
    return out[0] if nodes == ONE_NODE else out


def _quarantined(root: Path) -> list[str]:
    """REASON of every quarantined directory."""
    return sorted((d / REASON).read_text() for d in (root / QUARANTINE).glob("step-*"))


def test_resume_loads_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    root = _make(tmp_path)
    name, fallbacks, value = _resume(root)
    assert (name, value, fallbacks) == ("step-2", 2.0, [])
    assert (root / "step-2" / "n0" / MARKER).exists()


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
    c.load(c.dir_of(1), back)
    return [back["w"].min().item(), back["w"].max().item(), len(back["meta"]["tokens"])]


def test_a_save_holds_the_state_as_of_the_call_once_fenced(tmp_path: Path) -> None:
    assert run_world(_save_then_change, 1, str(tmp_path / "ckpt"))[0] == [1.0, 1.0, 1]


def test_retention_keeps_only_the_newest(tmp_path: Path) -> None:
    root = _make(tmp_path, (1, 2, 3, 4, 5))
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-3", "step-4", "step-5"]


def test_a_deleted_marker_at_the_high_water_mark_is_restored_not_rolled_back(
    tmp_path: Path,
) -> None:
    """Deleting the newest step's marker used to make it a torn save and resume the step
    before, with no override (a rollback within `keep`). Its manifest and files verify:
    the commit is finished again and the run resumes where it was."""
    root = _make(tmp_path)
    (root / "step-2" / "n0" / MARKER).unlink()
    name, fallbacks, value = _resume(root)
    assert (name, value) == ("step-2", 2.0) and fallbacks == []
    assert (root / "step-2" / "n0" / MARKER).exists()


def test_a_deleted_marker_with_an_altered_file_at_the_mark_is_a_rollback(tmp_path: Path) -> None:
    root = _make(tmp_path)
    (root / "step-2" / "n0" / MARKER).unlink()
    _corrupt(root)
    with pytest.raises(RuntimeError, match=r"rollback refused.*step 2"):
        _resume(root)
    assert len(_quarantined(root)) == 1  # kept as evidence, not deleted
    name, fallbacks, value = _resume(root, allow_rollback=True)  # the operator's choice
    assert (name, value) == ("step-1", 1.0) and "allowed" in fallbacks[0].reason


def test_a_torn_save_above_the_high_water_mark_is_removed(tmp_path: Path) -> None:
    root = _make(tmp_path)
    shutil.copytree(root / "step-2", root / "step-3")  # a save that died before its mark
    (root / "step-3" / "n0" / MARKER).unlink()
    name, fallbacks, value = _resume(root)
    assert (name, value) == ("step-2", 2.0)
    assert "no commit marker" in fallbacks[0].reason and not (root / "step-3").exists()


def _corrupt(root: Path, node: str = "n0") -> None:
    f = next((root / "step-2" / node).glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _drop_shard(root: Path) -> None:
    next((root / "step-2" / "n0").glob("*.distcp")).unlink()


def _forge_manifest(root: Path) -> None:
    m = root / "step-2" / "n0" / MANIFEST
    body = json.loads(m.read_text())
    body["step"] = 99
    m.write_text(json.dumps(body))


def _truncate_manifest(root: Path) -> None:
    m = root / "step-2" / "n0" / MANIFEST
    m.write_text(m.read_text()[:40])


def _swap_manifest(root: Path) -> None:
    """An authentic manifest, but step 1's."""
    shutil.copy(root / "step-1" / "n0" / MANIFEST, root / "step-2" / "n0" / MANIFEST)


def _extra_file(root: Path) -> None:
    (root / "step-2" / "n0" / "evil.pkl").write_bytes(b"\x80\x04N.")


CORRUPTIONS = {
    "corrupt-shard": (_corrupt, "is corrupt"),
    "missing-shard": (_drop_shard, "is missing"),
    "forged-manifest": (_forge_manifest, "does not verify"),
    "truncated-manifest": (_truncate_manifest, "missing or unreadable"),
    "swapped-manifest": (_swap_manifest, "manifest is of step 1"),
    "extra-file": (_extra_file, "unexpected files"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_newest_checkpoint_is_skipped_and_quarantined_with_its_reason(
    tmp_path: Path, case: str
) -> None:
    root = _make(tmp_path)
    corrupt, words = CORRUPTIONS[case]
    corrupt(root)
    name, fallbacks, value = _resume(root)
    assert (name, value) == ("step-1", 1.0)
    assert [(f.step, f.node) for f in fallbacks] == [(2, "n0")]
    assert words in fallbacks[0].reason, fallbacks
    assert not (root / "step-2").exists()  # nothing left to block a later save of step 2
    (reason,) = _quarantined(root)
    assert words in reason and Path(fallbacks[0].moved_to).parent == root / QUARANTINE


def _resume_then_save(rank: int, world: int, root: str) -> str:
    c = _ckpt(Path(root))
    d = c.latest()
    c.load(d, _state(0.0))  # type: ignore[arg-type]
    c.save(2, _state(2.0))  # training reaches step 2 again
    c.wait()
    return c.latest().parent.name  # type: ignore[union-attr]


def test_quarantined_step_can_be_saved_again_when_training_reaches_it(tmp_path: Path) -> None:
    root = _make(tmp_path)
    _corrupt(root)
    assert run_world(_resume_then_save, 1, str(root))[0] == "step-2"
    assert (root / "step-2" / "n0" / MARKER).exists() and len(_quarantined(root)) == 1


def test_checkpoint_of_another_run_is_never_loaded(tmp_path: Path) -> None:
    root = _make(tmp_path)
    name, fallbacks = _resume(root, run_id="run-b")
    assert name is None
    assert [f.step for f in fallbacks] == [2, 1]
    assert all("belongs to run run-a" in f.reason for f in fallbacks), fallbacks
    assert len(_quarantined(root)) == 2  # kept for their run, out of this one's way


def test_checkpoint_under_another_key_is_never_loaded(tmp_path: Path) -> None:
    name, fallbacks = _resume(_make(tmp_path), key=bytes(32))
    assert name is None and "does not verify" in fallbacks[0].reason


def test_each_node_commits_its_own_directory(tmp_path: Path) -> None:
    root = _make(tmp_path, nodes=TWO_NODES)
    for node in ("n0", "n1"):
        d = root / "step-2" / node
        assert (d / MARKER).exists()
        assert json.loads((d / MANIFEST).read_text())["node"] == node


def test_a_value_the_ranks_of_a_node_share_is_stored_once_per_node(tmp_path: Path) -> None:
    root = _make(tmp_path, (1,), n=1_000_000, nodes=[[0, 1]])  # w: 4 MB on both ranks
    size = sum(f.stat().st_size for f in (root / "step-1" / "n0").glob("*.distcp"))
    assert 4e6 <= size < 5e6


def _hosts(tmp: Path) -> Path:
    """Two nodes with separate roots, as on hosts without a shared filesystem."""
    return _make(tmp, nodes=TWO_NODES, root="hosts/{node}")


def _both_resume_from(root: Path, step: int) -> list[Any]:
    out = _resume(root, nodes=TWO_NODES)
    assert [(Path(d).parts[-3:], v) for d, _, v in out] == [
        ((node, f"step-{step}", node), float(step)) for node in ("n0", "n1")
    ]
    assert out[0][1] == out[1][1]  # every rank knows every node's fallbacks
    return list(out[0][1])


def test_ranks_resume_from_the_newest_step_every_node_committed(tmp_path: Path) -> None:
    _make(tmp_path, (1,), nodes=TWO_NODES, root="hosts/{node}")
    n1 = tmp_path / "hosts" / "n1"
    record = (n1 / "high-water-n1.json").read_bytes()
    root = _make(tmp_path, (2,), nodes=TWO_NODES, root="hosts/{node}")
    # n1 never committed step 2: its directory and its high-water mark as after step 1
    shutil.rmtree(n1 / "step-2")
    (n1 / "high-water-n1.json").write_bytes(record)
    fallbacks = _both_resume_from(root, 1)
    assert [(f.step, f.node) for f in fallbacks] == [(2, "n0")]
    assert "not committed on node n1" in fallbacks[0].reason
    assert not (tmp_path / "hosts" / "n0" / "step-2").exists()
    assert len(_quarantined(tmp_path / "hosts" / "n0")) == 1


def test_corrupt_newest_step_on_one_node_makes_every_rank_resume_from_the_previous_common_step(
    tmp_path: Path,
) -> None:
    root = _hosts(tmp_path)
    _corrupt(tmp_path / "hosts" / "n1", "n1")
    fallbacks = _both_resume_from(root, 1)
    assert [(f.step, f.node) for f in fallbacks] == [(2, "n0"), (2, "n1")]
    assert "unusable on node n1" in fallbacks[0].reason
    assert "is corrupt" in fallbacks[1].reason
    for node in ("n0", "n1"):
        assert not (tmp_path / "hosts" / node / "step-2").exists()


def test_node_roots_fill_in_node_region_and_stack() -> None:
    assert node_root("/c/{stack}/{region}/{node}", "s", "bj-0", "beijing") == Path(
        "/c/s/beijing/bj-0"
    )


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


def _marker_write_fails(rank: int, world: int, root: str) -> str:
    """Step 1 commits; step 2's marker write fails (disk full at the last moment)."""
    import errno

    from training.state import checkpoint as ck

    real = ck._write_atomic
    full_now = []

    def full(path: Path, text: str) -> None:  # full from step 2's marker on, for good
        if full_now or (path.name == MARKER and path.parent.parent.name == "step-2"):
            full_now.append(path)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, text)

    ck._write_atomic = full  # type: ignore[assignment]
    return _try_save(rank, world, root, 1000) + "|" + _try_save(rank, world, root, 1000, 2)


def test_a_failed_marker_write_leaves_no_high_water_mark_above_the_committed_steps(
    tmp_path: Path,
) -> None:
    """The mark is raised before the marker is written. When that write fails (the disk
    full, so the mark cannot come down again), the torn step stays for resume, which
    finishes its commit (manifest and files verify); removed, it read as a rollback."""
    root = tmp_path / "ckpt"
    first, second = run_world(_marker_write_fails, 1, str(root))[0].split("|")
    assert first == "saved" and "No space left" in second, second
    name, fallbacks, value = _resume(root)
    assert (name, value) == ("step-2", 1.0) and fallbacks == []  # the commit is finished


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


def test_fresh_deletes_only_what_checkpointers_wrote(tmp_path: Path) -> None:
    """`geotrain train --fresh` on a root that also holds the user's files (a checkpoint dir
    set to the launch directory): the checkpoints go, the user's files stay."""
    from training.state.checkpoint import remove_checkpoints

    root = tmp_path / "root"
    for d in ("step-10/bj-0", "step-20/bj-0", "quarantine/step-5-bj-0-torn-1"):
        (root / d).mkdir(parents=True)
        (root / d / "x.distcp").write_text("x")
    (root / "high-water-bj-0.json").write_text("{}")
    (root / ".write-probe-bj-0").write_text("")
    (root / "STACK").write_text("local\n")
    mine = {
        "notes.md": "keep",
        "step-by-step.txt": "keep",
        "step-x/a": "keep",
        "src/main.py": "keep",
    }
    for name, text in mine.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    gone = remove_checkpoints([root], "local")
    assert {p.name for p in gone} == {
        "step-10",
        "step-20",
        "quarantine",
        "high-water-bj-0.json",
        ".write-probe-bj-0",
        "STACK",
    }
    assert all((root / name).read_text() == text for name, text in mine.items())
    assert sorted(p.name for p in root.iterdir()) == [
        "notes.md",
        "src",
        "step-by-step.txt",
        "step-x",
    ]
    only = tmp_path / "only"  # a root of checkpoints alone goes with them
    (only / "step-1" / "bj-0").mkdir(parents=True)
    remove_checkpoints([only], "local")
    assert not only.exists() and remove_checkpoints([tmp_path / "never"], "local") == []


def test_a_root_of_another_stack_is_refused_and_fresh_leaves_it_whole(tmp_path: Path) -> None:
    """Two stacks with one checkpoint dir would quarantine, prune and delete each other's
    steps: the first to use a root marks it, the other is refused before touching it."""
    from training.state.checkpoint import OWNER, claim, remove_checkpoints

    root = _make(tmp_path)  # run-a's steps, unmarked (a root from before the mark)
    claim(root, "a")
    assert (root / OWNER).read_text() == "a\n"
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(CheckpointError, match=r"holds stack a's checkpoints .*its own"):
        remove_checkpoints([root], "b")
    assert "holds stack a's" in run_world(_claimed, 1, str(root), "b")[0]
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    mine = tmp_path / "mine"  # several roots: all are checked before any is touched
    (mine / "step-1" / "n0").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="holds stack a's"):
        remove_checkpoints([mine, root], "b")
    assert (mine / "step-1" / "n0").is_dir()
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    claim(root, "a")  # the same stack: its runs share the root (nodes may share it too)
    assert remove_checkpoints([root, mine, root], "a") and not root.exists()
    assert not mine.exists()


def _claimed(rank: int, world: int, root: str, stack: str) -> str:
    try:
        Checkpointer(Path(root), "n0", "run-b", KEY, 3, stack=stack)
    except CheckpointError as e:
        return str(e)
    return "opened"


def test_an_unreadable_shard_and_an_unwritable_final_file_are_errors_that_stop_not_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both failures repeat on every attempt: a GeotrainError (exit 2, no torchrun
    restart) naming the file, not an OSError traceback restarted max_restarts times."""
    import errno

    from training.data.loader import load_region_text
    from training.errors import DataError, OutputError
    from training.resume import save_final
    from training.testing import make_spec

    shard = tmp_path / "corpus.txt"
    shard.write_bytes(b"x" * 8192)
    spec = make_spec(regions=1, local=1)
    r = spec.regions[0]
    region = dataclasses.replace(r, shards=[dataclasses.replace(r.shards[0], uri=f"file:{shard}")])

    def eio(self: Path) -> bytes:
        raise OSError(errno.EIO, "Input/output error", str(self))

    monkeypatch.setattr(Path, "read_bytes", eio)
    with pytest.raises(DataError, match=r"cannot read .*corpus.txt \(Input/output error\)"):
        load_region_text(region, 0, 1)
    monkeypatch.undo()

    job = types.SimpleNamespace(topo=types.SimpleNamespace(rank=0), model=torch.nn.Linear(2, 2))
    with pytest.raises(OutputError, match="cannot write the final weights"):
        save_final(job, tmp_path / "gone")  # type: ignore[arg-type]
    save_final(job, tmp_path)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "final.pt"]


def test_a_time_based_save_never_lands_on_the_last_step() -> None:
    """final.pt holds the last step; a checkpoint there would leave a rerun or a restart
    nothing to train (state.resume refuses it)."""
    from training import loop

    class Done:
        def __init__(self, flags: list[bool]) -> None:
            self.flags = flags

        def result(self) -> list[list[bool]]:
            return [self.flags]

    def after(step: int, steps: int) -> bool:
        job = types.SimpleNamespace(
            step=step - 1,
            spec=types.SimpleNamespace(
                steps=steps,
                checkpoint=types.SimpleNamespace(interval_steps=1000, interval_minutes=1),
            ),
            diloco=None,
            last_save=-1e9,  # the time trigger is due
            control=types.SimpleNamespace(start_gather=lambda mine: Done(mine)),
            pending=[Done([False, True])] * (loop.CONTROL_LATE + 1),
        )
        return loop.due(job)[1]  # type: ignore[arg-type]

    steps = 6 * loop.CONTROL_EVERY
    assert after(steps - loop.CONTROL_EVERY, steps) and not after(steps, steps)


def test_the_first_region_to_finish_writes_the_final_weights_and_stale_temps_go(
    tmp_path: Path,
) -> None:
    from training.resume import first_to_finish, save_final
    from training.spec import FINAL_CLAIM

    assert first_to_finish(tmp_path) and not first_to_finish(tmp_path)  # one per launch
    (tmp_path / FINAL_CLAIM).unlink()  # the launcher, at the next launch
    assert first_to_finish(tmp_path)
    stale = tmp_path / ".final.pt.4242.tmp"  # a writer killed mid-save
    stale.write_bytes(b"x" * 100)
    job = types.SimpleNamespace(model=torch.nn.Linear(2, 2))
    save_final(job, tmp_path)  # type: ignore[arg-type]
    assert not stale.exists() and (tmp_path / "final.pt").is_file()
