"""A fleet of SSH hosts on this machine for the deployment tests (root).

Each host is an `infra.hosts.Host` (own network namespace, private root, real systemd)
running a real OpenSSH sshd, with a login user `ops` that may sudo, like a fresh cloud
image. Around them, what a provider would give:
- per region a LAN (a bridge in the `inet` namespace) with the hosts' eth0 on it, their
  addresses from the stack (198.18.0.0/15, the benchmarking range: never this machine's);
- `inet` routes between the LANs and the operator's network (198.18.0.0/24);
- the operator: a namespace from which `pulumi up` (the replay) reaches the hosts;
- an outsider: a namespace on the first region's LAN that is not in any region subnet,
  for firewall tests.
A runtime venv built from the bundles' wheel is bind-mounted read-only into every host as
/opt/geotrain/.venv (the agent checks that it matches the bundle).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra.hosts import Host, remove_cgroups, runtime_binds, runtime_venv, stop_netns_processes
from infra.lab import VENVS
from infra.render.bundle import runtime_wheel
from infra.replay import Executor
from training.errors import LabError

PREFIX = "gt-fl-"
OPERATOR = "198.18.0.1"
OUTSIDER = "198.18.1.99"
SNAPSHOT_DIRS = (
    "/etc",
    "/opt/geotrain",
    "/var/lib",
    "/usr/local/sbin",
    "/usr/local/bin",
    "/home",
    "/root/.geotrain",
    "/run/systemd/system",
)
"""Everywhere a deployment may write (not /root or /opt at large: this machine keeps its
interpreters and package caches there, gigabytes no deployment touches)."""
SNAPSHOT_IGNORE = (
    "/var/lib/systemd/",
    "/var/lib/apt/",
    "/var/lib/dpkg/",
    "/var/lib/prometheus/",
    "/var/lib/private/",
    "/root/.cache/",
    "/root/.history_frr",
    "/etc/.pwd.lock",
)
"""Churn of the host itself, not of the agent: journald/timers, apt lists, Prometheus'
own database, caches, and the vtysh history of the tests' own queries."""


def snapshot(host: Host) -> dict[str, str]:
    """path -> type, mode, owner and content digest of everything under the dirs a
    deployment may touch (what 'the host as it was' is compared by)."""
    code = (
        "import hashlib,json,os,stat\n"
        "out={}\n"
        f"ignore={SNAPSHOT_IGNORE!r}\n"
        f"for top in {SNAPSHOT_DIRS!r}:\n"
        "  for d,dirs,files in os.walk(top):\n"
        "    dirs[:]=[x for x in dirs if x!='__pycache__']\n"
        "    for n in [*dirs,*files]:\n"
        "      p=os.path.join(d,n)\n"
        "      if p.startswith(ignore) or p.endswith('-'): continue\n"
        "      st=os.lstat(p)\n"
        "      if stat.S_ISLNK(st.st_mode): v='l:'+os.readlink(p)\n"
        "      elif stat.S_ISDIR(st.st_mode): v='d'\n"
        "      elif st.st_size > 4<<20: v=f's:{st.st_size}:{st.st_mtime_ns}'\n"
        "      else: v='f:'+hashlib.sha256(open(p,'rb').read()).hexdigest()[:16]\n"
        "      out[p]=f'{v} {st.st_mode:o} {st.st_uid}:{st.st_gid}'\n"
        "print(json.dumps(out))\n"
    )
    snap: dict[str, str] = json.loads(host.exec(["python3", "-c", code]).stdout)
    return snap


def diff(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What differs between two snapshots, one line per path."""
    out = [f"+ {p}" for p in sorted(set(after) - set(before))]
    out += [f"- {p}" for p in sorted(set(before) - set(after))]
    out += [
        f"~ {p}: {before[p]} -> {after[p]}"
        for p in sorted(before)
        if p in after and before[p] != after[p]
    ]
    return out


HOST_KEY = Path("/etc/ssh/ssh_host_ed25519_key.pub")
"""The hosts' sshd key: their root is an overlay of this machine's, /etc/ssh included."""
FIRST_CONTACT = ("sv-0",)
"""Nodes the stack gives no host key: their key is scanned at first contact (from the
operator's namespace) and pinned from then on; every other node's is pinned from the
stack."""


def stack_doc(name: str, steps: int = 6) -> dict[str, Any]:
    """A 3-region ssh stack: beijing has a gateway and a worker host, the other regions one
    host each (2 CPU workers per region)."""
    host_key = HOST_KEY.read_text().strip()

    def region(i: int, name: str, jur: str, nodes: list[tuple[str, int]]) -> dict[str, Any]:
        pinned = {n: host_key for n, _ in nodes if n not in FIRST_CONTACT}
        return {
            "name": name,
            "jurisdiction": jur,
            "subnet": f"10.42.{i}.0/24",
            "asn": 64600 + i,
            "pool": {
                "kind": "ssh",
                "gateway": nodes[0][0],
                "ssh": {"user": "ops", "port": 22, "host_keys": pinned},
                "nodes": [
                    {"name": n, "address": f"198.18.{i}.{10 + k}", "gpu_type": "cpu", "gpus": g}
                    for k, (n, g) in enumerate(nodes)
                ],
            },
        }

    return {
        "config": {
            "geotrain:regions": [
                region(1, "beijing", "CN", [("bj-gw", 1), ("bj-w1", 1)]),
                region(2, "frankfurt", "EU", [("fra-0", 2)]),
                region(3, "silicon-valley", "US", [("sv-0", 2)]),
            ],
            "geotrain:network": {
                "admin_cidrs": ["198.18.0.0/24"],
                "links": [
                    {"a": "beijing", "b": "frankfurt", "cost": 10},
                    {"a": "frankfurt", "b": "silicon-valley", "cost": 10},
                    {"a": "beijing", "b": "silicon-valley", "cost": 20},
                ],
            },
            "geotrain:training": {
                "steps": steps,
                "batch_size": 2,
                "seq_len": 32,
                "compression": {"quantize": "int8", "cipher": "sm4-gcm"},
                "checkpoint": {
                    "dir": "/var/lib/geotrain/checkpoints",
                    "interval_steps": 2,
                    "keep": 2,
                    "keep_on_destroy": False,
                },
                "key_file": "/etc/geotrain/run.key",
                "max_restarts": 2,
                "data_shards": [
                    {"name": "cn", "jurisdiction": "CN", "region": "beijing"},
                    {"name": "eu", "jurisdiction": "EU", "region": "frankfurt"},
                    {"name": "us", "jurisdiction": "US", "region": "silicon-valley"},
                ],
            },
            # Grafana comes from its own apt repository, which this machine cannot reach
            "geotrain:monitoring": {"host": "fra-0", "scrape_interval_s": 15, "grafana": False},
            "geotrain:tags": {"owner": "fleet-test", "cost-centre": "ci"},
        }
    }


def write_stack(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def sh(*args: str, check: bool = True) -> str:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {r.stderr.strip()}")
    return r.stdout


@dataclass
class Fleet:
    root: Path
    key: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)

    @property
    def operator(self) -> str:
        return PREFIX + "op"

    @property
    def outsider(self) -> str:
        return PREFIX + "out"

    def executor(self) -> Executor:
        return Executor(prefix=("ip", "netns", "exec", self.operator))

    def private_key(self) -> str:
        return self.key.read_text()

    def in_ns(self, ns: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout
        )

    def can_connect(self, ns: str, host: str, port: int, timeout: float = 2.0) -> str:
        """'open', 'refused' or 'dropped' for a TCP connect from namespace `ns`."""
        code = (
            "import socket,sys\n"
            f"s=socket.socket(); s.settimeout({timeout})\n"
            f"try: s.connect(({host!r}, {port})); print('open')\n"
            "except ConnectionRefusedError: print('refused')\n"
            "except (TimeoutError, OSError): print('dropped')\n"
        )
        return self.in_ns(ns, sys.executable, "-c", code).stdout.strip()

    def snapshot(self, name: str) -> dict[str, str]:
        return snapshot(self.hosts[name])

    def close(self) -> None:
        for h in self.hosts.values():
            with contextlib.suppress(Exception):
                h.stop()
        for ns in self.namespaces:
            with contextlib.suppress(Exception):
                stop_netns_processes(ns)
                remove_cgroups(ns)
            sh("ip", "netns", "del", ns, check=False)


@contextlib.contextmanager
def fleet(root: Path, doc: dict[str, Any]) -> Iterator[Fleet]:
    """Build the fleet for the stack `doc`; everything goes when the block exits."""
    root.mkdir(parents=True, exist_ok=True)
    key = root / "id_ed25519"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "geotrain-fleet", "-f", str(key))
    f = Fleet(root, key)
    try:
        _wire(f, doc)
        yield f
    finally:
        f.close()


def _wire(f: Fleet, doc: dict[str, Any]) -> None:
    inet = PREFIX + "inet"
    venv = runtime_venv(runtime_wheel(), VENVS)
    for ns in (inet, f.operator, f.outsider):
        _netns(f, ns)
    sh("ip", "netns", "exec", inet, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    _link(inet, "op0", f.operator, f"{OPERATOR}/24", "198.18.0.254", bridge=None)
    sh("ip", "-n", inet, "addr", "add", "198.18.0.254/24", "dev", "op0")
    regions = doc["config"]["geotrain:regions"]
    for i, r in enumerate(regions, start=1):
        br = f"lan{i}"
        sh("ip", "-n", inet, "link", "add", br, "type", "bridge")
        sh("ip", "-n", inet, "addr", "add", f"198.18.{i}.254/24", "dev", br)
        sh("ip", "-n", inet, "link", "set", br, "up")
        for n in r["pool"]["nodes"]:
            ns = PREFIX + n["name"]
            _netns(f, ns)
            _link(inet, f"p-{n['name']}"[:15], ns, f"{n['address']}/24", f"198.18.{i}.254", br)
            host = Host(
                name=n["name"],
                netns=ns,
                state_dir=f.root / "hosts" / n["name"],
                units=("ssh.service",),
                binds=runtime_binds(venv),
            )
            host.start()
            f.hosts[n["name"]] = host
            _login_user(f, host)
            _shared_runtime_reachable(host)
        if i == 1:  # the outsider shares beijing's LAN but no region subnet
            _link(inet, "p-outsider", f.outsider, f"{OUTSIDER}/24", f"198.18.{i}.254", br)
            sh("ip", "-n", f.outsider, "route", "add", r["subnet"], "dev", "eth0")


def _netns(f: Fleet, ns: str) -> None:
    sh("ip", "netns", "add", ns)
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    f.namespaces.append(ns)


def _link(inet: str, port: str, ns: str, cidr: str, via: str, bridge: str | None) -> None:
    sh("ip", "-n", inet, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
    if bridge:
        sh("ip", "-n", inet, "link", "set", port, "master", bridge)
    sh("ip", "-n", inet, "link", "set", port, "up")
    sh("ip", "-n", ns, "addr", "add", cidr, "dev", "eth0")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")
    sh("ip", "-n", ns, "route", "add", "default", "via", via)


def _shared_runtime_reachable(h: Host) -> None:
    """The shared runtime's bind-mounted environments (this checkout's venv, the base
    interpreter, e.g. under /root/.pyenv) may sit under directories only root can enter on
    this machine. Inside the host, their ancestors are the host's own (its overlay root),
    so make those traversable, so the workers' user can run the runtime as it runs a venv
    the agent builds from the host's python3. The mounts themselves are read-only: they
    must already be traversable."""
    dirs: set[str] = set()
    for b in h.binds:
        dirs |= {str(a) for a in Path(b.target).parents if str(a) != "/"}
        mode = os.stat(f"/proc/{h.pid}/root{b.target}").st_mode
        if not mode & stat.S_IXOTH:
            raise LabError(
                f"{b.source} is mode {stat.filemode(mode)}: the hosts' workers cannot use the "
                f"runtime in it; chmod o+rx it (or use a venv outside it)"
            )
    h.exec(["chmod", "o+x", *sorted(dirs)])


def _login_user(f: Fleet, h: Host) -> None:
    """`ops`, with the operator's key and passwordless sudo: a fresh cloud image."""
    pub = f.key.with_suffix(".pub").read_text()
    h.sh(
        "useradd -m -s /bin/sh ops && install -d -m 700 -o ops -g ops /home/ops/.ssh && "
        "cat > /home/ops/.ssh/authorized_keys && chown ops:ops /home/ops/.ssh/authorized_keys "
        "&& chmod 600 /home/ops/.ssh/authorized_keys && "
        "echo 'ops ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/ops && chmod 440 /etc/sudoers.d/ops",
        input=pub,
    )
