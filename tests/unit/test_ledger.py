"""The training ledger: chains written with training.audit.ledger, checked with
training.audit.verify, and every kind of tampering named in one line."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from training.audit import ledger as L
from training.audit.verify import verify_run
from training.errors import LedgerError

REGIONS = ("beijing", "frankfurt", "silicon-valley")
RUN = "run-test"


def _checkpoint(root: Path, step: int, node: str) -> None:
    d = root / f"step-{step}" / node
    d.mkdir(parents=True)
    files = {}
    for name in ("__0_0.distcp", ".metadata"):
        data = os.urandom(64)
        (d / name).write_bytes(data)
        files[name] = hashlib.sha256(data).hexdigest()
    (d / "manifest.json").write_text(json.dumps({"files": files, "step": step, "node": node}))
    (d / "COMMITTED").write_text("x\n")


def _start(ledgers: dict[str, L.Ledger], epoch: int = 0) -> None:
    keys = {r: led.public_hex for r, led in ledgers.items()}
    session = os.urandom(16).hex()  # agreed by every rank of a launch
    for led in ledgers.values():
        spec = {"launch-spec": {"sm3": L.sm3(b"spec")}}
        led.append("start", spec, epoch=epoch, session=session, keys=keys)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A finished run of three regions: a start, two recorded syncs, two checkpoints of
    the leader's node in each region, and the end, with final.pt named by beijing."""
    run_dir, root = tmp_path / "run", tmp_path / "ckpt"
    ledgers = {r: L.Ledger.open(run_dir, run_dir, r, RUN) for r in REGIONS}
    _start(ledgers)
    params = torch.arange(12, dtype=torch.float32)
    for step in (3, 6):
        params = params + 1
        for i, (r, led) in enumerate(ledgers.items()):
            grad = {"sm3": L.tensors_sm3([params * i])}
            subject = {f"gradient/{r}": grad, "params": {"sm3": L.tensors_sm3([params])}}
            led.append("sync", subject, step=step, epoch=0)
            _checkpoint(root, step, f"n{i}")
            led.record_checkpoint(root, f"n{i}", step, epoch=0)
    _final(run_dir, ledgers, params)
    return run_dir


def _final(run_dir: Path, ledgers: dict[str, L.Ledger], params: torch.Tensor) -> None:
    torch.save({"w": params}, run_dir / "final.pt")
    for i, led in enumerate(ledgers.values()):
        final = run_dir / "final.pt" if i == 0 else None
        led.record_end(L.tensors_sm3([params]), final, step=6, epoch=0)


def _lines(run_dir: Path, region: str = "beijing") -> list[str]:
    return L.chain_path(run_dir, region).read_text().splitlines()


def _write(run_dir: Path, lines: list[str], region: str = "beijing") -> None:
    L.chain_path(run_dir, region).write_text("".join(x + "\n" for x in lines))


def _rejected(run_dir: Path, *match: str, trust: dict[str, str] | None = None) -> str:
    with pytest.raises(LedgerError) as e:
        verify_run(run_dir, trust)
    msg = str(e.value)
    assert "\n" not in msg
    for m in match:
        assert m in msg, msg
    return msg


def test_an_untouched_run_verifies_with_every_file_and_cross_check(run: Path) -> None:
    v = verify_run(run)
    assert v.regions == sorted(REGIONS)
    assert v.entries == 3 * (1 + 2 + 2 + 1)
    assert v.cross_checked == 4  # the start, two syncs, and the end compared across regions
    assert (v.checkpoints, v.files, v.gone, v.final) == (6, 18, 0, True)
    assert "ledger ok: 3 regions" in v.summary()


def test_entries_are_in_toto_statements_in_dsse_envelopes_signed_over_pae(run: Path) -> None:
    env = json.loads(_lines(run)[1])
    assert env["payloadType"] == "application/vnd.in-toto+json"
    payload = base64.b64decode(env["payload"])
    st = json.loads(payload)
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    assert st["predicateType"] == "https://geotrain.dev/ledger/sync/v1"
    assert {s["name"] for s in st["subject"]} == {"gradient/beijing", "params"}
    prev = json.loads(base64.b64decode(json.loads(_lines(run)[0])["payload"]))
    assert st["predicate"]["prev"] == L.sm3(
        json.dumps(prev, sort_keys=True, separators=(",", ":")).encode()
    )
    pub = L.public_from_hex(L.pub_path(run, "beijing").read_text())
    sig = base64.b64decode(env["signatures"][0]["sig"])
    pub.verify(sig, L.pae(env["payloadType"], payload))  # raises if not over PAE
    assert env["signatures"][0]["keyid"] == L.keyid(pub)


def _flip_payload(lines: list[str]) -> None:
    env = json.loads(lines[2])
    payload = bytearray(base64.b64decode(env["payload"]))
    payload[payload.index(b'"step":3') + 7] ^= 0x01  # step 3 -> step 2
    env["payload"] = base64.b64encode(bytes(payload)).decode()
    lines[2] = json.dumps(env)


def _swap_signature(lines: list[str]) -> None:
    a, b = json.loads(lines[2]), json.loads(lines[3])
    a["signatures"] = b["signatures"]
    lines[2] = json.dumps(a)


TAMPER: dict[str, tuple[Callable[[list[str]], None], str, str]] = {
    "payload byte flip": (_flip_payload, "entry 2", "signature does not verify"),
    "signature swap": (_swap_signature, "entry 2", "signature does not verify"),
    "reorder": (lambda x: x.insert(1, x.pop(2)), "entry 1", "is entry 2 of its chain"),
    "deletion": (lambda x: x.pop(3), "entry 3", "is entry 4 of its chain"),
    "cut line": (lambda x: x.__setitem__(2, x[2][: len(x[2]) // 2]), "entry 2", "garbled"),
    "tail cut": (lambda x: x.pop(), "entry 4", "not end"),
    "tail cut to start": (lambda x: x.__delitem__(slice(1, None)), "entry 0", "not end"),
    "everything deleted": (lambda x: x.clear(), "beijing", "empty chain"),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampering_with_an_entry_is_named_by_chain_and_index(run: Path, case: str) -> None:
    edit, where, what = TAMPER[case]
    lines = _lines(run)
    edit(lines)
    _write(run, lines)
    _rejected(run, f"ledger beijing {where}" if "entry" in where else where, what)


def test_a_signature_from_another_regions_chain_is_named(run: Path) -> None:
    lines = _lines(run)
    env = json.loads(lines[2])
    env["signatures"] = json.loads(_lines(run, "frankfurt")[2])["signatures"]
    lines[2] = json.dumps(env)
    _write(run, lines)
    _rejected(run, "ledger beijing entry 2", "signature or key swapped")


def test_swapped_public_key_files_are_caught_at_the_first_entry(run: Path) -> None:
    a, b = L.pub_path(run, "beijing"), L.pub_path(run, "frankfurt")
    ka, kb = a.read_text(), b.read_text()
    a.write_text(kb)
    b.write_text(ka)
    _rejected(run, "ledger beijing entry 0", "signature or key swapped")


def _resign(run_dir: Path, region: str, key: Ed25519PrivateKey) -> None:
    """What an attacker with a key of their own does: rewrite a whole chain (its own
    start entries naming the new key) and replace the public key file."""
    new_hex = L.public_bytes(key.public_key()).hex()
    out, prev = [], L.GENESIS
    for line in _lines(run_dir, region):
        st = json.loads(base64.b64decode(json.loads(line)["payload"]))
        st["predicate"]["prev"] = prev
        if "keys" in st["predicate"]:
            st["predicate"]["keys"][region] = new_hex
        env, payload = L.envelope(st, key)
        out.append(env)
        prev = L.sm3(payload)
    _write(run_dir, out, region)
    L.pub_path(run_dir, region).write_text(new_hex + "\n")


def test_a_chain_resigned_with_another_key_is_caught_by_the_other_regions(run: Path) -> None:
    _resign(run, "beijing", Ed25519PrivateKey.generate())
    _rejected(run, "ledger frankfurt entry 0", "names beijing's key", "key swapped")


def test_a_trust_file_pins_each_regions_key(run: Path) -> None:
    pinned = {r: L.pub_path(run, r).read_text().strip() for r in REGIONS}
    assert verify_run(run, pinned).final
    pinned["frankfurt"] = L.public_bytes(Ed25519PrivateKey.generate().public_key()).hex()
    _rejected(run, "ledger frankfurt", "not the pinned one", trust=pinned)


def test_an_unreadable_key_or_a_trust_file_of_the_wrong_shape_is_one_line(
    run: Path, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from geotrain.cli import cli

    trust = tmp_path / "trust.json"
    for body, words in [
        ('{"beijing": null}', "beijing has no hex string"),
        ('["beijing"]', 'expected {"<region>"'),
        ("{not json", "not JSON"),
    ]:
        trust.write_text(body)
        r = CliRunner().invoke(cli, ["ledger", "verify", "--run", str(run), "--trust", str(trust)])
        assert r.exit_code != 0 and words in r.output, (body, r.output)
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    pub = L.pub_path(run, "beijing")
    pub.unlink()
    pub.mkdir()
    _rejected(run, "ledger beijing: cannot read", "Is a directory")


def test_a_deleted_chain_is_caught_by_the_other_regions_start_entries(run: Path) -> None:
    L.chain_path(run, "silicon-valley").unlink()
    L.pub_path(run, "silicon-valley").unlink()
    _rejected(run, "ledger beijing entry 0", "a chain deleted or added")


def test_a_region_that_signs_other_parameters_is_caught_by_the_cross_check(run: Path) -> None:
    key = L.signing_key(run, "frankfurt")
    lines = _lines(run, "frankfurt")
    st = json.loads(base64.b64decode(json.loads(lines[1])["payload"]))
    st["subject"][1]["digest"]["sm3"] = L.sm3(b"poisoned")
    lines[1] = L.envelope(st, key)[0]
    _write(run, lines, "frankfurt")
    # signed with its key, but the next entry's link breaks: a holder must redo the tail
    _rejected(run, "ledger frankfurt entry 2", "does not link")
    _resign(run, "frankfurt", key)  # the whole chain, consistently, with its real key
    _rejected(run, "ledger frankfurt entry 1", "params digest differs", "ledger beijing entry 1")


def _checkpoint_file(
    run: Path, step: int = 6, node: str = "n0", name: str = "__0_0.distcp"
) -> Path:
    return run.parent / "ckpt" / f"step-{step}" / node / name


def test_a_flipped_byte_in_a_checkpoint_file_is_named(run: Path) -> None:
    f = _checkpoint_file(run)
    data = bytearray(f.read_bytes())
    data[10] ^= 0x01
    f.write_bytes(bytes(data))
    _rejected(run, "ledger beijing entry 4", "checkpoint step-6/n0 file __0_0.distcp differs")


def test_a_missing_file_or_a_rewritten_manifest_is_named(run: Path) -> None:
    meta = _checkpoint_file(run, 3, "n1", ".metadata")
    data = meta.read_bytes()
    meta.unlink()
    _rejected(run, "ledger frankfurt entry 2", "checkpoint step-3/n1 file .metadata is missing")
    meta.write_bytes(data)
    m = _checkpoint_file(run, 6, "n2", "manifest.json")
    m.write_text(m.read_text() + " ")
    _rejected(run, "ledger silicon-valley entry 4", "step-6/n2 file manifest.json differs")


def test_a_committed_checkpoint_no_entry_names_is_refused(run: Path) -> None:
    _checkpoint(run.parent / "ckpt", 9, "n0")
    _rejected(run, "step-9/n0 is committed but no ledger entry names it")


def test_pruned_checkpoints_are_counted_not_errors(run: Path) -> None:
    import shutil

    shutil.rmtree(run.parent / "ckpt" / "step-3")
    v = verify_run(run)
    assert (v.checkpoints, v.gone) == (3, 3)


def test_final_weights_that_differ_from_the_end_entry_are_named(run: Path) -> None:
    (run / "final.pt").write_bytes((run / "final.pt").read_bytes() + b"\0")
    _rejected(run, "ledger beijing entry 5", "final weights", "differ")
    (run / "final.pt").unlink()
    _rejected(run, "ledger beijing entry 5", "missing")


def test_final_weights_resigned_by_one_region_are_not_what_the_others_signed(
    run: Path,
) -> None:
    """beijing's key holder swaps final.pt and re-signs beijing's end entry for it."""
    key = L.signing_key(run, "beijing")
    torch.save({"w": torch.zeros(12)}, run / "final.pt")
    lines = _lines(run)
    st = json.loads(base64.b64decode(json.loads(lines[-1])["payload"]))
    st["subject"][1]["digest"]["sm3"] = L.file_sm3(run / "final.pt")
    lines[-1] = L.envelope(st, key)[0]
    _write(run, lines)
    _rejected(run, "ledger beijing entry 5", "not the parameters every region signed")


def test_a_second_run_in_the_same_run_dir_is_cross_checked_on_its_own(run: Path) -> None:
    """`train --fresh` restarts epochs at 0: launches are told apart by session."""
    ledgers = {r: L.Ledger.open(run, run, r, RUN) for r in REGIONS}
    _start(ledgers)  # epoch 0 again, a new session
    other = torch.full((12,), 7.0)
    for led in ledgers.values():
        led.append("sync", {"params": {"sm3": L.tensors_sm3([other])}}, step=3, epoch=0)
    _final(run, ledgers, other)
    v = verify_run(run)
    assert v.final and v.cross_checked == 4 + 3  # start, syncs, end; then start, sync, end


def _landings(run_dir: Path, poisoned: str | None = None) -> None:
    """A second launch of streaming merges: fragments 0 and 1 land at step 4, each entry
    hashing only its fragment's parameters, then one whole-model merge at step 4 too.
    `poisoned`: the region that signs other parameters for fragment 1."""
    ledgers = {r: L.Ledger.open(run_dir, run_dir, r, RUN) for r in REGIONS}
    _start(ledgers)
    frags = [torch.full((6,), 1.0), torch.full((6,), 2.0)]
    for r, led in ledgers.items():
        for f, values in enumerate(frags):
            bad = r == poisoned and f == 1
            params = {"sm3": L.tensors_sm3([values + 1 if bad else values])}
            led.append("merge", {"params": params}, step=4, merge=f + 1, epoch=0, fragment=f)
        whole = {"sm3": L.tensors_sm3(frags)}
        led.append("merge", {"params": whole}, step=4, merge=3, epoch=0)
    _final(run_dir, ledgers, torch.cat(frags))


def test_fragments_landing_at_one_step_are_cross_checked_each_on_its_own(run: Path) -> None:
    """Streaming: a landing signs only its fragment's parameters, so entries of one step
    are compared per fragment (a whole-model merge at that step is its own point)."""
    _landings(run)
    v = verify_run(run)
    assert v.final and v.cross_checked == 4 + 5  # start, 2 fragments, whole model, end


def test_a_region_that_signs_another_fragment_is_named_with_the_fragment(run: Path) -> None:
    _landings(run, poisoned="silicon-valley")
    _rejected(run, "ledger silicon-valley entry", "params digest differs", "fragment 1")


def test_an_open_chain_is_accepted_only_when_asked(run: Path) -> None:
    for r in REGIONS:
        _write(run, _lines(run, r)[:-1], r)
    _rejected(run, "not end")
    v = verify_run(run, allow_open=True)
    assert v.open_chains == sorted(REGIONS) and not v.final


def test_a_reopened_ledger_continues_the_chain_and_refuses_a_tampered_one(run: Path) -> None:
    led = L.Ledger.open(run, run, "beijing", RUN)
    assert led.index == 6
    led.append("start", {"launch-spec": {"sm3": L.sm3(b"spec")}}, epoch=1, keys={})
    assert (
        L.read_chain(L.chain_path(run, "beijing"), "beijing", led.key.public_key())[-1].index == 6
    )
    lines = _lines(run)
    _flip_payload(lines)
    _write(run, lines)
    with pytest.raises(LedgerError, match="entry 2: signature does not verify"):
        L.Ledger.open(run, run, "beijing", RUN)


def test_record_dp_appends_a_typed_entry_on_the_leader_only(tmp_path: Path) -> None:
    assert L.record_dp("beijing", 1.0, 1e-5, 10) is None  # no ledger open: not a leader
    led = L.Ledger.open(tmp_path, tmp_path, "beijing", RUN)
    L.activate(led)
    try:
        assert L.record_dp("beijing", 2.5, 1e-5, 100) == 0
        with pytest.raises(LedgerError, match="only its own budget"):
            L.record_dp("frankfurt", 1.0, 1e-5, 10)
        with pytest.raises(LedgerError, match="epsilon -1"):
            L.record_dp("beijing", -1.0, 1e-5, 10)
    finally:
        L.activate(None)
    (e,) = L.read_chain(L.chain_path(tmp_path, "beijing"), "beijing", led.key.public_key())
    assert e.kind == "dp"
    assert (e.predicate["epsilon"], e.predicate["delta"], e.predicate["steps"]) == (2.5, 1e-5, 100)


def test_a_signing_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    L.signing_key(tmp_path, "beijing")
    path = L.key_path(tmp_path, "beijing")
    assert path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o644)
    with pytest.raises(LedgerError, match="readable by others"):
        L.signing_key(tmp_path, "beijing")


def test_verify_command_prints_one_line_and_exits_2(run: Path) -> None:
    from click.testing import CliRunner

    from geotrain.cli import cli

    ok = CliRunner().invoke(cli, ["ledger", "verify", "--run", str(run)])
    assert ok.exit_code == 0 and ok.output.startswith("ledger ok"), ok.output
    _write(run, _lines(run)[:-1])
    bad = CliRunner().invoke(cli, ["ledger", "verify", "--run", str(run)])
    assert bad.exit_code == 2
    assert bad.output.strip().count("\n") == 0 and "ledger beijing entry 4" in bad.output
