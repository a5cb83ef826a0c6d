"""Property: whatever a stack file holds, `geotrain validate` answers fast and clearly.

The answer is exit 0, or exit 2 with exactly one line on stderr of at most LINE_LIMIT
characters and no traceback. Inputs are the shipped stacks mutated (keys dropped,
duplicated, renamed, retyped; values and list sizes set at random), random YAML text and
random bytes. The CLI runs in-process (CliRunner) for speed; the worst cases (alias bomb,
files over the size cap) run as real processes in test_stack_files.py.

The example budget is fixed and derandomized, so CI runs the same inputs every time;
GEOTRAIN_FUZZ_EXAMPLES=5000 explores further with random inputs.
"""

from __future__ import annotations

import copy
import os
import tempfile
import typing
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from geotrain.cli import cli
from infra.model.schema import StackModel
from training.errors import MAX_ERROR_CHARS, ConfigError

STACKS = Path(__file__).resolve().parents[2] / "stacks"
BASES = ("local", "lab", "global")
PREFIX = "geotrain: error: "
LINE_LIMIT = len(PREFIX) + MAX_ERROR_CHARS
DEEP = os.environ.get("GEOTRAIN_FUZZ_EXAMPLES")
"""Set (e.g. 5000) for a longer, random exploration; CI runs the fixed, derandomized 150."""
FUZZ = settings(
    max_examples=int(DEEP or 150),
    deadline=timedelta(seconds=5),  # the promise: an answer within 5 s, for any input
    derandomize=DEEP is None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def stack_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d) / "Pulumi.fuzz.yaml"


def validate(path: Path) -> tuple[int, str]:
    """Run `geotrain validate --stack path` in-process; assert the one-answer contract."""
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code in (0, 2), r.output
    assert "Traceback" not in r.output
    if r.exit_code == 2:
        lines = r.stderr.splitlines()
        assert len(lines) == 1, r.stderr
        assert lines[0].startswith(PREFIX) and len(lines[0]) <= LINE_LIMIT, lines[0]
        assert r.stdout == ""
    return r.exit_code, r.stderr


# -- values -------------------------------------------------------------------------------

HUGE = {
    "HUGE-DECIMAL": "1" * 5000,  # past int()'s 4300-digit limit
    "HUGE-HEX": "0x" + "f" * 20_000,  # hex has no such limit: an 80 000-bit int
    "HUGE-FLOAT": "1" * 400 + ".5",  # inf
    "HUGE-STRING": "x" * 100_000,
}
"""Values yaml.safe_dump cannot write (or hypothesis cannot print): written as a token,
then swapped into the text."""

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 65535, 65536, 2**63, 2**64, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.text(alphabet="abcdef-0123456789", min_size=1, max_size=40),
    st.sampled_from(["", "bj-0", "beijing", "127.0.0.1", "10.42.9.0/24", "北京", *HUGE]),
    st.sampled_from(["CN", "EU", "cpu", "A100-80GB", "ssh", "local", "int4", "diloco"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=12), st.integers()), inner, max_size=4),
    ),
    max_leaves=12,
)


def _fields(model: type[BaseModel]) -> set[str]:
    out = set(model.model_fields)
    for f in model.model_fields.values():
        for t in (f.annotation, *typing.get_args(f.annotation)):
            if isinstance(t, type) and issubclass(t, BaseModel):
                out |= _fields(t)
    return out


FIELDS = sorted(_fields(StackModel))
"""Every key name of the stack model, for adding keys the shipped stacks do not set."""


def dump(doc: Any, allow_unicode: bool = False) -> str:
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=allow_unicode, width=1 << 30)
    for token, value in HUGE.items():
        text = text.replace(token, value)
    return text


def paths(node: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path under `node` (mapping keys and list indexes)."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        yield (*at, k)
        if isinstance(v, (dict, list)) and v:
            yield from paths(v, (*at, k))


def parent_of(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path[:-1]:
        doc = doc[k]
    return doc


def mutate(config: dict[str, Any], data: st.DataObject) -> None:
    """One random edit of the config mapping, in place."""
    path = data.draw(st.sampled_from(list(paths(config))))
    parent, key = parent_of(config, path), path[-1]
    op = data.draw(st.sampled_from(["drop", "retype", "rename", "resize", "copy", "add"]))
    if op == "drop":
        del parent[key]
    elif op == "add" and isinstance(parent, dict):  # a key the shipped stacks leave default
        parent[data.draw(st.sampled_from(FIELDS))] = data.draw(VALUES)
    elif op == "retype":
        parent[key] = data.draw(VALUES)
    elif op == "rename" and isinstance(parent, dict):
        parent[data.draw(st.text(max_size=20))] = parent.pop(key)
    elif op == "resize" and isinstance(parent[key], list) and parent[key]:
        n = data.draw(st.sampled_from([0, 1, 2, 17, 300]))
        parent[key] = [copy.deepcopy(parent[key][i % len(parent[key])]) for i in range(n)]
    elif op == "copy":  # a sibling's value in this place: right type, wrong meaning
        siblings = list(parent.values() if isinstance(parent, dict) else parent)
        parent[key] = copy.deepcopy(data.draw(st.sampled_from(siblings)))


def duplicate_a_line(text: str, data: st.DataObject) -> str:
    """Repeat one line: in block YAML that duplicates a key (or adds a list item)."""
    lines = text.splitlines(keepends=True)
    i = data.draw(st.integers(0, len(lines) - 1))
    return "".join(lines[: i + 1] + lines[i:])


# -- properties ---------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), base=st.sampled_from(BASES))
def test_mutated_shipped_stacks_get_ok_or_one_clear_line(
    stack_path: Path, data: st.DataObject, base: str
) -> None:
    doc = yaml.safe_load((STACKS / f"Pulumi.{base}.yaml").read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        mutate(doc["config"], data)
    text = dump(doc, allow_unicode=data.draw(st.booleans()))
    if data.draw(st.booleans()):
        text = duplicate_a_line(text, data)
    stack_path.write_text(text, encoding="utf-8")
    validate(stack_path)


@FUZZ
@given(data=st.data(), base=st.sampled_from(BASES))
def test_duplicated_key_lines_are_rejected_or_harmless(
    stack_path: Path, data: st.DataObject, base: str
) -> None:
    text = duplicate_a_line((STACKS / f"Pulumi.{base}.yaml").read_text(), data)
    stack_path.write_text(text, encoding="utf-8")
    validate(stack_path)


YAML_CHARS = st.sampled_from(list(":-?[]{},&*!|>'\"#%@` \n\t\\.0123456789abcxyzé北\x00\x1b\ufeff"))


@FUZZ
@given(
    head=st.sampled_from(["", "config:\n", "config:\n  geotrain:regions:\n", "config: "]),
    body=st.text(alphabet=YAML_CHARS, max_size=200),
)
def test_random_yaml_text_gets_ok_or_one_clear_line(stack_path: Path, head: str, body: str) -> None:
    stack_path.write_text(head + body, encoding="utf-8")
    validate(stack_path)


@FUZZ
@given(
    key=st.sampled_from(["regions", "network", "training", "monitoring", "policy", "tags"]),
    value=VALUES,
)
def test_random_values_of_each_top_key_get_ok_or_one_clear_line(
    stack_path: Path, key: str, value: Any
) -> None:
    doc = yaml.safe_load((STACKS / "Pulumi.local.yaml").read_text())
    doc["config"][f"geotrain:{key}"] = value
    stack_path.write_text(dump(doc), encoding="utf-8")
    validate(stack_path)


@FUZZ
@given(raw=st.binary(max_size=400), head=st.sampled_from([b"", b"config:\n  a: "]))
def test_random_bytes_get_ok_or_one_clear_line(stack_path: Path, raw: bytes, head: bytes) -> None:
    stack_path.write_bytes(head + raw)
    validate(stack_path)


@FUZZ
@given(source=st.text(), path=st.text(), message=st.text(max_size=5000))
def test_config_error_is_one_printable_line_of_bounded_length(
    source: str, path: str, message: str
) -> None:
    text = str(ConfigError(source, path, message))
    assert len(text) <= MAX_ERROR_CHARS and text.isprintable()
