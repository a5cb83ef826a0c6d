"""Regions of one rank each on this machine, as separate processes that can be killed with
-9 and restarted (training.ft.quorum): the harness of tests/integration/test_region_drop.py
and benchmarks/region_drop.py. Workers fork from a server that imported torch and the
worker once."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from training import worker
from training.ft.quorum import advertised, start_lighthouse
from training.observe.report import complete_events
from training.spec import CheckpointSpec, FaultToleranceSpec
from training.testing import PRELOAD, make_spec


def free_base(n: int) -> int:
    """A port p with p .. p + n - 1 free on loopback (the regions' stores)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n < 65535 and all(_free(base + i) for i in range(n)):
            return base
    raise OSError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RegionRun:
    """A spec on disk, a Lighthouse in this process, and one worker process per region
    (`regions` x 1 rank on loopback). `kw`: LaunchSpec overrides, plus quorum_timeout_s,
    heartbeat_timeout_s and checkpoint_every."""

    def __init__(self, tmp: Path, regions: int, steps: int, min_replicas: int, **kw: Any):
        ft = FaultToleranceSpec(
            lighthouse="127.0.0.1:0",
            min_replicas=min_replicas,
            store_port=free_base(regions),
            join_timeout_s=0.5,
            heartbeat_timeout_s=kw.pop("heartbeat_timeout_s", 8.0),
            timeout_s=10.0,
            quorum_timeout_s=kw.pop("quorum_timeout_s", 60.0),
        )
        every = kw.pop("checkpoint_every", 1000)
        self.lighthouse = start_lighthouse(ft)
        addr = advertised(ft, self.lighthouse)
        key = tmp / "run.key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        self.spec = make_spec(
            regions,
            1,
            steps=steps,
            batch_size=2,
            seq_len=32,
            key_file=str(key),
            metrics_port=0,
            checkpoint=CheckpointSpec(
                dir=str(tmp / "ckpt"), interval_steps=every, interval_minutes=60
            ),
            fault_tolerance=replace(ft, lighthouse=addr),
            **kw,
        )
        self.path = tmp / "spec.json"
        self.path.write_text(self.spec.to_json())
        self.tmp = tmp
        self.procs: dict[int, Any] = {}

    def start(self, region: int) -> None:
        """`python -m training.worker --node n<region> --local-rank 0`, forked from a server
        that imported torch and the worker once (a fresh interpreter costs ~3.5 s of CPU)."""
        argv = ["--spec", str(self.path), "--node", f"n{region}", "--local-rank", "0"]
        p = CTX.Process(
            target=_worker,
            args=(argv, str(self.events(region)), str(self.tmp / f"err{region}.log")),
        )
        p.start()
        self.procs[region] = p

    def events(self, region: int) -> Path:
        return self.tmp / f"events{region}.jsonl"

    def log(self, region: int) -> list[dict[str, Any]]:
        p = self.events(region)
        if not p.exists():
            return []
        return complete_events(p.read_bytes())

    def wait(self, what: str, ok: Callable[[], bool], seconds: float = 90) -> None:
        deadline = time.monotonic() + seconds
        while not ok():
            dead = {r: p.exitcode for r, p in self.procs.items() if p.exitcode not in (None, 0)}
            if time.monotonic() > deadline or dead:
                errs = {r: (self.tmp / f"err{r}.log").read_text()[-1500:] for r in self.procs}
                raise AssertionError(f"waiting for {what}; exited {dead}; stderr {errs}")
            time.sleep(0.05)

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join()
        self.lighthouse.shutdown()


def _worker(argv: list[str], events: str, err: str) -> None:
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.environ["GEOTRAIN_EVENTS"] = events
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    worker.main(argv)


CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload([*PRELOAD, "training.worker", "training.ft.loop"])


def steps_of(log: list[dict[str, Any]]) -> list[int]:
    return [e["step"] for e in log if e["event"] == "step"]


def done_of(log: list[dict[str, Any]]) -> dict[str, Any]:
    return next(e for e in log if e["event"] == "done")
