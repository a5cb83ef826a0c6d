"""Stage two of the host agent, in the runtime venv: bring the host to its bundle's state
(`apply`) or back to how it was (`remove`). Run by stage one (bootstrap), as root.

Every step compares before it changes, so a second apply of the same bundle changes
nothing and says so. Everything the agent changes is recorded in its state file with what
was there before (backups of files it replaced, service states, sysctl values), and
`remove` undoes exactly that. A step that fails undoes what this apply did, so the host is
left as it was before the apply.

Root-safe: the record lives in root's STATE_DIR (0700) and is checked field by field on
load; every file and directory is opened, chowned and replaced through `safefs`, which
follows no link another account could have planted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import grp
import hashlib
import ipaddress
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geotrain.agent import bootstrap, netlink, safefs
from geotrain.agent.bootstrap import STATE_DIR, AgentError
from geotrain.agent.hostspec import HOSTSPEC_FILE, HostSpec, UnitSpec

UNIT_DIR = Path("/etc/systemd/system")
WG_DIR = Path("/etc/wireguard")
FRR_CONF = Path("/etc/frr/frr.conf")
FRR_DAEMONS = Path("/etc/frr/daemons")
SYSCTL_FILE = Path("/etc/sysctl.d/90-geotrain.conf")
USERSPACE_DROPIN = UNIT_DIR / "wg-quick@.service.d" / "geotrain-userspace.conf"
BACKUP_DIR = STATE_DIR / "backup"
STATE_FILE = STATE_DIR / "state.json"
PLACEHOLDER = re.compile(r"<public key of ([a-z0-9-]+)>")
ADDRESS = re.compile(r"<address of ([a-z0-9-]+)>")
WG_KEY = re.compile(r"^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=$")
UNIT_NAME = re.compile(r"[A-Za-z0-9@_.:-]+\.(service|socket|timer|target|path|mount)")
IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")
SYSCTL_KEY = re.compile(r"[a-z0-9_]+(\.[A-Za-z0-9_-]+)+")
USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


@dataclass
class Secrets:
    """What `apply --secrets-stdin` reads: {"run_key": HEX, "wireguard": {NODE: PUBKEY},
    "files": {PATH: CONTENT}}."""

    run_key: str | None = None
    """The run key as hex."""
    wireguard: dict[str, str] = field(default_factory=dict)
    """Peer gateway node -> its WireGuard public key."""
    files: dict[str, str] = field(default_factory=dict)
    """Secret file path -> content (alerting credentials, Grafana's admin password)."""
    addresses: dict[str, str] = field(default_factory=dict)
    """Node -> its address, for `<address of NODE>` in bundle files (hosts whose address
    is known only at deploy time)."""

    @staticmethod
    def parse(data: bytes | None, node: str) -> Secrets:
        if not data:
            return Secrets()
        try:
            raw = json.loads(data)
            return Secrets(
                raw.get("run_key"),
                dict(raw.get("wireguard") or {}),
                dict(raw.get("files") or {}),
                dict(raw.get("addresses") or {}),
            )
        except (ValueError, AttributeError, TypeError):
            raise AgentError(node, "secrets", "stdin is not the secrets JSON object") from None


class State:
    """What the agent did to this host, with what was there before."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.d = data
        for key, empty in (
            ("files", {}),
            ("dirs", []),
            ("units", {}),
            ("inputs", {}),
            ("addresses", []),
            ("routes", []),
            ("sysctl", {}),
            ("tunnels", []),
        ):
            self.d.setdefault(key, empty)

    @staticmethod
    def load() -> State:
        """The record, once its directory and file are root's alone and every entry is one
        the agent writes (see `check`)."""
        host = os.uname().nodename
        with _as_agent_error(host, "state"):
            _private_dir(STATE_FILE.parent, create=False)
            got = safefs.read(STATE_FILE)
        if got is None:
            return State({})
        data, st = got
        if not safefs.trusted(st):
            raise AgentError(
                host,
                "state",
                f"{STATE_FILE} is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}: not "
                "root's alone, so it cannot say what to remove; inspect it, then remove it",
            )
        try:
            raw = json.loads(data)
        except ValueError:
            raw = None
        if not isinstance(raw, dict):
            raise AgentError(
                host, "state", f"{STATE_FILE} is corrupt; inspect it, then remove it to start over"
            )
        state = State(raw)
        problem = state.check()
        if problem:
            raise AgentError(
                host,
                "state",
                f"{STATE_FILE}: {problem}, which the agent never records; it was not written "
                "by the agent: inspect it, then remove it to start over",
            )
        return state

    def check(self) -> str | None:
        """Why the record cannot be the agent's, or None: every path it would restore or
        delete is absolute and normal, every backup is where the agent puts backups, no
        restored mode is set-id, names match what systemd, the kernel and Debian allow."""
        d = self.d
        try:
            for dest, rec in d["files"].items():
                if not _normal(dest):
                    return f"file {dest!r}"
                backup = rec.get("backup")
                if backup is not None and backup != str(BACKUP_DIR / dest.lstrip("/")):
                    return f"backup {backup!r} of {dest}"
                owner = rec.get("owner")
                if owner is not None and not _owner_ok(owner):
                    return f"owner and mode {owner!r} of {dest}"
            for x in [*d["dirs"], *({"path": m} for m in d.get("made_dirs", []))]:
                if not _normal(x["path"]) or len(Path(x["path"]).parts) < 3:
                    return f"directory {x['path']!r}"
            for name in d["units"]:
                if not UNIT_NAME.fullmatch(name):
                    return f"unit {name!r}"
            for key, value in d["sysctl"].items():
                if not SYSCTL_KEY.fullmatch(key) or "\n" in str(value):
                    return f"sysctl {key!r}"
            for a in d["addresses"]:
                ipaddress.ip_interface(a["address"])
                if not IFNAME.fullmatch(a["ifname"]):
                    return f"interface {a['ifname']!r}"
            for r in d["routes"]:
                ipaddress.ip_network(r["dst"], strict=False)
                ipaddress.ip_address(r["via"])
            for ifname in d["tunnels"]:
                if not IFNAME.fullmatch(ifname):
                    return f"tunnel {ifname!r}"
            user = d.get("user_created")
            if user is not None and (not USER.fullmatch(user) or user == "root"):
                return f"user {user!r}"
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            return f"an entry of the wrong shape ({type(e).__name__}: {e})"
        return None

    def save(self) -> None:
        _private_dir(STATE_FILE.parent, create=True)
        data = json.dumps(self.d, indent=1, sort_keys=True).encode()
        safefs.write(STATE_FILE, data, 0o600)


def _private_dir(path: Path, create: bool) -> None:
    """The record's directory: root's, mode 0700 (bootstrap.state_dir checks and makes
    STATE_DIR the same way)."""
    if path == STATE_DIR:
        bootstrap.state_dir(create)
        return
    st = safefs.lstat(path, strict=True)
    if st is None and create:
        fd = safefs.open_dir(path, create=True)
        os.fchmod(fd, 0o700)
        os.close(fd)
    elif st is not None and (
        not stat.S_ISDIR(st.st_mode) or not safefs.trusted(st) or st.st_mode & 0o077
    ):
        raise safefs.UnsafePath(
            f"{path} (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) must be a "
            "directory of root's with mode 0700, since it drives what `remove` deletes"
        )


def _normal(path: object) -> bool:
    return isinstance(path, str) and path.startswith("/") and os.path.normpath(path) == path


def _owner_ok(owner: object) -> bool:
    if not isinstance(owner, list) or len(owner) != 3:
        return False
    uid, gid, mode = owner
    ints = all(isinstance(x, int) and x >= 0 for x in owner)
    return ints and uid < 2**32 and gid < 2**32 and mode <= 0o1777  # no setuid/setgid


@contextlib.contextmanager
def _as_agent_error(node: str, step: str) -> Any:
    """A refused path as the agent's one line, with what to do."""
    try:
        yield
    except safefs.UnsafePath as e:
        raise AgentError(
            node,
            step,
            f"{e}; the agent runs as root and follows no link another account could have "
            "planted: remove it (or give the directory back to root) and run again",
        ) from None


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run(node: str, step: str, argv: list[str], check: bool = True) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        raise AgentError(
            node, step, f"`{' '.join(argv)}` failed: {lines[-1] if lines else r.returncode}"
        )
    return r.stdout


def sudo_rights(user: str) -> str | None:
    """What sudo lets `user` run (the first line of it), or None: no sudo on the host, or
    nothing allowed. Asked of sudo itself (`sudo -l -U`, as root): group memberships,
    sudoers.d files and any other source it reads count the same."""
    if shutil.which("sudo") is None:
        return None
    r = subprocess.run(["sudo", "-n", "-l", "-U", user], capture_output=True, text=True)
    lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode != 0 or not any("may run the following commands" in ln for ln in lines):
        return None
    i = next(k for k, ln in enumerate(lines) if "may run the following commands" in ln)
    return lines[i + 1] if i + 1 < len(lines) else "(some commands)"


def systemctl(node: str, *args: str, check: bool = True) -> str:
    """systemctl; a unit that fails to start is reported with its journal's last line."""
    r = subprocess.run(["systemctl", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        unit = args[-1]
        log = subprocess.run(
            ["journalctl", "-u", unit, "-n", "20", "--no-pager", "-o", "cat"],
            capture_output=True,
            text=True,
        ).stdout
        noise = ("[#]", "│", "┌", "└", "Failed to start", "Starting ", "Stopped ")
        lines = [
            ln.strip()
            for ln in log.splitlines()
            if ln.strip() and unit not in ln and not ln.strip().startswith(noise)
        ]
        why = " / ".join(lines[-2:]) if lines else (r.stderr.strip().splitlines() or ["?"])[-1]
        raise AgentError(node, "systemd", f"`systemctl {' '.join(args)}` failed: {why}")
    return r.stdout


def unit_state(name: str) -> tuple[bool, bool]:
    """(enabled, active) of a unit."""
    enabled = subprocess.run(["systemctl", "is-enabled", "--quiet", name]).returncode == 0
    active = subprocess.run(["systemctl", "is-active", "--quiet", name]).returncode == 0
    return enabled, active


class Apply:
    """One apply: steps, the record of what changed, and the undo stack for a failure."""

    def __init__(self, bundle: Path, spec: HostSpec, secrets: Secrets, state: State) -> None:
        self.bundle, self.spec, self.secrets, self.state = bundle, spec, secrets, state
        self.node = spec.node
        self.changed: list[str] = []
        self.addresses_wanted: list[dict[str, str]] = []
        """Every private address the spec wants, the agent's or not (`status` checks)."""
        self.installed: dict[str, str] = {}
        """dest -> sha256 of what this apply put there (what `status` compares against)."""
        self.undo: list[Callable[[], object]] = []
        self.inputs: dict[str, str] = {}
        """Digest of every input a unit may restart on (bundle files, run-key, runtime)."""

    # -- files ------------------------------------------------------------------------
    def put(
        self, dest: Path, data: bytes, mode: int, owner: str = "root", group: str = "root"
    ) -> bool:
        """Install `data` at `dest` (atomic), backing up a pre-existing file once. Through
        `safefs`: the directory must be root's, or `owner`'s when that is a daemon's (frr's
        /etc/frr), never the worker user's; it may lie below a daemon's directory (grafana's
        /var/lib/grafana), where no link is followed; the old file is read, and the new one
        written and chowned, through fds that follow no link."""
        uid, gid = _uid(owner), _gid(group)
        dir_owner = None if owner in ("root", self.spec.service_user) else uid
        self.installed[str(dest)] = sha(data)
        rec = self.state.d["files"].get(str(dest))
        made: list[str] = []
        with safefs.parent(dest, create=True, strict=False, made=made) as (fd, name):
            safefs.check_dir_for_write(fd, dest.parent, dir_owner)
            cur = safefs.read_at(fd, name, dest)
            old, orig = (cur[0], _owner_mode(cur[1])) if cur is not None else (None, None)
            if old == data and orig == (uid, gid, mode):
                if rec is None:  # identical file found: still ours to track (not to delete)
                    self.state.d["files"][str(dest)] = {
                        "backup": self._backup(fd, name, dest),
                        "owner": list(orig),
                    }
                return False
            if rec is None:
                self.state.d["files"][str(dest)] = {
                    "backup": self._backup(fd, name, dest) if old is not None else None,
                    "owner": list(orig) if orig is not None else None,
                }
            safefs.write_at(fd, name, data, mode, uid, gid)
        if made:
            self.state.d["made_dirs"] = sorted({*self.state.d.get("made_dirs", []), *made})

        def restore() -> None:
            if old is None or orig is None:
                safefs.unlink(dest)
            else:
                safefs.write(dest, old, orig[2], orig[0], orig[1], dir_owner=dir_owner)

        self.undo.append(restore)
        self.changed.append(str(dest))
        return True

    def _backup(self, fd: int, name: str, dest: Path) -> str | None:
        """Copy of the file found at `dest` (its directory's fd and name), kept once."""
        b = BACKUP_DIR / dest.as_posix().lstrip("/")
        _private_dir(STATE_FILE.parent, create=True)
        if safefs.lstat(b, strict=True) is None and safefs.copy_into(fd, name, dest, b) is None:
            return None
        return str(b)

    def src(self, rel: str) -> bytes:
        """A bundle file with `<address of NODE>` filled in (from stdin, else as the last
        apply installed it: addresses of existing hosts do not change)."""
        data = (self.bundle / rel).read_bytes()
        if b"<address of " not in data:
            return data
        text = data.decode()
        missing = sorted(set(ADDRESS.findall(text)) - set(self.secrets.addresses))
        if missing:
            raise AgentError(
                self.node,
                "files",
                f"{rel} needs the address of {', '.join(missing)}; pass "
                '{"addresses": {NODE: IP}} with --secrets-stdin',
            )
        return ADDRESS.sub(lambda m: self.secrets.addresses[m.group(1)], text).encode()

    # -- steps ------------------------------------------------------------------------
    def users_and_dirs(self) -> None:
        user = self.spec.service_user
        try:
            pwd.getpwnam(user)
        except KeyError:
            run(
                self.node,
                "users",
                ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", user],
            )
            self.state.d["user_created"] = user
            self.changed.append(f"user {user}")
        # the workers run as this user: they would have its sudo (root needs none: the
        # rendered spec never names it, the agent's own tests do)
        rights = sudo_rights(user) if pwd.getpwnam(user).pw_uid != 0 else None
        if rights is not None:
            raise AgentError(
                self.node,
                "users",
                f"the workers' user {user} may use sudo ({rights}); the workers run as it. "
                f"Log in as another user (pool.ssh.user) and take {user}'s sudo away "
                f"(deluser {user} sudo; its file in /etc/sudoers.d)",
            )
        made = {x["path"] for x in self.state.d["dirs"]}
        for d in self.spec.dirs:
            # the worker's own directories (its checkpoint root) may lie below one it owns:
            # walked without following any link there, re-owned through the fd only
            created: list[str] = []
            fd = safefs.open_dir(d.path, create=True, strict=False, made=created)
            try:
                if d.path in created:
                    self.state.d["dirs"].append({"path": d.path, "keep": d.keep_on_remove})
                    self.undo.append(functools.partial(safefs.remove_tree, d.path))
                    self.changed.append(d.path)
                    made.add(d.path)
                st = os.fstat(fd)
                want = (_uid(d.owner), _gid(d.group), int(d.mode, 8))
                if _owner_mode(st) == want:
                    continue
                if not d.adopt and d.path not in made and os.listdir(fd):
                    have = f"{st.st_uid}:{st.st_gid} mode {stat.S_IMODE(st.st_mode):04o}"
                    raise AgentError(
                        self.node,
                        "dirs",
                        f"{d.path} already exists with files in it ({have}); the agent "
                        "re-owns only directories it made, so their users keep them. Point "
                        "training.checkpoint.dir at a new or empty directory, or give this "
                        f"one over yourself: chown {d.owner}:{d.group} {d.path} && "
                        f"chmod {d.mode} {d.path}",
                    )
                os.fchown(fd, want[0], want[1])
                os.fchmod(fd, want[2])
            finally:
                os.close(fd)

    def files(self) -> None:
        for f in self.spec.files:
            data = self.src(f.src)
            self.inputs[f.src] = sha(data)
            self.put(Path(f.dest), data, int(f.mode, 8), f.owner, f.group)
        self._forget_files({f.dest for f in self.spec.files})

    def run_key(self) -> None:
        if self.spec.run_key_path is None:
            return
        path = Path(self.spec.run_key_path)
        try:
            self._run_key(path)
        except safefs.UnsafePath as e:
            raise AgentError(
                self.node,
                "run-key",
                f"{e}; the run key must live in a directory only root can change: set "
                "geotrain:training.key_file to /etc/geotrain/run.key (a relative key_file "
                "is kept there on hosts)",
            ) from None

    def _run_key(self, path: Path) -> None:
        probe = path.parent  # every directory above the key root's alone (the nearest that
        while True:  # exists: put() makes and records the rest)
            try:
                os.close(safefs.open_dir(probe, strict=True))
                break
            except FileNotFoundError:
                probe = probe.parent
        key = self.secrets.run_key
        if key is None:
            got = safefs.read(path)
            if got is not None:  # kept from the last apply: the key is stable per run
                self.inputs["run-key"] = sha(got[0])
                return
            raise AgentError(
                self.node,
                "run-key",
                "no run key on stdin and none on the host; "
                'pass {"run_key": HEX} with --secrets-stdin',
            )
        if not re.fullmatch(r"[0-9a-f]{64}", key):
            raise AgentError(self.node, "run-key", "the run key must be 64 hex digits")
        data = (key + "\n").encode()
        self.inputs["run-key"] = sha(data)
        user = self.spec.service_user
        self.put(path, data, 0o400, user, _group_of(user))

    def secret_files(self) -> None:
        for f in self.spec.secret_files:
            content = self.secrets.files.get(f.path)
            if content is None:
                got = safefs.read(f.path)
                if got is not None:  # kept from the last apply
                    self.inputs[f.path] = sha(got[0])
                    continue
                raise AgentError(
                    self.node,
                    "secrets",
                    f"no content for {f.path} on stdin; set it with `pulumi config set "
                    f"--secret {f.config_key or 'KEY'}` and run the deployment again",
                )
            data = content.encode()
            self.inputs[f.path] = sha(data)
            self.put(Path(f.path), data, 0o640, f.owner, f.group)

    def sysctl(self) -> None:
        if self.spec.sysctl_src is None:
            return
        data = self.src(self.spec.sysctl_src)
        prev = self.state.d["sysctl"]
        for key, value in _sysctl_pairs(data.decode()):
            proc = Path("/proc/sys") / key.replace(".", "/")
            now = proc.read_text().strip()
            prev.setdefault(key, now)
            if now != value:
                proc.write_text(value)
                self.undo.append(functools.partial(proc.write_text, now))
                self.changed.append(f"sysctl {key}={value}")
        self.put(SYSCTL_FILE, data, 0o644)

    def addresses_and_routes(self) -> None:
        want_addrs = []
        for a in self.spec.addresses:
            ifname = a.interface or netlink.interface_near(a.near)
            if ifname is None:
                raise AgentError(
                    self.node,
                    "addresses",
                    f"no interface holds {a.near} and there is no default route; set "
                    "geotrain:regions[].pool.nodes[].interface for this node",
                )
            want_addrs.append({"ifname": ifname, "address": a.address})
        want_routes = [{"dst": r.dst, "via": r.via} for r in self.spec.routes]
        for old in [x for x in self.state.d["routes"] if x not in want_routes]:
            netlink.del_route(old["dst"], old["via"])
            self.changed.append(f"route {old['dst']} removed")
        for old in [x for x in self.state.d["addresses"] if x not in want_addrs]:
            netlink.del_address(old["ifname"], old["address"])
            self.changed.append(f"address {old['address']} removed")
        # the state records an address or route as the agent's only when the agent created
        # it (now, or in an earlier apply): one that was there before (a cloud instance's own
        # primary address, an operator's route) is used, never recorded, never removed
        ours_addrs = [x for x in self.state.d["addresses"] if x in want_addrs]
        ours_routes = [x for x in self.state.d["routes"] if x in want_routes]
        for x in want_addrs:
            if netlink.add_address(x["ifname"], x["address"]):
                self.undo.append(functools.partial(netlink.del_address, x["ifname"], x["address"]))
                self.changed.append(f"address {x['address']} on {x['ifname']}")
                ours_addrs.append(x)
        for x in want_routes:
            if netlink.add_route(x["dst"], x["via"]):
                self.undo.append(functools.partial(netlink.del_route, x["dst"], x["via"]))
                self.changed.append(f"route {x['dst']} via {x['via']}")
                ours_routes.append(x)
        self.state.d["addresses"], self.state.d["routes"] = ours_addrs, ours_routes
        self.addresses_wanted = want_addrs

    def wireguard(self) -> None:
        tunnels = self.spec.tunnels
        if tunnels and not netlink.kernel_wireguard():
            dropin = (
                "# geotrain: this kernel has no WireGuard module; wg-quick runs wireguard-go\n"
                "[Service]\n"
                "Environment=WG_QUICK_USERSPACE_IMPLEMENTATION=wireguard-go\n"
                "Environment=WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD=1\n"
            )
            if self.put(USERSPACE_DROPIN, dropin.encode(), 0o644):
                systemctl(self.node, "daemon-reload")
        for t in tunnels:
            text = self.src(t.src).decode()
            need = set(PLACEHOLDER.findall(text))
            bad = [
                n
                for n in need
                if n in self.secrets.wireguard and not WG_KEY.fullmatch(self.secrets.wireguard[n])
            ]
            if bad:
                raise AgentError(
                    self.node,
                    "wireguard",
                    f"the public key given for {', '.join(sorted(bad))} is not a WireGuard key "
                    "(44 base64 characters); pass what `node prepare` printed there",
                )
            missing = need - set(self.secrets.wireguard)
            conf = WG_DIR / f"{t.ifname}.conf"
            kept = safefs.read(conf) if missing else None
            if missing:
                if kept is not None:  # keys are stable: keep the last filled config
                    text = kept[0].decode()
                else:
                    raise AgentError(
                        self.node,
                        "wireguard",
                        f"no public key for {', '.join(sorted(missing))}; pass the peers' "
                        "keys (`node prepare` prints them) with --secrets-stdin",
                    )
            else:
                text = PLACEHOLDER.sub(lambda m: self.secrets.wireguard[m.group(1)], text)
            changed = self.put(conf, text.encode(), 0o600)
            self.inputs[t.src] = sha(text.encode())
            self._unit(UnitSpec(name=f"wg-quick@{t.ifname}.service"), changed)
        gone = [i for i in self.state.d["tunnels"] if i not in {t.ifname for t in tunnels}]
        for ifname in gone:
            self._stop_unit(f"wg-quick@{ifname}.service")
            self._forget_file(WG_DIR / f"{ifname}.conf")
            self.changed.append(f"tunnel {ifname} removed")
        self.state.d["tunnels"] = [t.ifname for t in tunnels]

    def frr(self) -> None:
        spec = self.spec.frr
        if spec is None:
            return
        if "frr" not in self.state.d:
            enabled, active = unit_state("frr.service")
            fresh = "frr" in _bootstrap_installed()
            self.state.d["frr"] = {"enabled": enabled and not fresh, "active": active and not fresh}
        daemons_changed = False
        found = safefs.read(FRR_DAEMONS)
        if found is not None:
            new = _set_keys(found[0].decode(), spec.daemons)
            daemons_changed = self.put(FRR_DAEMONS, new.encode(), 0o640, "frr", "frr")
        conf = self.src(spec.src)
        conf_changed = self.put(FRR_CONF, conf, 0o640, "frr", "frr")
        self._unit(UnitSpec(name="frr.service"), daemons_changed or conf_changed)

    def units(self) -> None:
        wrote = any(c.startswith(str(UNIT_DIR)) for c in self.changed)  # drop-ins too
        for u in self.spec.units:
            if u.src is not None:
                data = self.src(u.src)
                self.inputs[u.src] = sha(data)
                wrote |= self.put(UNIT_DIR / u.name, data, 0o644)
        gone = [n for n in self.state.d["units"] if n not in {u.name for u in self.spec.units}]
        if wrote or gone:
            systemctl(self.node, "daemon-reload")
        for u in self.spec.units:
            inputs = "".join(self.inputs.get(i, "") for i in sorted(u.restart_on))
            digest = sha(inputs.encode())
            self._unit(u, changed=False, inputs=digest)
        for name in gone:
            if name.startswith(("wg-quick@", "frr.")):
                continue
            self._stop_unit(name)
            self.changed.append(f"unit {name} removed")

    # -- units ------------------------------------------------------------------------
    def _unit(self, u: UnitSpec, changed: bool, inputs: str | None = None) -> None:
        """Enable/start `u`; restart it when its inputs changed since the last apply."""
        rec = self.state.d["units"].get(u.name)
        if rec is None:
            enabled, active = unit_state(u.name)
            rec = {"enabled": enabled, "active": active, "inputs": None}
            self.state.d["units"][u.name] = rec
        enabled, active = unit_state(u.name)
        if u.enable and not enabled:
            systemctl(self.node, "enable", u.name)
            self.undo.append(lambda: systemctl(self.node, "disable", u.name, check=False))
            self.changed.append(f"enabled {u.name}")
        if not u.start:
            return
        if not active:  # a failed apply stops what it started
            self.undo.append(lambda: systemctl(self.node, "stop", u.name, check=False))
        stale = inputs is not None and inputs != rec["inputs"]
        if u.check and (stale or changed):
            r = subprocess.run(["/bin/sh", "-c", u.check], capture_output=True, text=True)
            if r.returncode != 0:
                out = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
                raise AgentError(
                    self.node,
                    "systemd",
                    f"`{u.check}` rejects the new config of {u.name}: "
                    f"{out[-1] if out else r.returncode}; nothing was restarted",
                )
        if u.run_once:
            if stale or changed:
                systemctl(self.node, "restart", u.name)
                self.changed.append(f"started {u.name}")
        elif changed or stale:
            if not active:
                systemctl(self.node, "start", u.name)
                self.changed.append(f"started {u.name}")
            else:
                verb = "reload-or-restart" if u.name == "frr.service" else "restart"
                systemctl(self.node, verb, u.name)
                self.changed.append(f"{'reloaded' if verb != 'restart' else 'restarted'} {u.name}")
        elif not active:
            systemctl(self.node, "start", u.name)
            self.changed.append(f"started {u.name}")
        rec["inputs"] = inputs

    def _stop_unit(self, name: str) -> None:
        rec = self.state.d["units"].pop(name, None) or {}
        systemctl(self.node, "disable", "--now", name, check=False)
        if rec.get("enabled"):
            systemctl(self.node, "enable", name, check=False)
        if rec.get("active"):
            systemctl(self.node, "start", name, check=False)
        self._forget_file(UNIT_DIR / name)

    def _forget_files(self, keep: set[str]) -> None:
        managed = {f"{UNIT_DIR}/{u.name}" for u in self.spec.units if u.src}
        managed |= {str(WG_DIR / f"{t.ifname}.conf") for t in self.spec.tunnels}
        managed |= {str(FRR_CONF), str(FRR_DAEMONS), str(SYSCTL_FILE), str(USERSPACE_DROPIN)}
        if self.spec.run_key_path:
            managed.add(self.spec.run_key_path)
        managed |= {f.path for f in self.spec.secret_files}
        for dest in [d for d in self.state.d["files"] if d not in keep | managed]:
            self._forget_file(Path(dest))
            self.changed.append(f"{dest} removed")

    def _forget_file(self, dest: Path) -> None:
        rec = self.state.d["files"].pop(str(dest), None)
        if rec is None:
            return
        restore_file(dest, rec, self.state.d.get("service_user"))


def restore_file(dest: Path, rec: dict[str, Any], service_user: str | None = None) -> None:
    """Put back what was at `dest` before the agent (content, mode, owner), or remove it."""
    backup = rec.get("backup")
    got = safefs.read(backup) if backup else None
    if backup and got is not None:
        uid, gid, mode = rec.get("owner") or (0, 0, 0o644)
        service_uid = _uid(service_user) if service_user else None
        dir_owner = None if uid in (0, service_uid) else uid
        safefs.write(dest, got[0], mode, uid, gid, dir_owner=dir_owner)
        safefs.unlink(backup)
    else:
        safefs.unlink(dest)


def _owner_mode(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))


def apply(bundle: Path, secrets_data: bytes | None) -> dict[str, Any]:
    spec = HostSpec.from_json((bundle / HOSTSPEC_FILE).read_text())
    state = State.load()
    owner = state.d.get("node")
    if owner not in (None, spec.node) or state.d.get("stack") not in (None, spec.stack):
        raise AgentError(
            spec.node,
            "state",
            f"this host already serves node {owner} of stack {state.d.get('stack')}; "
            "run `geotrain-node remove` there first",
        )
    state.d.update(node=spec.node, stack=spec.stack, service_user=spec.service_user)
    a = Apply(bundle, spec, Secrets.parse(secrets_data, spec.node), state)
    a.inputs["runtime"] = _runtime_digest()
    steps = (
        a.users_and_dirs,
        a.files,
        a.secret_files,
        a.run_key,
        a.sysctl,
        a.addresses_and_routes,
        a.wireguard,
        a.frr,
        a.units,
    )
    try:
        for step in steps:
            with _as_agent_error(spec.node, step.__name__.replace("_", "-")):
                step()
    except BaseException:
        for undo in reversed(a.undo):
            with contextlib.suppress(Exception):
                undo()
        with contextlib.suppress(Exception):
            subprocess.run(["systemctl", "daemon-reload"], capture_output=True)
        raise
    state.d["bundle"] = bundle.name
    state.d["expect"] = {  # what `status` finds drifted; never drives a change
        "files": a.installed,
        "units": sorted(u.name for u in spec.units if u.start),
        "tunnels": [t.ifname for t in spec.tunnels],
        "addresses": [{"ifname": x["ifname"], "address": x["address"]} for x in a.addresses_wanted],
    }
    state.save()
    return {"node": spec.node, "changed": a.changed}


DRIFT_EXIT = 3
"""`geotrain-node status`'s exit code when the host differs from its last apply (2 stays
an error's)."""


def status(textfile: Path | None = None) -> dict[str, Any]:
    """What differs on this host from what the last apply left: a managed file changed or
    gone, a service not running, a tunnel or the private address gone (a hand edit, a
    stopped unit, a host reimaged at the same address). Changes nothing; the next
    `pulumi up` does not see it (pulumi-command resources do not refresh), so this is
    what `geotrain node status` and the scheduled check (geotrain-status.timer) run.
    `textfile`: also write geotrain_node_drift for node-exporter's textfile collector."""
    state = State.load()
    node = state.d.get("node") or os.uname().nodename
    expect = state.d.get("expect")
    drift: list[str] = []
    if not isinstance(expect, dict):
        drift.append("no apply recorded on this host: run `pulumi up`")
        expect = {}
    for dest, want in sorted(dict(expect.get("files", {})).items()):
        try:
            got = safefs.read(Path(dest), strict=False)
        except (OSError, safefs.UnsafePath) as e:
            drift.append(f"file {dest}: unreadable ({e})")
            continue
        if got is None:
            drift.append(f"file {dest}: missing")
        elif sha(got[0]) != want:
            drift.append(f"file {dest}: changed")
    for unit in expect.get("units", []):
        if not unit_state(str(unit))[1]:
            drift.append(f"unit {unit}: not active")
    for ifname in expect.get("tunnels", []):
        if not netlink.has_link(str(ifname)):
            drift.append(f"tunnel {ifname}: missing")
    for x in expect.get("addresses", []):
        if not netlink.has_address(str(x["ifname"]), str(x["address"])):
            drift.append(f"address {x['address']} on {x['ifname']}: missing")
    out = {"node": node, "ok": not drift, "drift": drift}
    if textfile is not None:
        _write_textfile(textfile, node, len(drift))
    return out


def _write_textfile(path: Path, node: str, drifted: int) -> None:
    """geotrain_node_drift{node} for node-exporter's textfile collector (atomic: the
    collector never reads half a file)."""
    text = (
        "# HELP geotrain_node_drift Differences from the last apply (geotrain-node status).\n"
        "# TYPE geotrain_node_drift gauge\n"
        f'geotrain_node_drift{{node="{node}"}} {drifted}\n'
    )
    safefs.write(path, text.encode(), 0o644)


def remove(purge: bool) -> dict[str, Any]:
    """Undo every recorded change, newest first."""
    state = State.load()
    node = state.d.get("node") or os.uname().nodename
    with _as_agent_error(node, "remove"):
        return _remove(state, node, purge)


def _remove(state: State, node: str, purge: bool) -> dict[str, Any]:
    units = state.d["units"]
    for name in [n for n in units if n.startswith("geotrain-")] + [
        n for n in units if not n.startswith("geotrain-")
    ]:
        rec = units[name]
        if name == "frr.service":
            continue
        systemctl(node, "disable", "--now", name, check=False)
        if rec.get("enabled"):
            systemctl(node, "enable", name, check=False)
        if rec.get("active"):
            systemctl(node, "start", name, check=False)
    for ifname in state.d["tunnels"]:
        systemctl(node, "disable", "--now", f"wg-quick@{ifname}.service", check=False)
    for r in state.d["routes"]:
        netlink.del_route(r["dst"], r["via"])
    for a in state.d["addresses"]:
        netlink.del_address(a["ifname"], a["address"])
    for key, value in state.d["sysctl"].items():
        with contextlib.suppress(OSError):
            (Path("/proc/sys") / key.replace(".", "/")).write_text(value)
    for dest, rec in state.d["files"].items():
        restore_file(Path(dest), rec, state.d.get("service_user"))
    for made in sorted(state.d.get("made_dirs", []), key=len, reverse=True):
        safefs.rmdir(made)  # directories made for files, once empty
    frr = state.d.get("frr")
    if frr is not None:
        if frr["active"]:
            systemctl(node, "restart", "frr.service", check=False)
        else:
            systemctl(node, "disable", "--now", "frr.service", check=False)
        if frr["enabled"]:
            systemctl(node, "enable", "frr.service", check=False)
    systemctl(node, "daemon-reload", check=False)
    safefs.rmdir(USERSPACE_DROPIN.parent)
    kept = [
        Path(d["path"])
        for d in state.d["dirs"]
        if d["keep"] and not purge and _holds_files(Path(d["path"]))
    ]
    for d in reversed(state.d["dirs"]):
        _remove_tree_except(Path(d["path"]), kept)
    user = state.d.get("user_created")
    if user and _system_account(user):
        run(node, "users", ["userdel", user], check=False)
    safefs.remove_tree(BACKUP_DIR)
    safefs.unlink(STATE_FILE)
    return {"node": node, "removed": True, "kept": [str(k) for k in kept]}


def _remove_tree_except(path: Path, kept: list[Path]) -> None:
    """rm -r `path`, but keep every directory in `kept` (and the parents it needs); no
    link below it is followed (the worker user owns most of what is removed here)."""
    safefs.remove_tree(path, kept)


def _holds_files(path: Path) -> bool:
    try:
        fd = safefs.open_dir(path, strict=False)
    except (OSError, safefs.UnsafePath):
        return False
    try:
        return bool(os.listdir(fd))
    finally:
        os.close(fd)


def _system_account(user: str) -> bool:
    """Only a system account (uid 1-999, what `useradd --system` makes) is ever deleted."""
    try:
        return 0 < pwd.getpwnam(user).pw_uid < 1000
    except KeyError:
        return False


def _runtime_digest() -> str:
    from geotrain.version import source_digest

    return source_digest()


def _bootstrap_installed() -> list[str]:
    return [str(p) for p in bootstrap._state()["installed_packages"]]  # type: ignore[attr-defined]


def _uid(user: str) -> int:
    return int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid


def _gid(group: str) -> int:
    return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid


def _group_of(user: str) -> str:
    return grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name


def _sysctl_pairs(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")) and "=" in line:
            k, v = line.split("=", 1)
            out.append((k.strip(), v.strip()))
    return out


def _set_keys(text: str, values: dict[str, str]) -> str:
    """Set `key=value` lines of a shell-style config, keeping everything else."""
    lines = text.splitlines()
    done = set()
    for i, line in enumerate(lines):
        key = line.split("=", 1)[0].strip()
        if key in values and "=" in line and not line.lstrip().startswith("#"):
            lines[i] = f"{key}={values[key]}"
            done.add(key)
    lines += [f"{k}={v}" for k, v in values.items() if k not in done]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m geotrain.agent.apply")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("apply")
    p.add_argument("--bundle", required=True)
    p.add_argument("--secrets-stdin", action="store_true")
    p = sub.add_parser("remove")
    p.add_argument("--purge", action="store_true")
    p = sub.add_parser("status")
    p.add_argument("--textfile", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "apply":
            data = sys.stdin.buffer.read() if args.secrets_stdin else None
            out = apply(Path(args.bundle), data)
        elif args.cmd == "status":
            out = status(args.textfile)
        else:
            out = remove(args.purge)
    except AgentError as e:
        print(f"geotrain-node: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(out))
    if out.get("ok") is False:
        sys.exit(DRIFT_EXIT)


if __name__ == "__main__":
    main()
