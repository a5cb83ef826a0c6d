"""The training ledger: per region, an append-only SM3 hash chain of signed statements.

Every entry is an in-toto Statement v1 (`subject`: the artifacts it speaks for, with
digests; `predicateType`: https://geotrain.dev/ledger/<kind>/v1) wrapped in a DSSE
envelope signed over DSSE's PAE encoding with the region's Ed25519 key. The predicate of
entry i carries `index` = i and `prev` = SM3 of entry i - 1's payload, so an entry that
is changed, moved, dropped or inserted breaks the chain at a named index. The file is one
envelope per line: `<run dir>/ledger/<region>.jsonl`.

- **One chain per region**, written only by the region's leader (its local rank 0): no
  coordination on the hot path. The verifier (training.audit.verify) checks every chain
  and cross-checks them: every region names the same config digest and the same region
  keys at each launch, and the same parameters at every merge and at the end.
- **Keys.** Each region leader creates its Ed25519 key in its own state dir (`<run
  dir>/keys/ledger-<region>.key`, mode 0600, refused if readable by others, like the run
  key) and never sends it anywhere; it writes the public key next to its chain
  (`ledger/<region>.pub`). At every launch the leaders exchange public keys
  (authenticated by the run key) and every region's `start` entry names every region's
  key, so one region's key cannot be swapped without rewriting every chain.
- **Ed25519, not SM2**: `cryptography` (already a dependency, OpenSSL underneath) has no
  SM2 signatures; gmssl is a pure-Python package that would add an unaudited signature
  implementation to every host. SM3 (which `cryptography` has) makes the chain and every
  digest we compute ourselves; checkpoint files keep the SHA-256 digests of their
  manifest (already computed at commit, so recording them costs nothing).

Entry kinds (`KINDS`): `start` (each launch: config digest, epoch, session, keys),
`merge` (diloco: every merge), `sync` (allreduce: every `record_every` steps),
`checkpoint` (each committed checkpoint of the leader's node), `dp` (privacy budget
spent: `record_dp`), `end` (the run finished: step, parameters, final weights, and the
entry count, so a chain cut at its tail is told apart from a finished one).
"""

from __future__ import annotations

import base64
import json
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from training.errors import LedgerError

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_PREFIX = "https://geotrain.dev/ledger/"
KINDS = ("start", "merge", "sync", "checkpoint", "dp", "end")
GENESIS = "0" * 64
"""`prev` of entry 0."""
LEDGER_DIR = "ledger"
KEYS_DIR = "keys"


def predicate_type(kind: str) -> str:
    return f"{PREDICATE_PREFIX}{kind}/v1"


def kind_of(ptype: str) -> str | None:
    """The entry kind of a predicateType, or None when it is not one of ours."""
    if not (ptype.startswith(PREDICATE_PREFIX) and ptype.endswith("/v1")):
        return None
    kind = ptype[len(PREDICATE_PREFIX) : -len("/v1")]
    return kind if kind in KINDS else None


def sm3(data: bytes) -> str:
    h = hashes.Hash(hashes.SM3())
    h.update(data)
    return h.finalize().hex()


class TensorHasher:
    """SM3 over the raw bytes of tensors fed in order (any dtype, any device); with
    enabled=False every call is a no-op (ranks that write no ledger)."""

    def __init__(self, enabled: bool = True) -> None:
        self._h = hashes.Hash(hashes.SM3()) if enabled else None

    def update(self, t: torch.Tensor) -> None:
        if self._h is not None:
            raw = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
            self._h.update(raw.numpy().data)  # a view: no copy on CPU

    def hexdigest(self) -> str:
        if self._h is None:
            raise LedgerError("a disabled TensorHasher has no digest")
        return self._h.finalize().hex()


def tensors_sm3(tensors: Iterable[torch.Tensor]) -> str:
    """SM3 over the raw bytes of `tensors` in order."""
    h = TensorHasher()
    for t in tensors:
        h.update(t)
    return h.hexdigest()


def file_sm3(path: Path) -> str:
    h = hashes.Hash(hashes.SM3())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.finalize().hex()


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed, never the bare payload."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def keyid(public: Ed25519PublicKey) -> str:
    """SM3 of the raw 32-byte public key."""
    return sm3(public_bytes(public))


def public_bytes(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_from_hex(text: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(text.strip()))


def key_path(state_dir: Path, region: str) -> Path:
    return state_dir / KEYS_DIR / f"ledger-{region}.key"


def chain_path(run_dir: Path, region: str) -> Path:
    return run_dir / LEDGER_DIR / f"{region}.jsonl"


def pub_path(run_dir: Path, region: str) -> Path:
    return run_dir / LEDGER_DIR / f"{region}.pub"


def signing_key(state_dir: Path, region: str) -> Ed25519PrivateKey:
    """The region's key from its state dir, created (mode 0600) on first use. A key file
    that others can read, or that does not parse, is refused."""
    path = key_path(state_dir, region)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise LedgerError(
            f"ledger key {path} has mode {mode:o}: readable by others; run `chmod 600 {path}`"
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as e:
        raise LedgerError(f"ledger key {path} is unreadable ({e}); restore it") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise LedgerError(f"ledger key {path} is not an Ed25519 key; restore it")
    return key


def envelope(statement: dict[str, Any], key: Ed25519PrivateKey) -> tuple[str, bytes]:
    """(one DSSE envelope as a JSON line, its payload bytes)."""
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    sig = key.sign(pae(PAYLOAD_TYPE, payload))
    env = {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": [{"keyid": keyid(key.public_key()), "sig": base64.b64encode(sig).decode()}],
    }
    return json.dumps(env, sort_keys=True, separators=(",", ":")), payload


@dataclass(frozen=True)
class Entry:
    """One verified envelope of a chain."""

    index: int
    kind: str
    subject: dict[str, dict[str, str]]
    """name -> digest set."""
    predicate: dict[str, Any]
    payload: bytes


def open_envelope(line: str, public: Ed25519PublicKey, where: str) -> tuple[dict[str, Any], bytes]:
    """The statement of one envelope line and its payload bytes, once the signature under
    `public` verifies. Raises LedgerError naming `where` (the chain and entry)."""
    try:
        env = json.loads(line)
        payload = base64.b64decode(env["payload"], validate=True)
        sigs = env["signatures"]
        ptype = env["payloadType"]
    except (ValueError, KeyError, TypeError):
        raise LedgerError(f"{where}: not a DSSE envelope (garbled line)") from None
    if ptype != PAYLOAD_TYPE:
        raise LedgerError(f"{where}: payloadType {ptype!r}, expected {PAYLOAD_TYPE}")
    if not isinstance(sigs, list) or len(sigs) != 1 or not isinstance(sigs[0], dict):
        raise LedgerError(f"{where}: expected exactly one signature, found {sigs!r:.60}")
    want = keyid(public)
    if sigs[0].get("keyid") != want:
        raise LedgerError(
            f"{where}: signed by key {str(sigs[0].get('keyid'))[:16]}, not the region's key "
            f"{want[:16]} (signature or key swapped)"
        )
    try:
        public.verify(base64.b64decode(sigs[0]["sig"], validate=True), pae(ptype, payload))
        statement = json.loads(payload)
    except (InvalidSignature, ValueError, KeyError, TypeError):
        raise LedgerError(
            f"{where}: signature does not verify (payload or signature changed)"
        ) from None
    return statement, payload


def read_chain(path: Path, region: str, public: Ed25519PublicKey) -> list[Entry]:
    """Every entry of `region`'s chain, each signature, index and link checked."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LedgerError(f"ledger {region}: cannot read {path} ({e.strerror})") from None
    out: list[Entry] = []
    prev = GENESIS
    for i, line in enumerate(lines):
        where = f"ledger {region} entry {i}"
        st, payload = open_envelope(line, public, where)
        out.append(_entry(st, payload, i, prev, region, where))
        prev = sm3(payload)
    return out


def _entry(st: Any, payload: bytes, i: int, prev: str, region: str, where: str) -> Entry:
    """Check one statement's shape and its place in the chain."""
    try:
        pred = st["predicate"]
        kind = kind_of(st["predicateType"])
        subject = {s["name"]: dict(s["digest"]) for s in st["subject"]}
        ok = st["_type"] == STATEMENT_TYPE and isinstance(pred, dict)
    except (KeyError, TypeError, AttributeError):
        ok, kind = False, None
    if not ok or kind is None:
        raise LedgerError(f"{where}: not a geotrain in-toto statement")
    if pred.get("index") != i:
        raise LedgerError(
            f"{where}: is entry {pred.get('index')} of its chain (entries deleted, "
            "inserted or reordered)"
        )
    if pred.get("prev") != prev:
        raise LedgerError(
            f"{where}: does not link to entry {i - 1} (prev digest differs: an entry "
            "before it was changed, deleted or reordered)"
        )
    if pred.get("region") != region:
        raise LedgerError(f"{where}: belongs to region {pred.get('region')}, not {region}")
    return Entry(i, kind, subject, pred, payload)


@dataclass
class Ledger:
    """A region leader's open chain: appends are signed, linked, and written with one
    write() each (O_APPEND) then fsync'd; a lock orders the training loop's appends and
    the checkpoint writer thread's."""

    run_dir: Path
    region: str
    run_id: str
    key: Ed25519PrivateKey
    index: int = 0
    prev: str = GENESIS
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def open(run_dir: Path, state_dir: Path, region: str, run_id: str) -> Ledger:
        """This region's chain, continued where it ends (verified first: a leader does not
        sign on top of a chain that was tampered with)."""
        key = signing_key(state_dir, region)
        pub = pub_path(run_dir, region)
        pub.parent.mkdir(parents=True, exist_ok=True)
        mine = public_bytes(key.public_key()).hex()
        if pub.exists() and pub.read_text().strip() != mine:
            raise LedgerError(
                f"ledger {region}: {pub} is not the public key of {key_path(state_dir, region)}"
                "; restore it (or move the old ledger away to start a new one)"
            )
        pub.write_text(mine + "\n")
        ledger = Ledger(run_dir, region, run_id, key)
        path = chain_path(run_dir, region)
        if path.exists():
            entries = read_chain(path, region, key.public_key())
            if entries:
                ledger.index, ledger.prev = len(entries), sm3(entries[-1].payload)
        return ledger

    @property
    def public_hex(self) -> str:
        return public_bytes(self.key.public_key()).hex()

    def append(self, kind: str, subject: dict[str, dict[str, str]], **pred: Any) -> int:
        """Sign and append one entry; returns its index."""
        if kind not in KINDS:
            raise LedgerError(f"ledger entry kind {kind!r} is not one of {', '.join(KINDS)}")
        with self._lock:
            statement = {
                "_type": STATEMENT_TYPE,
                "subject": [{"name": n, "digest": d} for n, d in subject.items()],
                "predicateType": predicate_type(kind),
                "predicate": {
                    **pred,
                    "index": self.index,
                    "prev": self.prev,
                    "region": self.region,
                    "run_id": self.run_id,
                },
            }
            line, payload = envelope(statement, self.key)
            fd = os.open(
                chain_path(self.run_dir, self.region), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
            )
            try:
                os.write(fd, (line + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            index, self.index, self.prev = self.index, self.index + 1, sm3(payload)
            return index

    def record_checkpoint(self, root: Path, node: str, step: int, epoch: int) -> int:
        """A node's committed checkpoint `root`/step-N/`node`: every file its manifest
        names (the manifest's SHA-256, computed at commit) and the manifest itself (SM3)."""
        manifest = root / f"step-{step}" / node / "manifest.json"
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        subject = {f"{node}/{name}": {"sha256": digest} for name, digest in files.items()}
        subject[f"{node}/manifest.json"] = {"sm3": file_sm3(manifest)}
        return self.append(
            "checkpoint", subject, step=step, node=node, root=str(root.resolve()), epoch=epoch
        )

    def record_end(self, params: str, final: Path | None, step: int, epoch: int) -> int:
        """The run finished at `step` with parameters of SM3 `params` (and the final
        weights file, on the rank that wrote it); the entry count marks the tail."""
        subject = {"params": {"sm3": params}}
        if final is not None:
            subject[final.name] = {"sm3": file_sm3(final)}
        return self.append("end", subject, step=step, entries=self.index, epoch=epoch)

    def record_dp(self, epsilon: float, delta: float, steps: int, **extra: Any) -> int:
        """Privacy budget spent by this region so far (cumulative epsilon, delta, at
        `steps` optimizer steps)."""
        if not (epsilon >= 0 and 0 <= delta < 1 and steps >= 0):
            raise LedgerError(
                f"dp entry of region {self.region}: epsilon {epsilon}, delta {delta}, steps "
                f"{steps}; need epsilon >= 0, 0 <= delta < 1, steps >= 0"
            )
        body = json.dumps([epsilon, delta, steps], separators=(",", ":")).encode()
        subject = {f"dp/{self.region}": {"sm3": sm3(body)}}
        return self.append(
            "dp", subject, epsilon=float(epsilon), delta=float(delta), steps=int(steps), **extra
        )


_ACTIVE: Ledger | None = None
"""This process's open ledger (a region leader's worker), for `record_dp`."""


def activate(ledger: Ledger | None) -> None:
    global _ACTIVE
    _ACTIVE = ledger


def record_dp(region: str, epsilon: float, delta: float, steps: int) -> int | None:
    """Record the DP budget `region` has spent (cumulative epsilon and delta after
    `steps` steps) in this process's ledger. Any rank may call it: on a region leader it
    appends a signed `dp` entry and returns its index; elsewhere (no open ledger) it
    returns None, since only the leader writes its region's chain."""
    if _ACTIVE is None:
        return None
    if region != _ACTIVE.region:
        raise LedgerError(
            f"record_dp for region {region} in the ledger of region {_ACTIVE.region}; "
            "each region records only its own budget"
        )
    return _ACTIVE.record_dp(epsilon, delta, steps)
