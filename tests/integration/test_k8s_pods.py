"""The pod contract, without a cluster: every rendered worker pod of a 2-region Kubernetes
stack (one region a StatefulSet, the other a JobSet) runs as local processes with exactly
what Kubernetes would give it, and the run trains to the end.

Per pod, from its manifests: the container's command (python -m training.launch.torchrun, the
image's CMD) and env, $HOSTNAME (and a JobSet's $JOB_COMPLETION_INDEX), the working
directory (its volume), the spec ConfigMap's file, the init container's command run on
the Secret's file, and the key at the worker's mount path (a hard link of the init
container's file stands in for the subPath bind mount). Mount paths are mapped into a
directory per pod.

The network stands in for the cluster: pods share one network namespace `P`, each with
its own pod IP (from its region's pod CIDR) and a private /etc/hosts that resolves every
pod's DNS name as the headless Service would. The first region's gateway is a namespace
`G` holding the gateway address (10.42.1.1) on a veth to `P`, where a forwarder bound to
that address relays the rendezvous port to the first pod, as the rendered socat line
does. Not covered here: WireGuard, FRR, SNAT, NetworkPolicy, the kubelet itself.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from infra.model.load import validate
from infra.plan import Plan, build_plan
from infra.render import k8s
from tests.conftest import stack_doc
from training.launch import torchrun
from training.state.keys import KEY_BYTES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
]

FORWARDER = """
import socket, sys, threading
listen, port, target, bind = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[1]
srv = socket.create_server((listen, port), reuse_port=False)
print("ready", flush=True)
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try: s.shutdown(socket.SHUT_RDWR)
            except OSError: pass
while True:
    c, _ = srv.accept()
    try:  # like socat's fork: a failed connection fails alone
        u = socket.create_connection((target, port), source_address=(bind, 0))
    except OSError:
        c.close()
        continue
    threading.Thread(target=pipe, args=(c, u), daemon=True).start()
    threading.Thread(target=pipe, args=(u, c), daemon=True).start()
"""


def _plan() -> Plan:
    cfg = copy.deepcopy(stack_doc("k8s"))["config"]
    for i, workload in enumerate(("statefulset", "jobset")):
        region = cfg["geotrain:regions"][i]
        region["pool"]["kubernetes"].update(
            workload=workload, variant="cpu", tag="test-cpu", node_selector={}, tolerations=[]
        )
        for n in region["pool"]["nodes"]:
            n.update(gpu_type="cpu", gpus=1)
    cfg["geotrain:training"].update(
        model="deepseek-tiny",
        sync="allreduce",
        steps=16,
        batch_size=2,
        seq_len=32,
        checkpoint={"dir": "checkpoints/{node}", "interval_steps": 5, "keep": 2},
        max_restarts=0,
    )
    raw = {k.removeprefix("geotrain:"): v for k, v in cfg.items()}
    return build_plan(validate({"stack": "k8s", **raw}, "test"))


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


class Pods:
    """The namespaces, files and processes of the emulated clusters."""

    def __init__(self, tmp: Path, tag: str) -> None:
        self.tmp, self.p, self.g = tmp, f"gtk8s-p-{tag}", f"gtk8s-g-{tag}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def up(self, plan: Plan, ips: dict[str, str]) -> None:
        gw = plan.regions[0].router_id
        for ns in (self.p, self.g):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        for ip in ips.values():  # pod IPs: local addresses of P
            _sh("ip", "-n", self.p, "addr", "add", f"{ip}/32", "dev", "lo")
        _sh("ip", "-n", self.p, "link", "add", "v-gw", "type", "veth", "peer", "v-pods")
        _sh("ip", "-n", self.p, "link", "set", "v-pods", "netns", self.g)
        _sh("ip", "-n", self.p, "addr", "add", "169.254.42.2/30", "dev", "v-gw")
        _sh("ip", "-n", self.g, "addr", "add", "169.254.42.1/30", "dev", "v-pods")
        _sh("ip", "-n", self.g, "addr", "add", f"{gw}/32", "dev", "v-pods")
        for ns, dev in ((self.p, "v-gw"), (self.g, "v-pods")):
            _sh("ip", "-n", ns, "link", "set", dev, "up")
        # the route agents' route (pods -> gateway) and the gateway's route to the pods
        _sh("ip", "-n", self.p, "route", "add", f"{gw}/32", "via", "169.254.42.1")
        for ip in ips.values():
            _sh("ip", "-n", self.g, "route", "add", f"{ip}/32", "via", "169.254.42.2")
        etc = Path("/etc/netns") / self.p  # `ip netns exec` mounts it over /etc/hosts
        etc.mkdir(parents=True)
        lines = [f"{ip} {fqdn} {fqdn.split('.')[0]}" for fqdn, ip in ips.items()]
        (etc / "hosts").write_text("127.0.0.1 localhost\n" + "\n".join(lines) + "\n")

    def forward(self, plan: Plan, target: str) -> None:
        gw = plan.regions[0].router_id
        cmd = ["ip", "netns", "exec", self.g, sys.executable, "-c", FORWARDER]
        fwd = subprocess.Popen(
            [*cmd, gw, str(plan.master_port), target],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.procs.append(fwd)
        assert fwd.stdout and fwd.stdout.readline().strip() == b"ready"

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> Any:
        with open(log, "wb") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.p, *argv],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the pod's whole process group
                except ProcessLookupError:
                    p.kill()
                p.wait()
        for ns in (self.p, self.g):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / self.p, ignore_errors=True)
        with contextlib.suppress(OSError):  # only when no other test left a namespace there
            Path("/etc/netns").rmdir()


def _mapper(pod_dir: Path) -> Any:
    mounts = {
        torchrun.SPEC_DIR: pod_dir / "spec",
        torchrun.WORKDIR: pod_dir / "state",
        k8s.SECRET_DIR: pod_dir / "secret",
        k8s.KEYS_DIR: pod_dir / "keys",
    }

    def local(path: str) -> str:
        for mount, here in mounts.items():
            if path == mount or path.startswith(mount + "/"):
                return str(here) + path[len(mount) :]
        return path

    return local


def _prepare_pod(
    docs: list[dict[str, Any]], ordinal: int, pod_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """The pod's files and init container, as the kubelet would; its command and env."""
    work = next(d for d in docs if d["kind"] in ("StatefulSet", "JobSet"))
    jobset = work["kind"] == "JobSet"
    tmpl = (
        work["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        if jobset
        else work["spec"]["template"]
    )
    pod = tmpl["spec"]
    local = _mapper(pod_dir)
    by_name = {d["metadata"]["name"]: d for d in docs}
    for v in pod["volumes"]:
        if "configMap" in v:
            mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == v["name"])
            d = Path(local(mount["mountPath"]))
            d.mkdir(parents=True)
            for key, text in by_name[v["configMap"]["name"]]["data"].items():
                (d / key).write_text(text)
        if "secret" in v:
            mount = next(
                m for m in pod["initContainers"][0]["volumeMounts"] if m["name"] == v["name"]
            )
            d = Path(local(mount["mountPath"]))
            d.mkdir(parents=True)
            for key, text in by_name[v["secret"]["secretName"]]["stringData"].items():
                (d / key).write_text(text)
                (d / key).chmod(v["secret"]["defaultMode"])
    (pod_dir / "keys").mkdir()
    (pod_dir / "state").mkdir()
    [init] = pod["initContainers"]
    subprocess.run([local(a) for a in init["command"]], check=True)
    [worker] = pod["containers"]
    keys = next(m for m in worker["volumeMounts"] if m["name"] == "keys")
    target = Path(local(keys["mountPath"]))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.link(pod_dir / "keys" / keys["subPath"], target)  # stands in for the subPath mount
    name = (
        f"{work['metadata']['name']}-{k8s.JOBSET_RJOB}-0-{ordinal}"
        if jobset
        else f"{work['metadata']['name']}-{ordinal}"
    )
    env = {e["name"]: local(e["value"]) for e in worker["env"]}
    env["HOSTNAME"] = name
    if jobset:
        env["JOB_COMPLETION_INDEX"] = str(ordinal)
    # the image's installed runtime is this checkout; one torch thread per process here
    env |= {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "GEOTRAIN_THREADS": "1"}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable if a == "python" else local(a) for a in worker["command"]]
    return argv, env


def test_rendered_pods_of_two_regions_train_to_the_end(tmp_path: Path) -> None:
    plan = _plan()
    spec = k8s.pod_launch_spec(plan)
    key = os.urandom(KEY_BYTES).hex()
    ips: dict[str, str] = {}
    for r, rs in zip(plan.regions, spec.regions, strict=True):
        cidr = k8s.settings(plan, r).pod_cidr
        assert cidr is not None
        for i, n in enumerate(rs.nodes):
            ips[n.host] = str(cidr[i + 5])
    pods = Pods(tmp_path, str(os.getpid()))
    try:
        pods.up(plan, ips)
        # the forwarder gets the first pod's IP (socat on the gateway resolves its DNS name)
        pods.forward(plan, ips[spec.regions[0].nodes[0].host])
        running = []
        for r, rs in zip(plan.regions, spec.regions, strict=True):
            docs = k8s.pool_docs(plan, r) + k8s.delivery_docs(plan, r, key)
            for i, n in enumerate(rs.nodes):
                pod_dir = tmp_path / n.name
                argv, env = _prepare_pod(docs, i, pod_dir)
                state = pod_dir / "state"
                proc = pods.start(argv, env, state, tmp_path / f"{n.name}.log")
                running.append((n, proc, pod_dir, env))
        # readiness as the kubelet sees it: each pod's metrics-0 answers while it trains
        ready: set[str] = set()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            for n, *_ in running:
                if n.name not in ready and _probe(pods, ips[n.host], spec.metrics_port):
                    ready.add(n.name)
            done = [pod_dir / "state/run" / f"{spec.run_id}.done" for _, _, pod_dir, _ in running]
            failed = [(n.name, p.returncode) for n, p, _, _ in running if p.poll() not in (None, 0)]
            assert not failed, (failed, _tail(tmp_path))
            if all(d.exists() for d in done):
                break
            time.sleep(0.2)
        assert all(d.exists() for d in done), _tail(tmp_path)
        assert ready == {n.name for n, *_ in running}, ready
        digests = set()
        for n, proc, pod_dir, env in running:
            if env[torchrun.ON_DONE_ENV] == "exit":  # JobSet pods complete
                assert proc.wait(timeout=60) == 0
            else:  # StatefulSet pods idle after the last step until stopped
                assert proc.poll() is None
                os.killpg(proc.pid, signal.SIGTERM)
                assert proc.wait(timeout=60) == 0
            key_file = pod_dir / "state" / spec.key_file
            assert oct(key_file.stat().st_mode & 0o777) == "0o400"
            assert list((pod_dir / "state/checkpoints").glob(f"{n.name}/step-*/{n.name}"))
            for line in (pod_dir / "state/run/events.jsonl").read_text().splitlines():
                e = json.loads(line)
                if e["event"] == "done":
                    assert e["step"] == spec.steps
                    digests.add(e["digest"])
        assert len(digests) == 1  # every replica ends bitwise equal
    finally:
        pods.down()


def _probe(pods: Pods, ip: str, port: int) -> bool:
    r = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            pods.p,
            sys.executable,
            "-c",
            "import sys, urllib.request as u\n"
            f"try: ok = u.urlopen('http://{ip}:{port}/metrics', timeout=1).status == 200\n"
            "except OSError: ok = False\n"
            "sys.exit(0 if ok else 1)",
        ],
        capture_output=True,
    )
    return r.returncode == 0


def _tail(tmp: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        for log in sorted(tmp.glob("*.log"))
    )
