"""The interface NCCL (and plain gloo) are told to use: the one of the private address."""

from __future__ import annotations

import pytest

from training.comm import iface
from training.errors import SpecError


def test_the_interface_of_an_address_is_the_one_that_holds_it() -> None:
    assert iface.interface_of("127.0.0.1") == "lo"
    assert iface.interface_of("192.0.2.254") is None  # TEST-NET-1: no host has it


def test_nccl_gets_the_exact_interface_name_and_gloo_the_same_one() -> None:
    assert iface.socket_env("127.0.0.1", "bj-0") == {
        "NCCL_SOCKET_IFNAME": "=lo",
        "GLOO_SOCKET_IFNAME": "lo",
    }


def test_an_address_no_interface_holds_is_refused_with_the_node_and_the_fix() -> None:
    with pytest.raises(
        SpecError, match=r"node bj-1: no interface holds .* 192\.0\.2\.254.*pulumi up"
    ):
        iface.socket_env("192.0.2.254", "bj-1")


def test_the_operators_own_choice_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in iface.VARIABLES:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert iface.apply_socket_env("127.0.0.1", "bj-0") == {}
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert iface.apply_socket_env("127.0.0.1", "bj-0") == {
        "NCCL_SOCKET_IFNAME": "=lo",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
