"""The trained model as a directory others can load.

- `hf:` models: `save_pretrained` (safetensors; transformers 5 writes nothing else) plus
  the tokenizer files, so `AutoModelForCausalLM.from_pretrained(out)` and
  `AutoTokenizer.from_pretrained(out)` load it.
- presets: `model.safetensors` + `config.json` with `"model_type": "geotrain-deepseek"` and
  the ModelConfig fields. transformers' Auto classes cannot load it (it is not one of their
  families); `load_exported(out)` rebuilds it.
- `python:` factories: `model.safetensors` + `config.json` with
  `"model_type": "geotrain-python"` naming the factory; `load_exported` calls the factory
  (importable where it runs) and loads the weights into what it returns.

The directory appears whole or not at all: it is written beside `out_dir` and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from training.errors import OutputError, SpecError
from training.models.build import HF_PREFIX
from training.models.deepseek import DeepSeekLM, ModelConfig
from training.models.factory import PREFIX as PYTHON_PREFIX
from training.models.factory import load_factory

PRESET_TYPE = "geotrain-deepseek"
PYTHON_TYPE = "geotrain-python"
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    # the files of tokenizers without a tokenizer.json (BPE vocab/merges, sentencepiece)
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def export(
    model: nn.Module,
    ref: str,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `model` (built from `ref`) to `out_dir` and return it. The weights are
    `state_dict` where the caller passes the trained ones (e.g. a sync's global copy), else
    the model's own; the caller passes the plain module, not a DDP wrapper. Tokenizer files
    come from `tokenizer_dir`, else from an `hf:` model's directory. A non-empty `out_dir`
    is replaced only with `overwrite=True` (else OutputError)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise OutputError(f"{out} exists and is not empty; choose another directory or overwrite")
    state = _plain(state_dict if state_dict is not None else model.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(model, ref, state, tmp)
        _copy_tokenizer(ref, tokenizer_dir, tmp)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_exported(directory: str | Path) -> nn.Module:
    """The model `export` wrote to `directory`, fp32 on CPU, whichever kind it is."""
    path = Path(directory)
    config = json.loads((path / "config.json").read_text())
    kind = config.get("model_type")
    if kind == PRESET_TYPE:
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        model: nn.Module = DeepSeekLM(ModelConfig(**{k: config[k] for k in fields}))
    elif kind == PYTHON_TYPE:
        model = load_factory(config["factory"])
    else:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=True
        ).cpu()
    model.load_state_dict(load_file(str(path / WEIGHTS)), strict=True)
    return model.float().cpu()


def _write(model: nn.Module, ref: str, state: dict[str, torch.Tensor], tmp: Path) -> None:
    if ref.startswith(HF_PREFIX):
        save = getattr(model, "save_pretrained", None)
        if not callable(save):
            raise TypeError(f"{ref}: {type(model).__name__} has no save_pretrained")
        save(tmp, state_dict=state)
        return
    if isinstance(model, DeepSeekLM):
        config = {"model_type": PRESET_TYPE, "geotrain_ref": ref, **dataclasses.asdict(model.c)}
    elif ref.startswith(PYTHON_PREFIX):
        config = {"model_type": PYTHON_TYPE, "factory": ref}
    else:
        raise SpecError(f"cannot export {type(model).__name__} as '{ref}'")
    save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _plain(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies. Copies, so tied weights become separate tensors
    (safetensors refuses shared storage; loading fills both from equal values)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def _copy_tokenizer(ref: str, tokenizer_dir: str | Path | None, tmp: Path) -> None:
    if tokenizer_dir is not None:
        source = Path(tokenizer_dir)
    elif ref.startswith(HF_PREFIX):
        source = Path(ref.removeprefix(HF_PREFIX))
    else:
        return
    found = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    if tokenizer_dir is not None and not found:
        raise SpecError(
            f"{source}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}); point "
            "tokenizer_dir at the directory save_pretrained of a tokenizer wrote"
        )
    for file in found:
        shutil.copy2(file, tmp / file.name)


def _replace(tmp: Path, out: Path) -> None:
    """rename(2) replaces an empty directory in one step. A non-empty one (overwrite) moves
    aside first: a crash between the two renames leaves it whole as `.<name>.old.*`."""
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the export is for others to read
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if out.is_file():
            out.unlink()
        os.replace(tmp, out)
