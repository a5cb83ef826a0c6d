"""One training rank: `python -m training.worker --spec FILE --node NAME --local-rank I`,
or under torchrun `python -m training.worker --torchrun[=NODE] --spec FILE`
(training.launch.torchrun).

Reads only the launch spec. Every check that can fail on bad input (key file, data shard,
world size) runs before the process group starts, so a bad spec fails fast and clearly.

The rank's parts live by responsibility: training.job (the checks and setup),
training.resume (what a checkpoint holds, and the resume), training.gradsync (the
per-step sync and the periodic merge), training.loop (the steps and the run);
fault_tolerance runs training.ft.loop instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from training import loop
from training.errors import GeotrainError
from training.launch import torchrun
from training.spec import LaunchSpec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.worker")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--node")
    ap.add_argument("--local-rank", type=int)
    ap.add_argument(
        "--torchrun", nargs="?", const="", help="under torchrun: its env gives the rank (NODE)"
    )
    a = ap.parse_args(argv)
    if a.torchrun is None and (a.node is None or a.local_rank is None):
        ap.error("--node and --local-rank are required (or --torchrun under torchrun)")
    torch.set_num_threads(int(os.environ.get("GEOTRAIN_THREADS", "1")))
    events = os.environ.get("GEOTRAIN_EVENTS")
    run_dir = os.environ.get("GEOTRAIN_RUN_DIR")
    spec: LaunchSpec | None = None
    try:
        spec = LaunchSpec.load(a.spec)
        if a.torchrun is not None:  # =NODE: torchrun's rendezvous does not number nodes
            t = torchrun.enter(spec, a.torchrun or None, os.environ)
            a.node, a.local_rank = t.node, t.local_rank
            os.environ["GEOTRAIN_TORCHRUN"] = json.dumps(t.fields())  # for the start event
        run = _loop_for(spec)
        run(
            spec,
            a.node,
            a.local_rank,
            Path(events) if events else None,
            Path(run_dir) if run_dir else None,
        )
    except GeotrainError as e:
        print(f"geotrain worker {a.node}/{a.local_rank}: error: {e}", file=sys.stderr)
        torchrun.record_failure(events, spec, a.node, a.local_rank, e)
        _exit(e.exit_code)
    _exit(0)


def _loop_for(spec: LaunchSpec) -> Callable[..., None]:
    """The training loop of the spec: regions as torchft replica groups under
    fault_tolerance (imported only then: it loads torchft), else the fixed-world loop."""
    if spec.fault_tolerance is not None:
        from training.ft import loop as ft_loop

        return ft_loop.run
    return loop.run


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown: with torch, gloo and the store loaded it
    took 2.4 s after the last line of a run (measured on the two-node stack), which every
    launcher and restart waits for. Every file the worker writes is closed by then (events,
    ledger, checkpoints); only stdio is buffered."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
