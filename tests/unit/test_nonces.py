"""GCM nonces never repeat under a key, and control messages stay in their channel.

The nonce property: every (key, nonce) an AEAD seals in a real multi-rank run is recorded at
the cipher (training.sync.codec._cipher, for the keys derived from the run key), across the
sync modes and options (all-reduce, DiLoCo, streaming DiLoCo, secure aggregation and both
together, the topology and all-gather exchanges, the adaptive codec, several cross groups,
the heal transport), and no pair may appear twice in the whole world. The control property:
a message of one `Control` instance (another purpose, or the same purpose on another group
or another instance) replayed into another is refused."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import training.comm.session as session_mod
import training.sync.codec as codec_mod
from training.comm.session import Control, Session, agree
from training.comm.topology import Topology, make_groups
from training.errors import TransientReject
from training.gradsync import buckets
from training.spec import AdaptiveSpec, Cipher, CodecSpec, DilocoSpec, Exchange, Quantize
from training.sync.codec import HEADER, Address, Codec
from training.sync.diloco import DiLoCo
from training.sync.exchange_plan import ExchangePlan
from training.sync.hier import HierarchicalAllReduce
from training.sync.streaming import twin
from training.sync.topo_exchange import TopologyExchange
from training.testing import make_spec, run_world

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))
RUN = "nonce-run"


@dataclass(frozen=True)
class Mode:
    """One sync mode and option combination of a small world (R regions x L workers)."""

    regions: int = 3
    local: int = 1
    secure: bool = False
    diloco: DilocoSpec | None = None
    """None: a per-step all-reduce of two buckets."""
    exchange: Exchange = "direct"
    """direct, allgather, or topology (a fixed plan that relays through region 2)."""
    adaptive: bool = False
    cipher: Cipher = "sm4-gcm"
    quantize: Quantize = "int8"


BLOCKING = DilocoSpec(every_steps=2, outer_momentum=0.0)
STREAMING = DilocoSpec(every_steps=4, fragments=2, tau=1)
MODES = {
    "allreduce": Mode(),
    "allreduce-aes-2x2": Mode(regions=2, local=2, cipher="aes-gcm"),
    "allgather": Mode(exchange="allgather"),
    "topology-relayed": Mode(exchange="topology"),
    "adaptive": Mode(adaptive=True),
    "diloco": Mode(diloco=BLOCKING, quantize="int4"),
    "streaming": Mode(diloco=STREAMING, quantize="int4"),
    "secagg": Mode(secure=True),
    "secagg-2x2": Mode(regions=2, local=2, secure=True),
    "diloco-secagg": Mode(diloco=BLOCKING, secure=True),
    "streaming-secagg": Mode(diloco=STREAMING, secure=True),
}


def _record_seals() -> list[tuple[bytes, bytes]]:
    """From now on, in this rank: every (key, nonce) the codec's AEAD is asked to encrypt
    under, for keys derived from the run key (not the adaptive codec's calibration codec,
    whose throwaway key seals local samples that never leave the process)."""
    ours: set[bytes] = set()
    seals: list[tuple[bytes, bytes]] = []
    derive, cipher = codec_mod.derive, codec_mod._cipher

    def recording_derive(run_key: bytes, salt: bytes, info: str, size: int) -> bytes:
        key = derive(run_key, salt, info, size)
        if run_key == KEY:
            ours.add(key)
        return key

    def recording_cipher(name: str, key: bytes, nonce: bytes, tag: bytes | None = None) -> Any:
        if tag is None and key in ours:  # an encryptor: a seal (decryptors carry the tag)
            seals.append((key, nonce))
        return cipher(name, key, nonce, tag)

    codec_mod.derive = recording_derive
    codec_mod._cipher = recording_cipher
    return seals


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))


def _sync(rank: int, mode: Mode) -> HierarchicalAllReduce:
    topo = Topology.of(make_spec(mode.regions, mode.local), rank)
    groups = make_groups(topo, torch.device("cpu"))
    adaptive = AdaptiveSpec(quantize=("int8", "int4"), zstd_levels=(1,)) if mode.adaptive else None
    spec = CodecSpec(
        quantize=mode.quantize,
        cipher=mode.cipher,
        block_size=16,
        secure_aggregation=mode.secure,
        adaptive=adaptive,
    )
    session = agree(KEY, RUN, -1)  # a worker's session: fresh, agreed by every rank
    sync = HierarchicalAllReduce(
        topo, groups, Codec(spec, KEY, session), RUN, allgather=mode.exchange == "allgather"
    )
    if mode.exchange == "topology":  # beijing <-> frankfurt relayed through region 2
        plan = ExchangePlan((4, 0, 20), ((0, 2, 2), (2, 1, 2), (0, 1, 2)))
        sync.planner = TopologyExchange(replan=10**9, plan=plan, exchanges=1)
    sync.probe()
    return sync


class _Digest:
    def update(self, t: torch.Tensor) -> None:
        pass


def _run(rank: int, mode: Mode, steps: int) -> None:
    sync = _sync(rank, mode)
    g = torch.Generator().manual_seed(rank)
    if mode.diloco is None:
        for step in range(steps):
            xs = [torch.randn(90, generator=g), torch.randn(33, generator=g)]
            sync.all_reduce_many(xs, step, [0, 1])
        return
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    parts = buckets(list(model.parameters()), 2e-4)  # [w0 (72)] and [b0, w1, b1 (25)]
    d = DiLoCo(parts, mode.diloco, sync, twin(sync) if mode.diloco.tau else None)
    for step in range(steps):
        model.zero_grad()
        x = torch.randn(8, 6, generator=g)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
        opt.step()
        if d.due(step, steps):
            d.advance(step, steps, _Digest)


def _world(rank: int, world: int, names: list[str], steps: int) -> dict[str, list[Any]]:
    """Each mode in turn, as one launch each (its own session), in one process per rank
    (the process-wide state a long-lived worker has, and one world start for all)."""
    seals = _record_seals()
    out = {}
    for name in names:
        _run(rank, MODES[name], steps)
        out[name], seals[:] = list(seals), []
    return out


@pytest.mark.parametrize(("regions", "local"), [(3, 1), (2, 2)])
def test_no_key_and_nonce_pair_is_sealed_twice_in_a_run(regions: int, local: int) -> None:
    names = [n for n, m in MODES.items() if (m.regions, m.local) == (regions, local)]
    ranks = run_world(_world, regions * local, names, 9)
    for name in names:
        seals = [s for r in ranks for s in r[name]]
        assert seals, f"{name}: nothing was sealed: the recording missed the codec's cipher"
        repeated = {pair: n for pair, n in Counter(seals).items() if n > 1}
        assert not repeated, (
            f"{name}: {len(repeated)} (key, nonce) pairs sealed more than once among "
            f"{len(seals)} sealed payloads, e.g. nonce {next(iter(repeated))[1].hex()}"
        )


def test_heal_responses_never_share_a_nonce_under_a_steps_key() -> None:
    """Two donors serve the same step (one key: HKDF(run key, run tag, step)) to several
    healers' challenges: every response is sealed under a nonce of its own."""
    import training.ft.heal as heal

    seals: list[tuple[bytes, bytes]] = []
    cipher = heal._cipher

    def recording(name: str, key: bytes, nonce: bytes, tag: bytes | None = None) -> Any:
        if tag is None:
            seals.append((key, nonce))
        return cipher(name, key, nonce, tag)

    heal._cipher = recording
    donors = [heal.SealedTransport("127.0.0.1", KEY, RUN) for _ in range(2)]
    try:
        for d in donors:
            d._staged = (5, b"state")
            for _ in range(8):
                assert d._respond(f"/5/{os.urandom(heal.CHALLENGE_BYTES).hex()}") is not None
    finally:
        heal._cipher = cipher
        for d in donors:
            d.shutdown()
    assert len(seals) == 16 and len({k for k, _ in seals}) == 1
    assert len(set(seals)) == 16


def test_codecs_of_one_session_never_start_a_links_counter_over() -> None:
    """Two codecs of one session (a sync's and its secure aggregation's, or a twin's), and
    one rebound to its session, keep drawing from one counter per key."""
    session = Session(RUN, os.urandom(16), epoch=1)
    spec = CodecSpec(quantize="none", block_size=16)
    first, second = Codec(spec, KEY, session), Codec(spec, KEY, session)
    addr = Address(epoch=1, step=0, source=2, dest=0, bucket=0, stage=2)
    nonces = [first.encode(torch.ones(8), addr)[0][HEADER.size - 12 : HEADER.size]]
    nonces.append(second.encode(torch.ones(8), addr)[0][HEADER.size - 12 : HEADER.size])
    first.bind(session)
    nonces.append(first.encode(torch.ones(8), addr)[0][HEADER.size - 12 : HEADER.size])
    assert [int.from_bytes(n, "big") for n in nonces] == [0, 1, 2]
    other = Codec(spec, KEY, Session(RUN, os.urandom(16), epoch=1))  # another session's keys
    assert other.encode(torch.ones(8), addr)[0][HEADER.size - 12 : HEADER.size] == bytes(12)


# -- control channels ---------------------------------------------------------------------
def _control_replays(rank: int, world: int) -> dict[str, str]:
    """Rank 0's `steps` channel sends one message; then the network hands every other
    channel that message (every rank's, as recorded) in place of the real ones. Each channel
    must refuse it, and still work when left alone."""
    import torch.distributed as dist

    session = agree(KEY, RUN, -1)
    pair = dist.new_group([0, 1])  # the same ranks as the world, another group
    source = Control(KEY, session, "steps")
    others = {
        "another purpose": Control(KEY, session, "balance"),
        "another instance": Control(KEY, session, "steps"),
        "another group": Control(KEY, session, "steps", pair),
        "another session": Control(KEY, agree(KEY, RUN, -1), "steps"),
    }
    real = session_mod.all_gather_bytes
    recorded: list[list[bytes]] = []

    def record(data: bytes, group: Any = None) -> list[bytes]:
        recorded.append(real(data, group))
        return recorded[-1]

    session_mod.all_gather_bytes = record
    assert source.gather({"stop": False}) == [{"stop": False}] * world
    out = {}
    for what, ctl in others.items():
        session_mod.all_gather_bytes = lambda data, group=None: recorded[0]
        try:
            out[what] = f"used {ctl.gather({'stop': True})}"
        except TransientReject as e:
            out[what] = str(e)
        session_mod.all_gather_bytes = real
        assert ctl.gather({"stop": True}) == [{"stop": True}] * world  # not replayed: works
    return out


def test_a_control_message_replayed_into_another_channel_is_refused() -> None:
    for out in run_world(_control_replays, 2):
        assert set(out) == {
            "another purpose",
            "another instance",
            "another group",
            "another session",
        }
        accepted = {what: got for what, got in out.items() if "failed authentication" not in got}
        assert not accepted, accepted


def _twin_key_exchanges(rank: int, world: int) -> list[str]:
    """The sync's and its streaming twin's secure aggregation exchange X25519 keys on
    their own cross groups: each refuses the other's messages."""
    mode = MODES["streaming-secagg"]
    sync = _sync(rank, mode)
    stream = twin(sync)
    assert sync.secure is not None and stream.secure is not None
    real = session_mod.all_gather_bytes
    recorded: list[list[bytes]] = []

    def record(data: bytes, group: Any = None) -> list[bytes]:
        recorded.append(real(data, group))
        return recorded[-1]

    session_mod.all_gather_bytes = record
    sync.secure._pair_masker()  # the sync's key exchange, recorded
    session_mod.all_gather_bytes = lambda data, group=None: recorded[0]
    try:
        stream.secure._pair_masker()
    except TransientReject as e:
        return [str(e)]
    return ["the twin used the sync's key exchange"]


def test_the_twins_secure_aggregation_refuses_the_syncs_key_exchange() -> None:
    for out in run_world(_twin_key_exchanges, 3):
        assert "'secagg-x25519'" in out[0] and "failed authentication" in out[0], out
