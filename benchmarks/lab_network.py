"""Issue 5 benchmark (root): the lab's up/down time, BFD failover time, and the time of one
gradient sync over the lab's WAN links shaped to 50 Mbit/s (tc tbf), geotrain's
hierarchical int8+zstd+SM4 versus one flat gloo all-reduce over all ranks, in one run.
The six workers train the demo model on their regions' data inside the lab's namespaces;
every step's gradient is synced both ways (timed) and the hierarchical result is applied.
Then the delay relay's own ceiling (issue 35): per link, unshaped, one TCP stream between
the two gateways over their tunnel, through the relay the lab runs (infra/relay.py) and
through the asyncio relay it replaced (infra/relay.py at BASELINE_RELAY), side by side;
and each relay alone on loopback, a paced UDP stream at ALONE_RATES (loss, delay).

Run: sudo .venv/bin/python benchmarks/lab_network.py [--relay-only]. Prints a table and
saves it to benchmarks/results/lab_network.md (--relay-only: prints the relay table only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
N_PARAMS = 2_452_992  # the demo model (deepseek-tiny)
BASELINE_RELAY = "14d912b7bee9ee6690e9a1331ba1d419bb4b3f0e"
"""The last commit whose infra/relay.py is the asyncio relay (one call_later per datagram)."""
BULK_S, RAMP_S = 8.0, 3.0
"""A ceiling transfer lasts BULK_S; its rate counts from RAMP_S on (TCP's slow start over
a 181 ms round trip takes ~2 s to open a 200 Mbit/s window)."""
BULK_BUFFER = 32 << 20
"""SO_SNDBUF/SO_RCVBUF of the ceiling's TCP stream: above delay x rate (200 Mbit/s x
181 ms = 4.5 MB), so the stream's window is not what is measured."""
ALONE_DELAY_MS, ALONE_RATES, ALONE_S = 90.0, (200.0, 400.0, 800.0), 3.0
"""The relay alone: the lab's longest delay (most bytes in flight), offered rates, seconds."""
DATAGRAM = 1452
"""A full WireGuard datagram's UDP payload: the tunnel MTU 1420 + 32 bytes of WireGuard."""
STAMP = struct.Struct("!Id")  # sequence number, send time (time.monotonic: one clock here)


def worker(spec_path: str, rank: int, reps: int, out: str) -> None:
    """Trains the demo model on its region's data inside its namespace; each step's
    gradient (N_PARAMS values) is synced both ways, timed, and the hierarchical result
    is what the optimizer applies."""
    import torch
    import torch.distributed as dist

    from training.comm import gloo
    from training.comm.topology import Topology, make_groups
    from training.data.loader import ByteLoader, load_region_text
    from training.models.deepseek import build_model
    from training.spec import LaunchSpec
    from training.sync.buckets import buckets as sync_buckets
    from training.sync.buckets import flat_grads, grads_of, scatter
    from training.sync.codec import Codec
    from training.sync.hier import HierarchicalAllReduce

    torch.set_num_threads(1)
    spec = LaunchSpec.load(spec_path)
    node = next(
        n for r in spec.regions for n in r.nodes if n.first_rank <= rank < n.first_rank + n.nprocs
    )
    store = dist.TCPStore(
        spec.master_addr,
        spec.master_port,
        spec.world_size,
        rank == 0,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group(
        gloo.bind(node.host), store=store, rank=rank, world_size=spec.world_size
    )
    topo = Topology.of(spec, rank)

    def new_sync() -> HierarchicalAllReduce:  # each with its own groups and residuals
        codec = Codec(spec.codec, bytes(range(32)))
        groups = make_groups(topo, torch.device("cpu"))
        return HierarchicalAllReduce(topo, groups, codec, spec.run_id)

    sync, each, many = new_sync(), new_sync(), new_sync()
    torch.manual_seed(spec.seed)
    model = build_model(spec.model)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == N_PARAMS
    text = load_region_text(spec.regions[topo.region_index], topo.region_index, topo.regions)
    loader = ByteLoader.of(text, spec.batch_size, spec.seq_len, spec.seed * 1000 + rank)
    opt = torch.optim.AdamW(params, lr=spec.lr)
    in_buckets = sync_buckets(params, spec.bucket_mb)  # the training loop's buckets
    ids = list(range(len(in_buckets)))
    times: dict[str, list[float]] = {"flat": [], "hier": [], "each": [], "many": []}
    for i in range(reps + 1):  # step 0 warms up both paths (connections, allocations)
        opt.zero_grad(set_to_none=True)
        model.loss(loader.next()).backward()
        g = flat_grads(params)
        dist.barrier()
        t0 = time.perf_counter()
        y = g.clone()
        dist.all_reduce(y)
        t_flat = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        avg = sync.all_reduce(g, step=i)
        t_hier = time.perf_counter() - t0
        flats = [flat_grads(b) for b in in_buckets]
        dist.barrier()
        t0 = time.perf_counter()
        for b, f in zip(ids, flats, strict=True):  # one exchange per bucket and stage
            each.all_reduce(f, step=i, bucket=b)
        t_each = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        many.all_reduce_many(flats, i, ids)  # one exchange per stage (the training loop's)
        t_many = time.perf_counter() - t0
        scatter(avg, grads_of(params))
        opt.step()
        if i:
            for k, v in (("flat", t_flat), ("hier", t_hier), ("each", t_each), ("many", t_many)):
                times[k].append(v)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({**times, "buckets": [len(in_buckets)]}))
    dist.destroy_process_group()


def sync_bench(plan: object, reps: int) -> dict[str, list[float]]:
    from infra.render import render_launch_spec

    spec = render_launch_spec(plan)  # type: ignore[arg-type]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = dataclasses.replace(spec, master_port=port)
    tmp = ROOT / ".geotrain" / "bench"
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path, out = tmp / "spec.json", tmp / "sync.json"
    spec_path.write_text(spec.to_json())
    procs = []
    for r in spec.regions:
        for n in r.nodes:
            for i in range(n.nprocs):
                procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            str(n.netns),
                            sys.executable,
                            __file__,
                            "--worker",
                            str(spec_path),
                            str(n.first_rank + i),
                            str(reps),
                            str(out),
                        ],
                        cwd=ROOT,
                        env={**os.environ, "OMP_NUM_THREADS": "1"},
                    )
                )
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"a sync worker failed with {p.returncode}")
    return json.loads(out.read_text())


def failover(plan: object, lab: object, runs: int) -> list[float]:
    """Seconds from cutting beijing-frankfurt to the first reply over the alternate path."""
    bj = plan.region("beijing")  # type: ignore[attr-defined]
    fra_w = next(n for n in plan.region("frankfurt").nodes if not n.is_gateway)  # type: ignore[attr-defined]
    bj_w = next(n for n in bj.nodes if not n.is_gateway)
    out = []
    for _ in range(runs):
        echo = _probe(str(fra_w.netns), "echo", fra_w.private_ip, "7100", "9")
        assert echo.stdout is not None
        echo.stdout.readline()  # bound
        t_start = time.monotonic()
        probe = _probe(str(bj_w.netns), "probe", fra_w.private_ip, "7100", "7")
        time.sleep(2.0)
        t_cut = time.monotonic() - t_start  # approximate: probe started ~ at t_start
        cable = next(
            t.a_uplink if t.a == "beijing" else t.b_uplink
            for t in plan.tunnels  # type: ignore[attr-defined]
            if {t.a, t.b} == {"beijing", "frankfurt"}
        )
        lab.sh("ip", "-n", str(bj.gateway.netns), "link", "set", cable, "down")  # type: ignore[attr-defined]
        replies = json.loads(probe.communicate()[0].splitlines()[-1])["replies"]
        lab.sh("ip", "-n", str(bj.gateway.netns), "link", "set", cable, "up")  # type: ignore[attr-defined]
        echo.communicate()
        after = [t for t in replies if t > t_cut]
        before = [t for t in replies if t <= t_cut]
        gap_start = before[-1] if before else t_cut
        resumed = next((b for a, b in itertools.pairwise(after) if b - a < 0.05), None)
        out.append((resumed - gap_start) if resumed else float("nan"))
        lab.wait_for_bgp(plan, 60)  # type: ignore[attr-defined]
    return out


def set_bfd(plan: object, interval_ms: int, multiplier: int) -> None:
    """Every gateway's BFD profile, changed live through vtysh: what
    network.bfd_interval_ms and bfd_multiplier render into frr.conf."""
    from infra.hosts import Host, find_systemd
    from infra.render.network import BFD_PROFILE

    for r in plan.regions:  # type: ignore[attr-defined]
        h = Host(r.gateway.name, str(r.gateway.netns), Path("/nonexistent"))
        h.pid = find_systemd(h.netns)
        h.exec(
            [
                "vtysh",
                *("-c", "configure terminal", "-c", "bfd", "-c", f"profile {BFD_PROFILE}"),
                *("-c", f"transmit-interval {interval_ms}"),
                *("-c", f"receive-interval {interval_ms}"),
                *("-c", f"detect-multiplier {multiplier}"),
            ]
        )


def bfd_table(plan: object, lab: object, runs: int) -> list[str]:
    """Failover under the stack's BFD timers and under 100 ms x 3, side by side in one lab
    (saved as lab_bfd.md)."""
    net = plan.network  # type: ignore[attr-defined]
    rows = []
    for interval, mult in ((net.bfd_interval_ms, net.bfd_multiplier), (100, 3)):
        set_bfd(plan, interval, mult)
        lab.wait_for_bgp(plan, 60)  # type: ignore[attr-defined]
        fo = failover(plan, lab, runs)
        rows.append(
            f"| {interval} ms x {mult} | {interval * mult / 1000:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in fo)} | {sorted(fo)[len(fo) // 2]:.2f} |"
        )
    return [
        "# Lab failover under two BFD settings (benchmarks/lab_network.py --bfd)",
        "",
        "One lab (the lab stack), beijing-frankfurt cut at its gateway's cable; seconds from "
        "the cut to the first reply over the alternate path, worker to worker. The BFD "
        "profile is changed live on every gateway between the two rows (vtysh), everything "
        "else is the stack's.",
        "",
        "| BFD | detection time s | failover s (runs) | median s |",
        "|---|---|---|---|",
        *rows,
    ]


def round_trips(plan: object) -> dict[str, float]:
    """Median round trip between two regions' ranks over each link's direct path: worker
    to worker, from the gateway where it is a region's only node."""

    def rank_node(region: str) -> Any:
        nodes = plan.region(region).nodes  # type: ignore[attr-defined]
        return next((n for n in nodes if not n.is_gateway), nodes[0])

    out = {}
    for t in plan.tunnels:  # type: ignore[attr-defined]
        src, dst = rank_node(t.a), rank_node(t.b)
        echo = _probe(str(dst.netns), "echo", dst.private_ip, "7101", "8")
        assert echo.stdout is not None
        echo.stdout.readline()  # bound
        got = _probe(str(src.netns), "rtt", dst.private_ip, "7101", "9").communicate()[0]
        echo.kill()
        echo.wait()
        rtts = sorted(json.loads(got.splitlines()[-1])["rtts"])
        out[f"{t.a}-{t.b}"] = rtts[len(rtts) // 2] if rtts else float("nan")
    return out


def bulk_sink(host: str, port: int) -> None:
    """Accept one TCP stream; print {bytes, rate from RAMP_S on (Mbit/s)}."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.setsockopt(socket.SOL_SOCKET, 33, BULK_BUFFER)  # SO_RCVBUFFORCE (root)
    srv.bind((host, port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf, n, marks = bytearray(1 << 20), 0, []
    t0 = time.monotonic()
    while k := conn.recv_into(buf):
        n += k
        marks.append((time.monotonic() - t0, n))
    steady = [m for m in marks if m[0] >= RAMP_S]
    (t1, n1), (t2, n2) = steady[0], steady[-1]
    print(json.dumps({"bytes": n, "mbps": (n2 - n1) * 8 / (t2 - t1) / 1e6}))


def bulk_source(host: str, port: int) -> None:
    """Send to a bulk_sink for BULK_S seconds."""
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, 32, BULK_BUFFER)  # SO_SNDBUFFORCE (root)
    c.connect((host, port))
    data, t0 = bytes(1 << 20), time.monotonic()
    while time.monotonic() - t0 < BULK_S:
        c.sendall(data)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)  # the sink's close: every byte is in


def relay_ceiling(plan: Any, lab: Any, state: Path) -> list[dict[str, Any]]:
    """Per link with a relay, unshaped: one TCP stream gateway a -> b over the tunnel
    and the round trip between them, through the asyncio relay and through the lab's."""
    from infra.hosts import netns_pids, stop_netns_processes

    relays = _relay_programs()
    rows = []
    for t in plan.tunnels:
        if t.relay_netns is None:
            continue
        na, nb = str(plan.region(t.a).gateway.netns), str(plan.region(t.b).gateway.netns)
        for ns, dev in ((na, t.a_ifname), (nb, t.b_ifname)):  # no tbf: the relay's ceiling
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)  # fmt: skip
        for name, program in relays.items():
            stop_netns_processes(t.relay_netns)
            lab.start_relay(t, state, program)
            (pid,) = netns_pids(t.relay_netns)
            rtt = _gateway_rtt(na, nb, t.b_ip)
            drops0 = [_udp_drops(ns) for ns in (t.relay_netns, nb)]
            cpu0, w0 = _cpu_s(pid), time.monotonic()
            mbps = _bulk(na, nb, t.b_ip)
            cpu = (_cpu_s(pid) - cpu0) / (time.monotonic() - w0)
            drops = [_udp_drops(ns) - d for ns, d in zip((t.relay_netns, nb), drops0, strict=True)]
            rows.append({"link": f"{t.a}-{t.b}", "delay": t.latency_ms, "relay": name,
                         "rtt_ms": rtt * 1000, "mbps": mbps, "cpu": cpu,
                         "drops": drops})  # fmt: skip
    return rows


def _relay_programs() -> dict[str, tuple[str, ...]]:
    """The relays compared, old first: `python *program ARGV` runs each."""
    from infra.lab import RELAY

    old = ROOT / ".geotrain" / "bench" / "relay_asyncio.py"
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_text(
        subprocess.run(
            ["git", "show", f"{BASELINE_RELAY}:infra/relay.py"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout
    )  # fmt: skip
    return {"asyncio relay (before)": (str(old),), "infra/relay.py": RELAY}


def udp_sink(host: str, port: int, seconds: float) -> None:
    """Count datagrams for `seconds` after the first; print the rate they arrived at
    and their one-way delays."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root)
    s.bind((host, port))
    s.settimeout(5.0)
    print("ready", flush=True)
    delays, seqs, t_first, t_last = [], 0, 0.0, 0.0
    with contextlib.suppress(TimeoutError):
        data = s.recv(2048)
        t_first = t_last = time.monotonic()
        s.settimeout(1.0)  # the stream has ended when nothing comes for a second
        while t_last - t_first < seconds:
            seq, sent = STAMP.unpack_from(data)
            delays.append(t_last - sent)
            seqs = max(seqs, seq + 1)
            data = s.recv(2048)
            t_last = time.monotonic()
    delays.sort()
    span = max(t_last - t_first, 1e-9)
    print(json.dumps({
        "received": len(delays), "sent_before_last": seqs,
        "mbps": len(delays) * DATAGRAM * 8 / span / 1e6,
        "p50": delays[len(delays) // 2] if delays else None,
        "p99": delays[len(delays) * 99 // 100] if delays else None,
    }))  # fmt: skip


def udp_source(host: str, port: int, mbps: float, seconds: float) -> None:
    """Send full-size datagrams at `mbps`, paced every millisecond, for `seconds`."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, 32, 8 << 20)  # SO_SNDBUFFORCE (root)
    pad, per_s = bytes(DATAGRAM - STAMP.size), mbps * 1e6 / 8 / DATAGRAM
    t0, seq = time.monotonic(), 0
    while (now := time.monotonic()) - t0 < seconds:
        while seq < (now - t0) * per_s:
            s.sendto(STAMP.pack(seq, time.monotonic()) + pad, (host, port))
            seq += 1
        time.sleep(0.001)
    print(json.dumps({"sent": seq}))


def relay_alone(delay_ms: float, rates: tuple[float, ...], seconds: float) -> list[dict]:
    """Each relay alone on loopback (no WireGuard, no lab): a paced stream of full
    WireGuard-size datagrams one way through it, at each offered rate."""
    rows = []
    for name, program in _relay_programs().items():
        for mbps in rates:
            ports = []
            for ip in ("127.0.0.1", "127.0.0.4"):  # free ports for gateway A and B
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                    probe.bind((ip, 0))
                    ports.append(probe.getsockname()[1])
            pa, pb = map(str, ports)
            argv = ["127.0.0.2", pb, "127.0.0.1", pa, "127.0.0.3", "127.0.0.4", str(delay_ms)]
            relay = subprocess.Popen([sys.executable, *program, *argv], cwd=ROOT,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
            sink = subprocess.Popen(
                [sys.executable, __file__, "--udp-sink", "127.0.0.4", pb, str(seconds)],
                cwd=ROOT, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                assert relay.stdout is not None and sink.stdout is not None
                relay.stdout.readline()  # ready
                sink.stdout.readline()  # ready
                source = subprocess.run(
                    [sys.executable, __file__, "--udp-source", "127.0.0.2", pb, str(mbps),
                     str(seconds + 1)],
                    cwd=ROOT, check=True, capture_output=True, text=True,
                )  # fmt: skip
                got = json.loads(sink.communicate(timeout=30)[0].splitlines()[-1])
            finally:
                relay.kill()
                relay.wait()
            sent = json.loads(source.stdout.splitlines()[-1])["sent"]
            rows.append({"relay": name, "offered": mbps, "delay": delay_ms, "sent": sent, **got})
    return rows


def alone_lines(rows: list[dict], seconds: float) -> list[str]:
    out = [
        "",
        f"Each relay alone (no WireGuard, no lab, loopback): one way, a stream of "
        f"{DATAGRAM}-byte datagrams (a full WireGuard datagram) paced at the offered rate; "
        f"received: the rate they arrived at over {seconds:.0f} s from the first; loss: of "
        "those sent before the last one received; delay: one way, send to receive.",
        "",
        "| relay | delay (ms) | offered (Mbit/s) | received (Mbit/s) | loss | "
        "delay p50 / p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        loss = 1 - r["received"] / max(r["sent_before_last"], 1)
        p50, p99 = (f"{r['p50'] * 1000:.1f}", f"{r['p99'] * 1000:.1f}") if r["p50"] else ("-", "-")
        out.append(
            f"| {r['relay']} | {r['delay']:.0f} | {r['offered']:.0f} | {r['mbps']:.0f} | "
            f"{loss:.1%} | {p50} / {p99} |"
        )
    return out


def _gateway_rtt(na: str, nb: str, b_ip: str) -> float:
    echo = _probe(nb, "echo", b_ip, "7102", "6")
    assert echo.stdout is not None
    echo.stdout.readline()  # bound
    got = _probe(na, "rtt", b_ip, "7102", "9").communicate()[0]
    echo.kill()
    echo.wait()
    rtts = sorted(json.loads(got.splitlines()[-1])["rtts"])
    return rtts[len(rtts) // 2] if rtts else float("nan")


def _bulk(na: str, nb: str, b_ip: str) -> float:
    def run(ns: str, *args: str) -> subprocess.Popen[str]:
        cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, *args]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)

    sink = run(nb, "--sink", b_ip, "7103")
    assert sink.stdout is not None
    sink.stdout.readline()  # listening
    if run(na, "--source", b_ip, "7103").wait(timeout=BULK_S + 60) != 0:
        raise SystemExit("the relay ceiling's TCP source failed")
    return float(json.loads(sink.communicate(timeout=30)[0].splitlines()[-1])["mbps"])


def _udp_drops(ns: str) -> int:
    """Datagrams namespace `ns` dropped for a full socket receive buffer (RcvbufErrors)."""
    snmp = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"],
                          check=True, capture_output=True, text=True).stdout  # fmt: skip
    names, values = (line.split()[1:] for line in snmp.splitlines() if line.startswith("Udp:"))
    return int(values[names.index("RcvbufErrors")])


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ceiling_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "### Relay ceiling: each link's delay relay alone (unshaped), old relay vs new",
        "",
        f"One TCP stream gateway to gateway over the link's tunnel (wireguard-go), tbf "
        f"removed from that link, {BULK_S:.0f} s, the rate from {RAMP_S:.0f} s on; socket "
        f"buffers {BULK_BUFFER >> 20} MiB so the stream's window is not the limit. RTT: "
        "median of 9 UDP round trips between the gateways over the tunnel, with that relay. "
        "Relay CPU: its CPU time over the transfer's wall time; per core: the rate over "
        "that share, what the relay would carry with a core to itself (an estimate). Old: "
        "the asyncio relay (one call_later per datagram, infra/relay.py at "
        f"{BASELINE_RELAY[:7]}); new: "
        "infra/relay.py (one thread, a deadline FIFO per direction, 8 MiB socket buffers). "
        "Dropped: datagrams the relay's namespace and gateway b's (wireguard-go's socket) "
        "dropped for a full receive buffer during the transfer (RcvbufErrors).",
        "",
        "| link | delay each way (ms) | RTT old / new (ms) | old relay (Mbit/s) | "
        "new relay (Mbit/s) | new / old | relay CPU old / new (% of a core) | "
        "per core old / new (Mbit/s) | datagrams dropped, old: at the relay / at gateway b; "
        "new: same |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    links = list(dict.fromkeys(r["link"] for r in rows))
    for link in links:
        o, n = (r for r in rows if r["link"] == link)
        out.append(
            f"| {link} | {n['delay']:.0f} | {o['rtt_ms']:.0f} / {n['rtt_ms']:.0f} | "
            f"{o['mbps']:.0f} | {n['mbps']:.0f} | {n['mbps'] / o['mbps']:.1f}x | "
            f"{o['cpu'] * 100:.0f} / {n['cpu'] * 100:.0f} | "
            f"{o['mbps'] / o['cpu']:.0f} / {n['mbps'] / n['cpu']:.0f} | "
            f"{o['drops'][0]} / {o['drops'][1]}; {n['drops'][0]} / {n['drops'][1]} |"
        )
    return out


def _probe(ns: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "infra.probe", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    if len(sys.argv) > 1 and sys.argv[1] in ("--sink", "--source"):
        (bulk_sink if sys.argv[1] == "--sink" else bulk_source)(sys.argv[2], int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--udp-sink":
        udp_sink(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--udp-source":
        udp_source(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--failovers", type=int, default=3)
    ap.add_argument("--relay-only", action="store_true", help="only the relay ceiling; prints")
    ap.add_argument("--bfd", action="store_true", help="only failover under two BFD settings")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from infra import lab
    from infra.model import load_stack
    from infra.plan import build_plan

    plan = build_plan(load_stack("lab"))
    state = ROOT / ".geotrain" / "lab" / "lab"
    if a.bfd:
        lab.lab_up(plan, state)
        try:
            text = "\n".join(bfd_table(plan, lab, a.failovers)) + "\n"
        finally:
            lab.lab_down(plan, state)
        print(text)
        (ROOT / "benchmarks" / "results" / "lab_bfd.md").write_text(text)
        return
    if a.relay_only:
        lab.lab_up(plan, state)
        try:
            ceiling = relay_ceiling(plan, lab, state)
        finally:
            lab.lab_down(plan, state)
        alone = relay_alone(ALONE_DELAY_MS, ALONE_RATES, ALONE_S)
        print("\n".join([*ceiling_lines(ceiling), *alone_lines(alone, ALONE_S)]))
        return
    ups, downs = [], []
    for _ in range(2):
        t0 = time.monotonic()
        lab.lab_up(plan, state)
        ups.append(time.monotonic() - t0)
        t0 = time.monotonic()
        lab.lab_down(plan, state)
        downs.append(time.monotonic() - t0)
    lab.lab_up(plan, state)
    try:
        rtts = round_trips(plan)
        fo = failover(plan, lab, a.failovers)
        sync = sync_bench(plan, a.reps)
        for t in plan.tunnels:  # the same sync without shaping: this machine's CPU floor
            for region in (t.a, t.b):
                ns = str(plan.region(region).gateway.netns)
                dev = t.side(region).ifname  # the agent shapes each tunnel interface
                lab.sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root")
        floor = sync_bench(plan, a.reps)
        ceiling = relay_ceiling(plan, lab, state)
    finally:
        lab.lab_down(plan, state)
    alone = relay_alone(ALONE_DELAY_MS, ALONE_RATES, ALONE_S)  # after the lab: a quiet host

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    flat, hier = median(sync["flat"]), median(sync["hier"])
    ratios = sorted(f / h for f, h in zip(sync["flat"], sync["hier"], strict=True))
    coal = sorted(e / m for e, m in zip(sync["each"], sync["many"], strict=True))
    flat0, hier0 = median(floor["flat"]), median(floor["hier"])
    mbps = plan.tunnels[0].bandwidth_mbps
    lines = [
        f"# Lab network: 3 regions x 2 ranks, tunnels shaped to {mbps} Mbit/s (tc tbf on each "
        "WireGuard interface, set by the host agent)",
        "",
        "| measure | value |",
        "|---|---|",
        f"| lab up (s, 2 runs) | {', '.join(f'{u:.2f}' for u in ups)} |",
        f"| lab down (s, 2 runs) | {', '.join(f'{d:.2f}' for d in downs)} |",
        f"| failover: cut to first packet on the alternate path (s, {len(fo)} runs) | "
        f"{', '.join(f'{f:.2f}' for f in fo)} |",
        f"| one sync of the step's {N_PARAMS:,} fp32 gradients, flat gloo all-reduce (s, "
        f"median of {len(sync['flat'])} training steps) | {flat:.2f} |",
        f"| same, geotrain hierarchical int8+zstd+SM4 (s, median) | {hier:.2f} |",
        f"| speed-up hierarchical vs flat (ratio of the medians) | {flat / hier:.1f}x |",
        f"| same, per training step: min / median / max | "
        f"{ratios[0]:.1f}x / {median(ratios):.1f}x / {ratios[-1]:.1f}x |",
        f"| same gradients in the training loop's {int(sync['buckets'][0])} sync buckets "
        f"(bucket_mb), one cross-region exchange per bucket and stage (s, median) | "
        f"{median(sync['each']):.2f} |",
        "| same buckets, one exchange per stage for all of them (all_reduce_many, what the "
        f"training loop runs) (s, median) | {median(sync['many']):.2f} |",
        f"| speed-up one exchange per stage vs per bucket: ratio of the medians; per step "
        f"min / median / max | {median(sync['each']) / median(sync['many']):.1f}x; "
        f"{coal[0]:.1f}x / {median(coal):.1f}x / {coal[-1]:.1f}x |",
        "| bandwidth unshaped (tbf removed; the latency relays stay): flat / hierarchical "
        f"(s) | {flat0:.2f} / {hier0:.2f} |",
        "",
        "Six workers, userspace wireguard-go, FRR and the userspace latency relays share 2 "
        "cores here: the per-step spread of the ratios is this machine's load. With the tbf "
        "shaping removed what is left is the links' delay and this machine's CPU "
        "(wireguard-go, the relays, the workers' codec); what one link then carries is the "
        "relay ceiling below. Each step's gradient is synced every way; the hierarchical "
        "result is the one applied.",
        "",
        f"BFD: {plan.network.bfd_interval_ms} ms x {plan.network.bfd_multiplier}. "
        "Latency: each link's latency_ms, delayed each way by the lab's relay (infra/relay.py; "
        "this kernel has no netem); measured round trips over the overlay: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in rtts.items())
        + ".",
        "",
        *ceiling_lines(ceiling),
        *alone_lines(alone, ALONE_S),
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "lab_network.md"
    # keep the sections other benchmarks write there (lab_utilisation.py)
    rest = out.read_text().partition("\n## ")[2] if out.exists() else ""
    out.write_text(table + (f"\n## {rest}" if rest else ""))


if __name__ == "__main__":
    main()
