"""A launch's session: what every rank agrees on before training, and the keys made from it.

- **Session.** Every start of the worker group (a launch, or a restart) agrees on a fresh
  16-byte session id: each rank contributes 16 random bytes and the id is the SHA-256 of
  all of them in rank order, so it is fresh as long as any one rank's randomness is. The
  epoch is a counter persisted by every node (training.checkpoint's node record): the new
  epoch is one more than the highest any node recorded, so nodes launched separately
  agree on it. A key confirmation (a MAC under the new session's key, from every rank)
  proves that every rank derived the same session from the same run key.
- **Keys.** HKDF-SHA256 from the run key, salt = run tag (a digest of the run id) ||
  session id, info = purpose, source rank, destination, stage and key generation
  (`derive`). A payload's key is therefore unique to one run, session, link, direction
  and stage: no two links or directions share a key, and a key of one launch is useless in
  the next.
- **Control messages.** The few values ranks exchange outside the codec (the session
  agreement, the time-based merge and save flags, checkpoint resume and commit
  agreement, secure aggregation's public keys) go through `Control`: JSON, never pickle,
  with an HMAC per sender and sequence number, verified before the JSON is parsed, under a
  key of the session and of the channel: its purpose, its group (c10d name and global
  ranks) and its instance, so no two channels can replay into each other.
- **The rendezvous store** listens on the master address only (`rendezvous_store`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import ipaddress
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from training.errors import RendezvousTimeout, SessionError, TransientReject

SESSION_BYTES = 16
RUN_TAG_BYTES = 16
MAC_BYTES = 32


def run_tag(run_id: str) -> bytes:
    """16 bytes that stand for the run id in payload headers and key salts."""
    return hashlib.sha256(b"geotrain/run|" + run_id.encode()).digest()[:RUN_TAG_BYTES]


@dataclass(frozen=True)
class Session:
    run_id: str
    """The run (stable across launches)."""
    id: bytes
    """16 bytes every rank of this launch agreed on (zeros: not agreed; tools and tests)."""
    epoch: int
    """Persisted launch counter every node agreed on."""

    @staticmethod
    def unagreed(run_id: str, epoch: int = 0) -> Session:
        """A fixed session for tools, benchmarks and tests that run no agreement. Workers
        never use it: its keys repeat from one launch to the next."""
        return Session(run_id, bytes(SESSION_BYTES), epoch)

    @functools.cached_property
    def tag(self) -> bytes:
        return run_tag(self.run_id)

    @functools.cached_property
    def _salt(self) -> bytes:
        return self.tag + self.id

    def salt(self) -> bytes:
        """HKDF salt: run tag || session id."""
        return self._salt


def derive(run_key: bytes, salt: bytes, info: str, size: int) -> bytes:
    """HKDF-SHA256(run key, salt, info) -> `size` bytes."""
    return HKDF(
        algorithm=hashes.SHA256(), length=size, salt=salt, info=b"geotrain/v2|" + info.encode()
    ).derive(run_key)


def link_info(purpose: str, source: int, dest: int, stage: int, generation: int) -> str:
    """HKDF info of one link's key: purpose (the cipher or MAC), source rank ->
    destination rank (the direction), the exchange stage and the key generation."""
    return f"{purpose}|{source}>{dest}|stage{stage}|gen{generation}"


_INSTANCES: dict[tuple[bytes, str, str], int] = {}
"""(session salt, purpose, group name) -> Control instances made so far in this process."""
_INSTANCES_LOCK = threading.Lock()


class Control:
    """Authenticated all-gather of small JSON values over a gloo group.

    Every rank sends `HMAC(key of (session, channel, sender), seq || body) || body`; every
    receiver checks each sender's MAC before it parses the body, so nothing a third party
    wrote is ever used, and nothing is unpickled. `seq` counts this channel's calls (all
    ranks call in lockstep, as for any collective): an earlier message of the same
    channel replayed in place of a newer one fails its MAC.

    The channel (`label`) is the purpose, the group's c10d name and global ranks, and the
    instance: how many Controls of that session, purpose and group this process made
    before. Every rank of a group makes them in the same order (the code that makes them
    runs on every rank of the group, as the group's collectives do; c10d names groups
    identically on every rank, its store keys depend on it), so every rank derives the same
    keys, and a message of one channel fails the MAC of any other: another purpose, the
    same purpose on another group (a streaming twin's) or another instance on the same one
    (a second sync object's). A rank that made one more would fail its first gather,
    loudly, not talk on another channel."""

    def __init__(self, run_key: bytes, session: Session, purpose: str, group: Any = None):
        self._key = run_key
        self._salt = session.salt()
        self._purpose = purpose
        self._group = group
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise SessionError(
                f"control channel '{purpose}' made before the process group: call "
                "torch.distributed.init_process_group first"
            )
        name = str(pg.group_name)
        with _INSTANCES_LOCK:
            k = (self._salt, purpose, name)
            self.instance = _INSTANCES.get(k, 0)
            _INSTANCES[k] = self.instance + 1
        self.label = json.dumps(
            [purpose, name, dist.get_process_group_ranks(pg), self.instance], separators=(",", ":")
        )
        """The channel, in every key of it (JSON: no two channels share a label)."""
        self._seq = 0
        self._keys: dict[int, bytes] = {}

    def _mac(self, rank: int, seq: int, body: bytes) -> bytes:
        if rank not in self._keys:
            info = f"control|{self.label}|rank{rank}"
            self._keys[rank] = derive(self._key, self._salt, info, 32)
        return hmac.new(self._keys[rank], seq.to_bytes(8, "big") + body, "sha256").digest()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (JSON-able), in group rank order, each verified."""
        seq, self._seq = self._seq, self._seq + 1
        me = dist.get_rank()
        body = json.dumps(value, separators=(",", ":")).encode()
        msg = self._mac(me, seq, body) + body
        return self._verified(seq, all_gather_bytes(msg, self._group))

    def start_gather(self, value: Any, size: int = 64) -> Pending:
        """`gather` without waiting for it: one all-gather of fixed-size messages (`size`
        bytes of JSON, padded) that runs while the caller goes on; `Pending.result()` waits
        for it and verifies every sender. Every rank must start it at the same point of
        its collectives, as any collective."""
        body = json.dumps(value, separators=(",", ":")).encode()
        if len(body) > size:
            raise ValueError(f"control value of {len(body)} bytes exceeds {size}: {value!r}")
        seq, self._seq = self._seq, self._seq + 1
        body = body.ljust(size)  # JSON ignores the padding; the MAC covers it
        signed = bytearray(self._mac(dist.get_rank(), seq, body) + body)
        msg = torch.frombuffer(signed, dtype=torch.uint8)
        world = dist.get_world_size(self._group)
        bufs = [torch.empty_like(msg) for _ in range(world)]
        work = dist.all_gather(bufs, msg, group=self._group, async_op=True)
        return Pending(self, seq, bufs, work)

    def _verified(self, seq: int, blobs: list[bytes]) -> list[Any]:
        out = []
        for i, blob in enumerate(blobs):
            rank = i if self._group is None else dist.get_global_rank(self._group, i)
            mac, body = blob[:MAC_BYTES], blob[MAC_BYTES:]
            if not hmac.compare_digest(mac, self._mac(rank, seq, body)):
                raise TransientReject(
                    f"control message '{self._purpose}' #{seq} from rank {rank} failed "
                    "authentication (tampered, replayed from this or another channel, or "
                    f"another run key; channel {self.label}); not used"
                )
            out.append(json.loads(body))
        return out


@dataclass
class Pending:
    """A control all-gather in flight (Control.start_gather)."""

    control: Control
    seq: int
    bufs: list[torch.Tensor]
    work: Any

    def result(self) -> list[Any]:
        """Every rank's value, in group rank order, each verified (waits if needed)."""
        self.work.wait()
        return self.control._verified(self.seq, [b.numpy().tobytes() for b in self.bufs])


def all_gather_bytes(data: bytes, group: Any = None) -> list[bytes]:
    """Every rank's `data`, in group rank order (two gloo all-gathers: sizes, then bytes
    padded to the longest)."""
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [b[: int(s.item())].numpy().tobytes() for b, s in zip(bufs, sizes, strict=True)]


def agree(run_key: bytes, run_id: str, epoch_seen: int, group: Any = None) -> Session:
    """A collective: the session of this launch (see the module docstring). `epoch_seen`:
    the highest epoch this rank's node has recorded (-1: none, or not a node leader)."""
    try:
        boot = Control(run_key, Session.unagreed(run_id), "session-agree", group)
        views = boot.gather({"nonce": os.urandom(SESSION_BYTES).hex(), "epoch": epoch_seen})
        sid = hashlib.sha256(b"".join(bytes.fromhex(v["nonce"]) for v in views)).digest()
        session = Session(run_id, sid[:SESSION_BYTES], max(int(v["epoch"]) for v in views) + 1)
        confirm = Control(run_key, session, "session-confirm", group).gather(session.epoch)
    except TransientReject as e:
        raise SessionError(
            f"the ranks of run {run_id} do not agree on the session ({e}): some rank holds "
            "another run key (copy the same key file to every node) or the agreement was "
            "tampered with; stopping"
        ) from None
    if set(confirm) != {session.epoch}:
        raise SessionError(f"the ranks of run {run_id} disagree on the epoch: {confirm}")
    return session


def rendezvous_store(
    host: str, port: int, world: int, is_master: bool, timeout: timedelta
) -> dist.TCPStore:
    """torch's TCPStore, whose server listens on `host` only.

    TCPStore's own server binds the wildcard address (every interface, public ones
    included) and has no option for an address. It does accept a listening socket
    (`master_listen_fd`, served by its libuv backend): geotrain binds that socket to the
    plan's master address itself, so the store is reachable only where the plan says."""
    if not is_master:
        return dist.TCPStore(host, port, world, False, timeout=timeout)
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    fd = sock.detach()  # the store owns the descriptor from here
    try:
        return dist.TCPStore(
            host,
            sock_port(fd),
            world,
            True,
            timeout=timeout,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


JOINED = "geotrain/joined"


def wait_for_all(store: Any, world: int, wait: timedelta) -> None:
    """Hold every rank here until all `world` ranks reached the store. Hosts start their
    workers as their agents finish, minutes apart; the process group's own rendezvous
    waits only its collective timeout (120 s) for the master's address, which the master
    publishes once every rank has connected, so early ranks would give up first."""
    deadline = time.monotonic() + wait.total_seconds()
    joined = int(store.add(JOINED, 1))
    while joined < world:
        if time.monotonic() > deadline:
            raise RendezvousTimeout(
                f"{joined} of {world} ranks reached the rendezvous store in "
                f"{wait.total_seconds():.0f} s; start every node's workers (geotrain launch, "
                "or the geotrain-worker service), then this node retries"
            )
        time.sleep(0.2)
        joined = int(store.add(JOINED, 0))


def sock_port(fd: int) -> int:
    with socket.socket(fileno=os.dup(fd)) as s:
        return int(s.getsockname()[1])


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:  # a name: resolve it the way the clients will
        return socket.getaddrinfo(host, None)[0][0] == socket.AF_INET6
