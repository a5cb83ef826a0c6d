"""`geotrain render --out DIR`: what a render writes there, and what it removes.

A render records the files and host bundles it wrote in DIR/.geotrain-render.json. The
next render into DIR removes what the record lists and the new render no longer writes:
a node dropped from the stack leaves no bundle behind for someone to apply with an old
run id. Anything else in DIR (files the user put there) is never touched; a bundle
directory is removed only while it holds a bundle's manifest."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TypeGuard

from geotrain.agent.hostspec import MANIFEST_FILE
from infra.model.names import NAME_PATTERN
from infra.render.artifacts import Artifact
from infra.render.bundle import Bundle

RECORD = ".geotrain-render.json"
NODE_NAME = re.compile(NAME_PATTERN)
"""What a bundle directory may be named: a node name (no '/', no '..')."""
BUNDLES = "bundles"


def previous(root: Path) -> tuple[set[str], set[str]]:
    """(files, bundles) the last render into `root` recorded; empty sets without one, or
    with one of another shape (hand-edited, cut short): then nothing is removed."""
    try:
        body = json.loads((root / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set(), set()
    if not isinstance(body, dict):
        return set(), set()
    files, bundles = body.get("files"), body.get("bundles")
    if not (_strings(files) and _strings(bundles)):
        return set(), set()
    return set(files), {b for b in bundles if NODE_NAME.fullmatch(b)}


def _strings(x: object) -> TypeGuard[list[str]]:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def write(
    root: Path, stack: str, arts: Iterable[Artifact], bundles: dict[str, Bundle]
) -> list[str]:
    """Write `arts` and `bundles` (node name -> bundle) under `root`, then remove what the
    previous render recorded and this one does not write. Returns what was removed."""
    old_files, old_bundles = previous(root)
    files = []
    for a in arts:
        p = root / a.path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(a.content, encoding="utf-8")
        files.append(a.path)
    for name, b in bundles.items():
        b.write(root / BUNDLES / name)
    removed = []
    for rel in sorted(old_files - set(files)):
        p = root / rel
        if p.is_file() and not p.is_symlink() and _inside(root, p):
            p.unlink()
            removed.append(rel)
            _prune(root, p.parent)
    for name in sorted(old_bundles - set(bundles)):
        d = root / BUNDLES / name
        if (
            d.is_dir()
            and not d.is_symlink()
            and d.parent.resolve() == (root / BUNDLES).resolve()
            and (d / MANIFEST_FILE).is_file()
        ):
            shutil.rmtree(d)
            removed.append(f"{BUNDLES}/{name}")
    record = {"stack": stack, "files": sorted(files), "bundles": sorted(bundles)}
    (root / RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return removed


def _inside(root: Path, p: Path) -> bool:
    return p.resolve().is_relative_to(root.resolve())


def _prune(root: Path, d: Path) -> None:
    """Remove `d` and its parents below `root` while they are empty."""
    while d != root and _inside(root, d):
        try:
            d.rmdir()
        except OSError:  # not empty, or gone
            return
        d = d.parent
