"""Stage one of the host agent: standard library only, run by the host's own python3.

It runs from the wheel inside the bundle (the bundle's `agent.py` puts that wheel on
sys.path), so a fresh host needs nothing installed. Steps, each stopping with one clear
line (host, step, what to do) and leaving the host as it was before the apply:
1. verify: the manifest's digest is the one Pulumi rendered; every file matches it;
2. packages: `apt-get update` once, then install what is missing;
3. runtime: the venv at /opt/geotrain/.venv holds exactly the bundle's runtime (created
   from the bundle's wheel when absent; a read-only shared venv must already match), with
   the CUDA build of torch the host's NVIDIA driver runs (geotrain/agent/cuda.py);
then stage two (geotrain.agent.apply) runs in that venv with the same arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from geotrain.agent import cuda, safefs
from geotrain.agent.hostspec import HOSTSPEC_FILE, MANIFEST_FILE, HostSpec, Mirrors

VENV = Path("/opt/geotrain/.venv")
AGENT_HOME = Path("/opt/geotrain/agent")
"""A copy of the agent (bootstrap + wheel) kept for `node remove`."""
STATE_DIR = Path("/var/lib/geotrain-agent")
"""Root's record of what the agent did (state.json, bootstrap.json, backups): root, 0700.
Never inside /var/lib/geotrain, which the worker user owns: it could rename the record's
directory away and put a forged one in its place."""
ETC = Path("/etc/geotrain")
"""The only tree where `prepare` makes directories (the gateway's WireGuard key dir)."""
LEGACY_STATE_DIR = Path("/var/lib/geotrain/agent")
"""Where agents before this one kept it (in the worker user's tree: never read)."""
LOCK = Path("/run/geotrain-node.lock")
"""In /run (root's alone), not the world-writable /run/lock, where another account could
create the lock file first (a symlink, or a file it holds locked)."""
PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+")
"""A Debian package name (Debian Policy 5.6.1): no option can pass for one."""
APT_FILE = re.compile(
    r"/etc/apt/(keyrings/[a-z0-9][a-z0-9-]*\.asc|sources\.list\.d/[a-z0-9][a-z0-9-]*\.list)"
)
"""What `add_repos` writes; the only files bootstrap's record may ask `remove` to delete."""
BUNDLE_STORE = ".geotrain/bundles"
"""Under the login user's home: where Pulumi copies bundles (CopyToRemote)."""
KEEP_BUNDLES = 2


class AgentError(Exception):
    """One line for the operator: host, step, what failed and what to do."""

    def __init__(self, host: str, step: str, message: str) -> None:
        super().__init__(f"host {host}: step {step}: {message}")


@contextlib.contextmanager
def host_lock() -> Iterator[None]:
    """One agent at a time per host (a second waits, so two applies never interleave)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(LOCK, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise AgentError(
            os.uname().nodename,
            "lock",
            f"cannot open {LOCK} ({e.strerror}; a symlink is never followed); remove it and "
            "run again",
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()):
            raise AgentError(
                os.uname().nodename,
                "lock",
                f"{LOCK} is not root's own file (uid {st.st_uid}); remove it and run again",
            )
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- root's record ---------------------------------------------------------------------------
def state_dir(create: bool, host: str | None = None) -> Path | None:
    """STATE_DIR once it is certain that only root can read or change it; None when it
    does not exist (and `create` is False)."""
    host = host or os.uname().nodename
    try:
        st = safefs.lstat(STATE_DIR, strict=True)
    except safefs.UnsafePath as e:
        raise AgentError(host, "state", f"{e}; the agent keeps root's record there") from None
    if st is None:
        if not create:
            return None
        fd = safefs.open_dir(STATE_DIR, create=True)
        os.fchmod(fd, 0o700)
        os.close(fd)
        return STATE_DIR
    if not stat.S_ISDIR(st.st_mode) or not safefs.trusted(st) or st.st_mode & 0o077:
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else f"uid {st.st_uid}, mode "
        what += "" if stat.S_ISLNK(st.st_mode) else f"{stat.S_IMODE(st.st_mode):04o}"
        raise AgentError(
            host,
            "state",
            f"{STATE_DIR} ({what}) must be a directory of root's with mode 0700, since it "
            "drives what `remove` deletes; check what is in it, then `chown root:root "
            f"{STATE_DIR} && chmod 0700 {STATE_DIR}` (or remove it to start over)",
        )
    return STATE_DIR


def read_record(name: str, host: str | None = None) -> dict[str, object] | None:
    """A JSON record of root's from STATE_DIR (a regular file of root's that no one else
    can write); None when there is none."""
    host = host or os.uname().nodename
    if state_dir(create=False, host=host) is None:
        return None
    path = STATE_DIR / name
    try:
        got = safefs.read(path)
    except safefs.UnsafePath as e:
        raise AgentError(host, "state", f"{e}; remove it to start over") from None
    if got is None:
        return None
    data, st = got
    if not safefs.trusted(st):
        raise AgentError(
            host,
            "state",
            f"{path} is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}: not root's "
            "alone, so it cannot say what to remove; inspect it, then remove it to start over",
        )
    try:
        out = json.loads(data)
    except ValueError:
        out = None
    if not isinstance(out, dict):
        raise AgentError(
            host, "state", f"{path} is corrupt; inspect it, then remove it to start over"
        )
    return out


def write_record(name: str, record: dict[str, object]) -> None:
    state_dir(create=True)
    safefs.write(STATE_DIR / name, json.dumps(record, indent=1, sort_keys=True).encode(), 0o600)


def refuse_legacy_state(host: str) -> None:
    """An older agent's record sits in the worker user's tree: it may be forged, so it is
    never read; the operator decides."""
    if (LEGACY_STATE_DIR / "state.json").exists() and state_dir(False, host) is None:
        raise AgentError(
            host,
            "state",
            f"an older agent kept its record in {LEGACY_STATE_DIR}, which the worker user "
            "can change, so this agent does not trust it; check it, then move it to "
            f"{STATE_DIR} (root, 0700) and run again, or remove the host by hand",
        )


# -- 1. verify -----------------------------------------------------------------------------
def bundle_digest(bundle: Path) -> str:
    return hashlib.sha256((bundle / MANIFEST_FILE).read_bytes()).hexdigest()


def verify(bundle: Path, expect: str | None) -> tuple[dict[str, object], HostSpec]:
    """The manifest and host spec, once every file is what was rendered."""
    host = os.uname().nodename
    step = "verify"
    try:
        manifest_bytes = (bundle / MANIFEST_FILE).read_bytes()
    except OSError as e:
        raise AgentError(
            host,
            step,
            f"cannot read {bundle / MANIFEST_FILE} ({e.strerror}); copy the whole bundle "
            "(`geotrain render --stack S --out DIR` writes one per node under DIR/bundles)",
        ) from None
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    if expect and digest != expect:
        raise AgentError(
            host,
            step,
            f"bundle {bundle} has digest {digest[:16]}, expected {expect[:16]}; the copy is "
            "stale or was changed: copy the bundle again",
        )
    try:
        manifest = json.loads(manifest_bytes)
        files: dict[str, str] = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise AgentError(host, step, f"{bundle / MANIFEST_FILE} is not a bundle manifest") from None
    for rel, want in sorted(files.items()):
        p = bundle / rel
        try:
            got = hashlib.sha256(p.read_bytes()).hexdigest()
        except OSError:
            raise AgentError(
                host, step, f"bundle file {rel} is missing from {bundle}; copy the bundle again"
            ) from None
        if got != want:
            raise AgentError(
                host,
                step,
                f"bundle file {rel} has digest {got[:16]}, the manifest says {want[:16]}; "
                "the bundle was changed after rendering: copy it again",
            )
    try:
        spec = HostSpec.from_json((bundle / HOSTSPEC_FILE).read_text())
    except (OSError, ValueError, TypeError) as e:
        raise AgentError(host, step, f"{HOSTSPEC_FILE} is unreadable: {e}") from None
    return manifest, spec


# -- 2. packages ---------------------------------------------------------------------------
RUNTIME_PYTHON = (3, 11)
"""The runtime's interpreter, at least (pyproject's requires-python)."""
OLD_PYTHON_PACKAGES = ("python3.11", "python3.11-venv")
"""What a host whose python3 is older installs for the runtime venv: Ubuntu 22.04's python3
is 3.10 and its jammy-updates universe ships these. Stage one itself (this module, cuda,
safefs, hostspec) runs on 3.10: tests/unit/test_agent_python.py runs it there."""


def runtime_packages(version: tuple[int, ...] = sys.version_info[:3]) -> tuple[str, ...]:
    """Packages the runtime venv needs beyond the spec's, on an interpreter `version`."""
    return () if version[:2] >= RUNTIME_PYTHON else OLD_PYTHON_PACKAGES


def venv_python(node: str, version: tuple[int, ...] = sys.version_info[:3]) -> str:
    """The interpreter the runtime venv is made with: this one when it is new enough, else
    python3.11 (installed by the packages step: `runtime_packages`)."""
    if version[:2] >= RUNTIME_PYTHON:
        return sys.executable
    found = shutil.which("python3.11")
    if found is None:
        have = ".".join(str(v) for v in version[:3])
        raise AgentError(
            node,
            "runtime",
            f"this host's python3 is {have} and there is no python3.11; geotrain's runtime "
            "needs Python 3.11 or newer: on Ubuntu 22.04 enable the universe component "
            "(add-apt-repository universe) and run again, or use Ubuntu 24.04 or Debian 12",
        )
    return found


def installed(package: str) -> bool:
    r = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True
    )
    return r.returncode == 0 and r.stdout.split() == ["install", "ok", "installed"]


def missing_packages(spec: HostSpec, extra: tuple[str, ...] = ()) -> list[str]:
    if shutil.which("dpkg-query") is None:
        raise AgentError(
            spec.node,
            "packages",
            "this host has no dpkg/apt; the agent supports Debian and Ubuntu hosts",
        )
    return [p for p in resolve(spec, [*spec.packages, *extra]) if not installed(p)]


def install_packages(spec: HostSpec, extra: tuple[str, ...] = ()) -> list[str]:
    """Install what is missing; returns what this call installed."""
    missing = missing_packages(spec, extra)
    if not missing:
        return []
    add_repos(spec)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
    ):
        r = subprocess.run(argv, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
            why = next((ln for ln in reversed(lines) if ln.startswith("E:")), None)
            raise AgentError(
                spec.node,
                "packages",
                f"`{' '.join(argv[:2])}` failed for {', '.join(missing)}: "
                f"{why or (lines[-1] if lines else 'exit ' + str(r.returncode))}; "
                "check the host's apt sources and network; nothing else was changed",
            )
    return missing


def host_facts() -> dict[str, str]:
    """What repository lines and package names may depend on: `distro` as vendors name
    their repositories (debian12, ubuntu2204), `arch` (x86_64, sbsa), `cuda` (the
    driver's CUDA major, for NVIDIA's DCGM packages; empty without a driver)."""
    release = {}
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            k, _, v = line.partition("=")
            release[k] = v.strip('"')
    machine = os.uname().machine
    cuda = ""
    with contextlib.suppress(OSError):
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
        if "CUDA Version:" in out:
            cuda = out.split("CUDA Version:")[1].split()[0].split(".")[0]
    return {
        "distro": release.get("ID", "") + release.get("VERSION_ID", "").replace(".", ""),
        "arch": "sbsa" if machine == "aarch64" else machine,
        "cuda": cuda,
    }


def resolve(spec: HostSpec, names: list[str]) -> list[str]:
    """Package names with `{cuda}` filled in."""
    if not any("{cuda}" in n for n in names):
        return names
    cuda = host_facts()["cuda"]
    if not cuda:
        raise AgentError(
            spec.node,
            "packages",
            "dcgm-exporter's packages follow the NVIDIA driver's CUDA version, and "
            "nvidia-smi found no driver; install the driver first, or set "
            "geotrain:monitoring.gpu_metrics: runtime",
        )
    return [n.replace("{cuda}", cuda) for n in names]


def add_repos(spec: HostSpec) -> None:
    """The spec's apt repositories: key to /etc/apt/keyrings/<name>.asc, line to
    /etc/apt/sources.list.d/<name>.list (both removed by `node remove`)."""
    import urllib.request

    if not spec.repos:
        return
    facts = host_facts()
    for repo in spec.repos:
        keyring = Path(f"/etc/apt/keyrings/{repo.name}.asc")
        listing = Path(f"/etc/apt/sources.list.d/{repo.name}.list")
        if keyring.exists() and listing.exists():
            continue
        url = repo.key_url.format(**facts)
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                key = resp.read()
        except OSError as e:
            raise AgentError(
                spec.node,
                "packages",
                f"cannot fetch the signing key of apt repository {repo.name} from {url} "
                f"({e}); the host must reach it, or turn that service off in the stack",
            ) from None
        keyring.parent.mkdir(parents=True, exist_ok=True)
        keyring.write_bytes(key)
        listing.write_text(repo.line.format(keyring=keyring, **facts) + "\n")
        _remember_list("added_files", [str(keyring), str(listing)])


def wireguard_userspace() -> bool:
    """True when the kernel has no WireGuard module (wireguard-go must carry tunnels)."""
    if Path("/sys/module/wireguard").exists():
        return False
    try:
        r = subprocess.run(["modprobe", "-n", "wireguard"], capture_output=True)
    except OSError:  # no kmod on this host: no module can be loaded either
        return True
    return r.returncode != 0


# -- 3. runtime ----------------------------------------------------------------------------
def runtime_identity(venv: Path) -> dict[str, str] | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-m", "geotrain.version"], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    try:
        out: dict[str, str] = json.loads(r.stdout.strip().splitlines()[-1])
        return out
    except (ValueError, IndexError):
        return None


def torch_pin(wheel: Path) -> str | None:
    """The torch version the runtime wheel pins (`Requires-Dist: torch==2.13.0`)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = z.read(meta).decode() if meta else ""
    m = re.search(r"^Requires-Dist: torch\s*==\s*([0-9][0-9a-z.]*)\s*$", text, re.M)
    return m.group(1) if m else None


def torch_build(node: str, version: str) -> tuple[tuple[int, ...], cuda.CudaBuild] | None:
    """(driver, the CUDA build of torch it runs); None on a host without an NVIDIA driver
    (torch from the default index, as on every CPU host). A driver older than every build
    stops here, naming both versions."""
    driver = cuda.driver_version()
    if driver is None:
        return None
    build = cuda.build_for(driver)
    if build is None:
        oldest = cuda.TORCH_CUDA_BUILDS[-1]
        raise AgentError(
            node,
            "runtime",
            f"NVIDIA driver {cuda.show(driver)} is older than torch {version} supports (its "
            f"oldest CUDA build, {oldest.tag}, needs driver >= {cuda.show(oldest.min_driver)}); "
            f"install driver {cuda.DRIVER_BRANCH} or newer "
            f"(apt-get install nvidia-driver-{cuda.DRIVER_BRANCH}-server) and run again",
        )
    return driver, build


def installed_torch(venv: Path) -> str | None:
    """The local label (cu128, cpu) of the torch in `venv`, read without importing it."""
    for version_py in sorted(venv.glob("lib/python3*/site-packages/torch/version.py")):
        with contextlib.suppress(OSError):
            return cuda.torch_build_of(version_py.read_text())
    return None


def torch_runs(tag: str | None, driver: tuple[int, ...]) -> bool:
    """Whether the installed torch build uses this driver's GPUs (a cpu build does not; an
    unknown label is left as the venv's builder chose)."""
    if tag is None or tag == cuda.CPU_TAG:
        return False
    build = cuda.build_of_tag(tag)
    return build is None or driver >= build.min_driver


def ensure_torch(
    node: str, version: str | None, writable: bool, mirrors: Mirrors | None = None
) -> None:
    """On a GPU host, the venv's torch is a CUDA build the driver runs: installed from
    PyTorch's index for that CUDA when not (a read-only shared venv must already be)."""
    picked = torch_build(node, version) if version else None
    if picked is None:
        return
    driver, build = picked
    have = installed_torch(VENV)
    if torch_runs(have, driver):
        return
    if not writable:
        raise AgentError(
            node,
            "runtime",
            f"{VENV} holds torch build {have or '(none)'}, which NVIDIA driver "
            f"{cuda.show(driver)} cannot run on the GPU, and the venv is read-only; rebuild "
            f"it with torch=={version}+{build.tag} from {build.index_url}",
        )
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir"]
    want = f"torch=={version}+{build.tag}"
    index = build.index_url
    if mirrors is not None and mirrors.torch_index_url:
        index = f"{mirrors.torch_index_url.rstrip('/')}/{build.tag}"
    _run(node, "runtime", [*pip, want, "--index-url", index], None)


def ensure_runtime(
    bundle: Path, manifest: dict[str, object], node: str, mirrors: Mirrors | None = None
) -> bool:
    """Make the venv hold the bundle's runtime; True when this call created the venv."""
    want = dict(manifest["runtime"])  # type: ignore[call-overload]
    have = runtime_identity(VENV)
    ident = {"version": want["version"], "source_digest": want["source_digest"]}
    wheel = bundle / str(want["wheel"])
    version = torch_pin(wheel)
    if version:
        torch_build(node, version)  # a driver too old for every build stops before any change
    if have == ident:
        ensure_torch(node, version, os.access(VENV, os.W_OK), mirrors)
        return False
    created = False
    if have is None and not (VENV / "bin" / "python").exists():
        python = venv_python(node)
        hint = "python3-venv" if python == sys.executable else "python3.11-venv"
        _run(node, "runtime", [python, "-m", "venv", str(VENV)], hint)
        created = True
    elif not os.access(VENV, os.W_OK):
        raise AgentError(
            node,
            "runtime",
            f"{VENV} holds runtime {_short(have)} but the bundle carries {_short(ident)}, "
            "and the venv is read-only; rebuild the shared venv from this checkout",
        )
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir"]
    ensure_torch(node, version, True, mirrors)  # first: the wheel's `torch==X` is then met
    _run(node, "runtime", [*pip, "--force-reinstall", "--no-deps", str(wheel)], None)
    index = ["--index-url", mirrors.pip_index_url] if mirrors and mirrors.pip_index_url else []
    _run(node, "runtime", [*pip, str(wheel), *index], None)  # its dependencies, from the index
    if runtime_identity(VENV) != ident:
        raise AgentError(node, "runtime", f"{VENV} does not hold {_short(ident)} after install")
    return created


def _short(ident: dict[str, str] | None) -> str:
    if not ident:
        return "(none)"
    return f"{ident['version']} ({ident['source_digest'][:12]})"


def _run(node: str, step: str, argv: list[str], package_hint: str | None) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        hint = f"; install {package_hint}" if package_hint else ""
        raise AgentError(
            node,
            step,
            f"`{' '.join(argv[:4])}` failed: {lines[-1] if lines else r.returncode}{hint}",
        )


# -- the agent's own copy (for `node remove`) --------------------------------------------
def keep_agent_copy(bundle: Path, manifest: dict[str, object]) -> None:
    """Copy agent.py and the wheel to /opt/geotrain/agent and /usr/local/sbin/geotrain-node,
    so `node remove` works when the bundle is gone."""
    wheel = bundle / str(dict(manifest["runtime"])["wheel"])  # type: ignore[call-overload]
    AGENT_HOME.mkdir(parents=True, exist_ok=True)
    tmp = AGENT_HOME / "geotrain.whl.tmp"
    shutil.copyfile(wheel, tmp)
    os.replace(tmp, AGENT_HOME / "geotrain.whl")
    script = Path("/usr/local/sbin/geotrain-node")
    script.write_text(
        "#!/usr/bin/python3 -I\n"
        '"""geotrain host agent (installed by `geotrain node apply`)."""\n'
        "import sys\n"
        f"sys.path.insert(0, {str(AGENT_HOME / 'geotrain.whl')!r})\n"
        "from geotrain.agent.bootstrap import main\n"
        "main()\n"
    )
    script.chmod(0o755)


def remove_agent_copy() -> None:
    Path("/usr/local/sbin/geotrain-node").unlink(missing_ok=True)
    shutil.rmtree(AGENT_HOME, ignore_errors=True)
    with contextlib.suppress(OSError):
        AGENT_HOME.parent.rmdir()  # /opt/geotrain, when nothing else is in it


def prune_bundles(current: Path) -> None:
    """Keep the current bundle and the one before it in the bundle store."""
    store = current.parent
    if store.name != "bundles":
        return
    others = sorted(
        (p for p in store.iterdir() if p.is_dir() and p != current),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in others[KEEP_BUNDLES - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


# -- commands ------------------------------------------------------------------------------
def stage_two(argv: list[str], stdin: bytes | None) -> int:
    py = VENV / "bin" / "python"
    r = subprocess.run([str(py), "-m", "geotrain.agent.apply", *argv], input=stdin)
    return r.returncode


def cmd_prepare(args: argparse.Namespace) -> int:
    """Packages and the gateway's WireGuard key; prints the public key (never the private
    key, which is made here and never leaves the host)."""
    bundle = Path(args.bundle).resolve()
    with host_lock():
        _, spec = verify(bundle, args.digest)
        refuse_legacy_state(spec.node)
        _state(spec.node)  # a record only root could have written, before anything changes
        extra = ("wireguard-go",) if spec.tunnels and wireguard_userspace() else ()
        installed_now = install_packages(spec, extra)
        _remember_packages(installed_now)
        key_dir = Path(spec.wireguard_key_dir)
        key = key_dir / "private.key"
        if not _under_etc(str(key_dir)):
            raise AgentError(
                spec.node, "wireguard", f"wireguard_key_dir {key_dir} is not under {ETC}"
            )
        try:
            got = safefs.read(key)
            if got is None:
                made: list[str] = []
                fd = safefs.open_dir(key_dir, create=True, made=made)
                os.fchmod(fd, 0o700)
                os.close(fd)
                _remember_list("created_dirs", made)
                private = subprocess.run(
                    ["wg", "genkey"], capture_output=True, text=True, check=True
                )
                safefs.write(key, private.stdout.encode(), 0o600)
                got = safefs.read(key)
        except safefs.UnsafePath as e:
            raise AgentError(spec.node, "wireguard", f"{e}; give it back to root") from None
        assert got is not None
        public = subprocess.run(
            ["wg", "pubkey"], input=got[0].decode(), capture_output=True, text=True, check=True
        ).stdout.strip()
    print(public)  # the only output: Pulumi passes it to the peers as it is
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    bundle = Path(args.bundle).resolve()
    stdin = sys.stdin.buffer.read() if args.secrets_stdin else None
    with host_lock():
        manifest, spec = verify(bundle, args.digest)
        refuse_legacy_state(spec.node)
        _state(spec.node)  # a record only root could have written, before anything changes
        extra = ("wireguard-go",) if spec.tunnels and wireguard_userspace() else ()
        _remember_packages(install_packages(spec, (*extra, *runtime_packages())))
        if ensure_runtime(bundle, manifest, spec.node, spec.mirrors):
            _remember("created_venv", True)
        keep_agent_copy(bundle, manifest)
        argv = ["apply", "--bundle", str(bundle)]
        if args.secrets_stdin:
            argv.append("--secrets-stdin")
        rc = stage_two(argv, stdin)
        if rc == 0:
            prune_bundles(bundle)
        return rc


def cmd_remove(args: argparse.Namespace) -> int:
    host = os.uname().nodename
    with host_lock():
        refuse_legacy_state(host)
        state = _state(host)
        if (VENV / "bin" / "python").exists() and read_record("state.json", host) is not None:
            rc = stage_two(["remove", *(["--purge"] if args.purge else [])], None)
            if rc != 0:
                return rc
        packages = [p for p in state["installed_packages"] if installed(p)]  # type: ignore[attr-defined]
        if packages:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            subprocess.run(
                ["apt-get", "remove", "-y", "-qq", *packages], capture_output=True, env=env
            )
        for added in state["added_files"]:  # type: ignore[attr-defined]
            safefs.unlink(added)
        # deepest first: the WireGuard key dir, then /etc/geotrain when prepare made it
        for made in sorted(state["created_dirs"], key=len, reverse=True):  # type: ignore[call-overload]
            safefs.remove_tree(made)
        if state.get("created_venv") is True:
            safefs.remove_tree(VENV)
        safefs.remove_tree(STATE_DIR)
        remove_agent_copy()
    print(json.dumps({"removed": True}))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Drift from the last apply (geotrain.agent.apply.status): JSON on stdout, exit 3 when
    the host differs. Read-only, so without the host lock (an apply may be running)."""
    if not (VENV / "bin" / "python").exists():
        print(
            json.dumps(
                {
                    "node": os.uname().nodename,
                    "ok": False,
                    "drift": ["no runtime venv: run `pulumi up`"],
                }
            )
        )
        return 3
    extra = ["--textfile", args.textfile] if args.textfile else []
    return stage_two(["status", *extra], None)


def _state(host: str | None = None) -> dict[str, object]:
    """bootstrap.json: what stage one added (packages, apt files, directories, the venv),
    each entry checked to be something stage one can have added, so that a record from
    anyone else cannot make `remove` delete other files or packages."""
    host = host or os.uname().nodename
    state = read_record("bootstrap.json", host) or {}
    lists: dict[str, list[str]] = {}
    for key in ("installed_packages", "added_files", "created_dirs"):
        value = state.setdefault(key, [])
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise AgentError(
                host,
                "state",
                f"{STATE_DIR}/bootstrap.json: {key} is not a list of names; inspect the file, "
                "then remove it to start over",
            )
        lists[key] = value
    bad = [p for p in lists["installed_packages"] if not PACKAGE.fullmatch(p)]
    bad += [f for f in lists["added_files"] if not APT_FILE.fullmatch(f)]
    bad += [d for d in lists["created_dirs"] if not _under_etc(d)]
    if bad:
        raise AgentError(
            host,
            "state",
            f"{STATE_DIR}/bootstrap.json asks to remove {bad[0]!r}, which the agent never "
            "adds (packages are Debian names, files its apt sources, directories under "
            f"{ETC}); it was not written by the agent: inspect it, then remove it",
        )
    return state


def _under_etc(path: str) -> bool:
    return os.path.normpath(path) == path and (Path(path) == ETC or ETC in Path(path).parents)


def _remember(key: str, value: object) -> None:
    state = _state()
    state[key] = value
    write_record("bootstrap.json", state)


def _remember_list(key: str, new: list[str]) -> None:
    if new:
        old = list(_state().get(key, []))  # type: ignore[call-overload]
        _remember(key, sorted({*old, *new}))


def _remember_packages(new: list[str]) -> None:
    _remember_list("installed_packages", new)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="geotrain-node", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "apply"):
        p = sub.add_parser(name)
        p.add_argument("--bundle", required=True, help="Bundle directory on this host.")
        p.add_argument("--digest", help="Expected bundle digest (sha256 of manifest.json).")
        if name == "apply":
            p.add_argument(
                "--secrets-stdin",
                action="store_true",
                help="Read the run key and peers' WireGuard public keys as JSON on stdin.",
            )
    p = sub.add_parser("remove")
    p.add_argument("--purge", action="store_true", help="Also delete kept data (checkpoints).")
    p = sub.add_parser("status", help="What differs from the last apply (exit 3 when any).")
    p.add_argument("--textfile", help="Also write geotrain_node_drift for node-exporter here.")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("geotrain-node: error: the host agent needs root (run it with sudo)", file=sys.stderr)
        sys.exit(2)
    try:
        commands = {
            "prepare": cmd_prepare,
            "apply": cmd_apply,
            "remove": cmd_remove,
            "status": cmd_status,
        }
        rc = commands[args.cmd](args)
    except AgentError as e:
        print(f"geotrain-node: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc)


if __name__ == "__main__":
    main()
