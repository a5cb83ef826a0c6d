"""Regions as torchft replica groups: a region drops, the others train on; it comes back
and heals from a live peer (`fault_tolerance` in the launch spec).

- **Who is in.** A torchft Lighthouse (`python -m training.ft.quorum lighthouse --spec F`,
  on the address the stack placed it at) forms a quorum of regions for every cross-region
  round. Each rank runs a torchft `Manager`: rank l of region r is group rank l of replica
  group `region<r>`; its ManagerServer, heal server and advertised addresses are the node's
  own (overlay) address, never the hostname default.
- **Inside a region** the ranks keep their normal group: each region is its own c10d world
  and its own torchrun job (training.launch.launcher: rendezvous store on its first node at
  `store_port + region index`), so a dead region breaks no collective of another, and
  torchrun restarts a failed region alone.
- **Across regions** the Manager reconfigures a torchft `ProcessGroupGloo` per quorum: rank
  l of every region in the quorum. Our sync (training.sync.hier: the codec, SM4-GCM, error
  feedback) runs on that group through a `QuorumTopology` view: the quorum's regions, and
  an average over the ranks of the regions that contribute (the weights of the average
  follow the quorum). torchft's own `Manager.allreduce` cannot carry our codec: it
  all-reduces plain fp32/bf16 tensors (or torchft's fp8 quantization), with no per-link
  keys, no authentication and no error feedback, whereas our exchange is an all-to-all of
  sealed bytes that every receiver verifies. So torchft carries membership, the group,
  healing and the commit vote; our codec carries every byte.
- **A session per quorum.** The quorum's members agree on a fresh session (each
  contributes 16 random bytes under a MAC of the run key): the codec's keys change with
  every membership.
- **A round that fails** (a peer died mid-exchange: gloo reports the closed connection, or
  the `timeout_s` runs out) is voted down by `should_commit`, and runs again on the next
  quorum, which leaves the dead region out: survivors lose no step. Inputs of a round are
  kept until it commits (gradients are scattered only after the vote; a merge touches no
  weight before its outer step).
- **Healing.** A region that (re)starts joins before its first step; when it is behind, the
  Manager fetches a live peer's state through training.ft.heal (sealed, challenge-bound):
  weights, inner optimizer, DiLoCo global weights and outer optimizer, counters, and the
  phase the donor is in (before a step, or at a merge). A region healed into a merge
  contributes nothing to that merge (its pseudo-gradient would duplicate the donor's).
- **Fewer than `min_replicas`** regions, or a region cut off: its quorum times out, it
  stops with QuorumLost (exit 3) and its torchrun restarts it from its checkpoints;
  a region that resumes behind the others heals from the furthest one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import torch
import torch.distributed as dist
import torchft.manager
from torchft._torchft import LighthouseServer
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from training.comm import gloo
from training.comm.session import Session, derive, rendezvous_store, run_tag
from training.comm.topology import Groups, Topology
from training.errors import QuorumLost, SpecError, TransientReject
from training.ft.heal import SealedTransport
from training.launch import torchrun
from training.launch.procs import die_with
from training.spec import FaultToleranceSpec, LaunchSpec, NodeSpec, fault_tolerance_conflict
from training.state.checkpoint import Checkpointer, node_group
from training.sync.codec import Codec
from training.sync.hier import HierarchicalAllReduce, SyncStats
from training.sync.secagg import all_to_all_bytes

T = TypeVar("T")
STEP, MERGE = "step", "merge"
"""Where a round starts: before a step's forward pass, or at a DiLoCo merge."""
LIGHTHOUSE_READY = "geotrain lighthouse: "
"""First line of `python -m training.ft.quorum lighthouse`, once it listens: then its address."""
REPLICA_PREFIX = "region"
"""Replica group ids are `region<index>`: torchft reads the trailing digits as the index."""


# -- validation -----------------------------------------------------------------------
def validate(spec: LaunchSpec) -> FaultToleranceSpec:
    """The spec's fault_tolerance, checked against the rest of the spec."""
    ft = spec.fault_tolerance
    if ft is None:
        raise SpecError(f"run {spec.run_id} has no fault_tolerance section")
    R = len(spec.regions)
    if not 1 <= ft.min_replicas <= R:
        raise SpecError(
            f"fault_tolerance.min_replicas {ft.min_replicas} is outside 1..{R} (the run's "
            f"regions); use {R // 2 + 1} (a majority)"
        )
    host, _, port = ft.lighthouse.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:  # 0: tests bind any
        raise SpecError(
            f"fault_tolerance.lighthouse '{ft.lighthouse}' is not host:port (port 0-65535); "
            "the stack renders it from geotrain:training.fault_tolerance.lighthouse"
        )
    if ft.store_port + R - 1 > 65535:
        raise SpecError(
            f"fault_tolerance.store_port {ft.store_port} + {R - 1} (one per region) passes "
            "65535; use a lower store_port, e.g. 29520"
        )
    if ft.quorum_timeout_s <= ft.heartbeat_timeout_s:
        raise SpecError(
            f"fault_tolerance.quorum_timeout_s {ft.quorum_timeout_s:g} must exceed "
            f"heartbeat_timeout_s {ft.heartbeat_timeout_s:g}: a restarted job waits for the "
            "Lighthouse to forget the members of the attempt before"
        )
    conflict = fault_tolerance_conflict(
        secure_aggregation=spec.codec.secure_aggregation,
        privacy=[r.name for r in spec.regions if r.privacy],
        timed_merges=spec.sync == "diloco" and spec.diloco.interval_minutes is not None,
        streaming=spec.sync == "diloco" and spec.diloco.streaming,
        adaptive=spec.codec.adaptive is not None,
        balance=spec.balance == "throughput",
        workers={r.name: sum(n.nprocs for n in r.nodes) for r in spec.regions},
        cuda=[r.name for r in spec.regions if any(n.device == "cuda" for n in r.nodes)],
        topology=spec.exchange == "topology",
    )
    if conflict:
        raise SpecError(f"fault_tolerance {conflict}")
    return ft


# -- the quorum's view of the topology ------------------------------------------------
@dataclass(frozen=True)
class QuorumTopology(Topology):
    """The topology training.sync.hier sees during one quorum: `regions` are the quorum's
    members (region_index is this region's position among them), `world_size` the ranks
    whose contributions the average divides by."""

    members: tuple[int, ...] = ()
    """Region indices of the quorum, in the cross group's rank order."""

    def peer_ranks(self, local_rank: int) -> list[int]:
        return [m * self.local_size + local_rank for m in self.members]


def view(topo: Topology, members: list[int], contributors: int) -> QuorumTopology:
    return QuorumTopology(
        rank=topo.rank,
        world_size=contributors * topo.local_size,
        regions=len(members),
        local_size=topo.local_size,
        region_index=members.index(topo.region_index),
        local_rank=topo.local_rank,
        region_names=tuple(topo.region_names[m] for m in members),
        members=tuple(members),
    )


def fold(src: SyncStats, dst: SyncStats, members: tuple[int, ...]) -> None:
    """Add a quorum sync's counters to the run's, per-peer bytes keyed by region index."""
    dst.intra_bytes += src.intra_bytes
    dst.cross_raw_bytes += src.cross_raw_bytes
    dst.cross_wire_bytes += src.cross_wire_bytes
    dst.sync_seconds += src.sync_seconds
    dst.syncs += src.syncs
    for j, n in src.per_peer_wire.items():
        dst.per_peer_wire[members[j]] = dst.per_peer_wire.get(members[j], 0) + n
    src.__init__()  # type: ignore[misc]  # zero it: counted once


# -- torchft pieces -------------------------------------------------------------------
class QuorumGroup(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, remembering who the current quorum holds, and
    bound to the node's address: torchft creates gloo's default device, which listens on
    what the hostname resolves to (see training/comm/gloo.py)."""

    ranks: list[int]
    """Global ranks of the group, in group rank order."""
    quorum_id: int = -1
    address: str = "127.0.0.1"
    """The node's private address: gloo listens and is reached there."""

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        """torchft's `ProcessGroupGloo._create_pg`, with a bound device."""
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = self._timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address)]
        backend = dist.ProcessGroupGloo(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        super().configure(
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id,
            group_rank,
            group_world_size,
            global_ranks,
        )
        self.ranks = list(global_ranks or [])
        self.quorum_id = -1 if quorum_id is None else quorum_id


@contextlib.contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """torchft's Manager binds its ManagerServer to `[::]` (every interface); bind it to
    the node's address instead, the one it advertises."""
    real = torchft.manager.ManagerServer

    def bound(**kw: Any) -> Any:
        kw["bind"] = f"[{host}]:0" if ":" in host else f"{host}:0"
        return real(**kw)

    with mock.patch.object(torchft.manager, "ManagerServer", bound):
        yield


def lighthouse_url(ft: FaultToleranceSpec) -> str:
    return f"http://{ft.lighthouse}"


def advertised(ft: FaultToleranceSpec, server: LighthouseServer) -> str:
    """host:port of a started Lighthouse: the spec's host (torchft's own `address()` names
    the machine's hostname) and the port it bound (the spec's, or the one port 0 picked)."""
    host = ft.lighthouse.rpartition(":")[0]
    return f"{host}:{server.address().rpartition(':')[2]}"


def start_lighthouse(ft: FaultToleranceSpec) -> LighthouseServer:
    """The Lighthouse on exactly `ft.lighthouse` (host:port; port 0 picks one)."""
    try:
        return LighthouseServer(
            bind=ft.lighthouse,
            min_replicas=ft.min_replicas,
            join_timeout_ms=int(ft.join_timeout_s * 1000),
            heartbeat_timeout_ms=int(ft.heartbeat_timeout_s * 1000),
        )
    except RuntimeError as e:  # torchft's Rust server: "Address already in use (os error 98)"
        raise SpecError(
            f"cannot start the Lighthouse on {ft.lighthouse} ({str(e)[:120]}); free the port "
            "or move geotrain:training.fault_tolerance.port"
        ) from None


# -- one rank's quorum ----------------------------------------------------------------
@dataclass
class Quorum:
    """A rank's torchft Manager, the cross group it reconfigures, and our sync on it."""

    spec: LaunchSpec
    topo: Topology
    key: bytes
    host: str
    store_at: tuple[str, int]
    """The region's store (region_world): where this rank's Manager keeps its keys."""
    intra: Any
    device: torch.device
    stats: SyncStats
    """The run's sync counters (job.sync.stats): each quorum's are folded into them."""
    state: Callable[[], dict[str, Any]]
    """This rank's state for a healer (training.ft.quorum.heal_state)."""
    load: Callable[[dict[str, Any]], None]
    manager: Manager = field(init=False)
    pg: QuorumGroup = field(init=False)
    transport: SealedTransport = field(init=False)
    sync: HierarchicalAllReduce | None = None
    members: tuple[int, ...] = ()
    contributors: int = 0
    phase: str = STEP
    """Where this rank's open round started (sent to a healer with the state)."""
    healed_phase: str | None = None
    """Set when this rank healed in the open round: the donor's phase."""
    heals: int = 0
    begun: bool = False
    on_quorum: Callable[[Quorum, int], None] | None = None
    """Called when a new quorum's sync is ready (metrics, events)."""
    _qid: int = field(default=-1, init=False)

    def __post_init__(self) -> None:
        ft = self.spec.fault_tolerance
        assert ft is not None  # validate() ran
        t = timedelta(seconds=ft.timeout_s)
        self.pg = QuorumGroup(timeout=t)
        self.pg.address = self.host
        self.transport = SealedTransport(
            self.host, self.key, self.spec.run_id, self.spec.codec.cipher
        )
        with _manager_server_on(self.host):
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=self._load,
                state_dict=self._state,
                min_replica_size=ft.min_replicas,
                use_async_quorum=False,  # heal before the step: every member then contributes
                timeout=t,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                connect_timeout=t,
                rank=self.topo.local_rank,
                world_size=self.topo.local_size,
                store_addr=self.store_at[0],
                store_port=self.store_at[1],
                lighthouse_addr=lighthouse_url(ft),
                replica_id=f"{REPLICA_PREFIX}{self.topo.region_index}",
                hostname=self.host,
                checkpoint_transport=self.transport,
                init_sync=False,  # every region starts from the same seeded weights
            )

    def _state(self) -> dict[str, Any]:
        return {"phase": self.phase, **self.state()}

    def _load(self, state: dict[str, Any]) -> None:
        self.load(state)
        self.healed_phase = str(state["phase"])
        self.heals += 1

    # -- rounds -----------------------------------------------------------------------
    def begin(self, phase: str) -> None:
        """Join the next quorum (once per round; heals here when behind)."""
        if self.begun:
            return
        self.phase = phase
        self._start()
        self.begun = True

    def _start(self) -> None:
        ft = self.spec.fault_tolerance
        assert ft is not None
        try:
            self.manager.start_quorum()
        except Exception as e:  # torchft raises its RPC's own errors: a timeout, mostly
            raise QuorumLost(
                f"no quorum of {ft.min_replicas} regions within {ft.quorum_timeout_s:g} s "
                f"({type(e).__name__}: {str(e)[:120]}); the job restarts from its checkpoints"
            ) from None

    def round(self, fn: Callable[[HierarchicalAllReduce], T], on_fail: Callable[[str], None]) -> T:
        """Run `fn` on the quorum's sync until the quorum commits it. A peer that dies
        mid-round fails it on every survivor; the next quorum leaves it out."""
        assert self.begun  # begin() opened this round
        while True:
            out: T | None = None
            try:
                if self.manager.errored() is None:  # a failed heal or group: vote it down
                    out = fn(self._ready())
            # gloo reports a closed peer or a timeout as RuntimeError; c10d's logging
            # wrapper turns it into ValueError for groups outside its map (torchft's)
            except (RuntimeError, ValueError, OSError, TransientReject) as e:
                self.manager.report_error(_cause(e))
            if self.manager.should_commit():
                self.begun = False
                self.healed_phase = None
                return out  # type: ignore[return-value]  # set when committed
            on_fail(str(self.manager.errored() or "vote failed")[:300])
            self._start()

    def _ready(self) -> HierarchicalAllReduce:
        """The sync of the current quorum (a new one, with a new session, on a change)."""
        if self.sync is not None and self.pg.quorum_id == self._qid:
            return self.sync
        L = self.topo.local_size
        members = [r // L for r in self.pg.ranks]
        ft = self.spec.fault_tolerance
        assert ft is not None
        arrived(self.pg.parent, ft.quorum_timeout_s)
        session, healers = agree_quorum(self.key, self.spec.run_id, self, members)
        # a healer takes its donor's phase: every member counts the same contributors
        phase = self.healed_phase or self.phase
        contributors = len(members) - (healers if phase == MERGE else 0)
        if self.sync is not None:
            fold(self.sync.stats, self.stats, self.members)
        self.sync = HierarchicalAllReduce(
            view(self.topo, members, contributors),
            Groups(intra=self.intra, cross=self.pg.parent, device=self.device),
            Codec(self.spec.codec, self.key, session),
            self.spec.run_id,
            error_feedback=self.spec.codec.error_feedback,
            allgather=self.spec.exchange == "allgather",
        )
        self.members, self.contributors, self._qid = tuple(members), contributors, self.pg.quorum_id
        if self.on_quorum is not None:
            self.on_quorum(self, healers)
        return self.sync

    def flush(self) -> None:
        """Fold the open quorum's sync counters into the run's (before a report)."""
        if self.sync is not None:
            fold(self.sync.stats, self.stats, self.members)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        self.transport.shutdown()


def arrived(group: Any, seconds: float) -> None:
    """A barrier on a new quorum's group that waits up to `seconds` (the quorum timeout),
    not the group's `timeout_s`: a member healing into the quorum arrives only once the
    donor's state has crossed the WAN, which can take longer than `timeout_s` (a sealed
    copy of weights and optimizer state). Without it the others time out while it heals,
    the next quorum forms without it, it is behind again and heals again, every round.
    A member that dies closes its connections and fails the barrier at once."""
    opts = dist.BarrierOptions()
    opts.timeout = timedelta(seconds=seconds)
    group.barrier(opts).wait()


def _cause(e: Exception) -> Exception:
    """The error a round failed with. c10d's logging wrapper, logging the real error of a
    collective on a group outside its map, raises ValueError ("not initialized in the
    world group map") with the real one as its context: that one says what happened."""
    real = e.__context__
    return real if isinstance(e, ValueError) and isinstance(real, Exception) else e


def agree_quorum(key: bytes, run_id: str, q: Quorum, members: list[int]) -> tuple[Session, int]:
    """A collective over the quorum's cross group: a fresh session (16 random bytes from
    every member, each MAC'd under the run key) and how many members healed this round."""
    tag = run_tag(run_id)
    qid = q.pg.quorum_id
    body = json.dumps(
        {"nonce": os.urandom(16).hex(), "healed": q.healed_phase is not None, "quorum": qid}
    ).encode()

    def mac(rank: int, b: bytes) -> bytes:
        k = derive(key, tag, f"quorum-agree|rank{rank}", 32)
        return hmac.new(k, b, "sha256").digest()

    msg = mac(q.topo.rank, body) + body
    blobs = all_to_all_bytes([msg] * len(members), q.pg.parent, len(members))
    views = []
    for m, blob in zip(members, blobs, strict=True):
        rank = m * q.topo.local_size + q.topo.local_rank
        if not hmac.compare_digest(blob[:32], mac(rank, blob[32:])):
            raise TransientReject(f"quorum agreement from rank {rank} failed authentication")
        views.append(json.loads(blob[32:]))
    if {v["quorum"] for v in views} != {qid}:
        raise TransientReject(f"quorum agreement mixes quorum ids {[v['quorum'] for v in views]}")
    sid = hashlib.sha256(b"".join(bytes.fromhex(v["nonce"]) for v in views)).digest()[:16]
    return Session(run_id, sid, max(qid, 0)), sum(bool(v["healed"]) for v in views)


# -- the region's own world -----------------------------------------------------------
@dataclass(frozen=True)
class RegionStore:
    store: Any
    addr: str
    port: int


def region_world(spec: LaunchSpec, topo: Topology, host: str, wait: timedelta) -> RegionStore:
    """Init this region's c10d world (its ranks only); returns its store, which the Manager
    and the cross-region groups of every quorum use too. Under torchrun (one job per
    region: training.launch.launcher) it is the store of torchrun's round, at MASTER_ADDR:
    MASTER_PORT; started directly (`--node --local-rank`), the region's first node hosts it
    at store_port + region index."""
    ft = spec.fault_tolerance
    assert ft is not None
    L = topo.local_size
    store = torchrun.torchrun_store(L, wait)
    if store is not None:
        at = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        at = spec.regions[topo.region_index].nodes[0].host, ft.store_port + topo.region_index
        store = rendezvous_store(*at, L, topo.local_rank == 0, wait)
    dist.init_process_group(
        gloo.bind(host),
        store=dist.PrefixStore("geotrain/region", store),
        rank=topo.local_rank,
        world_size=L,
        timeout=timedelta(seconds=120),
    )
    return RegionStore(store, *at)


def region_checkpointer(
    spec: LaunchSpec, topo: Topology, node: str, key: bytes, state_dir: Path | None
) -> Checkpointer:
    """training.job.make_checkpointer over the region's world: a region commits its own
    checkpoints (ranks are region-local in this world)."""
    from training.spec import node_root

    region = spec.regions[topo.region_index]
    world = dist.new_group(backend=gloo.backend())
    spans, at = [], 0
    for n in region.nodes:
        spans.append(list(range(at, at + n.nprocs)))
        at += n.nprocs
    me = next(n for n in region.nodes if n.name == node)
    return Checkpointer(
        node_root(spec.checkpoint.dir, spec.stack, node, region.name),
        me.name,
        spec.run_id,
        key,
        spec.checkpoint.keep,
        group=node_group(spans),
        world=world,
        state_dir=state_dir,
        stack=spec.stack,
    )


# -- the lighthouse process -----------------------------------------------------------
@contextlib.contextmanager
def lighthouse_for(
    spec: LaunchSpec, nodes: list[NodeSpec], spec_path: Path
) -> Iterator[str | None]:
    """Host the run's Lighthouse for the block when the stack placed it on one of `nodes`
    (the nodes this launcher runs): it outlives every restart of the workers. In this
    (launcher) process, or, for a lab node, in a process inside the node's namespace
    (the address exists only there). Yields its address, or None when it runs elsewhere
    (or is off)."""
    ft = spec.fault_tolerance
    host = ft.lighthouse.rpartition(":")[0] if ft is not None else None
    node = next((n for n in nodes if n.host == host), None)
    if ft is None or node is None:
        yield None
        return
    validate(spec)
    if node.netns:
        with _lighthouse_in(node.netns, spec_path) as addr:
            yield addr
        return
    server = start_lighthouse(ft)
    try:
        yield advertised(ft, server)
    finally:
        server.shutdown()


@contextlib.contextmanager
def _lighthouse_in(netns: str, spec_path: Path) -> Iterator[str]:
    """`python -m training.ft.quorum lighthouse` inside `netns`, until the block ends (it
    dies with this process too); yields the address it printed once it listens."""
    cmd = [sys.executable, "-m", "training.ft.quorum", "lighthouse", "--spec", str(spec_path)]
    p = subprocess.Popen(
        ["ip", "netns", "exec", netns, *cmd],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=die_with(os.getpid()),  # as in training.launch.launcher.spawn
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith(LIGHTHOUSE_READY):
            raise SpecError(
                f"the Lighthouse in namespace {netns} did not start (exit {p.wait()}); "
                "is the lab up?"
            )
        yield line.removeprefix(LIGHTHOUSE_READY).split()[0]
    finally:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def serve_lighthouse(spec: LaunchSpec) -> None:
    """Run the Lighthouse until SIGTERM/SIGINT."""
    ft = validate(spec)
    server = start_lighthouse(ft)
    print(f"{LIGHTHOUSE_READY}{advertised(ft, server)} min_replicas={ft.min_replicas}", flush=True)
    stop = False

    def done(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, done)
    signal.signal(signal.SIGINT, done)
    while not stop:
        time.sleep(0.2)
    server.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.ft.quorum")
    ap.add_argument("command", choices=["lighthouse"])
    ap.add_argument("--spec", required=True)
    a = ap.parse_args(argv)
    serve_lighthouse(LaunchSpec.load(a.spec))


if __name__ == "__main__":
    main()
