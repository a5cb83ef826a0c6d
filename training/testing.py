"""Helpers to run a function on a real multi-process gloo world on this machine (tests and
benchmarks): one TCPStore on port 0 in the parent, workers forked from a fork server,
results returned."""

from __future__ import annotations

import abc
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.spec import LaunchSpec, NodeSpec, RegionSpec, ShardSpec

REGION_NAMES = ("beijing", "frankfurt", "silicon-valley", "singapore")
JURISDICTIONS = ("CN", "EU", "US", "SG")


def make_spec(regions: int = 3, local: int | Sequence[int] = 2, **overrides: Any) -> LaunchSpec:
    """A launch spec for `regions` x `local` CPU workers on 127.0.0.1; `local` a sequence:
    workers per region (heterogeneous pools)."""
    sizes = [local] * regions if isinstance(local, int) else list(local)
    rs = []
    for i, size in enumerate(sizes):
        rs.append(
            RegionSpec(
                name=REGION_NAMES[i],
                jurisdiction=JURISDICTIONS[i],
                nodes=[
                    NodeSpec(
                        name=f"n{i}",
                        host="127.0.0.1",
                        first_rank=sum(sizes[:i]),
                        nprocs=size,
                        device="cpu",
                    )
                ],
                shards=[
                    ShardSpec(name=f"s{i}", jurisdiction=JURISDICTIONS[i], uri="pydoc-topics:auto")
                ],
            )
        )
    base: dict[str, Any] = {
        "run_id": "test-run",
        "stack": "test",
        "master_addr": "127.0.0.1",
        "master_port": 0,
        "regions": rs,
    }
    base.update(overrides)
    return LaunchSpec(**base)


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        # plain pickle copies tensors; the queue's own pickler would share memory that
        # disappears when this process exits
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException as e:  # report every failure to the parent, typed
        queue.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PRELOAD = [
    "torch",
    "torch.distributed",
    "training.sync.codec",
    "training.sync.hier",
    "training.state.checkpoint",
]
"""What the fork server imports once, so each rank starts in ~30 ms instead of importing torch
afresh (spawn: ~1.5 s of CPU per rank, 6 ranks per world, dozens of worlds per test run)."""


def _context() -> Any:
    """A fork server, not plain fork: ranks fork from a process that imported torch but never
    ran it (no thread pools, no CUDA), so they start clean, as with spawn, only faster."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_world(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120) -> list[Any]:
    """Run fn(rank, world, *args) on `world` ranks (processes); returns results by rank.
    Raises RuntimeError naming the ranks that failed (with their exception)."""
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(r, world, store.port, fn, args, queue), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, Any] = {}
    try:
        _collect(procs, queue, timeout, results, errors)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise WorldError(errors)
    return [results[r] for r in range(world)]


def _collect(
    procs: list[Any], queue: Any, timeout: float, results: dict[int, Any], errors: dict[int, Any]
) -> None:
    """Each rank's report, by rank. A rank that exits without one (os._exit, a signal) is an
    error as soon as it is seen dead, so a test of a dying rank does not wait out `timeout`."""
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    while len(results) + len(errors) < len(procs):
        try:
            rank, status, value = queue.get(timeout=0.2)
        except Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in results or r in errors or p.is_alive():
                    continue
                # its report may still be in the pipe: give the queue a second after death
                if now - dead_since.setdefault(r, now) > 1.0:
                    errors[r] = ("Died", f"exit code {p.exitcode} before reporting", "")
            if now > deadline:
                pending = [r for r in range(len(procs)) if r not in results and r not in errors]
                raise TimeoutError(f"ranks {pending} did not report within {timeout} s") from None
            continue
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            errors[rank] = value


class WorldError(RuntimeError):
    def __init__(self, errors: dict[int, Any]) -> None:
        self.errors = errors
        first = min(errors)
        super().__init__(
            f"ranks {sorted(errors)} failed; rank {first}: "
            f"{errors[first][0]}: {errors[first][1]}\n{errors[first][2]}"
        )


def join_lab_world(spec_path: str, rank: int, timeout_s: float) -> tuple[LaunchSpec, Any]:
    """A benchmark rank inside the lab (already in its node's namespace): the spec, and the
    default process group joined over the node's private address, as training.job does.
    Returns (spec, its Topology)."""
    from training.comm import gloo
    from training.comm.topology import Topology

    torch.set_num_threads(1)
    spec = LaunchSpec.load(spec_path)
    node = next(
        n for r in spec.regions for n in r.nodes if n.first_rank <= rank < n.first_rank + n.nprocs
    )
    store = dist.TCPStore(
        spec.master_addr, spec.master_port, spec.world_size, rank == 0, timedelta(seconds=timeout_s)
    )
    dist.init_process_group(
        gloo.bind(node.host), store=store, rank=rank, world_size=spec.world_size
    )
    return spec, Topology.of(spec, rank)


class PerBucket(abc.ABC):
    """A DiLoCo reducer (training.diloco.Reducer) made of a per-bucket `all_reduce`: test
    doubles that fix, gate or fail one bucket's average define only that."""

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor, step: int, bucket: int = 0) -> torch.Tensor:
        """One bucket's cross-region average."""

    def all_reduce_many(
        self, xs: Sequence[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        return [self.all_reduce(x, step, b) for x, b in zip(xs, buckets, strict=True)]

    def clear_residuals(self) -> None:  # a double keeps no residuals
        return None
