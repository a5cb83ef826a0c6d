"""SSH host keys of ssh pools: the stack check, the known_hosts lookup, the pin on every
connection the program makes, and the first-contact scan kept in state (issue 37)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pulumi
import pytest
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await
from pulumi_command import local

from infra.backends.base import BackendContext, Parent
from infra.backends.ssh import SshBackend
from infra.mocks import GeotrainMocks, Recording, RecordingMonitor, run_under_mocks
from infra.model import load_stack
from infra.model.hostkeys import (
    KEEP_RECORDED_KEY,
    lookup_known_hosts,
    parse_host_key,
    scan_command,
)
from infra.plan import build_plan
from infra.replay import Executor, Replay
from training.errors import ConfigError

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIsE2cXTfAxG/oS45HLuOpIpO5cc2eDWLRY794Vl9IAy"
OTHER = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDjc+ZOK9AvpGlsBrvDUsusZySS3fGIID0uZ9Alspj2W"
ECDSA = (
    "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBMte+ouRydiH4EVTdik"
    "WvhPeaIlpCrElC2LibqJTEtBCdPiL8WdhWF/DVM4dVX7DJbhw3lNPCZ2x7PzJPsjUUFk="
)
RSA = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABgQCS9OJtSoll6Umbzr6RGgyyhnFdb1JxDz4k2txMTeS0b/P7k7wMLVZX"
BEIJING = "geotrain:regions[0].pool.ssh"
"""stacks/Pulumi.global.yaml: beijing's nodes bj-0..bj-7 at 192.0.2.10..17, port 22."""


def _ssh(**settings: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(cfg: dict[str, Any]) -> None:
        cfg["geotrain:regions"][0]["pool"]["ssh"].update(settings)

    return mutate


def _refused(write_stack: Callable[..., Path], **settings: Any) -> ConfigError:
    path = write_stack("global", _ssh(**settings))
    with pytest.raises(ConfigError) as e:
        load_stack(str(path))
    # the stack file (clipped when long), the key path, one line
    assert e.value.source.endswith(path.name) and "\n" not in str(e.value)
    return e.value


def test_a_key_line_keeps_type_and_base64_and_drops_the_comment() -> None:
    assert parse_host_key(ED25519 + " root@host") == ED25519
    assert parse_host_key("  " + ECDSA + "\n") == ECDSA


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("AAAAC3NzaC1lZDI1NTE5AAAAIIsE2cXTfAxG", "not an OpenSSH public key line"),
        (RSA, "RSA key"),
        ("ssh-dss AAAAB3NzaC1kc3MAAACBAP", "key type 'ssh-dss'"),
        ("ssh-ed25519 AAAA!!!", "not valid base64"),
        (ED25519[:-8], "not a well-formed ssh-ed25519 key"),  # cut short
        ("ecdsa-sha2-nistp256 " + ED25519.split()[1], "not a well-formed ecdsa"),  # wrong type
    ],
)
def test_the_check_refuses_a_malformed_host_key_naming_file_and_key_path(
    write_stack: Callable[..., Path], key: str, says: str
) -> None:
    e = _refused(write_stack, host_keys={"bj-1": key})
    assert e.path == f"{BEIJING}.host_keys.bj-1"
    assert says in e.message


def test_a_host_key_for_a_node_not_in_the_pool_is_refused(
    write_stack: Callable[..., Path],
) -> None:
    e = _refused(write_stack, host_keys={"fra-0": ED25519})
    assert e.path == f"{BEIJING}.host_keys.fra-0"
    assert "not a node of region beijing" in e.message and "bj-0" in e.message


def test_strict_checking_refuses_a_node_without_a_key_and_accepts_a_full_set(
    write_stack: Callable[..., Path],
) -> None:
    all_but_one = {f"bj-{i}": ED25519 for i in range(7)}
    e = _refused(write_stack, host_keys=all_but_one, strict_host_key_checking="yes")
    assert e.path == f"{BEIJING}.host_keys"
    assert "no host key for bj-7 (192.0.2.17:22)" in e.message
    full = {**all_but_one, "bj-7": ECDSA}
    load_stack(str(write_stack("global", _ssh(host_keys=full, strict_host_key_checking="yes"))))


def test_known_hosts_must_be_absolute_and_readable(
    write_stack: Callable[..., Path], tmp_path: Path
) -> None:
    e = _refused(write_stack, known_hosts="ssh/known_hosts")
    assert e.path == f"{BEIJING}.known_hosts" and "relative" in e.message
    e = _refused(write_stack, known_hosts=str(tmp_path / "absent"))
    assert e.path == f"{BEIJING}.known_hosts" and "cannot read" in e.message


def test_stack_host_keys_are_refused_on_pools_that_are_not_ssh(
    write_stack: Callable[..., Path],
) -> None:
    def mutate(cfg: dict[str, Any]) -> None:
        cfg["geotrain:regions"][0]["pool"]["ssh"] = {"host_keys": {"bj-0": ED25519}}

    path = write_stack("global-cloud", mutate)
    with pytest.raises(ConfigError) as e:
        load_stack(str(path))
    assert e.value.path == f"{BEIJING}.host_keys"
    assert "the program pins the keys of the instances it creates" in e.value.message


def _known_hosts(tmp_path: Path, lines: list[str], hashed: bool = False) -> Path:
    f = tmp_path / "known_hosts"
    f.write_text("\n".join(lines) + "\n")
    if hashed:  # OpenSSH's own hashing (HashKnownHosts), not ours
        if shutil.which("ssh-keygen") is None:
            pytest.skip("ssh-keygen is not installed")
        subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(f)], check=True, capture_output=True)
        assert "192.0.2" not in f.read_text()
    return f


@pytest.mark.parametrize("hashed", [False, True])
def test_known_hosts_lookup_prefers_ed25519_and_files_other_ports_as_bracketed(
    tmp_path: Path, hashed: bool
) -> None:
    f = _known_hosts(
        tmp_path,
        [
            f"192.0.2.10 {ECDSA}",
            f"192.0.2.10 {ED25519} comment",
            f"192.0.2.10 {RSA}",
            f"[192.0.2.11]:2222 {OTHER}",
            f"192.0.2.12 {RSA}",
        ],
        hashed=hashed,
    )
    text = f.read_text()
    assert lookup_known_hosts(text, "192.0.2.10", 22) == ED25519
    assert lookup_known_hosts(text, "192.0.2.10", 2222) is None
    assert lookup_known_hosts(text, "192.0.2.11", 2222) == OTHER
    assert lookup_known_hosts(text, "192.0.2.11", 22) is None
    assert lookup_known_hosts(text, "192.0.2.12", 22) is None  # RSA only: nothing to pin


def test_known_hosts_lookup_reads_wildcards_negations_and_never_a_revoked_key() -> None:
    text = "\n".join(
        [
            "# a comment",
            f"192.0.2.1?,!192.0.2.13 {ED25519}",
            f"192.0.2.* {ECDSA}",
            f"@revoked * {OTHER}",
            f"192.0.2.14 {OTHER}",
            f"@cert-authority 192.0.2.15 {OTHER}",
            "a broken line",
        ]
    )
    assert lookup_known_hosts(text, "192.0.2.12", 22) == ED25519
    assert lookup_known_hosts(text, "192.0.2.13", 22) == ECDSA  # negated for the ed25519 line
    assert lookup_known_hosts(text, "192.0.2.14", 22) == ED25519  # its own key is revoked
    assert lookup_known_hosts(text, "198.51.100.1", 22) is None


def _global(write_stack: Callable[..., Path], **settings: Any) -> Recording:
    return run_under_mocks(load_stack(str(write_stack("global", _ssh(**settings)))))


def test_every_connection_pins_its_host_key_from_the_stack_or_a_first_contact_scan(
    write_stack: Callable[..., Path], tmp_path: Path
) -> None:
    f = _known_hosts(tmp_path, [f"192.0.2.12 {ECDSA}", f"192.0.2.11 {OTHER}"])
    rec = _global(
        write_stack, host_keys={"bj-0": ED25519 + " c", "bj-1": ED25519}, known_hosts=str(f)
    )
    plan = build_plan(load_stack("global"))
    scans = {r.name: r for r in rec.by_type("command:local:Command")}
    # beijing: bj-0, bj-1 from host_keys (before known_hosts), bj-2 from known_hosts
    want = {"bj-0": ED25519, "bj-1": ED25519, "bj-2": ECDSA}
    for n in plan.nodes:
        if n.name not in want:  # every other node: trust on first use
            scan = scans.pop(f"{n.region}-pool-{n.name}-hostkey")
            assert scan.inputs["create"] == scan_command(n.address, 22, 3)
            assert scan.inputs["update"] == KEEP_RECORDED_KEY
            assert scan.inputs["triggers"] == [f"{n.address}:22"]
            want[n.name] = _mock_stdout(scan.name)
    assert scans == {}
    remote = [
        *rec.by_type("command:remote:Command"),
        *rec.by_type("command:remote:CopyToRemote"),
    ]
    assert len(remote) == 2 * len(plan.nodes) + len(plan.regions)  # bundle, agent; wgkey
    for r in remote:
        node = next(n for n in plan.nodes if n.address == r.inputs["connection"]["host"])
        assert r.inputs["connection"]["hostKey"] == want[node.name], r.name


def _mock_stdout(name: str) -> str:
    """GeotrainMocks' stand-in stdout of command `name`."""
    return hashlib.sha256(name.encode()).hexdigest()[:43] + "="


def test_a_key_another_backend_made_wins_over_stack_and_scan(
    write_stack: Callable[..., Path],
) -> None:
    """The cloud backends' plug: a key in ctx.host_keys before pool() is the pin."""
    plan = build_plan(load_stack(str(write_stack("global", _ssh(host_keys={"bj-1": ECDSA})))))
    ctx = BackendContext(plan, host_keys={"bj-0": OTHER})
    rec = Recording()
    mocks = GeotrainMocks()
    monitor = RecordingMonitor(mocks, rec)
    pulumi.runtime.set_mocks(mocks, project="geotrain", stack="g", preview=False, monitor=monitor)

    def body() -> None:
        comp = pulumi.ComponentResource("geotrain:test:Pool", "p")
        SshBackend().pin(ctx, plan.regions[0], Parent("p", comp))

    _sync_await(run_pulumi_func(body))
    assert ctx.host_keys["bj-0"] == OTHER and ctx.host_keys["bj-1"] == ECDSA
    assert sorted(r.name for r in rec.resources if r.custom) == [
        f"p-bj-{i}-hostkey" for i in range(2, 8)
    ]


def test_the_recorded_key_survives_a_new_scan_script_and_a_new_host_scans_again(
    tmp_path: Path,
) -> None:
    """The `-hostkey` resource's contract under the replay (pulumi-command's semantics):
    an update (here: another create script) prints the recorded stdout; a trigger change
    (another host) runs create again."""

    def program(script: str, host: str) -> Callable[[Any], dict[str, Any]]:
        def run(model: Any) -> dict[str, Any]:
            c = local.Command(
                "hk", create=f"echo {script}", update=KEEP_RECORDED_KEY, triggers=[host]
            )
            return {"key": c.stdout}

        return run

    replay, model = Replay(tmp_path / "state.json", Executor()), load_stack("local")
    assert replay.up(model, program("key-one", "h1")).outputs["key"] == "key-one"
    d = replay.up(model, program("key-two", "h1"))
    assert d.ops("update") == ["hk"] and d.outputs["key"] == "key-one"
    d = replay.up(model, program("key-two", "h2"))
    assert d.ops("replace") == ["hk"] and d.outputs["key"] == "key-two"
