"""The lab's own workload through the CLI: a Hugging Face Llama config with its BPE
tokenizer (examples/tiny-llama), token shards each region prepares from its own text,
3 regions x 2 ranks, then an export that transformers loads with the runtime's logits."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.helpers import geotrain, small_stack
from training.audit import ledger

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "tiny-llama"


def _hf_stack(tmp: Path, name: str) -> Path:
    path = small_stack(tmp, name, model=f"hf:{MODEL}", seq_len=64)
    doc = yaml.safe_load(path.read_text())
    for shard in doc["config"]["geotrain:training"]["data_shards"]:
        shard["source"] = shard["uri"]
        shard["uri"] = f"tokens:{tmp / 'data' / shard['region']}"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_hf_llama_prepares_trains_and_exports_with_equal_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from training.models.build import build_model

    stack = _hf_stack(tmp_path, "hf")
    # before prepare, the worker would find no manifest; the stack itself is valid
    r = geotrain("data", "prepare", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("uint16") == 3 and "vocab 2048" in r.stdout
    r = geotrain("train", "--stack", str(stack), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trained" in r.stdout
    # each region's ledger names the manifest of the data it trained on, by digest
    for region in ("beijing", "frankfurt", "silicon-valley"):
        path = tmp_path / ".geotrain/hf/ledger" / f"{region}.jsonl"
        public = ledger.public_from_hex(path.with_suffix(".pub").read_text().strip())
        start = ledger.read_chain(path, region, public)[0]
        manifest = (tmp_path / "data" / region / "manifest.json").read_bytes()
        digests = [v["sha256"] for k, v in start.subject.items() if k.startswith("data/")]
        assert digests == [hashlib.sha256(manifest).hexdigest()], start.subject
    out = tmp_path / "exported"
    r = geotrain("export", "--stack", str(stack), "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    runtime = build_model(f"hf:{MODEL}", 64)
    runtime.load_state_dict(torch.load(tmp_path / ".geotrain/hf/final.pt", weights_only=True))
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(tokens).logits, runtime(tokens).logits)


def test_shards_prepared_with_another_tokenizer_are_refused_at_validate(tmp_path: Path) -> None:
    stack = _hf_stack(tmp_path, "other")
    r = geotrain("data", "prepare", "--stack", str(stack), "--tokenizer", "bytes", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = geotrain("validate", "--stack", str(stack), cwd=tmp_path)
    assert bad.returncode == 2 and "prepared with tokenizer" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
