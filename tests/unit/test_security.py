"""Issue #15: every finding of the runtime security review, played by a hostile peer or
process, is refused, with nothing applied and nothing loaded.

Multi-rank cases run on real gloo (training.testing.run_world); each has a timeout so a
hung collective fails the test instead of the suite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

import training.sync.codec as codec_mod
from training.comm.session import Control, Session, agree, derive, link_info, rendezvous_store
from training.comm.topology import Topology, make_groups
from training.errors import (
    CheckpointError,
    HostileReject,
    ReplayReject,
    RollbackError,
    SessionError,
    TransientReject,
)
from training.job import previous_rejects
from training.launch import launcher as launch
from training.observe.metrics import RuntimeMetrics
from training.spec import CodecSpec, listeners
from training.state.checkpoint import ALLOW_ROLLBACK_ENV, Checkpointer, VerifiedReader, node_group
from training.sync.codec import HEADER, Address, Codec, _Header, _pack, _unpack
from training.sync.hier import HierarchicalAllReduce
from training.testing import make_spec, run_world

pytestmark = pytest.mark.timeout(240)
KEY = bytes(range(32))
S1 = Session("run-a", bytes(range(16)), epoch=3)
S2 = Session("run-a", bytes(range(1, 17)), epoch=4)
ADDR = Address(epoch=3, step=7, source=2, dest=0, bucket=1, part=0, stage=0)
N = 1000


def _codec(session: Session = S1, cipher: str = "sm4-gcm", quant: str = "int8") -> Codec:
    return Codec(CodecSpec(quantize=quant, cipher=cipher, block_size=64), KEY, session)


@pytest.fixture
def nothing_decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails the test if anything sized by a header is decompressed or dequantized."""
    calls: list[str] = []

    def refuse(name: str) -> Any:
        def called(*a: Any, **k: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} ran on a payload that must be refused first")

        return called

    monkeypatch.setattr(codec_mod, "_dequantize", refuse("_dequantize"))
    monkeypatch.setattr(Codec, "_zd", lambda self: refuse("zstd")(self))
    return calls


def _header(payload: bytes) -> _Header:
    h = _unpack(payload)
    assert h is not None
    return h


def _forge(c: Codec, payload: bytes, body: bytes, **fields: Any) -> bytes:
    """A key holder's payload: `payload`'s header with `fields` changed, sealing `body`
    (authentic, since the key holder derives the keys)."""
    h = _header(payload)._replace(**fields)
    header = _pack(h)
    return header + c._seal(body, h, header, h.tag + h.session)


# -- 1. replay across runs; the epoch every node agrees on -------------------------------
def test_a_payload_recorded_in_an_earlier_session_is_refused_as_a_replay(
    nothing_decoded: list[str],
) -> None:
    recorded, _ = _codec(S1).encode(torch.randn(N), ADDR)
    later = _codec(S2)  # same run, same key file, the next launch
    for expect in (ADDR, dataclasses.replace(ADDR, epoch=S2.epoch)):
        # anyone on the path can replay: dropped and counted, a transient reject
        with pytest.raises(ReplayReject, match="replayed from another run or session"):
            later.decode(recorded, expect, N)
    assert later.stats.rejected == 2 and not nothing_decoded


def _launches(rank: int, world: int, roots: str, lose_record: bool) -> list[tuple[int, str]]:
    """Three launches of a two-node world (a node per rank, separate roots); before the
    third, node n1 loses its record (its epoch must come from n0's)."""
    out = []
    for launch_no in range(3):
        c = _ckpt(Path(roots) / "{node}", nodes=[[0], [1]])
        if launch_no == 2 and lose_record and rank == 1:
            c._record = {}
        s = agree(KEY, "run-a", c.stored_epoch, c.world)
        c.start(s)
        out.append((s.epoch, s.id.hex()))
    return out


def test_every_launch_agrees_on_a_fresh_session_and_the_epoch_the_nodes_recorded(
    tmp_path: Path,
) -> None:
    a, b = run_world(_launches, 2, str(tmp_path), True)
    assert a == b  # every rank: the same epoch and session
    assert [e for e, _ in a] == [0, 1, 2]  # persisted, one past the highest recorded
    assert len({sid for _, sid in a}) == 3  # fresh every launch


def _other_key(rank: int, world: int) -> str:
    key = KEY if rank == 0 else bytes(32)
    try:
        agree(key, "run-a", -1)
    except SessionError as e:
        return str(e)
    return "agreed"


def test_a_rank_with_another_run_key_cannot_join_the_session() -> None:
    out = run_world(_other_key, 2)
    assert all("do not agree on the session" in r for r in out), out


# -- 2. one key for everything -------------------------------------------------------------
def test_each_link_direction_stage_generation_and_session_has_its_own_key() -> None:
    keys = {
        derive(KEY, s.salt(), link_info("sm4-gcm", src, dst, stage, gen), 16)
        for s in (S1, S2, Session("run-b", S1.id, 3))
        for src, dst in ((2, 0), (0, 2), (2, 1), (3, 1))
        for stage in (0, 1)
        for gen in (0, 1)
    }
    assert len(keys) == 3 * 4 * 2 * 2
    # a payload sealed for 2 -> 0, re-addressed as 0 -> 2 by someone without the key
    payload, _ = _codec().encode(torch.randn(N), ADDR)
    h = _header(payload)._replace(source=0, dest=2)
    flipped = _pack(h) + payload[HEADER.size :]
    with pytest.raises(TransientReject, match="failed sm4-gcm authentication"):
        _codec().decode(flipped, dataclasses.replace(ADDR, source=0, dest=2), N)


def test_nonces_are_counters_that_never_repeat_and_the_key_changes_before_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(codec_mod, "REKEY_MESSAGES", 4)
    # a session no other test encrypted in: a link's counter belongs to the process
    fresh = dataclasses.replace(S1, id=os.urandom(16))
    sender, receiver = _codec(fresh), _codec(fresh)
    nonces = []
    for step in range(10):
        addr = dataclasses.replace(ADDR, step=step)
        payload, sent = sender.encode(torch.randn(N), addr)
        nonces.append(_header(payload).nonce)
        assert torch.equal(receiver.decode(payload, addr, N), sent)
    assert len(set(nonces)) == 10
    gens = [int.from_bytes(n[:4], "big") for n in nonces]
    counters = [int.from_bytes(n[4:], "big") for n in nonces]
    assert gens == [0] * 4 + [1] * 4 + [2] * 2 and counters == [0, 1, 2, 3] * 2 + [0, 1]
    # another link keeps its own counter (and key)
    other, _ = sender.encode(torch.randn(N), dataclasses.replace(ADDR, dest=1))
    assert _header(other).nonce == bytes(12)


# -- 3. payloads reaching the wrong group ---------------------------------------------------
class _Misrouting(HierarchicalAllReduce):
    """Rank 3 (region 1, local rank 1) sends region 0's local rank 1 a payload that a peer
    of local rank 0's group addressed to region 0's local rank 0 (2 -> 0)."""

    def _all_to_all_bytes(
        self, payloads: list[bytes], limits: list[int] | None = None
    ) -> list[bytes]:
        if self.topo.rank == 3 and payloads[0]:
            step = int.from_bytes(payloads[0][42:50], "big")
            addr = Address(self.epoch, step, 2, 0, bucket=0, part=0, stage=0)
            n = _header(payloads[0]).numel
            payloads = [self.codec.encode(torch.randn(n), addr)[0], *payloads[1:]]
        return super()._all_to_all_bytes(payloads, limits)


def _misrouted(rank: int, world: int) -> tuple[str, float]:
    spec = make_spec(2, 2)
    topo = Topology.of(spec, rank)
    codec = Codec(CodecSpec(quantize="int8"), KEY)
    sync = _Misrouting(topo, make_groups(topo, torch.device("cpu")), codec, spec.run_id)
    x = torch.ones(4000)
    try:
        sync.all_reduce(x, step=5)
    except ReplayReject as e:  # a redirect looks like one: dropped, counted, transient
        return str(e), x.sum().item()
    except RuntimeError:  # a peer that refused left the collective
        return "aborted", x.sum().item()
    return "applied", x.sum().item()


def test_a_payload_of_another_local_ranks_group_is_refused() -> None:
    out = run_world(_misrouted, 4)
    why, untouched = out[1]  # region 0, local rank 1
    assert "misaddressed" in why and "rank 2->0" in why, out
    assert untouched == 4000.0  # the caller's tensor: nothing applied


def test_a_piece_of_the_wrong_size_is_refused(nothing_decoded: list[str]) -> None:
    c = _codec()
    payload, _ = c.encode(torch.randn(1), ADDR)  # one value where the receiver expects N
    with pytest.raises(HostileReject, match="numel differ"):
        c.decode(payload, ADDR, N)


# -- 4. the decoder trusts header sizes ----------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"numel": 2**31}, "numel differ"),
        ({"numel": 1}, "numel differ"),
        ({"block": 0}, "block differ"),
        ({"quant": codec_mod.QUANT["int4"]}, "quantizer differ"),
    ],
)
@pytest.mark.parametrize("cipher", ["sm4-gcm", "none"])
def test_header_sizes_other_than_the_receivers_are_refused_before_any_allocation(
    fields: dict[str, int], words: str, cipher: str, nothing_decoded: list[str]
) -> None:
    c = _codec(cipher=cipher)
    payload, _ = c.encode(torch.randn(N), ADDR)
    h = _header(payload)._replace(**fields)
    header = _pack(h)
    garbled = header + payload[HEADER.size :]  # no key: not authentic as it claims
    with pytest.raises(TransientReject, match=words):
        c.decode(garbled, ADDR, N)
    body = payload[HEADER.size : -codec_mod.TAG_BYTES]
    forged = header + c._seal(body, h, header, h.tag + h.session)  # a key holder's lie
    with pytest.raises(HostileReject, match=words):
        c.decode(forged, ADDR, N)
    assert not nothing_decoded


def test_an_authentic_body_that_declares_another_size_is_never_decompressed(
    nothing_decoded: list[str],
) -> None:
    c = _codec()
    big, _ = c.encode(torch.randn(4 * N), ADDR)  # a frame of 4N values
    h = _header(big)
    body = c._open(big[HEADER.size :], h, big[: HEADER.size], S1.salt(), "sm4-gcm")
    assert body is not None
    forged = _forge(c, big, body=body, numel=N)  # header says N, the frame 4N
    with pytest.raises(HostileReject, match="wrong size"):
        c.decode(forged, ADDR, N)


# -- 5. listeners ----------------------------------------------------------------------------
def _free_port(span: int = 4) -> int:
    """The first of `span` free ports below the kernel's ephemeral range: the run picks its
    own ports (the rendezvous store's) from that range as it starts, after this returns, and
    could pick one of ours (a run once failed on a metrics port its store had taken)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, low - span)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + span):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {span} free ports between 20000 and {low}")


def _listening(pids: set[int] | None = None) -> list[tuple[str, int]]:
    """(local address, pid) of every TCP/UDP listener, optionally of `pids` only."""
    out = []
    for flags in ("-ltnpH", "-lunpH"):
        text = subprocess.run(["ss", flags], capture_output=True, text=True).stdout
        for line in text.splitlines():
            cols = line.split()
            for pid in map(int, re.findall(r"pid=(\d+)", line)):
                if pids is None or pid in pids:
                    out.append((cols[3], pid))
    return out


def _all_interfaces(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0]
    return host in ("0.0.0.0", "*", "[::]", "::") or host.startswith("[::]%")


needs_ss = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")


@needs_ss
def test_the_rendezvous_store_listens_on_the_master_address_only() -> None:
    port = _free_port()
    store = rendezvous_store("127.0.0.1", port, 1, True, timedelta(seconds=10))
    store.set("k", "v")
    mine = [a for a, _ in _listening({os.getpid()}) if a.endswith(f":{port}")]
    assert mine == [f"127.0.0.1:{port}"], mine
    # a client on another address of this host (127.0.0.2 is loopback too) is refused
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.2", port), 5):
        pass
    client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=10))
    assert client.get("k") == b"v"


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


@needs_ss
def test_nothing_a_local_run_starts_listens_on_every_interface(tmp_path: Path) -> None:
    from tests.integration.helpers import two_node_stack

    stack = two_node_stack(tmp_path, "listen", workers=1, steps=200)
    doc = yaml.safe_load(stack.read_text())
    base = _free_port()
    mon = doc["config"]["geotrain:monitoring"]
    mon["metrics_port"] = base
    for key in ("prometheus_port", "alertmanager_port", "grafana_port"):
        mon[key] = _free_port()  # never a port another run on this machine holds
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.Popen(
        [sys.executable, "-m", "geotrain", "train", "--stack", str(stack)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    run_dir = tmp_path / ".geotrain/listen"
    try:
        deadline = time.monotonic() + 180
        while not _stepped(run_dir / "events.jsonl"):
            assert proc.poll() is None and time.monotonic() < deadline, "no step was taken"
            time.sleep(0.1)
        seen = _listening(_descendants(proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    spec = json.loads((run_dir / "launch-spec.json").read_text())
    addrs = {a for a, _ in seen}
    # the store, both workers' metrics and gloo were up, each on the plan's address
    assert f"127.0.0.1:{spec['master_port']}" in addrs, seen
    assert {f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"} <= addrs, seen
    assert len(addrs) >= 5, seen
    assert not [a for a in addrs if _all_interfaces(a)], seen


def _stepped(events: Path) -> bool:
    try:
        return '"event": "step"' in events.read_text()
    except FileNotFoundError:
        return False


def test_policy_facts_list_what_the_runtime_binds() -> None:
    from infra.facts import monitoring_facts, training_facts
    from infra.model import load_stack
    from infra.plan import build_plan
    from infra.render.runtime import render_launch_spec

    plan = build_plan(load_stack("global"))
    spec = render_launch_spec(plan)
    bound = listeners(spec)
    facts = training_facts(plan)["endpoints"] + monitoring_facts(plan)["endpoints"]
    assert all(e in facts for e in bound)
    rendezvous = next(e for e in bound if e["service"] == "rendezvous")
    assert rendezvous["bind"] == spec.master_addr  # what rendezvous_store binds
    assert not [e for e in facts if e["bind"] in ("0.0.0.0", "::")]


# -- 6. time of check, time of use in checkpoints ----------------------------------------
def _ckpt(root: Path, nodes: list[list[int]] | None = None, **kw: Any) -> Checkpointer:
    nodes = nodes or [[0]]
    world = dist.new_group(backend="gloo")
    group = node_group(nodes)
    i = next(i for i, ranks in enumerate(nodes) if dist.get_rank() in ranks)
    name = f"n{i}"
    root = Path(str(root).replace("{node}", name))
    return Checkpointer(root, name, "run-a", KEY, 3, group, world, **kw)


class _Evil:
    """Unpickling this creates `path`: the code an attacker's pickle would run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def _swap(rank: int, world: int, root: str, marker: str, when: str) -> tuple[str, float]:
    c = _ckpt(Path(root))
    c.save(1, {"w": torch.full((N,), 1.0)})
    c.wait()
    d = c.dir_of(1)
    shard = next(d.glob("*.distcp"))
    evil = pickle.dumps(_Evil(marker))
    if when == "after-the-check":  # the manifest verified, then the files are swapped
        real = c._verified_manifest

        def then_swap(dd: Path) -> dict[str, str]:
            files = real(dd)
            (dd / ".metadata").write_bytes(evil)
            shard.write_bytes(b"\0" * shard.stat().st_size)
            return files

        c._verified_manifest = then_swap  # type: ignore[method-assign]
    else:  # each file is swapped the moment after it was read and checked
        read = VerifiedReader._verified

        def swap_behind(self: VerifiedReader, name: str) -> bytes:
            data = read(self, name)
            (d / name).write_bytes(evil if name == ".metadata" else b"\0" * len(data))
            return data

        VerifiedReader._verified = swap_behind  # type: ignore[method-assign]
    back = {"w": torch.zeros(N)}
    try:
        c.load(d, back)
    except CheckpointError as e:
        return str(e), back["w"].sum().item()
    return "loaded", back["w"].sum().item()


def test_a_checkpoint_swapped_after_verification_is_refused_and_nothing_is_unpickled(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "pwned"
    why, total = run_world(_swap, 1, str(tmp_path / "c"), str(marker), "after-the-check")[0]
    assert "changed after it was verified" in why and "not loaded" in why
    assert total == 0.0 and not marker.exists()


def test_dcp_reads_only_the_verified_bytes_never_the_files_again(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    why, total = run_world(_swap, 1, str(tmp_path / "c"), str(marker), "right-after-read")[0]
    assert (why, total) == ("loaded", float(N)) and not marker.exists()


# -- 7. rollback goes unnoticed ---------------------------------------------------------------
def _save(rank: int, world: int, root: str, steps: list[int]) -> None:
    c = _ckpt(Path(root))
    for s in steps:
        c.save(s, {"w": torch.full((N,), float(s))})
    c.wait()


def _resume(rank: int, world: int, root: str, allow: bool) -> tuple[Any, ...]:
    c = _ckpt(Path(root), allow_rollback=allow)
    try:
        d = c.latest()
    except RollbackError as e:
        return "refused", str(e)
    if d is None:
        return None, [f.reason for f in c.fallbacks]
    back = {"w": torch.zeros(N)}
    c.load(d, back)
    return d.parent.name, [f.reason for f in c.fallbacks], back["w"][0].item()


def _rename(root: Path, old: int, new: int) -> None:
    os.rename(root / f"step-{old}", root / f"step-{new}")


ATTACKS = {
    "rename-newest-to-a-later-step": lambda r: _rename(r, 2, 9),
    "delete-the-newest": lambda r: shutil.rmtree(r / "step-2"),
    "delete-every-checkpoint": lambda r: [shutil.rmtree(r / f"step-{s}") for s in (1, 2)],
    "delete-the-newest-and-the-record": lambda r: [
        shutil.rmtree(r / "step-2"),
        (r / "high-water-n0.json").unlink(),
    ],
    "forge-the-record": lambda r: [
        shutil.rmtree(r / "step-2"),
        (r / "high-water-n0.json").write_text(
            (r / "high-water-n0.json").read_text().replace('"high_water": 2', '"high_water": 1')
        ),
    ],
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_rolling_checkpoints_back_is_a_clear_error_unless_allowed(
    tmp_path: Path, attack: str
) -> None:
    root = tmp_path / "c"
    run_world(_save, 1, str(root), [1, 2])
    ATTACKS[attack](root)
    refused = run_world(_resume, 1, str(root), False)[0]
    assert refused[0] == "refused" and ALLOW_ROLLBACK_ENV in refused[1], refused
    assert "rollback refused" in refused[1]
    allowed = run_world(_resume, 1, str(root), True)[0]
    assert allowed[0] in ("step-1", None) and any("allowed" in r for r in allowed[1])


def test_an_old_checkpoint_renamed_to_a_newer_step_is_never_loaded(tmp_path: Path) -> None:
    root = tmp_path / "c"
    run_world(_save, 1, str(root), [1, 2])
    _rename(root, 1, 9)
    name, reasons, value = run_world(_resume, 1, str(root), False)[0]
    assert (name, value) == ("step-2", 2.0)
    assert any("manifest is of step 1" in r for r in reasons), reasons


# -- 8. cipher none has no integrity ----------------------------------------------------------
def test_cipher_none_still_authenticates_a_flipped_byte_is_refused(
    nothing_decoded: list[str],
) -> None:
    c = _codec(cipher="none", quant="none")
    x = torch.randn(N)
    payload, _ = c.encode(x, ADDR)
    for at in (HEADER.size + 10, len(payload) // 2, len(payload) - 1):
        b = bytearray(payload)
        b[at] ^= 0x01
        with pytest.raises(TransientReject, match="authentication"):
            c.decode(bytes(b), ADDR, N)
    assert not nothing_decoded


# -- 9. hostile versus transient --------------------------------------------------------------
STUB = """
import json, os, sys, time
kind, rank = sys.argv[1], int(sys.argv[2]) + int(os.environ["LOCAL_RANK"])
run_dir = os.environ["GEOTRAIN_RUN_DIR"]
with open(f"{run_dir}/starts-{rank}", "a+") as f:  # this rank's starts so far, this one too
    f.write("x")
    f.seek(0)
    restarted = len(f.read()) > 1
def emit(**e):
    with open(os.environ["GEOTRAIN_EVENTS"], "a") as f:
        f.write(json.dumps({"t": time.time(), "rank": rank, **e}) + "\\n")
if kind == "transient" and restarted:
    sys.exit(0)  # the restarted job gets clean traffic
if rank == 1:
    emit(event="rejected", kind=kind, reason=f"a {kind} reject", total=1)
    time.sleep(0.5)  # its peer, cut off, exits first
    sys.exit(2 if kind == "hostile" else 3)
time.sleep(0.1)
sys.exit(1)  # the peer: a collective error
"""


@pytest.mark.parametrize("kind", ["hostile", "transient"])
def test_a_hostile_reject_stops_the_job_and_a_transient_one_restarts_it(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real torchrun agents, one per node (c10d rendezvous), running a stub worker."""
    from geotrain.commands import free_port
    from training.state.keys import create_key_file

    spec = make_spec(2, 1, max_restarts=2, master_port=free_port())
    spec = dataclasses.replace(spec, key_file=str(tmp_path / "run.key"))
    create_key_file(Path(spec.key_file))
    nodes = [n for r in spec.regions for n in r.nodes]
    (tmp_path / "stub.py").write_text(STUB)

    def entry(spec_path: Path, node: Any) -> list[str]:
        return [str(tmp_path / "stub.py"), kind, str(node.first_rank)]

    monkeypatch.setattr(launch, "worker_entry", entry)
    monkeypatch.setattr(launch.signal, "signal", lambda *a: None)  # not this process's
    result = launch.launch(spec, tmp_path / "spec.json", nodes, tmp_path / "run")
    if kind == "hostile":  # stopped at once: torchrun would have retried it twice
        [only] = result.attempts
        assert (only.rc, only.failed, only.hostile) == (2, "n1/0", "a hostile reject")
    else:  # one job-wide restart: the failures the agents saw, then the end
        failed = {a.failed for a in result.attempts[:-1]}
        assert result.ok and failed and failed <= {"n0/0", "n1/0"}, result
        # every rank started twice: the reject restarted the job (which agent logged a
        # failure first is a race: its peer's agent may stop its worker for the restart
        # before that worker exits on its own)
        starts = [(tmp_path / "run" / f"starts-{r}").read_text() for r in (0, 1)]
        assert starts == ["xx", "xx"], starts


def test_the_rejected_count_is_exported_and_survives_a_restart(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    lines = [
        {"event": "rejected", "rank": 1, "total": 1, "t": 1.0},
        {"event": "rejected", "rank": 0, "total": 5, "t": 2.0},
        {"event": "rejected", "rank": 1, "total": 2, "t": 3.0},
    ]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    m = RuntimeMetrics("frankfurt", "fra-0", 1)  # the restarted worker of rank 1
    m.reject(previous_rejects(events, 1))
    value = m.registry.get_sample_value(
        "geotrain_payloads_rejected_total", {"region": "frankfurt", "node": "fra-0", "rank": "1"}
    )
    assert value == 2.0 and m.reject() == 3


# -- 10. other traffic across borders --------------------------------------------------------
def _tampered_control(rank: int, world: int) -> str:
    ctl = Control(KEY, S1, "steps")
    if rank == 1:  # a hostile peer: right shape, but not under this run's key
        ctl._key = bytes(32)
    try:
        ctl.gather([True, False])
    except TransientReject as e:
        return str(e)
    return "used"


def test_a_control_message_without_the_runs_key_is_refused() -> None:
    got = run_world(_tampered_control, 2)
    assert "from rank 1 failed authentication" in got[0], got
    assert "from rank 0 failed authentication" in got[1], got


def _control_in_flight(rank: int, world: int) -> list[Any]:
    """training.loop.due's gather: started at one control step, read at the next, with
    other collectives of the same group in between."""
    ctl = Control(KEY, S1, "steps")
    first = ctl.start_gather([rank == 1, False])
    dist.all_reduce(torch.ones(4))  # the steps in between
    second = ctl.start_gather([False, rank == 0])
    out = [first.result(), second.result()]
    hostile = Control(KEY, S1, "steps")
    if rank == 1:
        hostile._key = bytes(32)
    try:
        hostile.start_gather([True, True]).result()
    except TransientReject as e:
        out.append(str(e))
    with pytest.raises(ValueError, match="exceeds 64"):
        ctl.start_gather(["x" * 64])
    return out


def test_a_control_gather_in_flight_returns_every_ranks_flags_verified() -> None:
    got = run_world(_control_in_flight, 2)
    for r, out in enumerate(got):
        assert out[:2] == [[[False, False], [True, False]], [[False, True], [False, False]]]
        assert f"from rank {1 - r} failed authentication" in out[2], out


def _resume_without_pickle(rank: int, world: int, root: str) -> list[Any]:
    def no_pickle(*a: Any, **k: Any) -> Any:
        raise AssertionError("a pickle crossed between nodes")

    c = _ckpt(Path(root) / "{node}", nodes=[[0], [1]])
    c.save(1, {"w": torch.full((N,), 1.0)})
    c.wait()
    # this process only: whatever torch or geotrain would unpickle with
    pickle.loads = pickle.load = no_pickle  # type: ignore[assignment]
    dist.distributed_c10d._unpickler = no_pickle  # type: ignore[attr-defined]
    d = c.latest()  # the cross-node agreement: every node's steps, problems, records
    return [d is not None and d.parent.name, [f.reason for f in c.fallbacks]]


def test_checkpoint_agreement_between_nodes_carries_no_pickle(tmp_path: Path) -> None:
    out = run_world(_resume_without_pickle, 2, str(tmp_path))
    assert out == [["step-1", []], ["step-1", []]]


def test_a_replayed_payload_is_counted_as_replayed_and_does_not_stop_the_job() -> None:
    """Anyone on the path can replay recorded traffic: the reject is transient (exit 3,
    restart in a new session) and counted as `replayed`; only a key holder's payload of a
    shape no honest sender writes stops the job."""
    from types import SimpleNamespace

    from training.job import rejected

    recorded, _ = _codec(S1).encode(torch.randn(N), ADDR)
    with pytest.raises(ReplayReject) as caught:
        _codec(S2).decode(recorded, ADDR, N)
    assert isinstance(caught.value, TransientReject) and caught.value.exit_code == 3
    emitted: list[dict[str, object]] = []
    job = SimpleNamespace(
        metrics=SimpleNamespace(reject=lambda: 1, serving=False),
        emit=lambda event, **kw: emitted.append({"event": event, **kw}),
        step=7,
    )
    rejected(job, caught.value)  # type: ignore[arg-type]
    assert emitted[0]["kind"] == "replayed" and emitted[0]["total"] == 1
