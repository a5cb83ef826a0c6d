"""The Kubernetes gateway pod, without a cluster: each region's rendered gateway container
runs its command (`/bin/sh gateway.sh`, the image's CMD) as a container runtime would run
it, and the two regions' pods reach each other through it.

The container, from the rendered Deployment: its own PID and mount namespaces in the
node's network namespace (hostNetwork); as root (no runAsUser; the image has no USER)
with exactly the capabilities its securityContext gives (`setpriv --bounding-set`: a
root process's permitted and effective sets are its bounding set after exec, inheritable
and ambient empty, as containerd and CRI-O set them); a root filesystem of its own (an
overlay on this machine's `/`, which stands in for the gateway image: the same Debian
release and FRR, wireguard-tools, iproute2, iptables and socat packages, so /etc/frr is
frr's 0750 directory as in the image) with the runtime's minimal /dev, a read-only /sys
and /proc/sys, an empty /tmp, and the ConfigMap (0555) and key Secret (0400) mounted
read-only where the manifest mounts them.

One stand-in: this machine has no WireGuard kernel module, so wg-quick falls back to
wireguard-go (on this machine, not in the image), which needs /dev/net/tun in the
container; both need the same capability (NET_ADMIN).

The cluster around it, as docs/kubernetes.md requires it: each gateway's node has its
region's gateway `address` on an underlay link to the other node, forwards packets, and
routes its pod's IP to the pod (the CNI); each region's simulated pod has an IP from its
region's pod CIDR and a default route to the node.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from infra.hosts import stop_netns_processes
from infra.model.load import validate
from infra.plan import Plan, PlanRegion, build_plan
from infra.render import k8s
from tests.conftest import stack_doc

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("ip", "unshare", "setpriv", "nsenter", "wg", "wg-quick", "wireguard-go", "vtysh")
TOOLS += ("iptables-nft", "socat")
MISSING = [t for t in TOOLS if not shutil.which(t)]
MISSING += [p for p in ("/usr/lib/frr/frrinit.sh", "/dev/net/tun") if not Path(p).exists()]
pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(bool(MISSING), reason=f"missing {', '.join(MISSING)} (.ci/run installs)"),
]

RUNTIME_DEFAULT_CAPS = frozenset(
    {
        "CHOWN",
        "DAC_OVERRIDE",
        "FSETID",
        "FOWNER",
        "MKNOD",
        "NET_RAW",
        "SETGID",
        "SETUID",
        "SETFCAP",
        "SETPCAP",
        "NET_BIND_SERVICE",
        "SYS_CHROOT",
        "KILL",
        "AUDIT_WRITE",
    }
)
"""What containerd (and Docker) give a container that drops nothing: its capabilities are
this set plus securityContext.capabilities.add, less .drop."""
PRE_FIX = {"capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}}
"""The gateway's securityContext before it named its capabilities (issue 36, item 2)."""
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
"""The device nodes a runtime puts in a container's /dev."""
STDIO = ("stdin", "stdout", "stderr")
UNSHARE = ("unshare", "--pid", "--fork", "--mount", "--propagation", "private", "--kill-child")
"""A container's own PID and mount namespaces; hostNetwork keeps the node's network."""
ESTABLISHED_S = 45.0
"""BGP (timers 3/9, connect 5) is up in about 7 s here."""
ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 7001)); s.settimeout(10)
print("ready", flush=True)
data, peer = s.recvfrom(64)
s.sendto(data, peer)
print(peer[0], flush=True)
"""
SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.5)
for _ in range(20):
    s.sendto(b"pod-to-pod", (sys.argv[1], 7001))
    try:
        print(s.recvfrom(64)[1][0]); sys.exit(0)
    except TimeoutError:
        pass
sys.exit(1)
"""


def container_caps(security_context: Mapping[str, Any]) -> frozenset[str]:
    """The capability set a runtime gives a container with this securityContext."""
    assert not security_context.get("privileged"), "a privileged container has every capability"
    caps = security_context.get("capabilities", {})
    drop = set(caps.get("drop", []))
    base = set() if "ALL" in drop else set(RUNTIME_DEFAULT_CAPS)
    return frozenset((base | set(caps.get("add", []))) - drop)


def _plan() -> Plan:
    cfg = copy.deepcopy(stack_doc("k8s"))["config"]
    raw = {k.removeprefix("geotrain:"): v for k, v in cfg.items()}
    return build_plan(validate({"stack": "k8s", **raw}, "test"))


def _sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"`{shlex.join(cmd)}` failed: {r.stderr.strip()}")
    return r.stdout


def _keypair() -> tuple[str, str]:
    private = _sh("wg", "genkey").strip()
    public = subprocess.run(
        ["wg", "pubkey"], input=private, capture_output=True, text=True, check=True
    ).stdout.strip()
    return private, public


@dataclass
class Region:
    """A region's gateway node (a network namespace) and one simulated pod on it."""

    region: PlanRegion
    pod_cidr: str
    node: str
    pod: str
    pod_ip: str
    docs: list[dict[str, Any]] = field(default_factory=list)

    def container(self) -> dict[str, Any]:
        deploy = next(d for d in self.docs if d["kind"] == "Deployment")
        [c] = deploy["spec"]["template"]["spec"]["containers"]
        return dict(c)


@dataclass
class Container:
    """A rendered container running as a runtime would run it (see the module docstring)."""

    proc: subprocess.Popen[bytes]
    log: Path
    setpriv: list[str]

    def init_pid(self) -> int:
        """The container's PID 1 (its command), as this machine numbers it."""
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if pids := kids.read_text().split():
                    return int(pids[0])
            time.sleep(0.02)
        raise AssertionError(f"the container never started: {self.tail()}")

    def exec(self, *argv: str, caps: bool = False) -> subprocess.CompletedProcess[str]:
        """`kubectl exec`: with the container's user and capabilities when `caps` (a
        probe), as root with every capability otherwise (observation only)."""
        enter = ["nsenter", "-t", str(self.init_pid()), "-m", "-n", "-p", "-r", "-w"]
        cmd = [*enter, "env", "-i", f"PATH={CONTAINER_PATH}", *(self.setpriv if caps else [])]
        return subprocess.run([*cmd, *argv], capture_output=True, text=True)

    def stop(self, grace: float = 30.0) -> int | None:
        """The kubelet's stop: SIGTERM to PID 1, SIGKILL (the whole PID namespace) once
        the grace period is over. The container's exit status, None when killed."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        with contextlib.suppress(ProcessLookupError, AssertionError):
            os.kill(self.init_pid(), signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # unshare --kill-child takes PID 1
            self.proc.wait()
            return None

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(line for line in lines[-30:] if not line.startswith(("│", "┌", "└")))


def _volumes(docs: list[dict[str, Any]], pod: dict[str, Any], root: Path) -> list[tuple[Path, str]]:
    """The pod's ConfigMap and Secret volumes as files under `root` (their modes, owned by
    root, as the kubelet writes them) and where the container mounts them (read-only)."""
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    [c] = pod["containers"]
    mounts = []
    for v in pod["volumes"]:
        m = next(m for m in c["volumeMounts"] if m["name"] == v["name"])
        assert m.get("readOnly"), f"volume {v['name']} is writable"
        src = root / v["name"]
        src.mkdir(parents=True)
        if "configMap" in v:
            data, mode = by_name[("ConfigMap", v["configMap"]["name"])]["data"], v["configMap"]
        else:
            data, mode = by_name[("Secret", v["secret"]["secretName"])]["stringData"], v["secret"]
        for key, text in data.items():
            (src / key).write_text(text)
            (src / key).chmod(mode["defaultMode"])
        mounts.append((src, m["mountPath"]))
    return mounts


def _setpriv(security_context: Mapping[str, Any], caps: frozenset[str]) -> list[str]:
    """Become the container's user with exactly `caps`: for root, exec makes the
    permitted and effective sets the bounding set (inheritable and ambient empty)."""
    uid, gid = security_context.get("runAsUser", 0), security_context.get("runAsGroup", 0)
    bounding = ",".join(["-all", *(f"+{c.lower()}" for c in sorted(caps))])
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--init-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        f"--bounding-set={bounding}",
        "--",
    ]


def _boot(state: Path, mounts: list[tuple[Path, str]], exec_argv: list[str]) -> str:
    """The shell that builds the container's root and execs its command."""
    root, upper, work = (shlex.quote(str(state / d)) for d in ("root", "upper", "work"))
    lines = [
        "set -e",
        "mount --make-rprivate /",
        f"mount -t overlay overlay -o lowerdir=/,upperdir={upper},workdir={work} {root}",
        f"mount -t tmpfs -o mode=755,nosuid tmpfs {root}/dev",
        f"mkdir {root}/dev/net {root}/dev/shm",
        *(f"touch {root}/dev/{d} && mount --bind /dev/{d} {root}/dev/{d}" for d in DEVICES),
        # the stand-in for the WireGuard kernel module (module docstring)
        f"touch {root}/dev/net/tun && mount --bind /dev/net/tun {root}/dev/net/tun",
        f"mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {root}/dev/shm",
        f"ln -s /proc/self/fd {root}/dev/fd",
        *(f"ln -s /proc/self/fd/{i} {root}/dev/{n}" for i, n in enumerate(STDIO)),
        f"mount -t proc proc {root}/proc",
        f"mount --bind {root}/proc/sys {root}/proc/sys",
        f"mount -o remount,bind,ro {root}/proc/sys",
        f"mount -t sysfs -o ro sysfs {root}/sys",
        f"mount -t tmpfs -o mode=1777 tmpfs {root}/tmp",
    ]
    for src, target in mounts:
        t = shlex.quote(f"{state / 'root'}{target}")
        lines += [f"mkdir -p {t}", f"mount --bind {shlex.quote(str(src))} {t}"]
        lines.append(f"mount -o remount,bind,ro {t}")
    lines += [
        f"mkdir {root}/run/.oldroot",
        f"cd {root}",
        "pivot_root . run/.oldroot",
        "cd /",
        "umount -l /run/.oldroot",
        "rmdir /run/.oldroot",
        f"exec /usr/bin/env -i PATH={CONTAINER_PATH} HOME=/root {shlex.join(exec_argv)}",
    ]
    return "\n".join(lines)


def run_container(
    r: Region,
    state: Path,
    security_context: Mapping[str, Any] | None = None,
    command: list[str] | None = None,
) -> Container:
    """Start the gateway Deployment's container in `r`'s node, with its securityContext
    (or `security_context`) and its command (or `command`)."""
    deploy = next(d for d in r.docs if d["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["hostNetwork"] and "securityContext" not in pod
    c = r.container()
    sc = c["securityContext"] if security_context is None else security_context
    for d in ("upper", "work", "root"):
        (state / d).mkdir(parents=True)
    mounts = _volumes(r.docs, pod, state / "volumes")
    setpriv = _setpriv(sc, container_caps(sc))
    script = _boot(state, mounts, [*setpriv, *(command or c["command"])])
    log = state / "container.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", r.node, *UNSHARE, "/bin/sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Container(proc, log, setpriv)


# -- the cluster around the gateways --------------------------------------------------------
def _wire(a: Region, b: Region) -> None:
    """Two gateway nodes on one underlay link, each with a pod its CNI routes."""
    for r in (a, b):
        for ns in (r.node, r.pod):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", r.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        # the pod: its IP and a default route to the node (a routed CNI, like Calico's)
        _sh("ip", "-n", r.node, "link", "add", "cali0", "type", "veth", "peer", "eth0")
        _sh("ip", "-n", r.node, "link", "set", "eth0", "netns", r.pod)
        _sh("ip", "-n", r.node, "addr", "add", "169.254.1.1/32", "dev", "cali0")
        _sh("ip", "-n", r.pod, "addr", "add", f"{r.pod_ip}/32", "dev", "eth0")
        for ns, dev in ((r.node, "cali0"), (r.pod, "eth0")):
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", r.pod, "route", "add", "169.254.1.1/32", "dev", "eth0")
        _sh("ip", "-n", r.pod, "route", "add", "default", "via", "169.254.1.1")
        _sh("ip", "-n", r.node, "route", "add", f"{r.pod_ip}/32", "dev", "cali0")
    # the nodes' public addresses: each region's gateway node `address` in the stack
    _sh("ip", "-n", a.node, "link", "add", "ens5", "type", "veth", "peer", "ens6")
    _sh("ip", "-n", a.node, "link", "set", "ens6", "netns", b.node)
    for r, dev, o in ((a, "ens5", b), (b, "ens6", a)):
        _sh("ip", "-n", r.node, "addr", "add", f"{r.region.gateway.address}/32", "dev", dev)
        _sh("ip", "-n", r.node, "link", "set", dev, "up")
        _sh("ip", "-n", r.node, "route", "add", f"{o.region.gateway.address}/32", "dev", dev)


@contextlib.contextmanager
def _regions(plan: Plan, tag: str) -> Iterator[list[Region]]:
    """Both regions' nodes and pods, with their rendered gateway objects (real keys)."""
    keys = {r.gateway.name: _keypair() for r in plan.regions}
    pubkeys = {name: pub for name, (_, pub) in keys.items()}
    out = []
    for r in plan.regions:
        cidr = k8s.settings(plan, r).pod_cidr
        assert cidr is not None
        files = k8s.gateway_files(plan, r, pubkeys)
        name = k8s.gateway_config_name(plan, r, files)
        docs = k8s.gateway_docs(plan, r, files, name, keys[r.gateway.name][0])
        node, pod = f"gtk8g-{r.name[:3]}-{tag}", f"gtk8p-{r.name[:3]}-{tag}"
        out.append(Region(r, str(cidr), node, pod, str(cidr[5]), docs))
    try:
        _wire(*out)
        yield out
    finally:
        for reg in out:
            for ns in (reg.pod, reg.node):
                with contextlib.suppress(Exception):
                    stop_netns_processes(ns)
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _bgp_peers(c: Container) -> list[str]:
    r = c.exec("vtysh", "-c", "show bgp ipv4 unicast summary json")
    if r.returncode != 0:  # bgpd not up yet
        return []
    return [p.get("state", "") for p in json.loads(r.stdout or "{}").get("peers", {}).values()]


def _bgp_routes(r: Region, other: Region) -> str:
    return _sh("ip", "-n", r.node, "route", "show", "proto", "bgp", other.pod_cidr)


def _wait_established(regions: list[Region], containers: list[Container]) -> None:
    """Every BGP session established, and every node's kernel table holding the other
    region's pod CIDR through the tunnel (announced by one gateway, installed by the
    other's zebra)."""
    deadline = time.monotonic() + ESTABLISHED_S
    state: list[Any] = []
    while time.monotonic() < deadline:
        for c in containers:
            assert c.proc.poll() is None, f"the gateway exited: {c.tail()}"
        peers = [_bgp_peers(c) for c in containers]
        routes = [_bgp_routes(r, o) for r in regions for o in regions if o is not r]
        state = [peers, routes]
        if all(p and set(p) == {"Established"} for p in peers) and all(
            " dev wg-" in r for r in routes
        ):
            return
        time.sleep(0.3)
    logs = "\n".join(c.tail() for c in containers)
    raise AssertionError(f"BGP not up after {ESTABLISHED_S:.0f} s: {state}\n{logs}")


def _pod_to_pod(src: Region, dst: Region) -> tuple[str, str]:
    """A datagram from src's pod to dst's pod and back: the source dst's pod saw, and the
    source of the reply src's pod got."""
    echo = subprocess.Popen(
        ["ip", "netns", "exec", dst.pod, sys.executable, "-c", ECHO, dst.pod_ip],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        r = subprocess.run(
            ["ip", "netns", "exec", src.pod, sys.executable, "-c", SEND, dst.pod_ip],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, f"{src.region.name} -> {dst.region.name}: no reply"
        seen, _ = echo.communicate(timeout=10)
        return seen.strip(), r.stdout.strip()
    finally:
        if echo.poll() is None:
            echo.kill()
            echo.wait()


def _node_state(r: Region) -> dict[str, Any]:
    """What the gateway may change on its node."""
    return {
        "links": sorted(
            line.split(":")[1].strip().split("@")[0]
            for line in _sh("ip", "-n", r.node, "-o", "link", "show").splitlines()
        ),
        "addrs": _sh("ip", "-n", r.node, "-4", "-o", "addr", "show").count(" inet "),
        "routes": _sh("ip", "-n", r.node, "route", "show"),
        "nat": _sh("ip", "netns", "exec", r.node, "iptables-nft", "-t", "nat", "-S"),
        "mangle": _sh("ip", "netns", "exec", r.node, "iptables-nft", "-t", "mangle", "-S"),
    }


@pytest.fixture(scope="module")
def plan() -> Plan:
    return _plan()


def test_rendered_gateways_peer_announce_pod_cidrs_and_carry_pod_traffic(
    plan: Plan, tmp_path: Path
) -> None:
    with _regions(plan, str(os.getpid())) as regions:
        before = [_node_state(r) for r in regions]
        containers = [run_container(r, tmp_path / r.region.name) for r in regions]
        try:
            _wait_established(regions, containers)
            for c in containers:  # the readiness probe, with the container's capabilities
                probe = regions[containers.index(c)].container()["readinessProbe"]
                r = c.exec(*probe["exec"]["command"], caps=True)
                assert r.returncode == 0, r.stderr
            a, b = regions
            for src, dst in ((a, b), (b, a)):
                seen, reply = _pod_to_pod(src, dst)
                # the destination's pod sees the other region as its own gateway's overlay
                # address (the NetworkPolicy admits exactly that); the reply comes back
                # from the pod's own address
                assert (seen, reply) == (dst.region.router_id, dst.pod_ip)
            assert [c.stop() for c in containers] == [0, 0], [c.tail() for c in containers]
            # SIGTERM undid everything: the nodes are as they were
            assert [_node_state(r) for r in regions] == before
        finally:
            for c in containers:
                c.stop(grace=0)


def test_gateway_that_cannot_configure_frr_exits_and_leaves_its_node_as_it_was(
    plan: Plan, tmp_path: Path
) -> None:
    """A failing case of the same harness: without DAC_OVERRIDE root cannot write frr's
    /etc/frr (0750 frr:frr in the image); the container fails after its tunnel is up, and
    undoes it."""
    with _regions(plan, str(os.getpid())) as regions:
        r = regions[1]
        before = _node_state(r)
        sc = copy.deepcopy(r.container()["securityContext"])
        sc["capabilities"]["add"].remove("DAC_OVERRIDE")
        c = run_container(r, tmp_path, sc)
        try:
            assert c.proc.wait(timeout=60) != 0
            out = c.log.read_text()
            assert "[#] wg set wg-" in out  # the tunnel was up before it failed
            assert "/etc/frr/frr.conf': Permission denied" in out, out
            assert _node_state(r) == before
        finally:
            c.stop(grace=0)


@pytest.mark.parametrize(
    ("name", "security_context", "runs"),
    [
        ("rendered", None, True),
        ("runtime default + NET_ADMIN, NET_RAW (before)", PRE_FIX, False),
    ],
)
def test_frr_daemons_start_only_with_the_capabilities_they_ask_for(
    plan: Plan, tmp_path: Path, name: str, security_context: Any, runs: bool
) -> None:
    """zebra, bgpd and bfdd ask for their capabilities when they start (FRR's lib/privs.c)
    and exit at once without them; with them they run (until `timeout` stops them)."""
    with _regions(plan, str(os.getpid())) as regions:
        loop = (
            "for d in zebra bgpd bfdd; do (timeout 3 /usr/lib/frr/$d -F traditional "
            '>/tmp/$d.log 2>&1; echo "$d $?") & done; wait; cat /tmp/*.log'
        )
        c = run_container(regions[0], tmp_path, security_context, ["/bin/sh", "-c", loop])
        try:
            assert c.proc.wait(timeout=30) == 0
            out = c.log.read_text()
            codes = dict(line.split() for line in out.splitlines() if line.endswith(("124", " 1")))
            if runs:
                assert codes == {"zebra": "124", "bgpd": "124", "bfdd": "124"}, out
            else:
                assert codes == {"zebra": "1", "bgpd": "1", "bfdd": "1"}, out
                assert out.count("privs_init: initial cap_set_proc failed") == 3, out
        finally:
            c.stop(grace=0)
