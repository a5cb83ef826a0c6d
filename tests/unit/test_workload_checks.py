"""`geotrain validate` on the lab's workload: model references, tokenizer against the
model's embedding, token shards against the tokenizer, and FSDP against the rest of the
stack. Each refusal is one line naming the key; each passing case passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from geotrain.cli import cli

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-llama"


def _validate(tmp: Path, **training: Any) -> tuple[int, str]:
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.local.yaml").read_text())
    t = doc["config"]["geotrain:training"]
    t.update({k: v for k, v in training.items() if v is not None})
    path = tmp / "Pulumi.w.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    return r.exit_code, r.output


def _one_line_error(code: int, out: str, *needles: str) -> None:
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out, out
    for n in needles:
        assert n in out, out


@pytest.mark.parametrize(
    "model", ["deepseek-tiny", f"hf:{EXAMPLE}", "python:my_lab.models:build_llm"]
)
def test_model_references_that_are_valid_pass(tmp_path: Path, model: str) -> None:
    shards = None
    if model.startswith("hf:"):  # a BPE model reads tokens, not bytes: unprepared shards
        shards = [
            {"name": f"s{i}", "jurisdiction": j, "region": r, "uri": f"tokens:{tmp_path / r}"}
            for i, (j, r) in enumerate(
                [("CN", "beijing"), ("EU", "frankfurt"), ("US", "silicon-valley")]
            )
        ]
    code, out = _validate(tmp_path, model=model, data_shards=shards)
    assert code == 0, out


@pytest.mark.parametrize("model", ["llama-7b", "hf:", "python:nocallable", "python:a b:c"])
def test_unknown_model_references_are_refused(tmp_path: Path, model: str) -> None:
    _one_line_error(*_validate(tmp_path, model=model), "geotrain:training.model")


def test_hf_directory_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, out = _validate(tmp_path, model=f"hf:{tmp_path / 'empty'}")
    _one_line_error(code, out, "training.model", "config.json")


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    code, out = _validate(tmp_path, tokenizer=str(EXAMPLE))  # 2048 tokens, preset embeds 256
    _one_line_error(code, out, "training.tokenizer", "2048", "256")


def test_raw_text_shards_with_a_bpe_model_are_refused(tmp_path: Path) -> None:
    code, out = _validate(tmp_path, model=f"hf:{EXAMPLE}")
    _one_line_error(code, out, "data_shards[0].uri", "raw text, read as bytes")


def test_shards_prepared_with_another_tokenizer_are_refused(tmp_path: Path) -> None:
    prepared = tmp_path / "cn"
    prepared.mkdir()
    (prepared / "manifest.json").write_text(json.dumps({"tokenizer": {"digest": "bytes"}}))
    shards = [
        {"name": "cn", "jurisdiction": "CN", "region": "beijing", "uri": f"tokens:{prepared}"},
        {"name": "eu", "jurisdiction": "EU", "region": "frankfurt", "uri": f"tokens:{prepared}"},
        {
            "name": "us",
            "jurisdiction": "US",
            "region": "silicon-valley",
            "uri": f"tokens:{prepared}",
        },
    ]
    code, out = _validate(tmp_path, model=f"hf:{EXAMPLE}", data_shards=shards)
    _one_line_error(code, out, "data_shards[0].uri", "prepared with tokenizer")


def test_a_source_on_a_raw_shard_is_refused(tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.local.yaml").read_text())
    shards = doc["config"]["geotrain:training"]["data_shards"]
    shards[0]["source"] = "pydoc-topics:auto"
    code, out = _validate(tmp_path, data_shards=shards)
    _one_line_error(code, out, "data_shards[0].source")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"balance": "throughput"}, "balance"),
        ({"compression": {"quantize": "int8", "secure_aggregation": True}}, "secure_aggregation"),
        ({"sync": "diloco", "diloco": {"inner_steps": 10, "tau": 2}}, "streaming"),
    ],
)
def test_fsdp_with_what_it_cannot_run_with_is_refused(
    tmp_path: Path, extra: dict[str, Any], needle: str
) -> None:
    code, out = _validate(tmp_path, parallel={"shard": "fsdp"}, **extra)
    _one_line_error(code, out, "training.parallel.shard", needle)


def test_fsdp_on_regions_of_different_sizes_is_refused(tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.local.yaml").read_text())
    doc["config"]["geotrain:regions"][0]["pool"]["nodes"][0]["gpus"] = 3
    doc["config"]["geotrain:training"]["parallel"] = {"shard": "fsdp"}
    path = tmp_path / "Pulumi.u.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    _one_line_error(r.exit_code, r.output, "parallel.shard", "same number of workers")


def test_fsdp_passes_and_one_worker_per_region_gets_a_hint(tmp_path: Path) -> None:
    code, out = _validate(tmp_path, parallel={"shard": "fsdp", "param_dtype": "bf16"})
    assert code == 0 and "hint" not in out, out
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.local.yaml").read_text())
    for r in doc["config"]["geotrain:regions"]:
        r["pool"]["nodes"][0]["gpus"] = 1
    doc["config"]["geotrain:training"]["parallel"] = {"shard": "fsdp"}
    path = tmp_path / "Pulumi.one.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    assert r.exit_code == 0 and "hint: parallel.shard fsdp has nothing to shard" in r.output


def test_fsdp_settings_without_fsdp_are_refused(tmp_path: Path) -> None:
    code, out = _validate(tmp_path, parallel={"param_dtype": "bf16"})
    _one_line_error(code, out, "training.parallel.param_dtype")


def test_hf_stack_validates_before_its_shards_are_prepared() -> None:
    r = CliRunner().invoke(cli, ["validate", "--stack", str(REPO / "stacks" / "Pulumi.hf.yaml")])
    assert r.exit_code == 0, r.output


def test_the_torch_free_reference_grammar_names_the_presets_the_runtime_builds() -> None:
    from training.models import deepseek, refs

    assert tuple(deepseek.PRESETS) == refs.PRESET_NAMES
    assert {c.vocab for c in deepseek.PRESETS.values()} == {refs.PRESET_VOCAB}


def test_autocast_passes_with_and_without_fsdp_and_is_refused_with_privacy(
    tmp_path: Path,
) -> None:
    assert _validate(tmp_path, parallel={"autocast": "bf16"})[0] == 0
    assert _validate(tmp_path, parallel={"shard": "fsdp", "autocast": "bf16"})[0] == 0
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.local.yaml").read_text())
    doc["config"]["geotrain:regions"][1]["privacy"] = {"target_epsilon": 8}
    doc["config"]["geotrain:training"]["parallel"] = {"autocast": "bf16"}
    path = tmp_path / "Pulumi.dp.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = CliRunner().invoke(cli, ["validate", "--stack", str(path)])
    _one_line_error(r.exit_code, r.output, "training.parallel.autocast", "frankfurt", "privacy")
