"""`geotrain ledger verify`: check a run's ledger (training.audit.ledger) and the files it names.

In order, each failure one LedgerError line naming the chain and entry:
1. keys: every chain has its region's public key next to it; with a trust file, every
   key equals its pinned one;
2. each chain alone: signatures, indices and SM3 links (training.audit.ledger.read_chain); it
   opens with `start` and, unless the run may still be going (`allow_open`), ends with
   `end`;
3. across chains: every `start` names exactly the regions present and their keys; at each
   launch every region signed the same config digest; at every merge or recorded
   sync step, and at the end, every region signed the same parameters;
4. files: every committed checkpoint directory an entry names (the newest entry of each
   node and step) still holds exactly those bytes; a committed directory of a recorded
   node that no entry names is refused; `final.pt` matches the last `end` that names it,
   and its tensors are the parameters every region signed at the end.
Checkpoints that were pruned or set aside (their directory is gone) are counted, not
errors: keeping `keep` checkpoints is the point of pruning.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from training.audit.ledger import (
    LEDGER_DIR,
    Entry,
    file_sm3,
    keyid,
    public_bytes,
    public_from_hex,
    read_chain,
    tensors_sm3,
)
from training.errors import LedgerError

MARKER = "COMMITTED"  # training.checkpoint's; not imported: verifying needs no torch.distributed
FINAL = "final.pt"


@dataclass
class Verified:
    regions: list[str]
    entries: int = 0
    cross_checked: int = 0
    """Merge/sync steps and launches whose digests every region agreed on."""
    checkpoints: int = 0
    """Checkpoint directories whose every file was recomputed and matched."""
    files: int = 0
    gone: int = 0
    """Checkpoint entries whose directory was pruned or set aside."""
    final: bool = False
    """Whether final.pt was checked."""
    open_chains: list[str] = field(default_factory=list)

    def summary(self) -> str:
        tail = "final weights match" if self.final else "no final weights recorded"
        opened = f"; open (no end yet): {', '.join(self.open_chains)}" if self.open_chains else ""
        return (
            f"ledger ok: {len(self.regions)} regions ({', '.join(self.regions)}), "
            f"{self.entries} signed entries, {self.cross_checked} launches/merges/syncs "
            f"cross-checked, {self.checkpoints} checkpoints ({self.files} files) match, "
            f"{self.gone} pruned or set aside, {tail}{opened}"
        )


def load_keys(run_dir: Path, trust: dict[str, str] | None) -> dict[str, Ed25519PublicKey]:
    d = run_dir / LEDGER_DIR
    chains = {p.stem for p in d.glob("*.jsonl")}
    pubs = {p.stem for p in d.glob("*.pub")}
    if not chains:
        raise LedgerError(f"no ledger under {d}: train first, or point --run at the run dir")
    for r in sorted(chains ^ pubs):
        what = "public key" if r in chains else "chain"
        raise LedgerError(f"ledger {r}: its {what} is missing from {d}")
    keys = {}
    for r in sorted(chains):
        pub = d / f"{r}.pub"
        try:
            keys[r] = public_from_hex(pub.read_text())
        except OSError as e:  # a directory, unreadable
            raise LedgerError(f"ledger {r}: cannot read {pub} ({e.strerror or e})") from None
        except ValueError:
            raise LedgerError(f"ledger {r}: {pub} is not an Ed25519 key") from None
    for r, pinned in (trust or {}).items():
        if r not in keys:
            raise LedgerError(f"ledger {r}: pinned in the trust file, but the run has no chain")
        if public_bytes(keys[r]).hex() != pinned.strip().lower():
            raise LedgerError(
                f"ledger {r}: its public key {keyid(keys[r])[:16]} is not the pinned one "
                f"{pinned[:16]}… (key swapped)"
            )
    return keys


def verify_run(
    run_dir: Path, trust: dict[str, str] | None = None, allow_open: bool = False
) -> Verified:
    keys = load_keys(run_dir, trust)
    chains = {r: read_chain(run_dir / LEDGER_DIR / f"{r}.jsonl", r, k) for r, k in keys.items()}
    out = Verified(sorted(chains), entries=sum(map(len, chains.values())))
    for r, entries in chains.items():
        if _shape(r, entries, allow_open):
            out.open_chains.append(r)
    hexkeys = {r: public_bytes(k).hex() for r, k in keys.items()}
    for r, entries in chains.items():
        _names_keys(r, entries, hexkeys)
    out.cross_checked = _cross_check(chains)
    _check_checkpoints(chains, out)
    out.final = _check_final(run_dir, chains)
    return out


def _shape(region: str, entries: list[Entry], allow_open: bool) -> bool:
    """Check the chain opens with `start` and ends with `end`; True when it is open."""
    if not entries:
        raise LedgerError(f"ledger {region}: empty chain (every entry deleted)")
    if entries[0].kind != "start":
        raise LedgerError(f"ledger {region} entry 0: a {entries[0].kind} entry, not start")
    last = entries[-1]
    if last.kind == "end":
        if last.predicate.get("entries") != last.index:
            raise LedgerError(f"ledger {region} entry {last.index}: end counts wrong entries")
        return False
    if allow_open:
        return True
    raise LedgerError(
        f"ledger {region} entry {last.index}: the chain ends with a {last.kind} entry, not "
        "end: cut at its tail, or the run has not finished (--open accepts a running run)"
    )


def _names_keys(region: str, entries: list[Entry], keys: dict[str, str]) -> None:
    """Every start entry names exactly the run's regions, with their keys."""
    for e in entries:
        if e.kind != "start":
            continue
        named = e.predicate.get("keys") or {}
        where = f"ledger {region} entry {e.index}"
        if set(named) != set(keys):
            raise LedgerError(
                f"{where}: names regions {sorted(named)}, the run dir holds chains of "
                f"{sorted(keys)} (a chain deleted or added)"
            )
        for r, k in named.items():
            if k != keys[r]:
                raise LedgerError(
                    f"{where}: names {r}'s key {k[:16]}…, but ledger/{r}.pub is "
                    f"{keys[r][:16]}… (key swapped)"
                )


def _cross_check(chains: dict[str, list[Entry]]) -> int:
    """The same config per launch and the same parameters per merge, sync and end,
    whichever region signed them; returns how many such points were compared."""
    # a point is (kind, launch, step, fragment): the launch is the session id of the
    # chain's last start, which every rank agreed on (epochs restart at 0 after `train
    # --fresh`); a streaming landing's entry hashes only its fragment's parameters (-1:
    # the whole model), and fragments may land at the same step
    seen: dict[tuple[str, str, int, int], tuple[str, str, int]] = {}
    for r, entries in sorted(chains.items()):
        session = ""
        for e in entries:
            if e.kind == "start":
                session = str(e.predicate.get("session", e.index))
            value = _shared_value(e)
            if value is None:
                continue
            fragment = e.predicate.get("fragment")
            point = (
                e.kind,
                session,
                int(e.predicate.get("step", -1)),
                -1 if fragment is None else int(fragment),
            )
            first = seen.setdefault(point, (value, r, e.index))
            if first[0] != value:
                what = "launch-spec" if e.kind == "start" else "params"
                raise LedgerError(
                    f"ledger {r} entry {e.index}: {e.kind} {what} digest differs from "
                    f"ledger {first[1]} entry {first[2]} (launch {session[:8]}"
                    f"{f', step {point[2]}' if e.kind != 'start' else ''}"
                    f"{f', fragment {fragment}' if fragment is not None else ''})"
                )
    ends = {r: next((e for e in reversed(es) if e.kind == "end"), None) for r, es in chains.items()}
    finals = {(e.predicate.get("step"), e.subject["params"].get("sm3")) for e in ends.values() if e}
    if len(finals) > 1:
        raise LedgerError(f"ledgers end at different steps or parameters: {sorted(finals)!r:.120}")
    return len(seen)


def _shared_value(e: Entry) -> str | None:
    if e.kind == "start":
        return e.subject.get("launch-spec", {}).get("sm3")
    if e.kind in ("merge", "sync", "end"):
        return e.subject.get("params", {}).get("sm3")
    return None


def _check_checkpoints(chains: dict[str, list[Entry]], out: Verified) -> None:
    newest: dict[tuple[str, str, int], tuple[str, Entry]] = {}
    for r, entries in chains.items():
        for e in entries:
            if e.kind == "checkpoint":
                p = e.predicate
                newest[(str(p["root"]), str(p["node"]), int(p["step"]))] = (r, e)
    for (root, node, step), (r, e) in sorted(newest.items()):
        d = Path(root) / f"step-{step}" / node
        if not d.is_dir():
            out.gone += 1
            continue
        out.files += _check_dir(d, node, f"ledger {r} entry {e.index}", e)
        out.checkpoints += 1
    for root, node in {(k[0], k[1]) for k in newest}:
        for marker in sorted(Path(root).glob(f"step-*/{node}/{MARKER}")):
            digits = marker.parent.parent.name[len("step-") :]
            if not digits.isdigit() or (root, node, int(digits)) not in newest:
                raise LedgerError(
                    f"checkpoint {marker.parent} is committed but no ledger entry names it "
                    "(forged, or written outside this run)"
                )


def _check_dir(d: Path, node: str, where: str, e: Entry) -> int:
    """Recompute every file the entry names under `d`; returns how many."""
    prefix = f"{node}/"
    named = {n[len(prefix) :]: dig for n, dig in e.subject.items() if n.startswith(prefix)}
    label = f"checkpoint step-{e.predicate['step']}/{node}"
    for name, digest in sorted(named.items()):
        f = d / name
        if not f.is_file():
            raise LedgerError(f"{where}: {label} file {name} is missing")
        if "sm3" in digest:
            ok = file_sm3(f) == digest["sm3"]
        else:
            ok = hashlib.sha256(f.read_bytes()).hexdigest() == digest.get("sha256")
        if not ok:
            raise LedgerError(f"{where}: {label} file {name} differs from its entry (digest)")
    manifest = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
    extra = set(manifest.get("files", {})) - set(named)
    if extra:
        raise LedgerError(f"{where}: {label} holds files no entry names: {sorted(extra)}")
    return len(named)


def _check_final(run_dir: Path, chains: dict[str, list[Entry]]) -> bool:
    for r, entries in chains.items():
        end = next((e for e in reversed(entries) if e.kind == "end"), None)
        if end is None or FINAL not in end.subject:
            continue
        f = run_dir / FINAL
        where = f"ledger {r} entry {end.index}"
        if not f.is_file():
            raise LedgerError(f"{where}: the final weights {f} are missing")
        if file_sm3(f) != end.subject[FINAL].get("sm3"):
            raise LedgerError(f"{where}: the final weights {f} differ from the entry (digest)")
        # and the tensors in it are the parameters every region signed at the end (the
        # ends agree: _cross_check), so one region's key cannot vouch for other weights
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
            tensors = tensors_sm3(state.values())
        except Exception as e:  # a file that a key holder made: whatever it fails with
            raise LedgerError(f"{where}: the final weights {f} do not load ({e!r:.80})") from None
        if tensors != end.subject["params"].get("sm3"):
            raise LedgerError(
                f"{where}: the final weights {f} are not the parameters every region signed"
            )
        return True
    return False
