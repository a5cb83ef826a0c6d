"""The host agent removes only what it added: an address or route that was on the host
before (a cloud instance's own primary address equals the node's address) is used but
never recorded, so `geotrain node remove` leaves it; one the agent added is removed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from geotrain.agent import apply


class FakeNetlink:
    """The host's addresses and routes, as netlink would report and change them."""

    def __init__(self, addresses: set[tuple[str, str]], routes: set[tuple[str, str]]) -> None:
        self.addresses, self.routes = addresses, routes

    def interface_near(self, near: str | None) -> str:
        return "eth0"

    def add_address(self, ifname: str, cidr: str) -> bool:
        if (ifname, cidr) in self.addresses:
            return False  # EEXIST
        self.addresses.add((ifname, cidr))
        return True

    def del_address(self, ifname: str, cidr: str) -> bool:
        present = (ifname, cidr) in self.addresses
        self.addresses.discard((ifname, cidr))
        return present

    def add_route(self, dst: str, via: str) -> bool:
        if (dst, via) in self.routes:
            return False
        self.routes.add((dst, via))
        return True

    def del_route(self, dst: str, via: str) -> bool:
        present = (dst, via) in self.routes
        self.routes.discard((dst, via))
        return present


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNetlink:
    # the node's address is already the instance's primary address; its route too
    fake = FakeNetlink({("eth0", "10.42.1.4/24")}, {("10.42.0.0/16", "10.42.1.1")})
    for name in ("interface_near", "add_address", "del_address", "add_route", "del_route"):
        monkeypatch.setattr(apply.netlink, name, getattr(fake, name))
    monkeypatch.setattr(apply, "STATE_FILE", tmp_path / "state.json")
    monkeypatch.setattr(apply, "BACKUP_DIR", tmp_path / "backup")
    monkeypatch.setattr(apply, "USERSPACE_DROPIN", tmp_path / "dropin" / "x.conf")
    monkeypatch.setattr(apply, "systemctl", lambda *a, **k: None)
    return fake


def _apply(addresses: list[str], routes: list[tuple[str, str]]) -> apply.State:
    spec: Any = SimpleNamespace(
        node="bj-0",
        addresses=[SimpleNamespace(interface=None, near=None, address=a) for a in addresses],
        routes=[SimpleNamespace(dst=d, via=v) for d, v in routes],
    )
    state = apply.State.load()
    apply.Apply(Path("."), spec, SimpleNamespace(), state).addresses_and_routes()
    state.d["node"] = "bj-0"
    apply.STATE_FILE.write_text(json.dumps(state.d))
    return state


def test_an_address_and_route_that_were_there_before_survive_remove(host: FakeNetlink) -> None:
    state = _apply(["10.42.1.4/24", "10.99.0.1/32"], [("10.42.0.0/16", "10.42.1.1")])
    assert state.d["addresses"] == [{"ifname": "eth0", "address": "10.99.0.1/32"}]
    assert state.d["routes"] == []
    apply.remove(purge=False)
    assert ("eth0", "10.42.1.4/24") in host.addresses  # the primary address stays
    assert ("10.42.0.0/16", "10.42.1.1") in host.routes
    assert ("eth0", "10.99.0.1/32") not in host.addresses  # what the agent added goes


def test_what_the_agent_added_stays_its_own_across_applies(host: FakeNetlink) -> None:
    _apply(["10.99.0.1/32"], [("10.43.0.0/16", "10.42.1.1")])
    state = _apply(["10.99.0.1/32"], [("10.43.0.0/16", "10.42.1.1")])  # an update: no change
    assert state.d["addresses"] == [{"ifname": "eth0", "address": "10.99.0.1/32"}]
    assert state.d["routes"] == [{"dst": "10.43.0.0/16", "via": "10.42.1.1"}]
    apply.remove(purge=False)
    assert ("eth0", "10.99.0.1/32") not in host.addresses
    assert ("10.43.0.0/16", "10.42.1.1") not in host.routes
