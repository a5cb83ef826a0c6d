"""FSDP2 inside each region on real processes: a dense (Llama) and a MoE (Mixtral) Hugging
Face config, 3 regions x 2 ranks on gloo, sharded inside the region and exchanged across
regions by the codec. A kill -9 resumes bitwise; a region's rank count may change between
runs (the checkpoint reshards); the export loads in transformers with the runtime's logits."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.helpers import committed, events, geotrain, small_stack, start

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-llama"
NODES = ("bj-0", "fra-0", "sv-0")


def _model_dir(tmp: Path, family: str) -> Path:
    """A tiny config of `family` over the example's BPE tokenizer (2048 tokens)."""
    from transformers import LlamaConfig, MixtralConfig

    d = tmp / f"model-{family}"
    d.mkdir()
    common = {
        "vocab_size": 2048,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    if family == "llama":
        config = LlamaConfig(**common)
    else:
        config = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    config.save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EXAMPLE / name, d / name)
    return d


def _stack(tmp: Path, name: str, model: Path, data: Path, workers: int = 2, steps: int = 8) -> Path:
    path = small_stack(tmp, name, model=f"hf:{model}", parallel={"shard": "fsdp"}, steps=steps)
    doc = yaml.safe_load(path.read_text())
    for shard in doc["config"]["geotrain:training"]["data_shards"]:
        shard["source"] = shard["uri"]
        shard["uri"] = f"tokens:{data / shard['region']}"
    for region in doc["config"]["geotrain:regions"]:
        region["pool"]["nodes"][0]["gpus"] = workers
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _prepare(stack: Path, cwd: Path) -> None:
    r = geotrain("data", "prepare", "--stack", str(stack), cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr


def _final(cwd: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(cwd / ".geotrain" / name / "final.pt", weights_only=True)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fsdp_trains_resumes_bitwise_after_kill_9_and_exports(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    from training.models.build import build_model

    model, data = _model_dir(tmp_path, family), tmp_path / "data"
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _prepare(_stack(a, "same", model, data), a)
    ref = geotrain("train", "--stack", str(_stack(a, "same", model, data)), cwd=a)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    done = [e for e in events(a / ".geotrain/same") if e["event"] == "done"]
    assert len(done) == 3 and len({e["digest"] for e in done}) == 1  # every region alike

    proc = start("train", "--stack", str(_stack(b, "same", model, data)), cwd=b)
    run_dir = b / ".geotrain" / "same"
    deadline = time.monotonic() + 300
    victim = None
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        ev = events(run_dir)
        step = max((e["step"] for e in ev if e["event"] == "step"), default=0)
        common = set.intersection(*(committed(run_dir / "checkpoints", n) for n in NODES))
        if step >= 4 and common:
            pids = [e["pid"] for e in ev if e["event"] == "start"]
            victim = random.Random(os.getpid()).choice(pids)
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    assert victim is not None and proc.returncode == 0, out
    assert "restarting from the newest checkpoint" in out
    ra, rb = _final(a, "same"), _final(b, "same")
    assert ra.keys() == rb.keys()
    for k in ra:
        assert torch.equal(ra[k], rb[k]), k

    out_dir = tmp_path / "export"
    r = geotrain(
        "export", "--stack", str(_stack(b, "same", model, data)), "--out", str(out_dir), cwd=b
    )
    assert r.returncode == 0, r.stdout + r.stderr
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
    runtime = build_model(f"hf:{model}", 32)
    runtime.load_state_dict(rb)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(tokens).logits, runtime(tokens).logits)
    if family == "llama":  # one family is enough for the layout change (it saves a run)
        _resumes_with_another_rank_count(a, model, data)


def _resumes_with_another_rank_count(cwd: Path, model: Path, data: Path) -> None:
    """The same run with 3 ranks per region instead of 2 and more steps: the checkpoint of
    the 2-rank run reshards (DCP), every rank says so, every region ends alike."""
    three = _stack(cwd, "same", model, data, workers=3, steps=11)
    r = geotrain("train", "--stack", str(three), cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    log = events(cwd / ".geotrain/same")
    resumed = {e["step"] for e in log if e["event"] == "resume"}
    assert resumed == {6}, resumed  # the last step the 2-rank run committed
    assert sum(e["event"] == "resharded" for e in log) == 9  # every rank of the 3-rank run
    done = [e for e in log if e["event"] == "done" and e["step"] == 11]
    assert len(done) == 3 and len({e["digest"] for e in done}) == 1
    report = json.loads((cwd / ".geotrain/same/report.json").read_text())
    assert report["world"] == 9
