"""`hf:<dir>` models: any causal LM family transformers builds, from a local directory.

The directory holds a `config.json` (what `save_pretrained` writes). Without weights the
model starts from transformers' own initialisation; with `*.safetensors` it continues
pretraining from them. Nothing is fetched from the hub, and no code from the directory
runs (`trust_remote_code` stays off; wrap such a model in a `python:` factory instead).
Pickle weights (`pytorch_model.bin`) are refused: loading them can run code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.errors import MAX_ERROR_CHARS, SpecError, clip

_RESAVE = "write config.json and weights together with save_pretrained"


def load_hf(directory: str | Path, *, seq_len: int) -> nn.Module:
    """The causal LM in `directory`: fp32 parameters on CPU, KV cache off (training never
    decodes). Raises SpecError (one line: the path and the fix) for a directory transformers
    cannot build from, or one whose positions are fewer than `seq_len`."""
    from transformers import AutoModelForCausalLM

    path = Path(directory)
    config = _config(path)
    _check_positions(path, config, seq_len)
    config.use_cache = False
    if _weights(path):
        try:
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                path,
                config=config,
                dtype=torch.float32,
                local_files_only=True,
                output_loading_info=True,
            )
        except (OSError, RuntimeError, ValueError) as e:  # a shape mismatch is a RuntimeError
            raise _error(f"{path}: the safetensors do not load ({e}); {_RESAVE}") from None
        model, info = loaded  # (model, loading info) with output_loading_info
        # a missing tensor would be silently re-initialised: refuse it, since "continue
        # pretraining" from partly random weights is not what was asked for
        missing = list(info.get("missing_keys", ())) + list(info.get("mismatched_keys", ()))
        if missing:
            raise _error(
                f"{path}: {len(missing)} tensors of config.json's model are not in the "
                f"safetensors (first: {sorted(map(str, missing))[0]}); {_RESAVE}"
            )
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.float().cpu()


def hf_facts(directory: str | Path, *, seq_len: int | None = None) -> dict[str, Any]:
    """What `geotrain validate` reports about an `hf:` directory, without allocating the
    model: model_type, vocab_size (input embedding rows), has_weights, tied_embeddings,
    max_positions (None where the config has none) and num_params: with weights, the
    elements the safetensors headers list (persistent buffers such as DeepSeek-V3's router
    bias included: an estimate); without, the parameters of a meta-device build, which
    allocates nothing (None if that build fails).
    The same SpecErrors as load_hf, including the `seq_len` check when it is given."""
    path = Path(directory)
    config = _config(path)
    if seq_len is not None:
        _check_positions(path, config, seq_len)
    weights = _weights(path)
    text = config.get_text_config()
    return {
        "model_type": config.model_type,
        "vocab_size": int(text.vocab_size),
        "has_weights": bool(weights),
        "tied_embeddings": bool(getattr(text, "tie_word_embeddings", False)),
        "max_positions": getattr(text, "max_position_embeddings", None),
        "num_params": _count_stored(weights) if weights else _count_meta(config),
    }


def _config(path: Path) -> Any:
    """The directory's transformers config, after the checks that give one-line errors."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    file = path / "config.json"
    if not file.is_file():
        raise _error(
            f"{file} not found: an hf: model is a directory holding config.json "
            "(what save_pretrained writes); point hf: at that directory"
        )
    try:
        raw = json.loads(file.read_text())
        model_type = raw["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _error(
            f"{file}: not a transformers config ({type(e).__name__}: {e}); it needs a "
            "'model_type' key, as save_pretrained writes"
        ) from None
    version = transformers.__version__
    if model_type not in CONFIG_MAPPING_NAMES:
        fix = (
            "it needs trust_remote_code, which geotrain never sets; wrap it in a "
            "python:<module>:<callable> factory"
            if "auto_map" in raw
            else "upgrade transformers or use a python:<module>:<callable> factory"
        )
        raise _error(
            f"{file}: model_type '{model_type}' is unknown to transformers {version}; {fix}"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise _error(
            f"{file}: model_type '{model_type}' has no causal LM class in transformers "
            f"{version}; geotrain trains next-token models (Llama, Qwen2, Mixtral, ...)"
        )
    if list(path.glob("*.bin")) and not _weights(path):
        raise _error(
            f"{path}: holds pickle weights (*.bin) and no *.safetensors; geotrain loads "
            "safetensors only; convert them (load, then save_pretrained)"
        )
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise _error(f"{file}: transformers {version} cannot read it: {e}") from None


def _check_positions(path: Path, config: Any, seq_len: int) -> None:
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and limit < seq_len:
        raise _error(
            f"{path / 'config.json'}: max_position_embeddings is {limit}, below seq_len "
            f"{seq_len}; lower seq_len to at most {limit}"
        )


def _weights(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _count_stored(files: list[Path]) -> int:
    """Elements in the safetensors files, read from their headers only."""
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def _count_meta(config: Any) -> int | None:
    """Parameters of the model built on the meta device: no memory for weights, about 2 s
    for DeepSeek-V3's 671e9 on one core."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an estimate only: validate reports None rather than failing
        return None
    return sum(p.numel() for p in model.parameters())


def _error(message: str) -> SpecError:
    return SpecError(clip(message, MAX_ERROR_CHARS))
