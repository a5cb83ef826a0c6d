"""Gloo bound to one address: the node's private (region-subnet) address.

Gloo's default device binds, and advertises to its peers, the first IPv4 address of the
interface named by GLOO_SOCKET_IFNAME (or what the hostname resolves to). A host whose
LAN interface also carries its public or datacenter address would then listen on that
one: peers in other regions reach only the overlay, and the host firewall admits worker
traffic only from the overlay, so the collective would hang. torch offers no
environment setting for an address, so every gloo group of a worker is created through a
registered backend whose device is `ProcessGroupGloo.create_device(hostname=address)`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

NAME = "geogloo"
_bound: str | None = None


def bind(address: str) -> str:
    """Register the bound gloo backend for this process (once); returns its name."""
    global _bound
    if _bound is not None:
        if _bound != address:
            raise RuntimeError(f"gloo is already bound to {_bound}, not {address}")
        return NAME

    from torch.distributed import ProcessGroupGloo

    def create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=address)]
        return ProcessGroupGloo(store, rank, size, opts)

    dist.Backend.register_backend(NAME, create, devices=["cpu"])
    _bound = address
    return NAME


def backend() -> str:
    """The gloo backend name this process uses: bound when bind() ran, else plain gloo
    (tests and tools that run every rank on loopback)."""
    return NAME if _bound is not None else "gloo"
