"""Issue 5 benchmark (root): the lab's up/down time, BFD failover time, and the time of one
gradient sync over the lab's WAN links shaped to 50 Mbit/s (tc tbf), geotrain's
hierarchical int8+zstd+SM4 versus one flat gloo all-reduce over all ranks, in one run.
The six workers train the demo model on their regions' data inside the lab's namespaces;
every step's gradient is synced both ways (timed) and the hierarchical result is applied.

Run: sudo .venv/bin/python benchmarks/lab_network.py. Prints a table and saves it to
benchmarks/results/lab_network.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
N_PARAMS = 2_452_992  # the demo model (deepseek-tiny)


def worker(spec_path: str, rank: int, reps: int, out: str) -> None:
    """Trains the demo model on its region's data inside its namespace; each step's
    gradient (N_PARAMS values) is synced both ways, timed, and the hierarchical result
    is what the optimizer applies."""
    import torch
    import torch.distributed as dist

    from training.comm import gloo
    from training.comm.topology import Topology, make_groups
    from training.data.loader import ByteLoader, load_region_text
    from training.gradsync import flat_grads, grads_of, scatter
    from training.models.deepseek import build_model
    from training.spec import LaunchSpec
    from training.sync.codec import Codec
    from training.sync.hier import HierarchicalAllReduce, sync_buckets

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
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--failovers", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from infra import lab
    from infra.model import load_stack
    from infra.plan import build_plan

    plan = build_plan(load_stack("lab"))
    state = ROOT / ".geotrain" / "lab" / "lab"
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
    finally:
        lab.lab_down(plan, state)

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
        "cores here: the per-step spread of the ratios is this machine's load, and with the "
        "tbf shaping removed the relays' delay (and their own throughput) still bound the "
        "syncs, so the unshaped run is no longer a CPU floor (before the relays it was, and "
        "the link-bound part was 11.6x faster hierarchical than flat). Each step's gradient "
        "is synced every way; the hierarchical result is the one applied.",
        "",
        f"BFD: {plan.network.bfd_interval_ms} ms x {plan.network.bfd_multiplier}. "
        "Latency: each link's latency_ms, delayed each way by the lab's relay (infra/relay.py; "
        "this kernel has no netem); measured round trips over the overlay: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in rtts.items())
        + ".",
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
