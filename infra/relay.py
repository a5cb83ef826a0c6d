"""A UDP delay relay: the lab's way to give a link its latency (this kernel has no netem,
fq or etf qdisc, so nothing in it can hold a packet for a time). It sits in the middle of
a lab cable, in its own namespace, and forwards each WireGuard datagram to the other
gateway `delay` later, both ways:

    gateway A --cable-- [A-side socket  relay  B-side socket] --cable-- gateway B

A's WireGuard endpoint for B is the relay's A-side address with B's listen port; the
relay sends on from its B-side socket, bound to the address and port B expects A at, so
each gateway sees one steady peer. Bandwidth is not the relay's business: the host agent
shapes each WireGuard interface with tc.

One thread, no per-packet timer: every datagram gets the same delay, so its deadline is
later than every one before it and a FIFO of (deadline, datagram) per direction is kept
in deadline order by appending (order is kept by construction). The loop drains whatever
each socket holds, sends what is due, and sleeps in poll until the next deadline or the
next datagram. Socket buffers are large so a burst that arrives while the loop is off the
CPU waits in the kernel instead of being dropped (benchmarks/lab_network.py measures the
relay's own ceiling against the asyncio relay it replaced).

    python -m infra.relay A_SIDE_IP PORT_OF_B A_IP PORT_OF_A B_SIDE_IP B_IP DELAY_MS
"""

from __future__ import annotations

import collections
import select
import socket
import sys
import time
from dataclasses import dataclass, field

SOCKET_BUFFER = 8 << 20
"""Bytes of kernel buffer per socket and way. The kernel charges a datagram's whole
buffer (2-4 KiB for a 1,452-byte WireGuard datagram), so 8 MiB is ~2,000-4,000 datagrams:
60-120 ms at 400 Mbit/s, room for the loop to lose the CPU for a while on a loaded host
(the default 208 KiB is ~2 ms)."""
MAX_QUEUED = 64 << 20
"""Bytes a direction may hold in flight (delay x rate: 200 Mbit/s x 90 ms = 2.25 MB);
beyond it a datagram is dropped, as a router's full queue would."""
DRAIN = 512
"""Most datagrams read from one socket before the loop sends what is due again, so a
flood one way cannot hold up the other way's deadlines."""
MAX_DATAGRAM = 65535
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # <asm-generic/socket.h>; not in Python's socket


@dataclass
class Way:
    """One direction: datagrams read from `src` go out of `dst` to `target`."""

    src: socket.socket
    """The socket this way's datagrams arrive on."""
    dst: socket.socket
    """The other side's socket, which they leave from (the address the peer expects)."""
    target: tuple[str, int]
    """The gateway they are for."""
    queue: collections.deque[tuple[float, bytes]] = field(default_factory=collections.deque)
    """(deadline, datagram), oldest first; deadlines never decrease (one constant delay)."""
    queued: int = 0
    """Bytes in `queue`."""
    dropped: int = 0
    """Datagrams dropped because `queue` held MAX_QUEUED bytes."""

    def take(self, now: float, delay_s: float) -> None:
        """Read what the socket holds (up to DRAIN datagrams), each due at now + delay."""
        deadline, recv, q = now + delay_s, self.src.recv, self.queue
        for _ in range(DRAIN):
            try:
                data = recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionRefusedError:  # an ICMP error for an earlier send: no datagram
                continue
            if self.queued + len(data) > MAX_QUEUED:
                self.dropped += 1
                continue
            q.append((deadline, data))
            self.queued += len(data)

    def send_due(self, now: float) -> bool:
        """Send every datagram whose deadline has passed; False if the socket was full
        (the rest wait for the next round)."""
        q, sendto, target = self.queue, self.dst.sendto, self.target
        while q and q[0][0] <= now:
            data = q[0][1]
            try:
                sendto(data, target)
            except (BlockingIOError, InterruptedError):
                return False
            except ConnectionRefusedError:  # the gateway is not listening yet: lost, as on a wire
                pass
            q.popleft()
            self.queued -= len(data)
        return True


def bind(addr: tuple[str, int]) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        # the FORCE options pass net.core.[rw]mem_max as root (the lab); without
        # CAP_NET_ADMIN (the unit tests) the plain option, capped there
        try:
            s.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)
        except PermissionError:
            s.setsockopt(socket.SOL_SOCKET, plain, SOCKET_BUFFER)
    s.setblocking(False)
    s.bind(addr)
    return s


def run(
    a_side: tuple[str, int], a: tuple[str, int], b_side: tuple[str, int], b: tuple[str, int],
    delay_ms: float,
) -> None:  # fmt: skip
    sa, sb = bind(a_side), bind(b_side)
    ways = (Way(sa, sb, b), Way(sb, sa, a))  # from A on to B from the B-side socket; back
    by_fd = {w.src.fileno(): w for w in ways}
    poller = select.poll()
    for w in ways:
        poller.register(w.src, select.POLLIN)
    delay_s = delay_ms / 1000
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        blocked = False
        for w in ways:
            blocked |= not w.send_due(now)
        heads = [w.queue[0][0] for w in ways if w.queue]
        if blocked:
            timeout_ms: float | None = 1.0  # a full send buffer drains in well under 1 ms
        elif heads:
            timeout_ms = max(0.0, (min(heads) - now) * 1000)  # poll rounds up to whole ms
        else:
            timeout_ms = None
        ready = poller.poll(timeout_ms)
        now = time.monotonic()
        for fd, _ in ready:
            by_fd[fd].take(now, delay_s)


def main(argv: list[str]) -> None:
    a_side_ip, port_b, a_ip, port_a, b_side_ip, b_ip, delay = argv
    run(
        (a_side_ip, int(port_b)),
        (a_ip, int(port_a)),
        (b_side_ip, int(port_a)),
        (b_ip, int(port_b)),
        float(delay),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
