"""Bundles: everything one host needs, in one directory the host agent applies.

A bundle holds the rendered files of its node, `host.json` (what the host must look
like), the runtime wheel, `agent.py` (stage one of the agent, run by the host's python3)
and `manifest.json` (SHA-256 of every file and the runtime's identity). The SHA-256 of
the manifest is the bundle's digest: Pulumi passes it to the agent, which refuses a
bundle that does not match it.

`geotrain render` writes one per node; the Pulumi program copies it to the host
(`remote.CopyToRemote`) and the lab uploads it into its namespace hosts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from geotrain.agent.hostspec import HOSTSPEC_FILE, MANIFEST_FILE, HostSpec
from geotrain.version import __version__, source_digest
from infra.plan import Plan, PlanNode
from infra.render.host import HostRole, render_host
from training.errors import GeotrainError, OutputError

REPO_ROOT = Path(__file__).resolve().parents[2]
WHEEL_CACHE = REPO_ROOT / ".geotrain" / "wheels"
BUNDLE_FORMAT = 1
REPRODUCIBLE_EPOCH = "315532800"
"""SOURCE_DATE_EPOCH for wheel builds (1980-01-01): the same sources give the same wheel
bytes on every machine, so the same stack gives the same bundle digests."""

AGENT_PY = '''"""geotrain host agent, stage one: run as root with the host's own python3:
    sudo python3 -I agent.py apply --bundle DIR --digest SHA256 [--secrets-stdin]
It needs nothing but python3: the agent comes from the wheel next to it."""
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(next((here / "wheels").glob("geotrain-*.whl"))))
from geotrain.agent.bootstrap import main  # noqa: E402

main()
'''


@dataclass(frozen=True)
class Bundle:
    node: str
    """Node the bundle is for."""
    files: dict[str, bytes]
    """Relative path -> content (manifest.json included)."""
    host: HostSpec
    """What the host must look like (also in the files, as host.json)."""

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.files[MANIFEST_FILE]).hexdigest()

    def replace(self, rel: str, data: bytes) -> Bundle:
        """The bundle with one file replaced and its manifest re-rendered (tests: a bad
        package, a missing file)."""
        files = {k: v for k, v in self.files.items() if k != MANIFEST_FILE}
        files[rel] = data
        manifest = json.loads(self.files[MANIFEST_FILE])
        manifest["files"] = {k: hashlib.sha256(v).hexdigest() for k, v in sorted(files.items())}
        files[MANIFEST_FILE] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
        host = HostSpec.from_json(files[HOSTSPEC_FILE].decode())
        return Bundle(self.node, files, host)

    def write(self, directory: Path) -> Path:
        """Write the bundle into `directory`, replacing an earlier bundle there; anything
        else in its place (a directory without a bundle's manifest, a symlink, a file) is
        refused, never deleted."""
        if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
            raise OutputError(
                f"{directory} is a symlink or a file, not a bundle geotrain wrote; remove it "
                "or write the bundles elsewhere"
            )
        if directory.exists():
            if any(directory.iterdir()) and not (directory / MANIFEST_FILE).is_file():
                raise OutputError(
                    f"{directory} holds files but no bundle manifest: geotrain did not write "
                    "it and does not delete it; remove it or write the bundles elsewhere"
                )
            shutil.rmtree(directory)
        for rel, data in self.files.items():
            p = directory / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        return directory


def render_bundle(plan: Plan, node: PlanNode, role: HostRole, wheel: Path) -> Bundle:
    """`wheel` comes from runtime_wheel(): its directory is named by its source digest."""
    host, rendered = render_host(plan, node, role)
    files: dict[str, bytes] = {rel: text.encode() for rel, text in rendered.items()}
    files[HOSTSPEC_FILE] = host.to_json().encode()
    files["agent.py"] = AGENT_PY.encode()
    wheel_rel = f"wheels/{wheel.name}"
    files[wheel_rel] = wheel.read_bytes()
    manifest = {
        "format": BUNDLE_FORMAT,
        "stack": plan.stack,
        "node": node.name,
        "runtime": {
            "version": __version__,
            "source_digest": wheel_digest(wheel),
            "wheel": wheel_rel,
        },
        "files": {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(files.items())},
    }
    files[MANIFEST_FILE] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    return Bundle(node.name, files, host)


def wheel_digest(wheel: Path) -> str:
    """The source digest a cached wheel was built from (its directory's name)."""
    return wheel.parent.name


@functools.cache
def runtime_wheel() -> Path:
    """The runtime wheel of this checkout, built once per source digest (cached)."""
    digest = source_digest()
    out = WHEEL_CACHE / digest
    found = sorted(out.glob("geotrain-*.whl")) if out.is_dir() else []
    if found:
        return found[0]
    if not (REPO_ROOT / "pyproject.toml").exists():
        raise GeotrainError(
            f"cannot build the runtime wheel: {REPO_ROOT} is not a geotrain checkout; "
            "run Pulumi from a clone of the repository"
        )
    with tempfile.TemporaryDirectory(prefix="geotrain-wheel-") as tmp:
        src = Path(tmp) / "src"
        # a clean copy: setuptools' build/ dir in the checkout could carry deleted modules
        shutil.copytree(
            REPO_ROOT,
            src,
            ignore=shutil.ignore_patterns(
                ".git",
                ".venv",
                ".geotrain",
                "build",
                "*.egg-info",
                "__pycache__",
                "tests",
                "benchmarks",
                ".mypy_cache",
                ".ruff_cache",
                ".pytest_cache",
            ),
        )
        env = {**os.environ, "SOURCE_DATE_EPOCH": REPRODUCIBLE_EPOCH}
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(Path(tmp) / "dist"),
                str(src),
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()
            raise GeotrainError(
                f"building the runtime wheel failed: {tail[-1] if tail else r.returncode}; "
                "run `pip wheel --no-deps .` in the checkout to see why"
            )
        built = next((Path(tmp) / "dist").glob("geotrain-*.whl"))
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, out / built.name)
    return out / built.name
