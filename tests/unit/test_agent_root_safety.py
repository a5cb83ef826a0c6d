"""The host agent runs as root; the worker user must not be able to steer it (issue #37).

Each test plays one of the worker user's moves against the agent and shows it refused,
with the victim (a file or directory of root's) untouched: a symlink planted where the
agent writes or chowns, a record forged to make `remove` delete or copy what it chooses,
a record directory the worker can write. The agent's paths point into tmp_path. Without
root the "worker user" is a directory anyone may write (mode 0777); the tests that need a
second account (a directory the worker *owns*) run only as root.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from geotrain.agent import apply, bootstrap, safefs
from geotrain.agent.bootstrap import AgentError
from geotrain.agent.hostspec import DirSpec

ME = pwd.getpwuid(os.geteuid()).pw_name
MY_GROUP = grp.getgrgid(os.getegid()).gr_name
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root to give a directory to another uid")


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The agent's record in tmp_path/state (0700, ours); returns tmp_path."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    monkeypatch.setattr(apply, "STATE_FILE", state / "state.json")
    monkeypatch.setattr(apply, "BACKUP_DIR", state / "backup")
    monkeypatch.setattr(bootstrap, "STATE_DIR", state)
    monkeypatch.setattr(bootstrap, "LEGACY_STATE_DIR", tmp_path / "legacy")
    monkeypatch.setattr(apply, "USERSPACE_DROPIN", tmp_path / "dropin" / "x.conf")
    monkeypatch.setattr(apply, "systemctl", lambda *a, **k: None)
    return tmp_path


def worker_dir(path: Path) -> Path:
    """A directory the worker user can write: owned by `nobody` as root, else mode 0777."""
    path.mkdir(parents=True)
    if ROOT:
        nobody = pwd.getpwnam("nobody")
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
        path.chmod(0o755)
    else:
        path.chmod(0o777)
    return path


def victim(tmp_path: Path) -> Path:
    v = tmp_path / "shadow"
    v.write_text("root:secret\n")
    v.chmod(0o600)
    return v


def _apply(*dirs: DirSpec) -> apply.Apply:
    spec: Any = SimpleNamespace(node="bj-0", service_user="nobody", dirs=dirs)
    return apply.Apply(Path("."), spec, apply.Secrets(), apply.State({}))


def _unchanged(v: Path) -> None:
    st = v.lstat()
    assert v.read_text() == "root:secret\n"
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o600)


# -- symlinks planted where the agent writes or chowns -----------------------------------
def test_put_refuses_a_directory_the_worker_can_write_and_never_follows_its_temp_link(
    agent: Path,
) -> None:
    v = victim(agent)
    wdir = worker_dir(agent / "varlib" / "geotrain")
    (wdir / "run.key.geotrain-tmp").symlink_to(v)  # the old agent's temp name: O_TRUNC, chown
    (wdir / ".run.key.geotrain-tmp").symlink_to(v)
    (wdir / "run.key").symlink_to(v)
    a = _apply()
    with pytest.raises(safefs.UnsafePath, match="another account could redirect the write"):
        a.put(wdir / "run.key", b"k" * 64, 0o400, ME, MY_GROUP)
    _unchanged(v)


def test_a_run_key_below_the_workers_directory_is_refused_even_in_a_dir_of_roots(
    agent: Path,
) -> None:
    wdir = worker_dir(agent / "varlib" / "geotrain")
    (wdir / "keys").mkdir()  # root's, but the worker may rename it and put its own there
    spec: Any = SimpleNamespace(node="bj-0", service_user=ME, run_key_path=None)
    spec.run_key_path = str(wdir / "keys" / "run.key")
    a = apply.Apply(Path("."), spec, apply.Secrets(run_key="ab" * 32), apply.State({}))
    with pytest.raises(AgentError, match=r"step run-key: .*/etc/geotrain/run\.key"):
        a.run_key()
    assert not (wdir / "keys" / "run.key").exists()
    spec.run_key_path = str(agent / "etc" / "run.key")  # a directory of root's: written
    a.run_key()
    assert (agent / "etc" / "run.key").read_text() == "ab" * 32 + "\n"


def test_put_in_roots_own_directory_replaces_a_planted_temp_link_without_following_it(
    agent: Path,
) -> None:
    v = victim(agent)
    etc = agent / "etc"
    etc.mkdir()
    (etc / ".run.key.geotrain-tmp").symlink_to(v)
    assert _apply().put(etc / "run.key", b"key\n", 0o400, ME, MY_GROUP)
    assert (etc / "run.key").read_bytes() == b"key\n"
    assert not (etc / ".run.key.geotrain-tmp").exists()
    _unchanged(v)


def test_put_refuses_a_destination_that_is_a_symlink(agent: Path) -> None:
    v = victim(agent)
    etc = agent / "etc"
    etc.mkdir()
    (etc / "firewall.nft").symlink_to(v)
    with pytest.raises(safefs.UnsafePath, match="is a symlink"):
        _apply().put(etc / "firewall.nft", b"table\n", 0o640)
    _unchanged(v)


def test_a_worker_directory_swapped_for_a_symlink_is_never_chowned_through(
    agent: Path,
) -> None:
    v = agent / "etc-victim"
    v.mkdir(mode=0o700)
    wdir = worker_dir(agent / "varlib" / "geotrain")
    (wdir / "checkpoints").symlink_to(v)  # was a directory; the worker made it a link
    a = _apply(DirSpec(str(wdir / "checkpoints" / "bj-0"), ME, MY_GROUP, "0750"))
    with pytest.raises(safefs.UnsafePath, match=r"symlink in .*another account can write"):
        a.users_and_dirs()
    assert not (v / "bj-0").exists()
    st = v.lstat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o700)


def test_a_dir_spec_that_is_itself_a_planted_symlink_is_refused(agent: Path) -> None:
    v = agent / "etc-victim"
    v.mkdir(mode=0o700)
    wdir = worker_dir(agent / "varlib" / "geotrain")
    (wdir / "run").symlink_to(v)
    a = _apply(DirSpec(str(wdir / "run"), ME, MY_GROUP, "0777"))
    with pytest.raises(safefs.UnsafePath):
        a.users_and_dirs()
    assert stat.S_IMODE(v.lstat().st_mode) == 0o700


def test_the_workers_own_directories_are_still_made_and_reowned_through_their_fd(
    agent: Path,
) -> None:
    wdir = worker_dir(agent / "varlib" / "geotrain")
    a = _apply(DirSpec(str(wdir / "checkpoints" / "bj-0"), ME, MY_GROUP, "0750"))
    a.users_and_dirs()
    st = (wdir / "checkpoints" / "bj-0").lstat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o750


def test_remove_deletes_the_workers_tree_without_following_a_link_in_it(agent: Path) -> None:
    v = victim(agent)
    outside = agent / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    wdir = worker_dir(agent / "varlib" / "geotrain")
    (wdir / "run").mkdir()
    (wdir / "run" / "link").symlink_to(outside)
    (wdir / "run" / "shadow").symlink_to(v)
    apply._remove_tree_except(wdir, [])
    assert not wdir.exists()
    assert (outside / "keep.txt").exists()
    _unchanged(v)


def test_the_lock_is_never_opened_through_a_symlink(
    agent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v = victim(agent)
    lock = agent / "geotrain-node.lock"
    lock.symlink_to(v)
    monkeypatch.setattr(bootstrap, "LOCK", lock)
    with (
        pytest.raises(AgentError, match=r"step lock: cannot open .*never followed"),
        bootstrap.host_lock(),
    ):
        pass
    _unchanged(v)


# -- the record: where it lives and what it may ask for ------------------------------------
def test_the_record_lives_outside_the_workers_tree() -> None:
    assert str(bootstrap.STATE_DIR) == "/var/lib/geotrain-agent"
    assert apply.STATE_FILE.parent == bootstrap.STATE_DIR
    assert Path("/var/lib/geotrain") not in bootstrap.STATE_DIR.parents


def test_a_record_directory_others_can_write_is_refused(agent: Path) -> None:
    state = agent / "state"
    apply.STATE_FILE.write_text("{}")
    state.chmod(0o777)
    with pytest.raises(AgentError, match="must be a directory of root's with mode 0700"):
        apply.State.load()
    with pytest.raises(AgentError, match="mode 0777"):
        bootstrap.read_record("bootstrap.json")
    state.chmod(0o700)
    assert apply.State.load().d["files"] == {}


def test_a_record_directory_swapped_for_a_symlink_is_refused(
    agent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forged = worker_dir(agent / "forged")
    (forged / "state.json").write_text(json.dumps({"user_created": "postgres"}))
    link = agent / "state-link"
    link.symlink_to(forged)
    monkeypatch.setattr(bootstrap, "STATE_DIR", link)
    with pytest.raises(AgentError, match=r"step state: .*symlink"):
        bootstrap.read_record("state.json")


@needs_root
def test_a_record_directory_the_worker_owns_is_refused(agent: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    os.chown(agent / "state", nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(AgentError, match=f"uid {nobody.pw_uid}"):
        bootstrap.state_dir(create=False)
    with pytest.raises(AgentError, match="must be a directory of root's"):
        apply.State.load()


@pytest.mark.parametrize(
    "forged, words",
    [
        ({"files": {"/etc/shadow": {"backup": "/tmp/mine", "owner": [0, 0, 0o644]}}}, "backup"),
        ({"files": {"/usr/bin/x": {"backup": None, "owner": [0, 0, 0o4755]}}}, "owner and mode"),
        ({"files": {"etc/../../x": {"backup": None, "owner": None}}}, "file"),
        ({"sysctl": {"../../etc/passwd": "x"}}, "sysctl"),
        ({"dirs": [{"path": "/etc", "keep": False}]}, "directory '/etc'"),
        ({"made_dirs": ["/usr/../etc"]}, "directory"),
        ({"units": {"ssh.service; rm -rf /": {}}}, "unit"),
        ({"user_created": "root"}, "user 'root'"),
        ({"tunnels": ["-o x"]}, "tunnel"),
        ({"addresses": [{"ifname": "eth0", "address": "not-an-address"}]}, "wrong shape"),
    ],
)
def test_a_forged_record_asking_to_remove_or_copy_what_the_agent_never_records_is_refused(
    agent: Path, forged: dict[str, Any], words: str
) -> None:
    apply.STATE_FILE.write_text(json.dumps(forged))
    with pytest.raises(AgentError, match=r"step state: .*never records") as e:
        apply.remove(purge=False)
    assert words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "forged, bad",
    [
        ({"installed_packages": ["-o", "APT::Update::Pre-Invoke::=id"]}, "-o"),
        ({"installed_packages": ["openssh-server --purge"]}, "openssh-server --purge"),
        ({"added_files": ["/etc/shadow"]}, "/etc/shadow"),
        ({"created_dirs": ["/etc"]}, "/etc"),
        ({"created_dirs": ["/etc/geotrain/../ssh"]}, "/etc/geotrain/../ssh"),
    ],
)
def test_a_forged_bootstrap_record_cannot_choose_packages_or_files_to_remove(
    agent: Path, forged: dict[str, Any], bad: str
) -> None:
    (agent / "state" / "bootstrap.json").write_text(json.dumps(forged))
    with pytest.raises(AgentError, match="never adds") as e:
        bootstrap._state("bj-0")
    assert repr(bad) in str(e.value)


def test_what_stage_one_records_passes_its_own_check(agent: Path) -> None:
    bootstrap._remember_list("installed_packages", ["wireguard-tools", "frr", "libc++1"])
    bootstrap._remember_list("added_files", ["/etc/apt/keyrings/grafana.asc"])
    bootstrap._remember_list("created_dirs", ["/etc/geotrain", "/etc/geotrain/wireguard"])
    state = bootstrap._state("bj-0")
    assert state["installed_packages"] == ["frr", "libc++1", "wireguard-tools"]
    st = (agent / "state" / "bootstrap.json").lstat()
    assert stat.S_IMODE(st.st_mode) == 0o600


def test_an_older_agents_record_in_the_workers_tree_is_never_trusted(agent: Path) -> None:
    legacy = worker_dir(agent / "legacy")
    (legacy / "state.json").write_text(json.dumps({"files": {}}))
    (agent / "state").rmdir()
    with pytest.raises(AgentError, match=r"older agent kept its record .* does not trust it"):
        bootstrap.refuse_legacy_state("bj-0")


def test_a_record_the_agent_wrote_round_trips(agent: Path) -> None:
    etc = agent / "etc"
    etc.mkdir()
    (etc / "frr.conf").write_text("debian's\n")
    a = _apply()
    a.put(etc / "frr.conf", b"ours\n", 0o640)
    a.state.d.update(node="bj-0", service_user="nobody")
    a.state.save()
    assert stat.S_IMODE(apply.STATE_FILE.lstat().st_mode) == 0o600
    loaded = apply.State.load()
    assert loaded.check() is None
    apply.remove(purge=False)
    assert (etc / "frr.conf").read_text() == "debian's\n"
    assert not apply.STATE_FILE.exists()
