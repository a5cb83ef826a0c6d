"""The launch spec: JSON round trip, and one clear line for every malformed spec."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from training.errors import SpecError
from training.spec import CodecSpec, LaunchSpec, NodeSpec
from training.testing import make_spec

SOURCE = "r/launch-spec.json"
RAW = json.loads(make_spec(regions=2, local=2).to_json())


def _load(change: Callable[[dict[str, Any]], object]) -> LaunchSpec:
    raw = copy.deepcopy(RAW)
    change(raw)
    return LaunchSpec.from_json(json.dumps(raw), SOURCE)


def _node(raw: dict[str, Any]) -> dict[str, Any]:
    node: dict[str, Any] = raw["regions"][1]["nodes"][0]
    return node


def test_spec_survives_json_with_every_field_and_its_type() -> None:
    spec = make_spec(regions=3, local=2, sync="diloco", lr=0.01)
    back = LaunchSpec.from_json(spec.to_json())
    assert back == spec and back.to_json() == spec.to_json()
    assert isinstance(back.codec, CodecSpec) and isinstance(back.regions[2].nodes[0], NodeSpec)
    assert back.world_size == 6


@pytest.mark.parametrize(
    ("change", "where", "words"),
    [
        (lambda r: _node(r).update(gpus=2), "regions[1].nodes[0].gpus", "unknown key"),
        (lambda r: r["codec"].update(quantise="int8"), "codec.quantise", "codec takes quantize"),
        (lambda r: r.update(stepz=8), "stepz", "the spec takes run_id"),
        (lambda r: r.pop("master_addr"), "master_addr", "required key is missing"),
        (lambda r: r.update(steps="8"), "steps", "'8' should be a valid integer"),
        (lambda r: r.update(steps=0), "steps", "0 should be greater than or equal to 1"),
        (lambda r: r.update(sync="ring"), "sync", "should be 'allreduce' or 'diloco'"),
        (lambda r: r["codec"].update(cipher="des"), "codec.cipher", "'des' should be"),
        (lambda r: _node(r).update(device="gpu"), "regions[1].nodes[0].device", "'gpu'"),
        (lambda r: r["regions"][1].update(nodes=[]), "regions[1].nodes", "at least 1"),
        (lambda r: r.update(checkpoint=[]), "checkpoint", "[] should be an object"),
        (lambda r: _node(r).update(first_rank=3), "regions", "ranks must be contiguous"),
        (
            lambda r: r["regions"][1]["nodes"].append(
                {**_node(r), "name": "n9", "first_rank": 4, "device": "cuda"}
            ),
            "regions",
            "region frankfurt mixes devices ['cpu', 'cuda']",
        ),
        (
            lambda r: r["regions"][0].update(privacy={"target_epsilon": 4}),
            "regions[0].privacy.delta",
            "(and 1 more)",
        ),
    ],
)
def test_a_malformed_spec_is_one_line_naming_the_key_path(
    change: Callable[[dict[str, Any]], object], where: str, words: str
) -> None:
    with pytest.raises(SpecError) as e:
        _load(change)
    line = str(e.value)
    assert line.startswith(f"{SOURCE}: {where}: ") and words in line, line
    assert "\n" not in line and "pydantic" not in line and "type=" not in line


def test_a_spec_of_another_version_is_refused_before_its_fields() -> None:
    with pytest.raises(SpecError, match=r"spec version 2 is not supported; .* reads version 1"):
        _load(lambda r: r.update(version=2, renamed_field=1))


@pytest.mark.parametrize(
    ("text", "words"), [("[1, 2]", "must be a JSON object"), ("{", "not valid JSON")]
)
def test_a_spec_that_is_not_a_json_object_is_refused(text: str, words: str) -> None:
    with pytest.raises(SpecError, match=words):
        LaunchSpec.from_json(text, SOURCE)


def test_constructing_a_spec_in_code_validates_it_too() -> None:
    with pytest.raises(ValidationError, match="nprocs"):
        NodeSpec(name="n", host="h", first_rank=0, nprocs=0, device="cpu")
    with pytest.raises(ValidationError, match="ranks must be contiguous"):
        LaunchSpec(
            run_id="r",
            stack="s",
            master_addr="127.0.0.1",
            master_port=0,
            regions=[make_spec(regions=2).regions[1]],  # starts at rank 2
        )
