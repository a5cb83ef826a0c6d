"""Stage two of the host agent, in the runtime venv: bring the host to its bundle's state
(`apply`) or back to how it was (`remove`). Run by stage one (bootstrap), as root.

Every step compares before it changes, so a second apply of the same bundle changes
nothing and says so. Everything the agent changes is recorded in its state file with what
was there before (backups of files it replaced, service states, sysctl values), and
`remove` undoes exactly that. A step that fails undoes what this apply did, so the host is
left as it was before the apply.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geotrain.agent import netlink
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
        try:
            return State(json.loads(STATE_FILE.read_text()))
        except FileNotFoundError:
            return State({})
        except ValueError:
            raise AgentError(
                os.uname().nodename,
                "state",
                f"{STATE_FILE} is corrupt; inspect it, then remove it to start over",
            ) from None

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.d, indent=1, sort_keys=True))
        os.replace(tmp, STATE_FILE)


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
        self.undo: list[Callable[[], object]] = []
        self.inputs: dict[str, str] = {}
        """Digest of every input a unit may restart on (bundle files, run-key, runtime)."""

    # -- files ------------------------------------------------------------------------
    def put(
        self, dest: Path, data: bytes, mode: int, owner: str = "root", group: str = "root"
    ) -> bool:
        """Install `data` at `dest` (atomic), backing up a pre-existing file once."""
        rec = self.state.d["files"].get(str(dest))
        old = dest.read_bytes() if dest.exists() else None
        orig = _stat_of(dest) if old is not None else None
        same = old == data and _mode_owner(dest) == (mode, owner, group)
        if same:
            if rec is None:  # identical file found: still ours to track (not to delete)
                self.state.d["files"][str(dest)] = {
                    "backup": self._backup(dest),
                    "owner": _stat_of(dest),
                }
            return False
        if rec is None:
            self.state.d["files"][str(dest)] = {
                "backup": self._backup(dest) if old is not None else None,
                "owner": _stat_of(dest) if old is not None else None,
            }
        made = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]
        if made:
            dest.parent.mkdir(parents=True)
            self.state.d["made_dirs"] = sorted(
                {*self.state.d.get("made_dirs", []), *map(str, made)}
            )
        tmp = dest.with_name(dest.name + ".geotrain-tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        shutil.chown(tmp, owner, group)
        os.chmod(tmp, mode)
        os.replace(tmp, dest)

        def restore() -> None:
            if old is None or orig is None:
                dest.unlink(missing_ok=True)
            else:
                dest.write_bytes(old)
                os.chown(dest, orig[0], orig[1])
                os.chmod(dest, orig[2])

        self.undo.append(restore)
        self.changed.append(str(dest))
        return True

    def _backup(self, dest: Path) -> str | None:
        if not dest.exists():
            return None
        b = BACKUP_DIR / dest.as_posix().lstrip("/")
        if not b.exists():
            b.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(dest, b)
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
        made = {x["path"] for x in self.state.d["dirs"]}
        for d in self.spec.dirs:
            p = Path(d.path)
            if not p.exists():
                p.mkdir(parents=True)
                self.state.d["dirs"].append({"path": d.path, "keep": d.keep_on_remove})
                self.undo.append(functools.partial(shutil.rmtree, p, ignore_errors=True))
                self.changed.append(d.path)
                made.add(d.path)
            now = _mode_owner(p)
            if now == (int(d.mode, 8), d.owner, d.group):
                continue
            if not d.adopt and d.path not in made and p.is_dir() and any(p.iterdir()):
                have = f"{now[1]}:{now[2]} mode {now[0]:04o}" if now else "unreadable"
                raise AgentError(
                    self.node,
                    "dirs",
                    f"{p} already exists with files in it ({have}); the agent re-owns "
                    "only directories it made, so their users keep them. Point "
                    "training.checkpoint.dir at a new or empty directory, or give this one "
                    f"over yourself: chown {d.owner}:{d.group} {p} && chmod {d.mode} {p}",
                )
            shutil.chown(p, d.owner, d.group)
            os.chmod(p, int(d.mode, 8))

    def files(self) -> None:
        for f in self.spec.files:
            data = self.src(f.src)
            self.inputs[f.src] = sha(data)
            self.put(Path(f.dest), data, int(f.mode, 8), f.owner, f.group)
        self._forget_files({f.dest for f in self.spec.files})

    def run_key(self) -> None:
        path = self.spec.run_key_path
        if path is None:
            return
        key = self.secrets.run_key
        if key is None:
            if Path(path).exists():  # kept from the last apply: the key is stable per run
                self.inputs["run-key"] = sha(Path(path).read_bytes())
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
        self.put(Path(path), data, 0o400, user, _group_of(user))

    def secret_files(self) -> None:
        for f in self.spec.secret_files:
            content = self.secrets.files.get(f.path)
            if content is None:
                if Path(f.path).exists():  # kept from the last apply
                    self.inputs[f.path] = sha(Path(f.path).read_bytes())
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
            if missing:
                if conf.exists():  # keys are stable: keep the last filled config
                    text = conf.read_text()
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
        if FRR_DAEMONS.exists():
            old = FRR_DAEMONS.read_text()
            new = _set_keys(old, spec.daemons)
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
        restore_file(dest, rec)


def restore_file(dest: Path, rec: dict[str, Any]) -> None:
    """Put back what was at `dest` before the agent (content, mode, owner), or remove it."""
    backup = rec.get("backup")
    if backup and Path(backup).exists():
        shutil.copy2(backup, dest)
        uid, gid, mode = rec.get("owner") or (0, 0, 0o644)
        os.chown(dest, uid, gid)
        os.chmod(dest, mode)
        Path(backup).unlink()
    else:
        dest.unlink(missing_ok=True)


def _stat_of(p: Path) -> tuple[int, int, int]:
    st = p.stat()
    return (st.st_uid, st.st_gid, st.st_mode & 0o7777)


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
    state.d.update(node=spec.node, stack=spec.stack)
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
            step()
    except BaseException:
        for undo in reversed(a.undo):
            with contextlib.suppress(Exception):
                undo()
        with contextlib.suppress(Exception):
            subprocess.run(["systemctl", "daemon-reload"], capture_output=True)
        raise
    state.d["bundle"] = bundle.name
    state.save()
    return {"node": spec.node, "changed": a.changed}


def remove(purge: bool) -> dict[str, Any]:
    """Undo every recorded change, newest first."""
    state = State.load()
    node = state.d.get("node") or os.uname().nodename
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
        restore_file(Path(dest), rec)
    for made in sorted(state.d.get("made_dirs", []), key=len, reverse=True):
        with contextlib.suppress(OSError):
            Path(made).rmdir()  # directories made for files, once empty
    frr = state.d.get("frr")
    if frr is not None:
        if frr["active"]:
            systemctl(node, "restart", "frr.service", check=False)
        else:
            systemctl(node, "disable", "--now", "frr.service", check=False)
        if frr["enabled"]:
            systemctl(node, "enable", "frr.service", check=False)
    systemctl(node, "daemon-reload", check=False)
    for d in (USERSPACE_DROPIN.parent,):
        with contextlib.suppress(OSError):
            d.rmdir()
    kept = [
        Path(d["path"])
        for d in state.d["dirs"]
        if d["keep"] and not purge and Path(d["path"]).exists() and any(Path(d["path"]).iterdir())
    ]
    for d in reversed(state.d["dirs"]):
        _remove_tree_except(Path(d["path"]), kept)
    user = state.d.get("user_created")
    if user:
        run(node, "users", ["userdel", user], check=False)
    shutil.rmtree(BACKUP_DIR, ignore_errors=True)
    STATE_FILE.unlink(missing_ok=True)
    return {"node": node, "removed": True, "kept": [str(k) for k in kept]}


def _remove_tree_except(path: Path, kept: list[Path]) -> None:
    """rm -r `path`, but keep every directory in `kept` (and the parents it needs)."""
    if path in kept or not path.exists():
        return
    inner = [k for k in kept if path in k.parents]
    if not inner:
        shutil.rmtree(path, ignore_errors=True)
        return
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            _remove_tree_except(child, kept)
        else:
            child.unlink(missing_ok=True)


def _runtime_digest() -> str:
    from geotrain.version import source_digest

    return source_digest()


def _bootstrap_installed() -> list[str]:
    try:
        return list(
            json.loads((STATE_DIR / "bootstrap.json").read_text()).get("installed_packages", [])
        )
    except (OSError, ValueError):
        return []


def _mode_owner(p: Path) -> tuple[int, str, str] | None:
    try:
        st = p.stat()
    except FileNotFoundError:
        return None
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return (st.st_mode & 0o7777, user, group)


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
    args = ap.parse_args(argv)
    try:
        if args.cmd == "apply":
            data = sys.stdin.buffer.read() if args.secrets_stdin else None
            out = apply(Path(args.bundle), data)
        else:
            out = remove(args.purge)
    except AgentError as e:
        print(f"geotrain-node: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
