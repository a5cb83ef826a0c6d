"""The run's rendezvous store for torchrun's c10d rendezvous, bound to the master address
only: `python -m training.launch.rdzv_host ADDR PORT`.

torchrun's c10d backend, when it hosts the store itself, binds its TCPStore to every
interface. The launcher of the node that holds rank 0 runs this process instead (in the
lab, inside the node's namespace, where the address lives) and every torchrun joins it as
a client (`--rdzv-conf=is_host=false`). It serves until it is stopped (SIGTERM), and dies
with its launcher (training.launch.launcher.spawn). Killed by a signal, the launcher starts
it again on the same address and port (its state, the rendezvous, is gone: the agents
start again too).
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

from training.comm.session import rendezvous_store

TIMEOUT = timedelta(seconds=600)


def main(argv: list[str] | None = None) -> None:
    addr, port = (argv if argv is not None else sys.argv[1:])[:2]
    # no interpreter teardown: with torch loaded it takes seconds the launcher waits for
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    store = rendezvous_store(addr, int(port), 1, True, TIMEOUT)
    print(f"rendezvous store on {addr}:{port}", flush=True)
    while store is not None:  # the store serves from its own thread
        signal.pause()


if __name__ == "__main__":
    main()
