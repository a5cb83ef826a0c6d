"""What the policy pack reads from infra beside the facts components register.

The rules (policies/rules.py) judge facts (infra/facts.py) and resources' own fields; for
cloud resources and defaults they need a few tables and one graph rule, named here so
the pack imports this module and `infra.tokens`, none of the model's internals.
"""

from __future__ import annotations

from typing import Any

from infra.model.checks.network import reachable
from infra.model.clouds import instance_type_gpus, taggable_types
from infra.model.gpus import GPU_TYPES
from infra.model.schema import Policy

__all__ = [
    "GPU_LIST_PRICES",
    "POLICY_DEFAULTS",
    "instance_type_gpus",
    "reachable",
    "taggable_types",
]

GPU_LIST_PRICES: dict[str, float] = {g: t.usd_per_hour for g, t in GPU_TYPES.items()}
"""USD per hour of one GPU of each type (infra/model/gpus.py), before gpu_prices overrides."""
POLICY_DEFAULTS: dict[str, Any] = Policy().model_dump()
"""`geotrain:policy` as a stack that sets none has it: the pack's defaults."""
