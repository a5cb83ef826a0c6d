"""Issue 19 benchmark (root): the topology-aware exchange against today's direct exchange
in the lab (infra/lab.py: namespaces, wireguard-go, FRR, tc tbf per link, the latency
relay), 3 regions x 2 ranks, one slow link, side by side in one lab run.

Links: beijing - frankfurt SLOW_MBIT, frankfurt - silicon-valley and beijing -
silicon-valley faster (LINK_MBIT), each delayed LATENCY_MS each way; every link costs the
same, so BGP keeps each pair on its direct tunnel (the relays are the exchange's, not the
routers'). The demo model trains with int8 + zstd + SM4-GCM under each exchange:
- direct: today's exchange (equal pieces, every payload on its direct link);
- topology, pieces only: piece weights planned from the agreed link matrix, no relay;
- topology: piece weights and relays (training.sync.topo_exchange).
Per mode: sync seconds per step (the hierarchical all-reduce's own time, mean over ranks),
wall seconds per step (slowest rank, after a barrier), both as medians over the steps
after the first, and their ratio to direct; the plans each cross group agreed; the RTT of
every link measured over the overlay (infra/probe.py) and as the start probe saw it.

Run: sudo .venv/bin/python benchmarks/topology_exchange.py [--steps 12]. Prints a table
and saves it to benchmarks/results/topology_exchange.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SLOW = ("beijing", "frankfurt")
SLOW_MBIT = 3
"""Below what the other links carry here: on this 2-core machine the lab's user-space
latency relay and wireguard-go hold every link to about 11 Mbit/s whatever its tc rate
(the start probe shows it), so a 10 Mbit/s link would not be the slow one."""
LINK_MBIT = {("frankfurt", "silicon-valley"): 100, ("beijing", "silicon-valley"): 200}
LATENCY_MS = 5
"""Each link's latency_ms (the relay delays each way)."""
MODES = {
    "direct": None,
    "topology, pieces only": False,
    "topology (pieces + relays)": True,
}
"""Mode -> relays allowed (None: the direct exchange)."""
REPLAN = 6
"""Exchanges between plans: every 2 steps of the demo model (3 buckets a step)."""
ATTEMPTS = 2
"""Tries per mode: on this loaded machine a rank sometimes never reaches the store."""
STATE = ROOT / ".geotrain" / "topolab" / "lab"


def worker(spec_path: str, rank: int, mode: str, steps: int, out: str) -> None:
    """One rank inside its namespace: train the demo model, time each step and its sync."""
    import torch
    import torch.distributed as dist

    from training.comm.topology import make_groups
    from training.data.loader import ByteLoader, load_region_text
    from training.gradsync import hierarchical_step
    from training.models.deepseek import build_model
    from training.sync.codec import Codec
    from training.sync.hier import HierarchicalAllReduce
    from training.sync.topo_exchange import TopologyExchange
    from training.testing import join_lab_world

    spec, topo = join_lab_world(spec_path, rank, 60)
    sync = HierarchicalAllReduce(
        topo, make_groups(topo, torch.device("cpu")), Codec(spec.codec, bytes(range(32))), "b"
    )
    relays = MODES[mode]
    if relays is not None:
        sync.planner = TopologyExchange(replan=REPLAN, relays=relays)
    sync.probe()
    torch.manual_seed(spec.seed)
    model = build_model(spec.model)
    text = load_region_text(spec.regions[topo.region_index], topo.region_index, topo.regions)
    loader = ByteLoader.of(text, spec.batch_size, spec.seq_len, spec.seed * 1000 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    step_s, sync_s, losses = [], [], []
    for step in range(steps):
        dist.barrier()
        t0, s0 = time.perf_counter(), sync.stats.sync_seconds
        loss = model.loss(loader.next())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        hierarchical_step(model, sync, step, spec.bucket_mb)
        opt.step()
        step_s.append(time.perf_counter() - t0)
        sync_s.append(sync.stats.sync_seconds - s0)
        losses.append(loss.item())
    p = sync.planner
    result = {
        "step_s": step_s,
        "sync_s": sync_s,
        "losses": losses,
        "links": sync.links.report() if sync.links else [],
        "probed": {j: link.probed for j, link in sync.links.links.items()} if sync.links else {},
        "plans": p.history if p else [],
        "relayed": p.relayed_bytes if p else 0,
        "wire": sync.stats.cross_wire_bytes,
    }
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def lab_stack(tmp: Path) -> Path:
    doc = yaml.safe_load((ROOT / "stacks" / "Pulumi.lab.yaml").read_text())
    for link in doc["config"]["geotrain:network"]["links"]:
        pair = (link["a"], link["b"])
        link["bandwidth_mbps"] = SLOW_MBIT if pair == SLOW else LINK_MBIT[pair]
        link["latency_ms"] = LATENCY_MS
        link["cost"] = 10  # every pair on its direct tunnel
    path = tmp / "Pulumi.topolab.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_mode(plan: Any, mode: str, steps: int, tmp: Path) -> list[dict[str, Any]]:
    from infra.render import render_launch_spec

    for attempt in range(1, ATTEMPTS + 1):
        spec = render_launch_spec(plan)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spec = dataclasses.replace(spec, master_port=port)
        tag = mode.split()[0] + ("-relays" if MODES[mode] else "")
        spec_path, out = tmp / f"spec-{tag}.json", tmp / f"out-{tag}"
        spec_path.write_text(spec.to_json())
        procs = [
            subprocess.Popen(
                [
                    *("ip", "netns", "exec", str(n.netns), sys.executable, __file__),
                    *("--worker", str(spec_path), str(n.first_rank + i), mode, str(steps)),
                    str(out),
                ],
                cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            )
            for r in spec.regions
            for n in r.nodes
            for i in range(n.nprocs)
        ]
        codes = [p.wait(timeout=300) for p in procs]
        if not any(codes):
            return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(spec.world_size)]
        print(f"{mode}: workers exited {codes} (attempt {attempt})", file=sys.stderr)
    raise SystemExit(f"{mode}: workers failed {ATTEMPTS} times")


def row(res: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    wall = [max(r["step_s"][s] for r in res) for s in range(1, steps)]
    sync = [statistics.mean(r["sync_s"][s] for r in res) for s in range(1, steps)]
    return {
        "wall": statistics.median(wall),
        "sync": statistics.median(sync),
        "loss": statistics.mean(statistics.mean(r["losses"][-3:]) for r in res),
        "mb": sum(r["wire"] for r in res) / 1e6 / steps,
        "relayed": sum(r["relayed"] for r in res) / 1e6 / steps,
    }


NOTES = (
    "Six workers, wireguard-go, FRR and the Python latency relays share 2 cores here: the "
    "start probe (above) shows the 100 and 200 Mbit/s links carrying far less per rank, "
    "so the slow link is 3 Mbit/s. Every plan in force is listed; the default "
    "`exchange: topology` is the last row (relays allowed). Each hop is one round (a frame "
    "received into a buffer of its codec bound; before, the sizes were swapped first); a "
    "relay plan costs a second hop per stage (and the relay's forwarding on the shared "
    "cores), which the planner's model counts only as half the largest RTT."
)
"""Said under every table (the setting, not the numbers)."""


def report(rows: dict[str, dict[str, Any]], res: dict[str, Any], rtts: Any, steps: int) -> str:
    base = rows["direct"]
    lines = [
        f"# Topology-aware vs direct exchange in the lab, 3 regions x 2 ranks, demo model, "
        f"{steps} steps each, int8 + zstd + SM4-GCM over wireguard-go",
        "",
        f"Links (tc tbf by the host agent, {LATENCY_MS} ms each way by the lab's relay): "
        f"{SLOW[0]}-{SLOW[1]} {SLOW_MBIT} Mbit/s, "
        + ", ".join(f"{a}-{b} {v} Mbit/s" for (a, b), v in LINK_MBIT.items())
        + ". Round trips measured over the overlay (infra/probe.py, median): "
        + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in rtts.items())
        + ".",
        "",
        "| exchange | sync s/step | vs direct | wall s/step | vs direct | cross-region MB/step "
        "(all ranks) | relayed MB/step | loss (last 3) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in rows.items():
        lines.append(
            f"| {mode} | {r['sync']:.3f} | {r['sync'] / base['sync']:.2f} | {r['wall']:.3f} | "
            f"{r['wall'] / base['wall']:.2f} | {r['mb']:.2f} | {r['relayed']:.2f} | "
            f"{r['loss']:.4f} |"
        )
    lines += ["", "Plans agreed (exchange number: plan; cross group of local rank 0, then 1):"]
    for mode in MODES:
        if MODES[mode] is None:
            continue
        for g in (0, 1):
            plans = "; ".join(f"at {n}: {d}" for n, d in res[mode][g]["plans"]) or "direct"
            lines.append(f"- {mode}, group {g}: {plans}")
    names = ("beijing", "frankfurt", "silicon-valley")
    lines += ["", "Start probe (over each cross group's gloo, per rank: 2 ranks share a link):"]
    for r in (0, 2):
        first = res["direct"][r]
        probed = {int(j): v for j, v in first["probed"].items()}
        rtt = {k["src"]: k["rtt"] for k in first["links"]}
        lines.append(
            f"- at {names[r // 2]}: "
            + ", ".join(
                f"from {names[j]} {8 * v / 1e6:.1f} Mbit/s, RTT {1e3 * rtt[names[j]]:.0f} ms"
                for j, v in sorted(probed.items())
            )
        )
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv
        worker(a[2], int(a[3]), a[4], int(a[5]), a[6])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--down", action="store_true", help="only take a leftover lab down")
    a = ap.parse_args()
    steps = a.steps
    from infra import lab
    from infra.model import load_stack
    from infra.plan import build_plan

    if a.down:
        tmp = Path(tempfile.mkdtemp(prefix="topolab-"))
        lab.lab_down(build_plan(load_stack(str(lab_stack(tmp)))), STATE)
        return

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from lab_network import round_trips

    tmp = Path(tempfile.mkdtemp(prefix="topolab-"))
    plan = build_plan(load_stack(str(lab_stack(tmp))))
    state = STATE
    t0 = time.time()
    lab.lab_up(plan, state)
    try:
        lab.wait_for_bgp(plan, 90)
        rtts = round_trips(plan)
        print(f"round trips over the overlay: {rtts}", file=sys.stderr)
        res = {}
        for mode in MODES:
            res[mode] = run_mode(plan, mode, steps, tmp)
            print(f"{mode}: done at {time.time() - t0:.0f} s", file=sys.stderr)
    finally:
        lab.lab_down(plan, state)
    rows = {mode: row(r, steps) for mode, r in res.items()}
    table = report(rows, res, rtts, steps)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "topology_exchange.md").write_text(table)


if __name__ == "__main__":
    main()
