"""Model references (presets, `hf:<dir>`, `python:<module>:<callable>`): each family builds
from a tiny local config, trains through `lm_loss`, and exports to a directory that reloads
with the same logits; every bad reference is one SpecError line naming the path or name."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from training.errors import OutputError, SpecError
from training.models.build import build_model, embedding_rows, lm_loss, params_digest
from training.models.deepseek import DeepSeekLM
from training.models.export import export, load_exported
from training.models.hf import hf_facts, load_hf

transformers = pytest.importorskip("transformers")

VOCAB = 300
SEQ = 16
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},
    "mistral": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {
        # MLA shares no KV heads: as many KV heads as query heads
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
    },
}


def write_config(directory: Path, family: str, **overrides: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = {**COMMON, **FAMILIES[family], **overrides}
    transformers.AutoConfig.for_model(family, **kwargs).save_pretrained(directory)
    return directory


def batch(seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    return request.param, write_config(tmp_path / request.param, request.param)


def test_every_family_builds_fp32_on_cpu_without_kv_cache(family_dir: tuple[str, Path]) -> None:
    family, directory = family_dir
    model = build_model(f"hf:{directory}", SEQ)
    config: Any = model.config
    assert config.model_type == family
    assert config.use_cache is False
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.float32, "cpu")}
    assert embedding_rows(model) == VOCAB


def test_one_adamw_step_lowers_the_loss_on_a_repeated_batch(
    family_dir: tuple[str, Path],
) -> None:
    torch.manual_seed(0)
    model = load_hf(family_dir[1], seq_len=SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = batch()
    before = lm_loss(model, tokens)
    before.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.step()
    with torch.no_grad():
        assert lm_loss(model, tokens) < before


def test_export_reloads_in_transformers_with_equal_logits(
    family_dir: tuple[str, Path], tmp_path: Path
) -> None:
    family, directory = family_dir
    torch.manual_seed(1)
    model = load_hf(directory, seq_len=SEQ).eval()
    with torch.no_grad():  # "trained" weights that differ from any initialisation
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = export(model, f"hf:{directory}", tmp_path / "out", state_dict=model.state_dict())
    assert (out / "model.safetensors").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokens = batch()[:, :-1]
    with torch.no_grad():
        want, got = model(tokens).logits, reloaded.eval()(tokens).logits
    assert torch.allclose(want, got, rtol=0, atol=1e-6), family


def test_weights_dir_continues_from_its_weights(
    family_dir: tuple[str, Path], tmp_path: Path
) -> None:
    directory = family_dir[1]
    torch.manual_seed(2)
    saved = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(directory)
    )
    saved.save_pretrained(tmp_path / "weights")
    loaded = load_hf(tmp_path / "weights", seq_len=SEQ)
    fresh = load_hf(directory, seq_len=SEQ)  # the same config without weights
    assert params_digest(loaded) == params_digest(saved)
    assert params_digest(fresh) != params_digest(saved)
    facts = hf_facts(tmp_path / "weights")
    assert facts["has_weights"] is True
    # the headers count each stored tensor: a tied embedding once, persistent buffers too
    # (DeepSeek-V3's router bias)
    stored = {t.data_ptr(): t.numel() for t in loaded.state_dict().values()}
    assert facts["num_params"] == sum(stored.values())


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("num_hidden_layers", 3, "tensors of config.json's model are not in"),
        ("intermediate_size", 48, "do not load"),
    ],
)
def test_weights_that_do_not_fit_the_config_are_refused_not_reinitialised(
    key: str, value: int, expected: str, tmp_path: Path
) -> None:
    directory = write_config(tmp_path / "w", "llama")
    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(directory)
    ).save_pretrained(directory)
    write_config(directory, "llama", **{key: value})
    with pytest.raises(SpecError) as err:
        load_hf(directory, seq_len=SEQ)
    assert expected in str(err.value) and str(directory) in str(err.value)
    assert "\n" not in str(err.value)


def test_hf_facts_reads_the_config_without_weights(family_dir: tuple[str, Path]) -> None:
    family, directory = family_dir
    facts = hf_facts(directory, seq_len=SEQ)
    model = load_hf(directory, seq_len=SEQ)
    assert facts == {
        "model_type": family,
        "vocab_size": VOCAB,
        "has_weights": False,
        "tied_embeddings": family == "qwen2",
        "max_positions": COMMON["max_position_embeddings"],
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def test_preset_exports_and_reloads_with_equal_logits(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = build_model("deepseek-tiny", 1024)
    assert isinstance(model, DeepSeekLM) and model.c.max_seq == 1024
    out = export(model, "deepseek-tiny", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["model_type"] == "geotrain-deepseek"
    reloaded = load_exported(out)
    assert params_digest(reloaded) == params_digest(model)
    tokens = batch(vocab=256)[:, :-1]
    with torch.no_grad():
        assert torch.equal(model(tokens), reloaded(tokens))


FACTORY_MODULE = """
import torch
from torch import nn

class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 8)
        self.head = nn.Linear(8, 64)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))  # (B, T, V)

def build():
    return Bigram()

def broken():
    raise RuntimeError("no GPU here")

def not_a_module():
    return 42

constant = 7
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's model module on sys.path; its name is unique so no test sees a cached one."""
    name = f"user_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FACTORY_MODULE))
    (tmp_path / f"{name}_raises.py").write_text("raise ImportError('needs flash_attn')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_python_factory_trains_and_exports_with_equal_logits(
    user_module: str, tmp_path: Path
) -> None:
    ref = f"python:{user_module}:build"
    torch.manual_seed(4)
    model = build_model(ref, SEQ)
    assert embedding_rows(model) == 64
    lm_loss(model, batch(vocab=64)).backward()
    out = export(model, ref, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["factory"] == ref
    reloaded = load_exported(out)
    tokens = batch(vocab=64)[:, :-1]
    with torch.no_grad():
        assert torch.equal(model(tokens), reloaded(tokens))


class _Logits(nn.Module):
    def __init__(self, wrap: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 32)  # logits = embedding row of the input token
        self.wrap = wrap

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.wrap(self.embed(input_ids))


class _Output:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


@pytest.mark.parametrize(
    "wrap", [lambda x: x, lambda x: (x, None), _Output], ids=["tensor", "tuple", "logits"]
)
def test_lm_loss_is_one_contract_for_every_output_kind(wrap: Callable[..., Any]) -> None:
    torch.manual_seed(5)
    model = _Logits(wrap)
    tokens = batch(vocab=32)
    want = nn.functional.cross_entropy(
        model.embed(tokens[:, :-1]).reshape(-1, 32), tokens[:, 1:].reshape(-1)
    )
    assert torch.allclose(lm_loss(model, tokens), want)


def test_lm_loss_uses_the_models_own_loss_when_it_defines_one() -> None:
    torch.manual_seed(6)
    model = build_model("deepseek-tiny", SEQ)
    tokens = batch(vocab=256)
    assert torch.equal(lm_loss(model, tokens), model.loss(tokens))  # type: ignore[operator]


def test_params_digest_changes_with_one_weight() -> None:
    torch.manual_seed(7)
    model = _Logits(lambda x: x)
    before = params_digest(model)
    assert params_digest(model) == before
    with torch.no_grad():
        model.embed.weight[3, 4] += 1e-3
    assert params_digest(model) != before


def _hf_dir(tmp_path: Path, config: dict[str, Any] | str | None, *files: str) -> str:
    directory = tmp_path / "m"
    directory.mkdir()
    if isinstance(config, dict):
        (directory / "config.json").write_text(json.dumps(config))
    elif isinstance(config, str):
        (directory / "config.json").write_text(config)
    for name in files:
        (directory / name).write_bytes(b"\0")
    return f"hf:{directory}"


BAD_HF: dict[str, tuple[dict[str, Any] | str | None, tuple[str, ...], str]] = {
    "no config": (None, (), "config.json not found"),
    "not json": ("{oops", (), "not a transformers config"),
    "no model_type": ({"hidden_size": 8}, (), "'model_type'"),
    "unknown type": ({"model_type": "nonesuch"}, (), "unknown to transformers 5."),
    "remote code": ({"model_type": "x", "auto_map": {}}, (), "trust_remote_code"),
    "not causal": ({"model_type": "t5"}, (), "no causal LM class"),
    "pickle only": ({"model_type": "llama"}, ("pytorch_model.bin",), "safetensors only"),
    "too short": ({"model_type": "llama", "max_position_embeddings": 8}, (), "below seq_len"),
}


@pytest.mark.parametrize("case", sorted(BAD_HF))
def test_bad_hf_dir_is_one_spec_error_line_naming_the_path(case: str, tmp_path: Path) -> None:
    config, files, expected = BAD_HF[case]
    ref = _hf_dir(tmp_path, config, *files)
    for attempt in (lambda: build_model(ref, SEQ), lambda: hf_facts(ref[3:], seq_len=SEQ)):
        with pytest.raises(SpecError) as err:
            attempt()
        assert expected in str(err.value) and str(tmp_path / "m") in str(err.value)
        assert "\n" not in str(err.value)


BAD_PYTHON: dict[str, tuple[str, str]] = {
    "no callable": ("python:{m}", "python:<module>:<callable>"),
    "two colons": ("python:{m}:build:x", "python:<module>:<callable>"),
    "not a name": ("python:1{m}:build", "python:<module>:<callable>"),
    "no module": ("python:{m}_missing:build", "cannot import module '{m}_missing'"),
    "import raises": ("python:{m}_raises:build", "ImportError: needs flash_attn"),
    "no attribute": ("python:{m}:nope", "has no attribute 'nope'"),
    "not callable": ("python:{m}:constant", "'constant' is a int, not a callable"),
    "factory raises": ("python:{m}:broken", "raised RuntimeError: no GPU here"),
    "not a module": ("python:{m}:not_a_module", "returned int, not a torch.nn.Module"),
    "unknown preset": ("{m}", "unknown model '{m}'; use a preset (deepseek-tiny"),
}


@pytest.mark.parametrize("case", sorted(BAD_PYTHON))
def test_bad_python_ref_is_one_spec_error_line_naming_it(case: str, user_module: str) -> None:
    ref, expected = (s.format(m=user_module) for s in BAD_PYTHON[case])
    with pytest.raises(SpecError) as err:
        build_model(ref, SEQ)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_export_never_clobbers_a_non_empty_dir_unless_told(tmp_path: Path) -> None:
    model = build_model("deepseek-tiny", SEQ)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError):
        export(model, "deepseek-tiny", out)
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir left behind
    export(model, "deepseek-tiny", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_export_copies_the_tokenizer_files(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "llama", "llama")
    (directory / "tokenizer.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text("{}")
    model = load_hf(directory, seq_len=SEQ)
    out = export(model, f"hf:{directory}", tmp_path / "out")
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    with pytest.raises(SpecError, match="no tokenizer files"):
        export(model, f"hf:{directory}", tmp_path / "out2", tokenizer_dir=tmp_path / "out2x")


def test_bf16_autocast_runs_the_forward_in_bf16_and_the_loss_in_fp32() -> None:
    from training.models.build import lm_loss, precision, to_device

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    seen: list[torch.dtype] = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    tokens = torch.randint(0, 50, (2, 9))
    assert to_device(tokens, torch.device("cpu")) is tokens  # pinned copies are CUDA's
    with precision(torch.device("cpu"), "bf16"):
        loss = lm_loss(model, tokens)
    loss.backward()
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32
    assert model[1].weight.dtype == torch.float32 and model[1].weight.grad is not None
    with precision(torch.device("cpu"), "none"):
        lm_loss(model, tokens)
    assert seen[-1] == torch.float32
