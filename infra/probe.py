"""Small network probes run inside lab namespaces (tests and benchmarks): a UDP echo, a
prober that timestamps replies, a round-trip timer, and a raw-socket capture that counts
frames holding a marker. Run as `python -m infra.probe echo|probe|rtt|capture ...`."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time


def echo(host: str, port: int, seconds: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, port))
    s.settimeout(0.2)
    print(json.dumps({"ready": True}), flush=True)  # callers wait for this, not a sleep
    end = time.monotonic() + seconds
    got = []
    while time.monotonic() < end:
        try:
            data, addr = s.recvfrom(2048)
        except TimeoutError:
            continue
        got.append(data[:64].decode(errors="replace"))
        s.sendto(data, addr)
    print(json.dumps({"received": got[:5], "count": len(got)}))


def probe(host: str, port: int, seconds: float, interval: float = 0.01) -> None:
    """Send a datagram every `interval`; print the monotonic times replies arrived."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    replies: list[float] = []
    start = time.monotonic()
    seq = 0
    while time.monotonic() - start < seconds:
        with contextlib.suppress(OSError):  # no route for a moment during failover
            s.sendto(f"probe {seq}".encode(), (host, port))
        seq += 1
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline:
            try:
                s.recvfrom(2048)
                replies.append(time.monotonic() - start)
            except (BlockingIOError, ConnectionRefusedError):
                time.sleep(0.001)
    print(json.dumps({"sent": seq, "replies": replies}))


def rtt(host: str, port: int, count: int) -> None:
    """Round trips to an echo server, one at a time: print the seconds each took."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2.0)
    out = []
    for seq in range(count):
        t0 = time.monotonic()
        s.sendto(f"rtt {seq}".encode(), (host, port))
        try:
            while s.recv(2048) != f"rtt {seq}".encode():  # a late reply to an earlier probe
                pass
        except TimeoutError:
            continue
        out.append(time.monotonic() - t0)
    print(json.dumps({"sent": count, "rtts": out}))


def capture(ifname: str, seconds: float, marker: str) -> None:
    """Count frames on `ifname` and those containing `marker` (AF_PACKET, all protocols)."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    s.bind((ifname, 0))
    s.settimeout(0.2)
    print(json.dumps({"ready": True}), flush=True)
    end = time.monotonic() + seconds
    frames = hits = 0
    m = marker.encode()
    while time.monotonic() < end:
        try:
            frame = s.recv(65535)
        except TimeoutError:
            continue
        frames += 1
        hits += m in frame
    print(json.dumps({"frames": frames, "marker_frames": hits}))


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "echo":
        echo(rest[0], int(rest[1]), float(rest[2]))
    elif cmd == "probe":
        probe(rest[0], int(rest[1]), float(rest[2]))
    elif cmd == "rtt":
        rtt(rest[0], int(rest[1]), int(rest[2]))
    elif cmd == "capture":
        capture(rest[0], float(rest[1]), rest[2])
