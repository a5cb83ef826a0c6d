"""Cross-field checks of a parsed stack: the rules pydantic's per-field types cannot see.

`check_model` is the single entry; each module checks one concern and raises the first
ConfigError it finds, naming the key path and the fix. The order below is the order a
user meets the errors in (the tests pin several of them).
"""

from __future__ import annotations

from infra.model.checks import (
    addresses,
    clouds,
    host_keys,
    kubernetes,
    monitoring,
    network,
    runtime,
    stack,
    training,
    workload,
)
from infra.model.checks.common import SINGLE_MACHINE_KINDS
from infra.model.checks.hints import idle_settings
from infra.model.schema import StackModel

__all__ = ["SINGLE_MACHINE_KINDS", "check_model", "idle_settings"]


def check_model(m: StackModel, source: str) -> None:
    """Raise ConfigError for the first inconsistency, naming its key path and the fix."""
    for check in (
        stack.regions,
        addresses.addresses,
        stack.pools,
        stack.workers,
        network.links,
        network.interface_names,
        addresses.ports,
        stack.tags,
        training.shards,
        training.settings,  # and fault_tolerance.check, after the sync settings
        workload.check,
        workload.parallel,
        monitoring.check,  # and fault_tolerance.quorum_ports
        stack.policy,
        runtime.check,
        kubernetes.check,
        clouds.check,
        host_keys.check,
    ):
        check(m, source)
