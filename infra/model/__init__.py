"""The typed stack model: the only reader of `geotrain:*` config."""

from infra.model.gpus import GPU_TYPES, GpuType
from infra.model.load import available_stacks, load_stack, model_from_config, stack_file
from infra.model.schema import StackModel

__all__ = [
    "GPU_TYPES",
    "GpuType",
    "StackModel",
    "available_stacks",
    "load_stack",
    "model_from_config",
    "stack_file",
]
