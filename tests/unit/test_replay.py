"""The deployment replay follows pulumi-command's semantics: one contract, checked with
local commands that log what runs (no SSH, no root)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pulumi
import pytest
from pulumi_command import local

from infra.model import load_stack
from infra.replay import DeploymentError, Executor, Replay


def _program(log: Path, version: str, extra: bool = True, trigger: str = "t1"):  # type: ignore[no-untyped-def]
    def program(model: Any) -> dict[str, Any]:
        a = local.Command(
            "a",
            create=f"echo create-a-{version} >> {log}",
            update=f"echo update-a-{version} >> {log}",
            delete=f"echo delete-a >> {log}",
        )
        local.Command(
            "b",
            create=f"echo create-b >> {log}",
            delete=f"echo delete-b >> {log}",
            triggers=[trigger],
            opts=pulumi.ResourceOptions(depends_on=[a]),
        )
        if extra:
            local.Command(
                "c",
                create=f"echo create-c-{version} >> {log}",  # no update: create runs again
                delete=f"echo delete-c >> {log}",
                opts=pulumi.ResourceOptions(depends_on=[a]),
            )
        return {}

    return program


def _lines(log: Path) -> list[str]:
    text = log.read_text() if log.exists() else ""
    log.write_text("")
    return text.split()


@pytest.fixture
def replay(tmp_path: Path) -> Replay:
    return Replay(tmp_path / "state.json", Executor())


def test_create_then_nothing_when_inputs_are_unchanged(replay: Replay, tmp_path: Path) -> None:
    log, model = tmp_path / "log", load_stack("local")
    replay.up(model, _program(log, "v1"))
    assert sorted(_lines(log)) == ["create-a-v1", "create-b", "create-c-v1"]
    d = replay.up(model, _program(log, "v1"))
    assert d.changed() == [] and _lines(log) == []


def test_changed_inputs_update_in_place_with_update_else_create(
    replay: Replay, tmp_path: Path
) -> None:
    log, model = tmp_path / "log", load_stack("local")
    replay.up(model, _program(log, "v1"))
    _lines(log)
    d = replay.up(model, _program(log, "v2"))
    assert sorted(_lines(log)) == ["create-c-v2", "update-a-v2"]
    assert sorted(d.ops("update")) == ["a", "c"] and d.ops("delete") == []


def test_a_changed_trigger_replaces_create_before_delete(replay: Replay, tmp_path: Path) -> None:
    log, model = tmp_path / "log", load_stack("local")
    replay.up(model, _program(log, "v1"))
    _lines(log)
    d = replay.up(model, _program(log, "v1", trigger="t2"))
    assert _lines(log) == ["create-b", "delete-b"]  # the new one first, then the old
    assert d.ops("replace") == ["b"] and d.ops("delete") == ["b"]


def test_a_resource_that_is_gone_is_deleted_and_destroy_deletes_dependents_first(
    replay: Replay, tmp_path: Path
) -> None:
    log, model = tmp_path / "log", load_stack("local")
    replay.up(model, _program(log, "v1"))
    _lines(log)
    replay.up(model, _program(log, "v1", extra=False))
    assert _lines(log) == ["delete-c"]
    replay.destroy()
    assert _lines(log) == ["delete-b", "delete-a"]  # b depends on a


def test_a_failing_step_stops_the_deployment_with_its_name(replay: Replay, tmp_path: Path) -> None:
    def broken(model: Any) -> dict[str, Any]:
        local.Command("bad", create="echo oops >&2; exit 3")
        return {}

    with pytest.raises(DeploymentError, match=r"create of bad .* exited 3: oops"):
        replay.up(load_stack("local"), broken)


def test_an_up_after_a_failed_up_reports_its_own_outcome(replay: Replay, tmp_path: Path) -> None:
    """The SDK keeps a failed run's pending outputs across set_mocks; the replay drops them,
    or the next `up` would raise the old failure after doing its work."""

    def program(create: str):  # type: ignore[no-untyped-def]
        def run(model: Any) -> dict[str, Any]:
            local.Command("a", create=create)
            return {}

        return run

    model = load_stack("local")
    with pytest.raises(DeploymentError, match="exited 3"):
        replay.up(model, program("exit 3"))
    assert replay.up(model, program(f"echo ok > {tmp_path / 'ok'}")).ops("create") == ["a"]
    assert (tmp_path / "ok").read_text() == "ok\n"
