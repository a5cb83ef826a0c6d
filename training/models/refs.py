"""The grammar of a model reference, without torch: the stack check (infra, at `geotrain
validate`) and the runtime (training.models.build, .factory) read references alike."""

from __future__ import annotations

import re

PRESET_NAMES = ("deepseek-tiny", "deepseek-small", "deepseek-base")
"""The bundled presets (training.models.deepseek.PRESETS)."""
PRESET_VOCAB = 256
"""The presets embed bytes."""
HF_PREFIX = "hf:"
PYTHON_PREFIX = "python:"
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def factory_parts(ref: str) -> tuple[str, str] | None:
    """(module, callable) of `python:<module>:<callable>`, or None when `ref` is not one."""
    parts = ref.removeprefix(PYTHON_PREFIX).split(":")
    if not ref.startswith(PYTHON_PREFIX) or len(parts) != 2:
        return None
    if not all(_DOTTED.fullmatch(p) for p in parts):
        return None
    return parts[0], parts[1]


def known_form(ref: str) -> bool:
    """Whether `ref` is a preset, `hf:<dir>` or `python:<module>:<callable>`."""
    if ref.startswith(HF_PREFIX):
        return bool(ref.removeprefix(HF_PREFIX).strip())
    return ref in PRESET_NAMES or factory_parts(ref) is not None
