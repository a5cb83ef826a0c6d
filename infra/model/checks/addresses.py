"""Addresses and ports: the overlay, region subnets, node addresses, the underlay and the
port ranges the regions and workers take."""

from __future__ import annotations

import itertools

from infra.model.checks.common import err, prefix_for
from infra.model.names import WORKER_HOST_OFFSET
from infra.model.schema import StackModel


def addresses(m: StackModel, source: str) -> None:
    net = m.network
    ov = net.overlay_cidr
    if ov.is_loopback or ov.is_multicast or ov.is_link_local or ov.is_reserved:
        raise err(
            source,
            "network.overlay_cidr",
            f"{ov} is a loopback, multicast, link-local or reserved block, which hosts do "
            "not route; use private space such as 10.42.0.0/16",
        )
    for i, r in enumerate(m.regions):
        for j, n in enumerate(r.pool.nodes):
            addr = n.address
            if addr.is_unspecified or addr.is_multicast or addr.is_reserved:  # and broadcast
                raise err(
                    source,
                    f"regions[{i}].pool.nodes[{j}].address",
                    f"{addr} is not a host's address (unspecified, multicast, broadcast or "
                    "reserved); give the address the operator reaches the node on",
                )
    if not net.transfer_cidr.subnet_of(net.overlay_cidr):
        raise err(
            source,
            "network.transfer_cidr",
            f"{net.transfer_cidr} is not inside "
            f"overlay_cidr {net.overlay_cidr}; pick a block inside the overlay",
        )
    for i, r in enumerate(m.regions):
        if not r.subnet.subnet_of(net.overlay_cidr):
            raise err(
                source,
                f"regions[{i}].subnet",
                f"{r.subnet} is not inside overlay_cidr "
                f"{net.overlay_cidr}; pick a subnet inside the overlay",
            )
        if r.subnet.overlaps(net.transfer_cidr):
            raise err(
                source,
                f"regions[{i}].subnet",
                f"{r.subnet} overlaps transfer_cidr {net.transfer_cidr}; move one of them",
            )
        need = WORKER_HOST_OFFSET + len(r.pool.nodes) + 1
        if r.subnet.num_addresses < need:
            raise err(
                source,
                f"regions[{i}].subnet",
                f"{r.subnet} holds {r.subnet.num_addresses} addresses but "
                f"{len(r.pool.nodes)} nodes need {need} (gateway .1, workers from "
                f".{WORKER_HOST_OFFSET}, broadcast); use /{prefix_for(need)} or larger",
            )
    for (i, a), (j, b) in itertools.combinations(enumerate(m.regions), 2):
        if a.subnet.overlaps(b.subnet):
            raise err(
                source,
                f"regions[{j}].subnet",
                f"{b.subnet} overlaps regions[{i}] "
                f"({a.name}) subnet {a.subnet}; region subnets must not overlap",
            )
    if net.underlay_cidr.overlaps(net.overlay_cidr):
        raise err(
            source,
            "network.underlay_cidr",
            f"{net.underlay_cidr} overlaps the overlay "
            f"{net.overlay_cidr}; the underlay must be separate",
        )
    lab = any(r.pool.kind == "lab" for r in m.regions)
    need = 2 * len(net.links)  # two cables per link: gateway - relay - gateway
    if lab and net.underlay_cidr.num_addresses // 4 < need:
        raise err(
            source,
            "network.underlay_cidr",
            f"{net.underlay_cidr} holds {net.underlay_cidr.num_addresses // 4} /30 cables, "
            f"{need} needed (two per link); use /{prefix_for(4 * need)} or larger",
        )
    seen: dict[str, str] = {}
    for i, r in enumerate(m.regions):
        for j, n in enumerate(r.pool.nodes):
            if r.pool.kind not in ("ssh",):
                continue
            path = f"regions[{i}].pool.nodes[{j}].address"
            if n.address in net.overlay_cidr:
                raise err(
                    source,
                    path,
                    f"{n.address} is inside overlay_cidr {net.overlay_cidr}; give the address "
                    "the operator reaches the host on (its underlay address)",
                )
            if str(n.address) in seen:
                raise err(
                    source,
                    path,
                    f"{n.address} is also node {seen[str(n.address)]}'s address; one host "
                    "serves one node",
                )
            seen[str(n.address)] = n.name


def ports(m: StackModel, source: str) -> None:
    net, mon = m.network, m.monitoring
    last = net.wireguard_port + len(m.regions) - 1
    if last > 65535:
        raise err(
            source,
            "network.wireguard_port",
            f"{net.wireguard_port} + one port per region ends at {last} > 65535; "
            f"use at most {65535 - len(m.regions) + 1}",
        )
    if mon.metrics_port:
        shared = any(r.pool.kind == "local" for r in m.regions)
        span = (
            sum(n.gpus for r in m.regions for n in r.pool.nodes)
            if shared
            else max(n.gpus for r in m.regions for n in r.pool.nodes)
        )
        end = mon.metrics_port + span - 1
        if end > 65535:
            raise err(
                source,
                "monitoring.metrics_port",
                f"{mon.metrics_port} + {span} worker ports ends at {end} > 65535; "
                f"use at most {65535 - span + 1}",
            )
        port = m.training.rendezvous_port
        if mon.metrics_port <= port <= end:
            raise err(
                source,
                "training.rendezvous_port",
                f"{port} collides with the runtime metrics ports {mon.metrics_port}-{end}; "
                "move one of them",
            )
