"""The runtime's identity: its version and a digest of its source files.

A bundle records the identity of the wheel it carries; the host agent compares it with the
runtime venv on the host (`python -m geotrain.version` there), so a host never runs code
other than what was rendered, also when test hosts share one pre-built venv.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

__version__ = "0.1.0"
PACKAGES = ("geotrain", "infra", "training", "policies")
SUFFIXES = (".py", ".yaml", ".json")
"""What the wheel carries of each package (pyproject: packages + package-data)."""


def source_digest() -> str:
    """SHA-256 over (relative path, content) of every shipped file, in a stable order."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"package {pkg} is not importable")
        base = Path(spec.origin).parent
        for f in sorted(base.rglob("*")):
            if f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts:
                rel = f"{pkg}/{f.relative_to(base).as_posix()}"
                h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def identity() -> dict[str, str]:
    return {"version": __version__, "source_digest": source_digest()}


if __name__ == "__main__":
    print(json.dumps(identity()))
