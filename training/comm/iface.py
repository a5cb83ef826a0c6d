"""Which interface NCCL (and plain gloo) use inside a region.

NCCL has no setting for an address, only for interfaces (NCCL_SOCKET_IFNAME), and it
advertises the *first* IPv4 address of the interface it picks; left alone, it picks the
first interface that is not loopback or docker, which on a cloud or SSH host may be one
that only the internet reaches. So every worker names, before its NCCL group exists, the
interface that holds its private (region-subnet) address: the LAN of its region.

On an SSH host the agent adds the private address beside the LAN address the host came
with, so the address NCCL advertises is the LAN one; the host firewall therefore admits
TCP from the region's own hosts' LAN addresses (infra/render/host.py, `_region_peers`).
On a cloud instance the private address is the NIC's first one. The same selection is
given to gloo as GLOO_SOCKET_IFNAME, which tools that create plain gloo groups honour
the same way (the runtime's own gloo groups bind the private address itself:
training/comm/gloo.py); the fleet test proves the pair with gloo, this machine having no
NCCL.
"""

from __future__ import annotations

import os
import socket

from pyroute2 import IPRoute

from training.errors import SpecError

VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 `address` (None: no interface has it)."""
    with IPRoute() as ipr:
        for a in ipr.get_addr(family=socket.AF_INET):
            if a.get_attr("IFA_ADDRESS") == address or a.get_attr("IFA_LOCAL") == address:
                return str(ipr.get_links(a["index"])[0].get_attr("IFLA_IFNAME"))
    return None


def socket_env(address: str, node: str) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME naming the interface of `address`, the
    node's private address. NCCL's `=` prefix asks for that exact name, not every
    interface that starts with it (eth1 would also match eth10)."""
    name = interface_of(address)
    if name is None:
        raise SpecError(
            f"node {node}: no interface holds its private address {address}, so NCCL "
            "cannot be told which network to use; run `pulumi up` (the agent adds the "
            "address) or check the node's address in the stack"
        )
    return {"NCCL_SOCKET_IFNAME": f"={name}", "GLOO_SOCKET_IFNAME": name}


def apply_socket_env(address: str, node: str) -> dict[str, str]:
    """Set the pair in this process's environment unless the operator set either (their
    choice wins: an InfiniBand or EFA fabric is named by them); returns what was set."""
    if any(v in os.environ for v in VARIABLES):
        return {}
    chosen = socket_env(address, node)
    os.environ.update(chosen)
    return chosen
