"""Reader of `geotrain:*` config from the Pulumi engine (inside `pulumi up`/`preview` and
under mocks). With load.py, the only code that reads config."""

from __future__ import annotations

import pulumi

from infra.model.load import PREFIX, TOP_KEYS, model_from_config, stack_file
from infra.model.schema import StackModel


def model_from_pulumi() -> StackModel:
    stack = pulumi.get_stack()
    cfg = pulumi.Config("geotrain")
    raw = {PREFIX + k: v for k in TOP_KEYS if (v := cfg.get_object(k)) is not None}
    path = stack_file(stack)
    source = f"stacks/{path.name}" if path.is_file() else f"Pulumi config of stack {stack}"
    return model_from_config(raw, stack, source)


def secret(key: str) -> pulumi.Output[str] | None:
    """A secret such as `geotrain:sshPrivateKey`; None when unset."""
    ns, _, name = key.partition(":")
    return pulumi.Config(ns).get_secret(name)
