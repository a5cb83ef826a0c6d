"""Workers started by torchrun: by `geotrain launch`/`geotrain train`
(training.launch.launcher, c10d rendezvous) and in Kubernetes pods (static rendezvous).

Two sides:
- the pod's entry point, `python -m training.launch.torchrun` (the image's CMD): it finds which
  node of the launch spec this pod is (the StatefulSet ordinal from $HOSTNAME, a JobSet's
  $JOB_COMPLETION_INDEX, or torchrun's own $PET_NODE_RANK), then runs torchrun for it with
  static rendezvous at the spec's master address: `--nnodes` = every node of the spec,
  `--node-rank` = the node's index in spec order, `--nproc-per-node` = its workers;
- the worker's side, `python -m training.worker --torchrun[=NODE]` (`enter`):
  the local rank comes from torchrun's LOCAL_RANK (under fault_tolerance torchrun's world
  is the node's region: each region is its own torchrun job); the node is NODE
  (training.launch.launcher names it: c10d numbers nodes in the order they join, not the
  spec's) or, in pods, the spec's node at torchrun's GROUP_RANK (checked: RANK must be
  the node's first rank + LOCAL_RANK). Its global rank is always the spec's. The worker
  records torchrun's RANK, GROUP_RANK and TORCHELASTIC_RESTART_COUNT in its `start` event;
  the restart count
  is torchrun's per node (after a failure the nodes' counts differ), so nothing keys on
  it: the codec's epoch is agreed separately (training.comm.session).

The workers' store (`torchrun_store`): under c10d (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
set by training.launch.launcher) torchrun gives every rendezvous round a fresh MASTER_PORT on the
address of the node it numbered 0; the worker torchrun calls RANK 0 hosts the store there,
bound to that address only, so no key of an earlier round can be read. In pods torchrun
hosts it (TORCHELASTIC_USE_AGENT_STORE) and every worker is a client.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from training.errors import GeotrainError, SpecError
from training.launch.procs import die_with_parent
from training.spec import LaunchSpec, NodeSpec

SPEC_DIR = "/etc/geotrain/spec"
"""Where pods mount the launch spec's ConfigMap (read-only)."""
SPEC_PATH = f"{SPEC_DIR}/launch-spec.json"
WORKDIR = "/var/lib/geotrain"
"""A pod's working directory and volume: relative paths of the spec (checkpoints, the
run key) resolve here."""
RUN_DIR = f"{WORKDIR}/run"
"""Events, the final weights and the done marker of a pod."""
REGION_ENV = "GEOTRAIN_REGION"
"""The pod's region (set in the pod template); with the ordinal it names the node."""
ON_DONE_ENV = "GEOTRAIN_ON_DONE"
"""`idle`: after the last step the pod stays (a StatefulSet would restart it and train
again); `exit`: it ends (a JobSet completes)."""
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")


def _nodes(spec: LaunchSpec) -> list[NodeSpec]:
    return [n for r in spec.regions for n in r.nodes]


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise SpecError(f"${name}={env[name]!r} is not an integer") from None


def pod_ordinal(env: Mapping[str, str]) -> int:
    """The pod's index in its region: a JobSet's (indexed Job's) completion index, else
    the StatefulSet ordinal at the end of the pod's host name."""
    if "JOB_COMPLETION_INDEX" in env:
        return _int(env, "JOB_COMPLETION_INDEX")
    m = re.fullmatch(r".*-([0-9]+)", env.get("HOSTNAME", ""))
    if not m:
        raise SpecError(
            f"cannot tell this pod's ordinal: no $JOB_COMPLETION_INDEX and $HOSTNAME "
            f"{env.get('HOSTNAME', '')!r} does not end in -N; run it from the rendered "
            "StatefulSet or JobSet, or set $PET_NODE_RANK"
        )
    return int(m.group(1))


def pod_node(spec: LaunchSpec, env: Mapping[str, str]) -> tuple[int, NodeSpec]:
    """(node rank = index in spec order, node) of this pod."""
    nodes = _nodes(spec)
    if "PET_NODE_RANK" in env:
        index = _int(env, "PET_NODE_RANK")
        if not 0 <= index < len(nodes):
            raise SpecError(f"$PET_NODE_RANK={index} is outside the spec's {len(nodes)} nodes")
        return index, nodes[index]
    name = env.get(REGION_ENV, "")
    names = [r.name for r in spec.regions]
    if name not in names:
        raise SpecError(
            f"${REGION_ENV}={name!r} is not a region of run {spec.run_id}; use one of "
            f"{', '.join(names)}"
        )
    region = spec.regions[names.index(name)]
    ordinal = pod_ordinal(env)
    if not 0 <= ordinal < len(region.nodes):
        raise SpecError(
            f"pod ordinal {ordinal} is outside region {name}'s {len(region.nodes)} nodes; "
            "the workload has more replicas than the spec has nodes: re-render the stack"
        )
    node = region.nodes[ordinal]
    return nodes.index(node), node


def torchrun_argv(spec: LaunchSpec, spec_path: str, index: int, node: NodeSpec) -> list[str]:
    """torchrun for one node: static rendezvous at the spec's master (node rank 0's agent
    hosts the store there), restarts as the spec says."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(_nodes(spec))}",
        f"--nproc-per-node={node.nprocs}",
        f"--node-rank={index}",
        f"--master-addr={spec.master_addr}",
        f"--master-port={spec.master_port}",
        f"--max-restarts={spec.max_restarts}",
        "-m",
        "training.worker",
        "--torchrun",
        "--spec",
        spec_path,
    ]


# -- the worker's side ------------------------------------------------------------------
@dataclass(frozen=True)
class TorchrunRank:
    node: str
    """This worker's node in the spec."""
    local_rank: int
    """torchrun's LOCAL_RANK."""
    restart: int
    """torchrun's TORCHELASTIC_RESTART_COUNT: this node's agent's restarts so far."""
    rank: int
    """torchrun's RANK (its own numbering under c10d; the worker's rank is the spec's)."""
    group_rank: int
    """torchrun's GROUP_RANK (the node's number in torchrun's rendezvous)."""

    def fields(self) -> dict[str, int]:
        """What the worker's `start` event records of torchrun."""
        return {
            "torchrun_restart": self.restart,
            "torchrun_rank": self.rank,
            "torchrun_group_rank": self.group_rank,
        }


def from_env(spec: LaunchSpec, env: Mapping[str, str], node: str | None = None) -> TorchrunRank:
    """The node and local rank torchrun gave this worker, checked against the spec;
    `node`: the node training.launch.launcher started this torchrun for (else GROUP_RANK's)."""
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise SpecError(
            f"--torchrun needs torchrun's environment but ${', $'.join(missing)} "
            "is not set; start the worker with torchrun, or pass --node and --local-rank"
        )
    nodes = _nodes(spec)
    group, local, rank = _int(env, "GROUP_RANK"), _int(env, "LOCAL_RANK"), _int(env, "RANK")
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if node is not None:
        region, _ = spec.node(node)  # an unknown name is a SpecError naming the nodes
        # under fault_tolerance each region is its own torchrun job (training.launch.launcher)
        ft = spec.fault_tolerance is not None
        world = sum(n.nprocs for n in region.nodes) if ft else spec.world_size
        _world(env, world, f"region {region.name}'s" if ft else "the spec's")
        return TorchrunRank(node, local, restart, rank, group)
    _world(env, spec.world_size, "the spec's")
    if not 0 <= group < len(nodes):
        raise SpecError(
            f"torchrun's GROUP_RANK {group} is outside the spec's {len(nodes)} nodes; "
            f"start torchrun with --nnodes={len(nodes)}"
        )
    n = nodes[group]
    if rank != n.first_rank + local:
        raise SpecError(
            f"torchrun gave rank {rank} to local rank {local} of node {n.name}, whose "
            f"ranks start at {n.first_rank}; start every node's torchrun with "
            "--nproc-per-node = its workers and --node-rank = its index in spec order"
        )
    return TorchrunRank(n.name, local, restart, rank, group)


def _world(env: Mapping[str, str], world: int, whose: str) -> None:
    if _int(env, "WORLD_SIZE") != world:
        raise SpecError(
            f"torchrun's WORLD_SIZE {env['WORLD_SIZE']} is not {whose} {world}; start every "
            "node's torchrun with --nproc-per-node = its workers (training.launch.launcher does)"
        )


def enter(spec: LaunchSpec, node: str | None, env: Mapping[str, str]) -> TorchrunRank:
    """A worker started by torchrun: who it is; it dies with its agent, and writes its
    output to GEOTRAIN_LOG_DIR/<node>-<local rank>.log when the launcher names one."""
    t = from_env(spec, env, node)
    # torchrun does not arrange it, and its workers run in their own sessions, out of
    # reach of a signal to the agent's process group: die with the agent
    die_with_parent()
    if env.get("GEOTRAIN_LOG_DIR"):
        path = Path(env["GEOTRAIN_LOG_DIR"]) / f"{t.node}-{t.local_rank}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return t


def record_failure(
    events: str | None,
    spec: LaunchSpec | None,
    node: str | None,
    local_rank: int | None,
    e: Exception,
) -> None:
    """The worker's last event before it exits with a GeotrainError: the launcher stops
    the run at once on exit code 2 (bad input), which no torchrun restart can cure. Like
    every event it names the region and rank, when the spec and node are known."""
    if not events:
        return
    code = getattr(e, "exit_code", 1)
    line: dict[str, object] = {"event": "failed", "region": None, "rank": None}
    if spec is not None and node is not None:
        try:
            region, n = spec.node(node)
            line |= {"region": region.name, "rank": n.first_rank + (local_rank or 0)}
        except GeotrainError:  # an unknown node: the error being recorded, maybe
            pass
    line |= {"node": node, "local_rank": local_rank, "exit_code": code}
    line |= {"reason": str(e), "t": time.time()}
    with open(events, "a", encoding="utf-8") as f:  # one write(): atomic append
        f.write(json.dumps(line) + "\n")


def torchrun_store(world_size: int, timeout: timedelta) -> Any:
    """The workers' store under torchrun (see the module docstring); None when the worker
    was not started by torchrun."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    import torch.distributed as dist

    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts it
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    from training.comm.session import rendezvous_store

    return rendezvous_store(addr, port, world_size, env.get("RANK") == "0", timeout)


# -- the pod's entry point --------------------------------------------------------------
def _stop(child: subprocess.Popen[bytes]) -> None:
    def forward(signum: int, _frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signum)  # torchrun stops its workers, then exits

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)


def _finish(message: str, env: Mapping[str, str]) -> None:
    print(message, flush=True)
    if env.get(ON_DONE_ENV) == "idle":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            signal.pause()


def run_pod(spec_path: str, env: Mapping[str, str]) -> int:
    spec = LaunchSpec.load(spec_path)
    index, node = pod_node(spec, env)
    run_dir = Path(env.get("GEOTRAIN_RUN_DIR", RUN_DIR))
    done = run_dir / f"{spec.run_id}.done"
    if done.exists():
        _finish(f"node {node.name}: run {spec.run_id} already finished ({done})", env)
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    child_env = {
        **env,
        "GEOTRAIN_RUN_DIR": str(run_dir),
        "GEOTRAIN_EVENTS": env.get("GEOTRAIN_EVENTS", str(run_dir / "events.jsonl")),
        "PYTHONUNBUFFERED": "1",
    }
    print(
        f"node {node.name} (node rank {index}, {node.nprocs} workers) of run {spec.run_id}: "
        f"torchrun with rendezvous at {spec.master_addr}:{spec.master_port}",
        flush=True,
    )
    child = subprocess.Popen(torchrun_argv(spec, spec_path, index, node), env=child_env)
    _stop(child)
    rc = child.wait()
    if rc != 0:
        return rc
    done.write_text(f"{spec.run_id}\n")
    _finish(f"node {node.name}: done", env)
    return 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.launch.torchrun")
    ap.add_argument("--spec", default=SPEC_PATH, help="launch spec (the mounted ConfigMap)")
    a = ap.parse_args(argv)
    try:
        rc = run_pod(a.spec, os.environ)
    except GeotrainError as e:
        print(f"geotrain pod: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    sys.exit(rc)


if __name__ == "__main__":
    main()
