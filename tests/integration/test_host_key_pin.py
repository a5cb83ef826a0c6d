"""Pinned SSH host keys against a real OpenSSH sshd on loopback (no root: it runs as this
user and lets only this user in). Through the replay, which checks `hostKey` as
pulumi-command does: a wrong key is refused in the key exchange, before the client
authenticates, so the command never runs and its stdin (the run key) never leaves."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pytest
from pulumi_command import local, remote

from infra.model import load_stack
from infra.model.hostkeys import KEEP_RECORDED_KEY, parse_host_key, scan_command
from infra.replay import DeploymentError, Executor, Replay

TOOLS = ("sshd", "ssh", "sftp", "ssh-keygen", "ssh-keyscan", "unshare")
MISSING = [t for t in TOOLS if shutil.which(t, path=f"{os.environ.get('PATH', '')}:/usr/sbin")]
MISSING = [t for t in TOOLS if t not in MISSING]
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(MISSING), reason=f"missing {', '.join(MISSING)} (openssh)"),
]
SECRET = "run-key-0123456789abcdef"


@dataclass
class Sshd:
    root: Path
    port: int
    host_key: str
    """The public key the running sshd presents (`TYPE BASE64`)."""
    log: list[str] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    @property
    def client_key(self) -> str:
        return (self.root / "client").read_text()

    def start(self, key_file: Path) -> None:
        """Serve with host key `key_file`; returns once sshd says it listens."""
        cfg = self.root / "sshd_config"
        cfg.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {key_file}\n"
            f"PidFile {self.root}/sshd.pid\nAuthorizedKeysFile {self.root}/authorized_keys\n"
            f"AllowUsers {getpass.getuser()}\nStrictModes no\nUsePAM no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nLogLevel VERBOSE\n"
            "Subsystem sftp internal-sftp\n"
        )
        self.host_key = parse_host_key(key_file.with_suffix(".pub").read_text())
        sshd = shutil.which("sshd", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
        assert sshd is not None
        # re-exec needs an absolute path; -e: log to stderr, which we read for readiness
        argv = [sshd, "-D", "-e", "-f", str(cfg)]
        if os.geteuid() == 0:
            # as root sshd wants its privilege separation directory, /run/sshd, which a
            # machine without a running sshd lacks: give it one in a mount namespace of
            # its own rather than create it on this machine
            argv = [
                "unshare", "-m", "sh", "-c",
                "mount -t tmpfs -o mode=755 tmpfs /run && mkdir -m 755 /run/sshd && "
                'exec "$@"', "sshd", *argv,
            ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()

        def read(p: subprocess.Popen[str]) -> None:
            assert p.stderr is not None
            for line in p.stderr:
                self.log.append(line.rstrip())
                if "Server listening on 127.0.0.1" in line:
                    ready.set()
            ready.set()  # exited: start() reports it

        threading.Thread(target=read, args=(self.proc,), daemon=True).start()
        ready.wait(20)
        if self.proc.poll() is not None or not any("Server listening" in x for x in self.log):
            pytest.skip(f"sshd did not start here: {' | '.join(self.log[-3:])}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def conn(self, host_key: pulumi.Input[str] | None) -> remote.ConnectionArgs:
        return remote.ConnectionArgs(
            host="127.0.0.1",
            port=self.port,
            user=getpass.getuser(),
            private_key=self.client_key,
            host_key=host_key,
            dial_error_limit=1,
        )

    def tried_to_log_in(self) -> bool:
        """Whether any client got as far as offering a key (sshd logs it at VERBOSE)."""
        return any("publickey" in line for line in self.log)


def _keygen(path: Path) -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
        check=True,
        capture_output=True,
    )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    tmp_path.chmod(0o755)
    for name in ("host", "impostor"):
        _keygen(tmp_path / name)
    client = _keygen(tmp_path / "client")
    (tmp_path / "authorized_keys").write_text(client.with_suffix(".pub").read_text())
    d = Sshd(tmp_path, _free_port(), "")
    d.start(tmp_path / "host")
    try:
        yield d
    finally:
        d.stop()


def _agent(sshd: Sshd, marker: Path, host_key: Callable[[], pulumi.Input[str]], v: str = "1"):  # type: ignore[no-untyped-def]
    """The ssh backend's shape in small: an agent command whose stdin is a secret, over a
    connection that pins `host_key()`."""

    def program(model: Any) -> dict[str, Any]:
        remote.Command(
            "agent",
            connection=sshd.conn(host_key()),
            create=f"cat > {marker}; echo {v} >> {marker}.runs",
            stdin=pulumi.Output.secret(SECRET),
            logging=remote.Logging.NONE,
        )
        return {}

    return program


def test_the_first_contact_scan_records_the_key_sshd_presents(sshd: Sshd) -> None:
    out, _ = Executor().local(scan_command("127.0.0.1", sshd.port, attempts=1), None)
    assert out == sshd.host_key


def test_a_wrong_host_key_is_refused_before_anything_is_sent(sshd: Sshd, tmp_path: Path) -> None:
    marker = tmp_path / "got"
    wrong = parse_host_key((tmp_path / "impostor.pub").read_text())
    replay, model = Replay(tmp_path / "state.json", Executor()), load_stack("local")
    with pytest.raises(DeploymentError, match="Host key verification failed"):
        replay.up(model, _agent(sshd, marker, lambda: wrong))
    assert not marker.exists()
    assert not sshd.tried_to_log_in()  # not even the client key was offered
    # the same deployment with the host's own key goes through
    replay.up(model, _agent(sshd, marker, lambda: sshd.host_key))
    assert marker.read_text() == SECRET and sshd.tried_to_log_in()


def test_a_copy_to_a_host_with_a_wrong_key_is_refused(sshd: Sshd, tmp_path: Path) -> None:
    src = tmp_path / "bundle"
    src.mkdir()
    (src / "agent.py").write_text("print('agent')\n")
    wrong = parse_host_key((tmp_path / "impostor.pub").read_text())
    conn = {
        "host": "127.0.0.1",
        "port": sshd.port,
        "user": getpass.getuser(),
        "privateKey": sshd.client_key,
        "hostKey": wrong,
    }
    with pytest.raises(DeploymentError, match="Host key verification failed"):
        Executor().copy(conn, str(src), str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists() and not sshd.tried_to_log_in()
    Executor().copy({**conn, "hostKey": sshd.host_key}, str(src), str(tmp_path / "dest"))
    assert (tmp_path / "dest" / "bundle" / "agent.py").read_text() == "print('agent')\n"


def test_a_key_recorded_at_first_contact_refuses_another_host_later(
    sshd: Sshd, tmp_path: Path
) -> None:
    """Trust on first use as the ssh backend wires it: the scan's stdout is the pin; after
    the host's key changes (an impostor on its address), the next update is refused."""
    marker = tmp_path / "got"
    scan = scan_command("127.0.0.1", sshd.port, attempts=1)

    def pinned() -> pulumi.Output[str]:
        hk = local.Command(
            "hostkey", create=scan, update=KEEP_RECORDED_KEY, triggers=[f"127.0.0.1:{sshd.port}"]
        )
        return hk.stdout

    replay, model = Replay(tmp_path / "state.json", Executor()), load_stack("local")
    replay.up(model, _agent(sshd, marker, pinned, v="1"))
    assert marker.read_text() == SECRET
    marker.unlink()
    sshd.stop()
    sshd.log.clear()
    sshd.start(tmp_path / "impostor")
    with pytest.raises(DeploymentError, match="Host key verification failed"):
        replay.up(model, _agent(sshd, marker, pinned, v="2"))  # an update: runs again
    assert not marker.exists() and not sshd.tried_to_log_in()
    assert (tmp_path / "got.runs").read_text() == "1\n"
