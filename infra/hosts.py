"""Hosts simulated on one Linux machine (root), for the lab and the SSH integration tests.

A host is what a real server looks like to the host agent, and nothing shared with the
machine it runs on can be damaged by it:
- its own network namespace (the caller creates and wires it: veths, bridges);
- its own root filesystem: overlayfs with the machine's `/` as the read-only lower layer
  and writes landing in the host's upper directory (so `/etc/frr`, `/etc/wireguard`,
  `/etc/geotrain`, `/opt/geotrain`, `/var/lib/geotrain` and `/etc/systemd/system` are
  private), plus private tmpfs on `/run`, `/tmp` and `/dev/shm`;
- a real systemd as PID 1 in its own PID, mount, UTS and cgroup namespaces, inside a
  cgroup of its own, booted into a minimal target (`geotrain-host.target`) that starts
  journald and only the units asked for (sshd for SSH hosts). systemd never runs on the
  shared root: there it would start every unit enabled in the shared `/etc`, and its
  tmpfiles cleanup would wipe the machine's `/tmp`.

`stop()` kills the host's systemd with SIGKILL from outside: the PID namespace takes every
process of the host with it, and the mount namespace (overlay, tmpfs) goes with them.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from training.errors import LabError

SYSTEMD = Path("/lib/systemd/systemd")
BOOT_TARGET = "geotrain-host.target"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "geotrain-hosts"
"""Every host's cgroup lives under this one, in each hierarchy systemd uses."""
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BOOT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Bind:
    """A directory of this machine made visible inside the host."""

    source: str
    """Path on this machine."""
    target: str
    """Path inside the host."""
    read_only: bool = True
    """Mount read-only (a shared pre-built venv must not be changed by a host)."""


@dataclass
class Host:
    """One simulated host; `start()` boots it, `stop()` removes every trace of it."""

    name: str
    """Host name (the stack's node name)."""
    netns: str
    """Network namespace the host lives in (must exist before start)."""
    state_dir: Path
    """Holds upper/ (every file the host wrote), work/ and root/ (the mount point)."""
    units: tuple[str, ...] = ()
    """Units the boot target wants besides journald (e.g. ssh.service)."""
    binds: tuple[Bind, ...] = ()
    """Directories of this machine bind-mounted into the host."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Files placed in the host's root before it boots (path inside the host -> text)."""
    pid: int | None = None
    """PID (in this machine's PID namespace) of the host's systemd, once started."""

    @property
    def upper(self) -> Path:
        return self.state_dir / "upper"

    # -- life cycle ---------------------------------------------------------------------
    def start(self, timeout: float = BOOT_TIMEOUT_S) -> None:
        """Boot the host and wait until systemd reports the boot target reached."""
        for d in ("upper", "work", "root"):
            (self.state_dir / d).mkdir(parents=True, exist_ok=True)
        self._write_boot_files()
        cgroups = _make_cgroups(self.netns)
        script = _boot_script(self, cgroups)
        log = open(self.state_dir / "boot.log", "wb")  # noqa: SIM115 (the child owns it)
        proc = subprocess.Popen(
            ["/bin/sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        try:
            self.pid = _wait_for_systemd(self.netns, proc, timeout)
            self._wait_running(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGKILL the host's systemd (its PID namespace takes every process with it),
        then remove its cgroups and files. Safe to call on a host that never started."""
        stop_netns_processes(self.netns)
        self.pid = None
        remove_cgroups(self.netns)
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def alive(self) -> bool:
        return self.pid is not None and Path(f"/proc/{self.pid}").exists()

    # -- running things inside ------------------------------------------------------------
    def exec(
        self,
        argv: Sequence[str],
        input: str | bytes | None = None,
        check: bool = True,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside the host: all its namespaces, its root, as root."""
        if self.pid is None:
            raise LabError(f"host {self.name} is not running; start it first")
        data = input.encode() if isinstance(input, str) else input
        r = subprocess.run(
            [*self.enter_argv(), *argv],
            input=data,
            capture_output=True,
            timeout=timeout,
        )
        out = subprocess.CompletedProcess(
            r.args,
            r.returncode,
            r.stdout.decode(errors="replace"),
            r.stderr.decode(errors="replace"),
        )
        if check and r.returncode != 0:
            msg = (out.stderr or out.stdout).strip().splitlines()
            raise LabError(
                f"host {self.name}: `{shlex.join(argv)}` failed with exit {r.returncode}: "
                f"{msg[-1] if msg else '(no output)'}"
            )
        return out

    def enter_argv(self) -> list[str]:
        """The command prefix that enters this host (for callers that stream)."""
        return [
            "nsenter",
            "-t",
            str(self.pid),
            "--all",
            "--root",
            "--wd",
            "env",
            "-i",
            f"PATH={HOST_PATH}",
            "HOME=/root",
            "LANG=C.UTF-8",
        ]

    def sh(self, script: str, check: bool = True, input: str | None = None) -> str:
        return self.exec(["/bin/sh", "-c", script], input=input, check=check).stdout

    def write(self, path: str, content: str, mode: int = 0o644) -> None:
        """Write a file inside the running host (through its root, as root)."""
        q = shlex.quote(path)
        self.sh(
            f"mkdir -p $(dirname {q}) && cat > {q} && chmod {mode:o} {q}",
            input=content,
        )

    def upload(self, source: Path, target: str) -> None:
        """Copy a directory of this machine into the host (a tar stream, as a copy over
        SSH would: the host sees a complete directory of its own)."""
        tar = subprocess.run(
            ["tar", "-C", str(source), "-cf", "-", "."], capture_output=True, check=True
        )
        q = shlex.quote(target)
        self.exec(
            ["/bin/sh", "-c", f"rm -rf {q} && mkdir -p {q} && tar -C {q} -xf -"],
            input=tar.stdout,
        )

    # -- internals ------------------------------------------------------------------------
    def _write_boot_files(self) -> None:
        # user-sessions removes /run/nologin, which tmpfiles creates at boot (no logins)
        wants = " ".join(("systemd-journald.service", "systemd-user-sessions.service", *self.units))
        files = {
            f"/etc/systemd/system/{BOOT_TARGET}": (
                "[Unit]\n"
                "Description=geotrain simulated host (journald and the units it was "
                "given, nothing else enabled in /etc)\n"
                f"Wants={wants}\n"
            ),
            "/etc/hostname": self.name + "\n",
            # name service as a cloud image has it: its own name in /etc/hosts (cloud-init),
            # and a resolver that answers at once. This machine's resolver is unreachable
            # from the host's network: every lookup would wait 5 s for it, and torch's
            # TCPStore looks up the peer of every connection it accepts, so a rendezvous of
            # four hosts stalled 2.5 minutes (nothing listens on the host's own port 53:
            # a lookup is refused at once)
            "/etc/hosts": f"127.0.0.1 localhost\n127.0.1.1 {self.name}\n",
            "/etc/resolv.conf": "nameserver 127.0.0.1\n",
            **self.files,
        }
        for path, text in files.items():
            p = self.upper / path.lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        for b in self.binds:
            (self.upper / b.target.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def _wait_running(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            r = self.exec(["systemctl", "is-system-running"], check=False)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                if state == "degraded":
                    failed = self.exec(
                        ["systemctl", "--failed", "--no-legend", "--plain"], check=False
                    ).stdout.strip()
                    raise LabError(f"host {self.name} booted with failed units: {failed}")
                return
            time.sleep(0.1)
        raise LabError(
            f"host {self.name}: systemd did not finish booting in {timeout:.0f} s "
            f"(state '{state}'); see {self.state_dir / 'boot.log'}"
        )


def _boot_script(h: Host, cgroups: list[Path]) -> str:
    """The shell that puts itself in the host's cgroups, enters the host's network
    namespace and new PID/mount/UTS/cgroup namespaces, mounts the private root and execs
    systemd as PID 1."""
    root, upper, work = (shlex.quote(str(h.state_dir / d)) for d in ("root", "upper", "work"))
    join = " ".join(f"echo $$ > {shlex.quote(str(c / 'cgroup.procs'))};" for c in cgroups)
    inner = [
        "set -e",
        "mount --make-rprivate /",
        f"mount -t overlay overlay -o lowerdir=/,upperdir={upper},workdir={work} {root}",
        f"mount --rbind /dev {root}/dev",
        f"mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {root}/dev/shm",
        f"mount -t proc proc {root}/proc",
        f"mount -t sysfs sysfs {root}/sys",
        f"mount -t tmpfs -o mode=755 tmpfs {root}/run",
        f"mount -t tmpfs -o mode=1777 tmpfs {root}/tmp",
        *_cgroup_mounts(root),
    ]
    for b in h.binds:  # after the tmpfs mounts: a target under /tmp must stay visible
        target = f"{root}/{b.target.lstrip('/')}"
        inner.append(f"mkdir -p {shlex.quote(target)}")
        inner.append(f"mount --bind {shlex.quote(b.source)} {shlex.quote(target)}")
        if b.read_only:
            inner.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
    inner += [
        f"hostname {shlex.quote(h.name)}",
        # pivot_root, not chroot: in a chroot the kernel refuses new user namespaces, which
        # hardened units (PrivateUsers=, e.g. Debian's prometheus) need
        f"mkdir {root}/run/oldroot",
        f"cd {root}",
        "pivot_root . run/oldroot",
        "cd /",
        "umount -l /run/oldroot",
        "rmdir /run/oldroot",
        f"exec /usr/bin/env -i container=geotrain-host PATH={HOST_PATH} "
        f"{SYSTEMD} --system --unit={BOOT_TARGET} --log-target=journal-or-kmsg",
    ]
    body = "\n".join(inner)
    return (
        f"set -e; {join} exec ip netns exec {shlex.quote(h.netns)} "
        "unshare --pid --fork --mount --uts --cgroup --propagation private "
        f"/bin/sh -c {shlex.quote(body)}"
    )


def _cgroup_layout() -> str:
    """'unified' (cgroup v2 at /sys/fs/cgroup) or 'hybrid' (v1 with a name=systemd
    hierarchy and v2 at /sys/fs/cgroup/unified)."""
    fs = {
        line.split()[1]: line.split()[2]
        for line in Path("/proc/mounts").read_text().splitlines()
        if len(line.split()) > 2
    }
    if fs.get(str(CGROUP_ROOT)) == "cgroup2":
        return "unified"
    if str(CGROUP_ROOT / "systemd") in fs:
        return "hybrid"
    raise LabError(
        "systemd needs cgroups: neither cgroup v2 at /sys/fs/cgroup nor a name=systemd "
        "hierarchy is mounted on this machine"
    )


def cgroup_dirs(netns: str) -> list[Path]:
    if _cgroup_layout() == "unified":
        return [CGROUP_ROOT / CGROUP_PARENT / netns]
    dirs = [CGROUP_ROOT / "systemd" / CGROUP_PARENT / netns]
    if (CGROUP_ROOT / "unified").is_dir():
        dirs.append(CGROUP_ROOT / "unified" / CGROUP_PARENT / netns)
    return dirs


def _cgroup_mounts(root: str) -> list[str]:
    """Inside the cgroup namespace a fresh cgroupfs shows the host's own cgroup as the
    root, so its systemd manages only its own subtree."""
    cg = f"{root}/sys/fs/cgroup"
    if _cgroup_layout() == "unified":
        return [f"mount -t cgroup2 -o nsdelegate cgroup2 {cg}"]
    out = [
        f"mount -t tmpfs -o mode=755 tmpfs {cg}",
        f"mkdir -p {cg}/systemd",
        f"mount -t cgroup -o none,name=systemd cgroup {cg}/systemd",
    ]
    if (CGROUP_ROOT / "unified").is_dir():
        out += [f"mkdir -p {cg}/unified", f"mount -t cgroup2 cgroup2 {cg}/unified"]
    return out


def _make_cgroups(netns: str) -> list[Path]:
    dirs = cgroup_dirs(netns)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


def remove_cgroups(netns: str, timeout: float = 5.0) -> None:
    """rmdir the host's cgroup tree bottom-up (a cgroup empties once its processes are
    reaped, so retry briefly)."""
    deadline = time.monotonic() + timeout
    for top in cgroup_dirs(netns):
        while top.exists():
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
            if not top.exists() or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            top.parent.rmdir()  # geotrain-hosts, once no host is left


def netns_pids(netns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def stop_netns_processes(netns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in `netns` and wait until they are gone."""
    deadline = time.monotonic() + timeout
    while True:
        pids = netns_pids(netns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise LabError(
                f"processes {pids} in network namespace {netns} survived SIGKILL for "
                f"{timeout:.0f} s; check `ip netns pids {netns}`"
            )
        time.sleep(0.05)


def find_systemd(netns: str) -> int | None:
    """PID (in this PID namespace) of the host systemd running in `netns`, if any."""
    for pid in netns_pids(netns):
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            continue
        if exe.endswith("/systemd") and _ns_pid(pid) == 1:
            return pid
    return None


def _wait_for_systemd(netns: str, proc: subprocess.Popen[bytes], timeout: float) -> int:
    """PID (in this namespace) of the systemd that the boot script exec'ed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = find_systemd(netns)
        if pid is not None:
            return pid
        if proc.poll() is not None:
            raise LabError(
                f"host in {netns} did not boot: the boot script exited with {proc.returncode}"
            )
        time.sleep(0.05)
    raise LabError(f"host in {netns}: systemd did not start within {timeout:.0f} s")


def _ns_pid(pid: int) -> int | None:
    """The PID of `pid` inside its innermost PID namespace."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def tool_missing(tools: Iterable[str]) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


VENV_IN_HOST = "/opt/geotrain/.venv"
"""Where simulated hosts see their runtime (where the agent builds it on a real host)."""


def runtime_binds(venv: Path) -> tuple[Bind, ...]:
    """What a host needs to run the shared runtime venv `venv`: the venv itself at
    VENV_IN_HOST, and, at their own paths, the environment its .pth line and interpreter
    link point into (they may live under /tmp, which hosts see as their own tmpfs)."""
    same = sorted({os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)})
    return (Bind(str(venv), VENV_IN_HOST), *(Bind(p, p) for p in same))


def runtime_venv(wheel: Path, root: Path) -> Path:
    """A venv holding exactly the wheel's runtime, for simulated hosts to share read-only
    (bind-mounted at VENV_IN_HOST). geotrain comes from the wheel, like the venv the agent
    builds on a real host, never from this checkout's live sources; its dependencies
    (torch, pyroute2, ...) come from this interpreter's environment through a .pth line,
    so building it downloads nothing. Cached per wheel (its directory names its digest)."""
    import sysconfig
    import zipfile

    out = root / wheel.parent.name
    if (out / "ready").exists():
        return out
    tmp = root / f"{wheel.parent.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True, capture_output=True
    )
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = tmp / "lib" / ver / "site-packages"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    # a plain path line: the directory is searched, its own .pth files (this checkout's
    # editable install) are not run
    (site / "geotrain-host-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    script = tmp / "bin" / "geotrain"
    script.write_text(f"#!{VENV_IN_HOST}/bin/python\nfrom geotrain.cli import main\n\nmain()\n")
    script.chmod(0o755)
    (tmp / "ready").write_text(wheel.name + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
