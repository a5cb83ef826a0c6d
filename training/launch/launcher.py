"""Starting workers: one node (`geotrain launch`, what SSH hosts run) or every node of a
single-machine stack (`geotrain train`), each node through torchrun.

Every node gets one torchrun (`torch.distributed.run`; in the lab inside the node's network
namespace) that starts its workers (`training.worker --torchrun=NODE`), supervises
them and restarts them. The torchruns of a run meet in torchrun's c10d rendezvous, so a
restart is job-wide (under fault_tolerance: region-wide, below): when a worker fails, its
agent stops the node's other workers and opens a new rendezvous round, and every other
agent, seeing a node waiting, stops and restarts its workers too; every rank then resumes
from the newest committed checkpoint (training.checkpoint). Each agent restarts its group
at most `max_restarts` times.

What stays here, because torchrun cannot do it:
- **The rendezvous store, bound to the master address.** torchrun's c10d backend would
  host its TCPStore on every interface; the launcher of the node that holds rank 0 (under
  fault_tolerance: of each region's first node) hosts it instead (`training.launch.rdzv_host`:
  bound to that address only, in the node's namespace) and every agent joins it as a
  client (`is_host=false`). The workers' own
  store of each round is bound the same way (training.launch.torchrun.torchrun_store).
- **Transient faults of what torchrun does not restart.** A torchrun agent or a store a
  signal killed (the OOM killer, kill -9) is started again, within max_restarts; agents
  that lost their store with it are started again too (`Supervisor._respawn_killed`).
- **Final failures stop at once.** Bad input (exit code 2) and a hostile reject cannot be
  cured by a restart; torchrun would retry them `max_restarts` times. The worker records
  either in the event log before it exits (`failed`, `rejected`), and the launcher stops
  every torchrun when it reads one. The run key is checked before torchrun starts
  (`preflight`): workers start only once every node joined the rendezvous.
- **Restarts reported** to `geotrain train`'s output (from each agent's log line for a
  failed worker, with its exit code).
- **Lifetime.** One launcher per run directory (`run_lock`). A SIGTERM stops every
  torchrun (which stops its workers); a launcher killed outright takes the torchruns
  along through the kernel's parent-death signal, and each worker dies with its agent
  the same way.
- **fault_tolerance** (regions as torchft replica groups, training.ft.quorum): each region is
  its own torchrun job (`rdzv_jobs`): its nodes' torchruns meet at the region's own
  rendezvous store (its first node, `store_port + region index`), so torchrun restarts a
  failed region alone, QuorumLost (exit 3) included, while the others train on; the
  restarted workers heal from a live peer. The Lighthouse is hosted here too. Once one
  region finished the run, the others get FINISH_GRACE_S to finish: a region still
  running after it, or failing, came back too late (nobody is left to heal from) and is
  stopped rather than waited for.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from training.errors import GeotrainError, RendezvousTimeout, SpecError
from training.launch.procs import die_with
from training.spec import FINAL_CLAIM, LaunchSpec, NodeSpec, node_root, record_path

POLL_S = 0.2
LOCK = "launcher.lock"
MONITOR_S = 0.2
"""How often each torchrun agent polls its workers (torchrun's default: 0.1 s... 5 s by
version); a failure is seen within this."""
CONNECT_S = 1.0
"""One try of `reach_store`."""
JOIN_S = 600
"""How long an agent waits for the rendezvous store and the other nodes (the workers' own
rendezvous waited as long: training.worker.RENDEZVOUS_TIMEOUT_S)."""
FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
"""torchrun's log line for a worker that failed (torch.distributed.elastic.multiprocessing)."""
FINISH_GRACE_S = 30.0
"""fault_tolerance: once one region finished the run, how long the others get to finish."""


@dataclass
class Attempt:
    rc: int
    """0 when every worker finished; else the failing worker's exit code."""
    failed: str | None = None
    """Which worker failed (node/local rank); the rejecting one after a hostile reject."""
    seconds: float = 0.0
    hostile: str | None = None
    """Why the group stopped for good: a worker's hostile reject (from the event log)."""


@dataclass
class LaunchResult:
    attempts: list[Attempt] = field(default_factory=list)
    """Every failure a restart followed, then the end (rc 0: done)."""

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].rc == 0


def spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own process group (so SIGTERM reaches its children) that dies
    with this process."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # preexec_fn is safe here: the launcher runs no other threads while it forks
            preexec_fn=die_with(os.getpid()),
        )


def in_netns(node: NodeSpec, cmd: list[str]) -> list[str]:
    """lab: the command runs in its node's namespace, on the overlay only."""
    return ["ip", "netns", "exec", node.netns, *cmd] if node.netns else cmd


def master_node(spec: LaunchSpec) -> NodeSpec:
    """The node that holds rank 0: its launcher hosts the rendezvous store."""
    return next(n for r in spec.regions for n in r.nodes if n.first_rank == 0)


@dataclass(frozen=True)
class RdzvJob:
    """One torchrun rendezvous: the nodes whose workers restart together."""

    name: str
    """`run` (every node), or under fault_tolerance the region's name."""
    nodes: tuple[NodeSpec, ...]
    addr: str
    port: int
    """The rendezvous store: bound to `addr` only, in `host`'s namespace."""
    rdzv_id: str
    host: NodeSpec
    """The node whose launcher hosts the store."""


def rdzv_jobs(spec: LaunchSpec) -> list[RdzvJob]:
    """The run's torchrun jobs: one for every node, or under fault_tolerance one per
    region, meeting at the region's store (its first node, store_port + region index), so
    a failed or cut-off region restarts alone while the others train on."""
    ft = spec.fault_tolerance
    if ft is None:
        every = tuple(n for r in spec.regions for n in r.nodes)
        master = master_node(spec)
        return [RdzvJob("run", every, spec.master_addr, spec.master_port, spec.run_id, master)]
    return [
        RdzvJob(
            r.name,
            tuple(r.nodes),
            r.nodes[0].host,
            ft.store_port + i,
            f"{spec.run_id}-{r.name}",
            r.nodes[0],
        )
        for i, r in enumerate(spec.regions)
    ]


def job_of(jobs: list[RdzvJob], node: str) -> RdzvJob:
    """The job of the node named `node`."""
    return next(j for j in jobs if node in {n.name for n in j.nodes})


def worker_entry(spec_path: Path, node: NodeSpec) -> list[str]:
    """What torchrun starts on `node` (after `python`)."""
    # --torchrun=NODE, one word: torchrun's own parser takes `--node ...` for --node-rank
    return ["-m", "training.worker", f"--torchrun={node.name}", "--spec", str(spec_path)]


def torchrun_command(spec: LaunchSpec, spec_path: Path, node: NodeSpec) -> list[str]:
    """One node's torchrun: c10d rendezvous (restarts of its whole job) at the job's store,
    which a launcher hosts (`is_host=false`); ranks and the workers' store address come
    from the node's own address."""
    job = job_of(rdzv_jobs(spec), node.name)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(job.nodes)}",
        f"--nproc-per-node={node.nprocs}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={job.addr}:{job.port}",
        f"--rdzv-id={job.rdzv_id}",
        # hosts start minutes apart: an agent waits that long for the store (torchrun's
        # default: 60 s) as for the other nodes (join_timeout, 600 s by default)
        f"--rdzv-conf=is_host=false,read_timeout={JOIN_S}",
        f"--local-addr={node.host}",
        f"--max-restarts={spec.max_restarts}",
        f"--monitor-interval={MONITOR_S}",
        *worker_entry(spec_path, node),
    ]
    return in_netns(node, argv)


def reach_store(job: RdzvJob, node: NodeSpec, wait_s: float = JOIN_S) -> None:
    """Before `node`'s torchrun starts: a TCP connection from the node's own address to
    its job's rendezvous store succeeds. A host's workers start as soon as its tunnels are
    up (systemd orders them after wg-quick and FRR), but the routes to the other regions
    arrive with BGP a few seconds later; a connection opened before them leaves by the
    default route with the wrong source address, and torchrun's store client then waits
    out the kernel's SYN retries (127 s) before it tries again. Each try here gives up
    after CONNECT_S instead. Only a store another launcher hosts is probed (this one's
    own starts with it), and not from lab nodes (in a namespace, started once the lab is
    up)."""
    if node.netns:
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection(
                (job.addr, job.port), timeout=CONNECT_S, source_address=(node.host, 0)
            ):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"node {node.name} cannot reach the rendezvous store {job.addr}:"
                    f"{job.port} (on {job.host.name}) from its address {node.host} after "
                    f"{wait_s:.0f} s ({e}); check the overlay: `wg show`, `vtysh -c 'show "
                    "bgp summary'` on the gateways, and that geotrain-worker runs on "
                    f"{job.host.name}"
                ) from None
            time.sleep(CONNECT_S / 2)


def store_command(job: RdzvJob) -> list[str]:
    argv = [sys.executable, "-m", "training.launch.rdzv_host", job.addr, str(job.port)]
    return in_netns(job.host, argv)


def _stop(procs: object) -> None:
    alive = [p for p in procs if p.poll() is None]  # type: ignore[attr-defined]
    for p in alive:
        os.killpg(p.pid, signal.SIGTERM)  # torchrun stops its workers, then exits
    deadline = time.monotonic() + 10
    for p in alive:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # its workers die with it (parent-death)
            p.wait()


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


CPU_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(4 * 2**20)}
"""glibc for CPU workers: every allocation of 4 MiB or more is its own mapping, returned
to the kernel when freed. glibc's default raises that threshold to the size of each large
block freed (up to 32 MiB), so a training step's large transients (FSDP's gathered blocks
and unsharded gradients) come from the heap afterwards, whose freed pieces the process
keeps: benchmarks/fsdp_memory.py measures the peak with and without. Not lower: at 128 KiB
every activation is a fresh mapping, and the page faults made CPU steps 1.86x (the hf
example) and 1.25x (deepseek-tiny) as long as the default's, while at 4 MiB the medians were
1.18x and 0.80x, inside the spread of the rounds (benchmarks/results/cpu_malloc.md). 128 KiB
saves more memory (fsdp_memory.md): an operator whose FSDP run is short of memory sets
MALLOC_MMAP_THRESHOLD_=131072 in the launcher's environment; an operator's own setting wins.
CUDA workers keep glibc's default (their tensors live in the CUDA allocator)."""


def worker_env(run_dir: Path, cpu: bool = True) -> dict[str, str]:
    return {
        **(CPU_MALLOC if cpu else {}),
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GEOTRAIN_EVENTS": str(run_dir / "events.jsonl"),
        "GEOTRAIN_RUN_DIR": str(run_dir),
        "GEOTRAIN_LOG_DIR": str(run_dir / "logs"),
        "PYTHONUNBUFFERED": "1",
        # the workers' store is per round, bound to the master's address, not the
        # agent's store on every interface (training.launch.torchrun.torchrun_store)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "LOGLEVEL": os.environ.get("LOGLEVEL", "WARNING"),
    }


def launch(
    spec: LaunchSpec,
    spec_path: Path,
    nodes: list[NodeSpec],
    run_dir: Path,
    on_poll: Callable[[], None] | None = None,
    on_restart: Callable[[Attempt], None] | None = None,
) -> LaunchResult:
    """Run `nodes`' workers, one torchrun per node, until they finish or fail for good."""
    # SIGTERM (systemd stop, kill) must run the cleanup below, not leave workers behind
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    result = LaunchResult()
    forget_records_of_fresh_roots(spec, nodes, run_dir)
    (run_dir / FINAL_CLAIM).unlink(missing_ok=True)  # this launch's first finisher writes
    bad = preflight(spec, nodes, run_dir / "logs")
    if bad is not None:
        result.attempts.append(bad)
        return result
    with _lighthouse(spec, spec_path, nodes) if spec.fault_tolerance else contextlib.nullcontext():
        Supervisor(spec, spec_path, nodes, run_dir, result).run(on_poll, on_restart)
    return result


def preflight(spec: LaunchSpec, nodes: list[NodeSpec], log_dir: Path) -> Attempt | None:
    """The run key, checked before torchrun starts: its workers start only once every
    node joined the rendezvous, so a host with a bad key would otherwise wait for all of
    them to learn it (the workers check the rest of their input themselves)."""
    from training.state.keys import load_key

    try:
        load_key(spec.key_file)
    except GeotrainError as e:
        log_dir.mkdir(parents=True, exist_ok=True)
        who = f"{nodes[0].name}/preflight"
        (log_dir / f"{nodes[0].name}-preflight.log").write_text(f"{e}\n")
        return Attempt(e.exit_code, who)
    return None


def _lighthouse(
    spec: LaunchSpec, spec_path: Path, nodes: list[NodeSpec]
) -> contextlib.AbstractContextManager[object]:
    """fault_tolerance: the Lighthouse, hosted by the launcher of the node it is placed on."""
    # torchft's Lighthouse logs every quorum request at INFO into the launcher's output
    os.environ.setdefault("RUST_LOG", "warn")
    from training.ft.quorum import lighthouse_for  # imports torchft: only when it is on

    return lighthouse_for(spec, nodes, spec_path)


@dataclass
class Supervisor:
    """The torchruns of `nodes`, and the rendezvous stores of their jobs hosted here."""

    spec: LaunchSpec
    spec_path: Path
    nodes: list[NodeSpec]
    run_dir: Path
    result: LaunchResult
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)
    """Bytes of each node's torchrun log already read."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed workers each node's agent reported (its restart count, as torchrun keeps it)."""
    respawns: dict[str, int] = field(default_factory=dict)
    """Torchrun agents started again after a signal killed them (OOM killer, kill -9) or
    their rendezvous store was lost."""
    store_restarts: dict[str, int] = field(default_factory=dict)
    """Rendezvous stores (by job) started again after a signal killed them."""
    env: dict[str, str] = field(default_factory=dict)
    finished_at: float | None = None
    """fault_tolerance: when the first region here finished the run (monotonic)."""
    jobs: list[RdzvJob] = field(init=False)
    here: set[str] = field(default_factory=set)
    """The names of `nodes`."""
    log_at: dict[str, int] = field(default_factory=dict)
    """Each node's torchrun log size when its current agent started."""
    stores: list[tuple[RdzvJob, Path, int, subprocess.Popen[bytes]]] = field(default_factory=list)
    """The rendezvous stores this launcher hosts: (job, log, its size before, process)."""

    def __post_init__(self) -> None:
        self.jobs = rdzv_jobs(self.spec)

    def run(
        self, on_poll: Callable[[], None] | None, on_restart: Callable[[Attempt], None] | None
    ) -> None:
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = self.env = worker_env(self.run_dir, all(n.device == "cpu" for n in self.nodes))
        events = self.run_dir / "events.jsonl"
        # this launch's events start here: a byte offset, not a wall-clock time, which a
        # clock stepped back (NTP) would make hide this launch's bad-input events
        t0, started = time.monotonic(), events.stat().st_size if events.exists() else 0
        here = self.here = {n.name for n in self.nodes}
        self.stores.clear()
        try:
            for job in self.jobs:
                if job.host.name in here:
                    log = log_dir / f"rendezvous-store-{job.name}.log"
                    at = log.stat().st_size if log.exists() else 0  # earlier launches' lines
                    self.stores.append((job, log, at, spawn(store_command(job), env, log)))
            for n in self.nodes:
                if (job := job_of(self.jobs, n.name)).host.name not in here:
                    reach_store(job, n)
                self._spawn_agent(n)
            end = self._watch(on_poll, on_restart, started)
            end.seconds = time.monotonic() - t0
            self.result.attempts.append(end)
        finally:
            _stop(self.procs.values())
            _stop([p for *_, p in self.stores])

    def _log(self, node: str) -> Path:
        return self.run_dir / "logs" / f"{node}-torchrun.log"

    def _spawn_agent(self, node: NodeSpec) -> None:
        log = self._log(node.name)
        self.log_at[node.name] = log.stat().st_size if log.exists() else 0
        cmd = torchrun_command(self.spec, self.spec_path, node)
        self.procs[node.name] = spawn(cmd, self.env, log)

    def _watch(
        self,
        on_poll: Callable[[], None] | None,
        on_restart: Callable[[Attempt], None] | None,
        since: int,
    ) -> Attempt:
        while True:
            if on_poll:
                on_poll()
            lost = self._check_stores(on_restart)
            if lost is not None:
                return lost
            new = self._new_failures()
            ended = {k: rc for k, p in self.procs.items() if (rc := p.poll()) is not None}
            # read once a worker is gone: its event precedes its agent's log line, and a
            # hostile one keeps serving its metrics until its peers stopped (worker.py)
            final = (
                _final(self.run_dir / "events.jsonl", self.nodes, since) if new or ended else None
            )
            if final is not None:
                return final
            for node in self._respawn_killed(ended, on_restart):
                del ended[node]
            late_failures = self.finished_at is not None
            if not late_failures:  # after it, a late region's failures are no restarts
                for a in new:
                    self.result.attempts.append(a)
                    node = str(a.failed).split("/")[0]
                    if on_restart and self.failures[node] <= self.spec.max_restarts:
                        on_restart(a)
            if self._region_finished(ended):
                # a region is done: the run's weights are final, a late region not awaited;
                # one that fails now has nobody left to heal from: stopped, not restarted
                for a in new if late_failures else []:
                    self._stop_job_of(str(a.failed).split("/")[0])
                ended = {k: rc for k, p in self.procs.items() if (rc := p.poll()) is not None}
                assert self.finished_at is not None
                late = time.monotonic() - self.finished_at > FINISH_GRACE_S
                if late or len(ended) == len(self.procs):
                    return Attempt(0)
                time.sleep(POLL_S)
                continue
            bad = {k: rc for k, rc in ended.items() if rc != 0}
            # fault_tolerance: a region out of restarts leaves the others training on
            alone = self.spec.fault_tolerance is None or len(ended) == len(self.procs)
            if bad and alone:
                return self._ended(next(iter(bad)), bad)
            if len(ended) == len(self.procs):
                return Attempt(0)
            time.sleep(POLL_S)

    def _respawn_killed(
        self, ended: dict[str, int], on_restart: Callable[[Attempt], None] | None
    ) -> list[str]:
        """Start again, within max_restarts per node, every torchrun agent a signal killed
        (the OOM killer, a kill -9: a transient fault, not the workers' failure), or that
        lost its rendezvous store (below). Its workers died with it; the other nodes'
        agents restart theirs and meet the new agent in the next rendezvous round, and
        every rank resumes from the newest checkpoint. Returns the nodes started again.

        A store killed and started again (`_check_stores`) has lost the rendezvous' state,
        and torch's store client does not reconnect: every agent of its job exits within a
        monitor interval (`num_nodes_waiting` fails: RendezvousConnectionError, exit 1).
        Started again, they meet in a fresh rendezvous on the new store, its first round,
        wherever their store runs (this launcher or another host's)."""
        out = []
        for node, rc in ended.items():
            if rc == 0 or self.finished_at is not None:
                continue
            lost_store = rc > 0 and _lost_store(self._log(node), self.log_at[node])
            if (rc > 0 and not lost_store) or self.respawns.get(node, 0) >= self.spec.max_restarts:
                continue
            self.respawns[node] = self.respawns.get(node, 0) + 1
            a = Attempt(rc, f"{node}/torchrun")
            self.result.attempts.append(a)
            # after a store this launcher started again, that store's line said it
            if on_restart and not (lost_store and job_of(self.jobs, node).host.name in self.here):
                on_restart(a)
            self._spawn_agent(next(x for x in self.nodes if x.name == node))
            out.append(node)
        return out

    def _check_stores(self, on_restart: Callable[[Attempt], None] | None) -> Attempt | None:
        """A store serves until it is stopped. One a signal killed (the OOM killer, a
        kill -9) is started again on its address and port, within max_restarts per store;
        its job's agents then start again too (`_respawn_killed`). Returns the end of the
        run when one was killed once more than that. One that exited by itself (its port
        taken, its address not on this host: bad input) would leave its torchruns waiting
        out their rendezvous timeout (600 s) for nothing: fail at once, with its log's last
        line."""
        for i, (job, log, at, proc) in enumerate(self.stores):
            if (rc := proc.poll()) is None:
                continue
            if rc < 0 and self.finished_at is not None:
                continue  # fault_tolerance: the run's weights are final, nobody restarts
            if rc < 0:
                a = Attempt(rc, f"{job.host.name}/rendezvous-store")
                if self.store_restarts.get(job.name, 0) >= self.spec.max_restarts:
                    return a
                self.store_restarts[job.name] = self.store_restarts.get(job.name, 0) + 1
                self.result.attempts.append(a)
                if on_restart:
                    on_restart(a)
                at = log.stat().st_size
                self.stores[i] = (job, log, at, spawn(store_command(job), self.env, log))
                continue
            with open(log, "rb") as f:
                f.seek(at)
                lines = f.read().decode(errors="replace").strip().splitlines()
            raise SpecError(
                f"the rendezvous store of {job.name} on {job.addr}:{job.port} exited with {rc} "
                f"({lines[-1][:160] if lines else 'no output'}; {log}); free the port or fix "
                "the address"
            )
        return None

    def _stop_job_of(self, node: str) -> None:
        _stop([self.procs[n.name] for n in job_of(self.jobs, node).nodes if n.name in self.procs])

    def _region_finished(self, ended: dict[str, int]) -> bool:
        """fault_tolerance: every torchrun here of some region exited 0 (from then on the
        others' failures are not restarts of the run)."""
        if self.finished_at is not None:
            return True
        if self.spec.fault_tolerance is None:
            return False
        for job in self.jobs:
            mine = [n.name for n in job.nodes if n.name in self.procs]
            if mine and all(ended.get(n) == 0 for n in mine):
                self.finished_at = time.monotonic()
                return True
        return False

    def _ended(self, node: str, bad: dict[str, int]) -> Attempt:
        """A torchrun that exited non-zero: its last failed worker, once out of restarts."""
        attempts = self.result.attempts
        mine = [i for i, a in enumerate(attempts) if str(a.failed).startswith(node + "/")]
        if mine:
            return attempts.pop(mine[-1])  # the failure that ended it: no restart followed
        return Attempt(bad[node], f"{node}/torchrun")

    def _new_failures(self) -> list[Attempt]:
        """Workers each agent reported failed since the last poll (torchrun's log)."""
        out = []
        for node in self.procs:
            try:
                with open(self._log(node), "rb") as f:
                    f.seek(self.seen.get(node, 0))
                    text = f.read()
            except FileNotFoundError:
                continue
            end = text.rfind(b"\n") + 1  # a partial line waits for the next poll
            self.seen[node] = self.seen.get(node, 0) + end
            for m in FAILED.finditer(text[:end].decode(errors="replace")):
                self.failures[node] = self.failures.get(node, 0) + 1
                out.append(Attempt(int(m.group(1)), f"{node}/{m.group(2)}"))
        return out


def _lost_store(log: Path, since: int) -> bool:
    """The torchrun agent writing `log` (from byte `since`) ended on a broken connection
    to its rendezvous store (torch.distributed.elastic's RendezvousConnectionError, its
    last line)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(since, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return False
    return bool(lines) and "RendezvousConnectionError" in lines[-1]


def _final(events: Path, nodes: list[NodeSpec], since: int) -> Attempt | None:
    """A failure no restart can cure, recorded past byte `since` of the event log (this
    launch's) by a worker of `nodes`: bad input (a `failed` event with exit code 2) or a
    hostile reject (its peers may have exited first, with a plain collective error)."""
    for e in _events(events, since):
        hostile = e.get("event") == "rejected" and e.get("kind") == "hostile"
        bad_input = e.get("event") == "failed" and e.get("exit_code") == 2
        if not (hostile or bad_input):
            continue
        who = _worker(int(str(e.get("rank", -1))), nodes, e)
        if who is not None:
            return Attempt(2, who, 0.0, str(e.get("reason", "")) if hostile else None)
    return None


def _worker(rank: int, nodes: list[NodeSpec], e: dict[str, object]) -> str | None:
    if "node" in e and "local_rank" in e:
        return f"{e['node']}/{e['local_rank']}" if any(n.name == e["node"] for n in nodes) else None
    for n in nodes:
        if n.first_rank <= rank < n.first_rank + n.nprocs:
            return f"{n.name}/{rank - n.first_rank}"
    return None


def _events(path: Path, since: int = 0) -> list[dict[str, object]]:
    """The log's events past byte `since` (all of them if it shrank: replaced or cut)."""
    out = []
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = (data[since:] if len(data) >= since else data).splitlines()
    for line in lines:
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if isinstance(e, dict):
                out.append(e)
    return out


def forget_records_of_fresh_roots(spec: LaunchSpec, nodes: list[NodeSpec], run_dir: Path) -> None:
    """A node whose checkpoint root does not exist starts over (`geotrain train --fresh`
    removed it, or it is a new root): its high-water record in the run dir goes too, or
    resume would call the empty root a rollback. Checked before any worker starts."""
    for n in nodes:
        region, _ = spec.node(n.name)
        if not node_root(spec.checkpoint.dir, spec.stack, n.name, region.name).exists():
            record_path(run_dir, n.name).unlink(missing_ok=True)


@contextlib.contextmanager
def run_lock(run_dir: Path, what: str) -> Iterator[None]:
    """Hold <run_dir>/launcher.lock (flock) for the block: one launcher per run directory,
    since two would share its event log and checkpoints. The kernel releases the lock when
    the process dies, however it dies. `what` names the run in the error ("stack local")."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by workers
    except OSError as e:  # a file on the way, no permission, a read-only filesystem
        raise GeotrainError(
            f"cannot use {run_dir} as the run directory of {what} ({e.strerror}: "
            f"{e.filename}); give a directory this user can write"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        pid = holder.get("pid", "?")
        raise GeotrainError(
            f"{what} is already training (launcher pid {pid}, started at "
            f"{holder.get('started', '?')}); wait for it or stop it with kill {pid}"
        ) from None
    try:
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, json.dumps({"pid": os.getpid(), "started": started}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race a waiter)


def _holder(fd: int) -> dict[str, object]:
    try:
        return dict(json.loads(os.pread(fd, 4096, 0) or b"{}"))
    except ValueError:  # the holder has the lock but has not written its pid yet
        return {}
