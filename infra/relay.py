"""A UDP delay relay: the lab's way to give a link its latency (the kernel here has no
netem). It sits in the middle of a lab cable, in its own namespace, and forwards each
WireGuard datagram to the other gateway `delay` later, both ways:

    gateway A --cable-- [A-side socket  relay  B-side socket] --cable-- gateway B

A's WireGuard endpoint for B is the relay's A-side address with B's listen port; the
relay sends on from its B-side socket, bound to the address and port B expects A at, so
each gateway sees one steady peer. Order is kept (one timer queue per direction).

    python -m infra.relay A_SIDE_IP PORT_OF_B A_IP PORT_OF_A B_SIDE_IP B_IP DELAY_MS
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any


class _Side(asyncio.DatagramProtocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, delay_s: float) -> None:
        self.loop = loop
        self.delay_s = delay_s
        self.transport: asyncio.DatagramTransport | None = None
        self.other: _Side | None = None
        self.target: tuple[str, int] | None = None
        """Where datagrams arriving here go, from the other side's socket."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        other = self.other
        if other is None or other.transport is None or self.target is None:
            return
        self.loop.call_later(self.delay_s, other.transport.sendto, data, self.target)


async def run(
    a_side: tuple[str, int], a: tuple[str, int], b_side: tuple[str, int], b: tuple[str, int],
    delay_ms: float,
) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    sa, sb = _Side(loop, delay_ms / 1000), _Side(loop, delay_ms / 1000)
    await loop.create_datagram_endpoint(lambda: sa, local_addr=a_side)
    await loop.create_datagram_endpoint(lambda: sb, local_addr=b_side)
    sa.other, sa.target = sb, b  # from A: on to B, from the B-side socket
    sb.other, sb.target = sa, a  # from B: back to A, from the A-side socket
    print("ready", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str]) -> None:
    a_side_ip, port_b, a_ip, port_a, b_side_ip, b_ip, delay = argv
    asyncio.run(
        run(
            (a_side_ip, int(port_b)),
            (a_ip, int(port_a)),
            (b_side_ip, int(port_a)),
            (b_ip, int(port_b)),
            float(delay),
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
