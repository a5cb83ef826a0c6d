"""Ubuntu 22.04 (python3 is 3.10): the agent's stage one runs on the host's python3, and the
runtime venv is made with python3.11, which the packages step installs (issue #36)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from geotrain.agent import bootstrap
from geotrain.agent.bootstrap import AgentError

REPO = Path(__file__).resolve().parents[2]


def _python310() -> str | None:
    """A Python 3.10 that runs (a pyenv shim may name one that is not selected)."""
    found = [
        shutil.which("python3.10"),
        *map(str, Path("/").glob("root/.pyenv/versions/3.10*/bin/python3.10")),
    ]
    for exe in filter(None, found):
        r = subprocess.run([exe, "-c", "pass"], capture_output=True, timeout=30)
        if r.returncode == 0:
            return exe
    return None


PY310 = _python310()


def test_a_new_enough_python3_makes_the_venv_itself_and_needs_no_package() -> None:
    assert bootstrap.runtime_packages((3, 12, 3)) == ()
    assert bootstrap.venv_python("bj-0", (3, 11, 2)) == bootstrap.sys.executable


def test_python_3_10_installs_python3_11_and_makes_the_venv_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert bootstrap.runtime_packages((3, 10, 12)) == ("python3.11", "python3.11-venv")
    fake = tmp_path / "python3.11"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bootstrap.venv_python("bj-0", (3, 10, 12)) == str(fake)


def test_python_3_10_without_python3_11_stops_with_one_line_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AgentError, match=r"python3 is 3\.10\.12 .*universe.*Ubuntu 24\.04"):
        bootstrap.venv_python("bj-0", (3, 10, 12))


@pytest.mark.skipif(PY310 is None, reason="no python3.10 on this machine to run stage one on")
def test_stage_one_runs_on_python_3_10_and_asks_for_python3_11() -> None:
    # stage one is what Ubuntu 22.04's own python3 runs (-I: no site, no user paths)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import geotrain.agent.bootstrap as b; print(sys.version_info[:2], b.runtime_packages())"
    )
    r = subprocess.run(
        [str(PY310), "-I", "-c", code, str(REPO)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "(3, 10) ('python3.11', 'python3.11-venv')"


SUDO = shutil.which("sudo")


@pytest.mark.skipif(SUDO is None or os.geteuid() != 0, reason="needs root and sudo (.ci/run)")
def test_sudo_rights_are_asked_of_sudo_itself() -> None:
    from geotrain.agent.apply import sudo_rights

    assert sudo_rights("nobody") is None
    assert sudo_rights("root") == "(ALL : ALL) ALL"  # Debian's sudoers: root ALL=(ALL:ALL) ALL


def test_a_workers_user_with_sudo_stops_the_apply_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from geotrain.agent import apply

    fake = tmp_path / "sudo"  # sudo as it answers for a user in group sudo
    fake.write_text(
        "#!/bin/sh\necho 'User geotrain may run the following commands on h:'\n"
        "echo '    (ALL : ALL) ALL'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert apply.sudo_rights("geotrain") == "(ALL : ALL) ALL"
    fake.write_text("#!/bin/sh\necho 'User geotrain is not allowed to run sudo on h.'\n")
    assert apply.sudo_rights("geotrain") is None


def test_the_login_user_cannot_be_the_workers_user(tmp_path: Path) -> None:
    import yaml
    from click.testing import CliRunner

    from geotrain.cli import cli

    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.global.yaml").read_text())
    doc["config"]["geotrain:regions"][1]["pool"]["ssh"]["user"] = "geotrain"
    path = tmp_path / "Pulumi.u.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "regions[1].pool.ssh.user" in r.output and "geotrain-admin" in r.output
