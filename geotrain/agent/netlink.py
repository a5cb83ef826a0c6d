"""Interfaces, addresses and routes through netlink (pyroute2), not parsed `ip` output.

Every function is idempotent and says whether it changed anything.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError


def _index(ipr: IPRoute, ifname: str) -> int | None:
    found = ipr.link_lookup(ifname=ifname)
    return int(found[0]) if found else None


def interface_near(address: str | None) -> str | None:
    """The interface holding `address`; else the one of the IPv4 default route."""
    with IPRoute() as ipr:
        if address:
            for a in ipr.get_addr(family=socket.AF_INET):
                if a.get_attr("IFA_ADDRESS") == address:
                    return str(ipr.get_links(a["index"])[0].get_attr("IFLA_IFNAME"))
        for r in ipr.get_default_routes(family=socket.AF_INET):
            oif = r.get_attr("RTA_OIF")
            if oif is not None:
                return str(ipr.get_links(oif)[0].get_attr("IFLA_IFNAME"))
    return None


def has_link(ifname: str) -> bool:
    with IPRoute() as ipr:
        return _index(ipr, ifname) is not None


def has_address(ifname: str, cidr: str) -> bool:
    iface = ipaddress.IPv4Interface(cidr)
    with IPRoute() as ipr:
        idx = _index(ipr, ifname)
        if idx is None:
            return False
        return any(
            a.get_attr("IFA_ADDRESS") == str(iface.ip) and a["prefixlen"] == iface.network.prefixlen
            for a in ipr.get_addr(index=idx, family=socket.AF_INET)
        )


def add_address(ifname: str, cidr: str) -> bool:
    iface = ipaddress.IPv4Interface(cidr)
    with IPRoute() as ipr:
        idx = _index(ipr, ifname)
        if idx is None:
            raise ValueError(f"interface {ifname} does not exist")
        try:
            ipr.addr("add", index=idx, address=str(iface.ip), prefixlen=iface.network.prefixlen)
        except NetlinkError as e:
            if e.code == errno.EEXIST:
                return False
            raise
        return True


def del_address(ifname: str, cidr: str) -> bool:
    iface = ipaddress.IPv4Interface(cidr)
    with IPRoute() as ipr:
        idx = _index(ipr, ifname)
        if idx is None:
            return False
        try:
            ipr.addr("del", index=idx, address=str(iface.ip), prefixlen=iface.network.prefixlen)
        except NetlinkError as e:
            if e.code in (errno.EADDRNOTAVAIL, errno.ENOENT, errno.ESRCH):
                return False
            raise
        return True


def add_route(dst: str, via: str) -> bool:
    with IPRoute() as ipr:
        try:
            ipr.route("add", dst=dst, gateway=via)
        except NetlinkError as e:
            if e.code == errno.EEXIST:
                return False
            raise
        return True


def del_route(dst: str, via: str) -> bool:
    with IPRoute() as ipr:
        try:
            ipr.route("del", dst=dst, gateway=via)
        except NetlinkError as e:
            if e.code in (errno.ESRCH, errno.ENOENT):
                return False
            raise
        return True


def kernel_wireguard() -> bool:
    """Whether the kernel has WireGuard (else wg-quick must use wireguard-go)."""
    if Path("/sys/module/wireguard").exists():
        return True
    with IPRoute() as ipr:
        name = "gtwgprobe0"
        try:
            ipr.link("add", ifname=name, kind="wireguard")
        except NetlinkError:
            return False
        ipr.link("del", ifname=name)
        return True
