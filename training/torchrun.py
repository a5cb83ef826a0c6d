"""Workers started by torchrun, as in Kubernetes pods.

Two sides:
- the pod's entry point, `python -m training.torchrun` (the image's CMD): it finds which
  node of the launch spec this pod is (the StatefulSet ordinal from $HOSTNAME, a JobSet's
  $JOB_COMPLETION_INDEX, or torchrun's own $PET_NODE_RANK), then runs torchrun for it with
  static rendezvous at the spec's master address: `--nnodes` = every node of the spec,
  `--node-rank` = the node's index in spec order, `--nproc-per-node` = its workers;
- the worker's side, `python -m training.worker --torchrun`: the node and local rank come
  from torchrun's environment (GROUP_RANK, LOCAL_RANK), checked against the spec (RANK
  must be the node's first rank + LOCAL_RANK, WORLD_SIZE the spec's), and the worker uses
  torchrun's store (TORCHELASTIC_USE_AGENT_STORE) instead of opening its own on the same
  port.

`geotrain launch` (hosts) is unchanged: it starts `training.worker --node --local-rank`.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from training.errors import GeotrainError, SpecError
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
    """This worker's node in the spec (torchrun's GROUP_RANK in spec order)."""
    local_rank: int
    """torchrun's LOCAL_RANK."""
    restart: int
    """torchrun's restart count: the codec's epoch, like GEOTRAIN_RESTART under launch."""


def from_env(spec: LaunchSpec, env: Mapping[str, str]) -> TorchrunRank:
    """The node and local rank torchrun gave this worker, checked against the spec."""
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise SpecError(
            f"--torchrun needs torchrun's environment but ${', $'.join(missing)} "
            "is not set; start the worker with torchrun, or pass --node and --local-rank"
        )
    nodes = _nodes(spec)
    group, local, rank = _int(env, "GROUP_RANK"), _int(env, "LOCAL_RANK"), _int(env, "RANK")
    if not 0 <= group < len(nodes):
        raise SpecError(
            f"torchrun's GROUP_RANK {group} is outside the spec's {len(nodes)} nodes; "
            f"start torchrun with --nnodes={len(nodes)}"
        )
    node = nodes[group]
    if rank != node.first_rank + local:
        raise SpecError(
            f"torchrun gave rank {rank} to local rank {local} of node {node.name}, whose "
            f"ranks start at {node.first_rank}; start every node's torchrun with "
            "--nproc-per-node = its workers and --node-rank = its index in spec order"
        )
    return TorchrunRank(node.name, local, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))


def agent_store(world_size: int, timeout: timedelta) -> Any:
    """torchrun's store as a client, when torchrun hosts it (its agent on node rank 0
    listens on MASTER_ADDR:MASTER_PORT: a store of our own there would collide)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        False,
        timeout=timeout,
    )


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
    ap = argparse.ArgumentParser(prog="python -m training.torchrun")
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
