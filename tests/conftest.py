"""Shared fixtures: stack files as dicts, and writing mutated copies of them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

STACKS = Path(__file__).resolve().parents[1] / "stacks"


def stack_doc(name: str) -> dict[str, Any]:
    return yaml.safe_load((STACKS / f"Pulumi.{name}.yaml").read_text())


@pytest.fixture
def write_stack(tmp_path: Path) -> Callable[..., Path]:
    """write_stack(base, mutate) -> path of a Pulumi.<name>.yaml built from `base` after
    `mutate(config)` edits its `config:` mapping in place."""

    def write(
        base: str, mutate: Callable[[dict[str, Any]], None] | None = None, name: str = "broken"
    ) -> Path:
        doc = copy.deepcopy(stack_doc(base))
        if mutate:
            mutate(doc["config"])
        path = tmp_path / f"Pulumi.{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return write
