"""`python:<module>:<callable>` models: the user's own nn.Module, built by their code.

The module is imported by name, so it must be importable where the workers run (installed,
or on PYTHONPATH / sys.path). The callable is called with no arguments: the factory owns
its configuration, so every region builds the same model from the same reference. It
must return a torch.nn.Module whose `forward(input_ids (B, T))` gives logits (B, T, V) or
an output with `.logits`, or that defines `loss(tokens (B, T+1)) -> scalar`
(training.models.build.lm_loss). `<callable>` may be dotted (`Model.tiny`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from training.errors import MAX_ERROR_CHARS, SpecError, clip
from training.models.refs import PYTHON_PREFIX, factory_parts

PREFIX = PYTHON_PREFIX


def load_factory(ref: str) -> nn.Module:
    """The module that `ref` (`python:<module>:<callable>`) returns; SpecError (one line,
    naming the module or callable and the fix) for anything else."""
    module_name, attr = parse(ref)
    factory = _resolve(ref, module_name, attr)
    try:
        model = factory()
    except Exception as e:  # the user's code: any failure is theirs to fix, said in one line
        raise _error(f"{ref}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise _error(
            f"{ref}: the factory returned {type(model).__name__}, not a torch.nn.Module; "
            "return the model itself"
        )
    return model


def parse(ref: str) -> tuple[str, str]:
    """(module, callable) of `python:<module>:<callable>`."""
    parts = factory_parts(ref)
    if parts is None:
        raise _error(
            f"bad model reference '{ref}'; write python:<module>:<callable>, "
            "e.g. python:mylab.models:build"
        )
    return parts


def _resolve(ref: str, module_name: str, attr: str) -> Callable[[], Any]:
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises as it runs
        raise _error(
            f"{ref}: cannot import module '{module_name}' ({type(e).__name__}: {e}); "
            "install it or put its folder on PYTHONPATH"
        ) from None
    for name in attr.split("."):
        if not hasattr(obj, name):
            raise _error(f"{ref}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, name)
    if not callable(obj):
        raise _error(f"{ref}: '{attr}' is a {type(obj).__name__}, not a callable")
    return obj


def _error(message: str) -> SpecError:
    return SpecError(clip(message, MAX_ERROR_CHARS))
