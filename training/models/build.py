"""One entry point from a model reference to a module, and the contracts every model meets.

A reference is a bundled preset (`deepseek-tiny`, ...), `hf:<dir>` (training.models.hf) or
`python:<module>:<callable>` (training.models.factory). Whatever it names, the runtime
trains it through `lm_loss`, counts its vocabulary with `embedding_rows` and checks that
every region starts from the same weights with `params_digest`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from training.errors import MAX_ERROR_CHARS, SpecError, clip
from training.models.deepseek import PRESETS, DeepSeekLM
from training.models.factory import PREFIX as PYTHON_PREFIX
from training.models.factory import load_factory
from training.models.hf import load_hf
from training.models.refs import HF_PREFIX


def build_model(ref: str, seq_len: int) -> nn.Module:
    """The model `ref` names, able to take `seq_len` tokens; SpecError (one line) otherwise."""
    if ref.startswith(HF_PREFIX):
        return load_hf(ref.removeprefix(HF_PREFIX), seq_len=seq_len)
    if ref.startswith(PYTHON_PREFIX):
        return load_factory(ref)
    if ref in PRESETS:
        c = PRESETS[ref]
        # a longer window than the preset's only lengthens its RoPE table (no parameters)
        return DeepSeekLM(dataclasses.replace(c, max_seq=max(c.max_seq, seq_len)))
    raise SpecError(
        clip(
            f"unknown model '{ref}'; use a preset ({', '.join(PRESETS)}), hf:<dir> "
            "or python:<module>:<callable>",
            MAX_ERROR_CHARS,
        )
    )


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of `tokens` (B, T+1) int64: inputs tokens[:, :-1],
    targets tokens[:, 1:]. A model that defines `loss(tokens)` computes it itself; any other
    is called as `model(input_ids)` and must return logits (B, T, V), an output with
    `.logits` (transformers' CausalLMOutput) or a tuple whose first item is the logits.
    A DistributedDataParallel wrapper has no `loss`, so it is called through its forward,
    which is what its gradient hooks need."""
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be (B, T+1) with T >= 1, got {tuple(tokens.shape)}")
    if inspect.isfunction(getattr(type(model), "loss", None)):
        return model.loss(tokens)  # type: ignore[operator]
    out = model(tokens[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None and isinstance(out, tuple | list) and out:
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"{type(model).__name__}(input_ids) returned {type(out).__name__}; return logits "
            "(B, T, V), an output with .logits, or define loss(tokens)"
        )
    targets = tokens[:, 1:]
    # fp32 whatever the compute dtype: a bf16 log-softmax over a large vocabulary loses bits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def precision(device: torch.device, autocast: str) -> contextlib.AbstractContextManager[object]:
    """The context the forward pass runs in: torch.autocast in bfloat16 on `device`
    (parallel.autocast: bf16; matmuls in bf16, reductions and the loss in fp32, as
    autocast decides per op) or nothing (fp32). The backward replays the forward's dtypes,
    so it runs outside."""
    if autocast == "none":
        return contextlib.nullcontext()
    if autocast != "bf16":
        raise SpecError(f"unknown parallel.autocast '{autocast}'; use none or bf16")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def to_device(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto the worker's device: on CUDA through pinned memory, asynchronously
    (the copy overlaps the host's next work until the forward needs it); on CPU as is."""
    if device.type != "cuda":
        return tokens
    return tokens.pin_memory().to(device, non_blocking=True)


def embedding_rows(model: nn.Module) -> int:
    """Rows of the input embedding: the largest token id the model accepts, plus one."""
    if isinstance(model, DeepSeekLM):
        return model.c.vocab
    get = getattr(model, "get_input_embeddings", None)
    emb = (
        get()
        if callable(get)
        else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    )
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    raise SpecError(
        f"{type(model).__name__} has no get_input_embeddings() and no nn.Embedding; define "
        "get_input_embeddings() returning its token embedding"
    )


def params_digest(model: nn.Module) -> str:
    """sha256 over the named parameters in order: each name, shape and the bytes of an fp32
    CPU copy. Equal digests mean equal weights, whichever device holds them."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
