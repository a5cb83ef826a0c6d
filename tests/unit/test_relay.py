"""The lab's delay relay (infra/relay.py) on loopback: each datagram arrives once, in
order, no earlier than the configured delay, from the one address the gateway expects,
both ways at once. Its speed is benchmarks/lab_network.py's business, not a test's."""

from __future__ import annotations

import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from infra import relay

DELAY_MS = 40.0
COUNT = 1500
"""Datagrams each way: 1,400 bytes in bursts of 30 every 10 ms, ~34 Mbit/s each way."""
HEADER = struct.Struct("!Id")  # sequence number, send time (time.monotonic)


@dataclass
class Rig:
    a: socket.socket
    """Gateway A's socket (127.0.0.1, port_a)."""
    b: socket.socket
    """Gateway B's socket (127.0.0.4, port_b)."""
    a_side: tuple[str, int]
    """The relay's socket on A's cable: A sends here to reach B."""
    b_side: tuple[str, int]
    """The relay's socket on B's cable: B sends here to reach A."""


def _socket(ip: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind((ip, 0))
    s.settimeout(5.0)
    return s


@pytest.fixture
def rig() -> Iterator[Rig]:
    a, b = _socket("127.0.0.1"), _socket("127.0.0.4")
    port_a, port_b = a.getsockname()[1], b.getsockname()[1]
    argv = ["127.0.0.2", str(port_b), "127.0.0.1", str(port_a), "127.0.0.3", "127.0.0.4"]
    p = subprocess.Popen(
        [sys.executable, "-m", "infra.relay", *argv, str(DELAY_MS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        yield Rig(a, b, ("127.0.0.2", port_b), ("127.0.0.3", port_a))
    finally:
        p.kill()
        p.wait()
        a.close()
        b.close()


def _send(s: socket.socket, to: tuple[str, int]) -> None:
    pad = bytes(1400 - HEADER.size)
    for seq in range(COUNT):
        s.sendto(HEADER.pack(seq, time.monotonic()) + pad, to)
        if seq % 30 == 29:
            time.sleep(0.01)  # pacing, not synchronisation


def _receive(s: socket.socket, got: list[tuple[int, float, tuple[str, int]]]) -> None:
    try:
        while len(got) < COUNT:
            data, addr = s.recvfrom(2048)
            seq, sent = HEADER.unpack_from(data)
            got.append((seq, time.monotonic() - sent, addr))
    except TimeoutError:
        pass  # the assertions below say what went missing


def test_relay_delivers_every_datagram_in_order_after_the_delay_both_ways(rig: Rig) -> None:
    at_b: list[tuple[int, float, tuple[str, int]]] = []
    at_a: list[tuple[int, float, tuple[str, int]]] = []
    threads = [
        threading.Thread(target=_receive, args=(rig.b, at_b)),
        threading.Thread(target=_receive, args=(rig.a, at_a)),
        threading.Thread(target=_send, args=(rig.a, rig.a_side)),
        threading.Thread(target=_send, args=(rig.b, rig.b_side)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # B hears A from the relay's B-side socket (bound to A's port), A hears B from the
    # A-side one: each gateway sees one steady peer
    for got, peer in ((at_b, rig.b_side), (at_a, rig.a_side)):
        assert [seq for seq, _, _ in got] == list(range(COUNT))  # none lost, none reordered
        assert {addr for _, _, addr in got} == {peer}
        delays = [d for _, d, _ in got]
        assert min(delays) >= DELAY_MS / 1000  # never early
        # late only by the loop's wake-up (poll rounds up to 1 ms) and this machine's load
        assert statistics.median(delays) < (DELAY_MS + 20) / 1000


def test_relay_drops_what_overflows_its_queue_and_keeps_the_order_of_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay, "MAX_QUEUED", 10_000)  # room for 7 datagrams of 1,400 bytes
    src, dst = _socket("127.0.0.1"), _socket("127.0.0.1")
    sink = _socket("127.0.0.1")
    try:
        src.setblocking(False)
        way = relay.Way(src, dst, sink.getsockname())
        for seq in range(10):
            dst.sendto(seq.to_bytes(4, "big") + bytes(1396), src.getsockname())
        deadline = time.monotonic() + 5  # loopback delivers at sendto; a bound all the same
        while len(way.queue) + way.dropped < 10 and time.monotonic() < deadline:
            way.take(now=100.0, delay_s=1.0)
        assert (len(way.queue), way.dropped) == (7, 3)
        assert way.send_due(now=100.5) and len(way.queue) == 7  # nothing due before 101
        assert way.send_due(now=101.0) and not way.queue and way.queued == 0
        seqs = [int.from_bytes(sink.recvfrom(2048)[0][:4], "big") for _ in range(7)]
        assert seqs == list(range(7))
    finally:
        for s in (src, dst, sink):
            s.close()
