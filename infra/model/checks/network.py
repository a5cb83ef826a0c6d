"""Links between regions: known ends, one per pair, room in transfer_cidr, every region
reachable; and the interface names the links derive."""

from __future__ import annotations

from infra.model.checks.common import err
from infra.model.names import ifname
from infra.model.schema import StackModel


def links(m: StackModel, source: str) -> None:
    names = [r.name for r in m.regions]
    pairs: dict[frozenset[str], int] = {}
    for i, link in enumerate(m.network.links):
        for end in ("a", "b"):
            value = getattr(link, end)
            if value not in names:
                raise err(
                    source,
                    f"network.links[{i}].{end}",
                    f"unknown region '{value}'; use one of {', '.join(names)}",
                )
        if link.a == link.b:
            raise err(
                source,
                f"network.links[{i}]",
                f"links {link.a} to itself; a link joins two different regions",
            )
        key = frozenset((link.a, link.b))
        if key in pairs:
            raise err(
                source,
                f"network.links[{i}]",
                f"duplicate link {link.a}-{link.b} "
                f"(also links[{pairs[key]}]); one link per region pair",
            )
        pairs[key] = i
    need = len(m.network.links) * 2
    if need > m.network.transfer_cidr.num_addresses:
        raise err(
            source,
            "network.transfer_cidr",
            f"{m.network.transfer_cidr} holds "
            f"{m.network.transfer_cidr.num_addresses // 2} /31 tunnels, {need // 2} "
            "needed; use a larger block",
        )
    if len(m.regions) > 1 and not m.network.links and m.regions[0].pool.kind != "local":
        raise err(
            source,
            "network.links",
            "no links between regions; add at least one "
            "link per region so every region is reachable",
        )
    if m.network.links and len(m.regions) > 1:  # the overlay must reach every region
        reach = reachable(m.regions[0].name, [(lk.a, lk.b) for lk in m.network.links])
        cut = [r.name for r in m.regions if r.name not in reach]
        if cut:
            raise err(
                source,
                "network.links",
                f"no path of links from {m.regions[0].name} to {', '.join(cut)}: the "
                "regions' gradients could not meet; add a link to each of them",
            )


def reachable(start: str, links: list[tuple[str, str]]) -> set[str]:
    """The regions a path of links joins to `start` (itself included); the policy pack's
    network-integrity check reads it too."""
    reach, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for a, b in links:
            for x, y in ((a, b), (b, a)):
                if x == here and y not in reach:
                    reach.add(y)
                    todo.append(y)
    return reach


def interface_names(m: StackModel, source: str) -> None:
    """Derived interface names must be distinct per gateway (they name config files, units
    and BGP neighbours)."""
    names = [r.name for r in m.regions]
    for prefix in ("wg-", "u-"):
        seen: dict[str, str] = {}
        for i, name in enumerate(names):
            derived = ifname(prefix, name)
            if derived in seen:
                raise err(
                    source,
                    f"regions[{i}].name",
                    f"regions '{seen[derived]}' and '{name}' both give the interface name "
                    f"'{derived}' (Linux allows 15 characters); rename one of them",
                )
            seen[derived] = name
