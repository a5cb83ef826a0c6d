"""Ranks whose hosts start minutes apart all meet: every rank waits at the store until the
whole world has joined (the process group's own rendezvous waits only 120 s)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from training.comm.session import JOINED, wait_for_all
from training.errors import RendezvousTimeout


def _waiter(store: dist.Store, world: int, wait_s: float, out: list[BaseException | None]) -> None:
    try:
        wait_for_all(store, world, timedelta(seconds=wait_s))
        out.append(None)
    except BaseException as e:  # handed to the test thread
        out.append(e)


def test_early_ranks_wait_for_the_last_one_to_join() -> None:
    store = dist.HashStore()
    out: list[BaseException | None] = []
    early = [threading.Thread(target=_waiter, args=(store, 3, 60, out)) for _ in range(2)]
    for t in early:
        t.start()
    for t in early:
        t.join(timeout=1.0)
    assert all(t.is_alive() for t in early) and not out  # still held: 2 of 3 joined
    wait_for_all(store, 3, timedelta(seconds=60))  # the late rank: nobody waits for it
    for t in early:
        t.join(timeout=30)
    assert out == [None, None]
    assert int(store.add(JOINED, 0)) == 3


def test_a_rank_that_never_comes_is_a_timeout_the_launcher_restarts() -> None:
    store = dist.HashStore()
    with pytest.raises(RendezvousTimeout, match="1 of 2 ranks reached") as e:
        wait_for_all(store, 2, timedelta(seconds=0.5))
    assert e.value.exit_code == 3  # not 2: the launcher and systemd restart, ranks meet again
