"""Run the pack's rules without the Pulumi engine: over the resources the program
registers under mocks, through the SDK's own argument types. `geotrain check` uses this;
`pulumi preview --policy-pack policies` runs the same rules with the real engine."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pulumi_policy import (
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    StackValidationArgs,
)

from policies.rules import ALL, RESOURCE_POLICIES, STACK_POLICIES


@dataclass(frozen=True)
class Violation:
    policy: str
    level: str
    """mandatory | advisory."""
    urn: str
    message: str


def _opts(parent: str | None = None) -> PolicyResourceOptions:
    return PolicyResourceOptions(
        protect=False,
        ignore_changes=[],
        delete_before_replace=None,
        aliases=[],
        custom_timeouts=PolicyCustomTimeouts(0, 0, 0),
        additional_secret_outputs=[],
        parent=parent,
    )


def policy_resource(
    type_: str, name: str, urn: str, props: Mapping[str, Any], parent: PolicyResource | None = None
) -> PolicyResource:
    return PolicyResource(
        resource_type=type_,
        props=props,
        urn=urn,
        name=name,
        opts=_opts(parent.urn if parent else None),
        provider=None,
        parent=parent,
        dependencies=[],
        property_dependencies={},
    )


def _level(name: str, config: Mapping[str, Any]) -> str:
    entry = config.get(name)
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Mapping) and "enforcementLevel" in entry:
        return str(entry["enforcementLevel"])
    return next(p for p in ALL if p.name == name).enforcement_level.value  # type: ignore[union-attr]


def _policy_config(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    entry = config.get(name)
    return (
        {k: v for k, v in entry.items() if k != "enforcementLevel"}
        if isinstance(entry, Mapping)
        else {}
    )


def resources_from_recording(registered: Iterable[Any]) -> list[PolicyResource]:
    """Policy resources from what the program registered under mocks
    (infra.mocks.Registered: type, name, urn, inputs, parent), parents first."""
    by_urn: dict[str, PolicyResource] = {}
    out = []
    for r in registered:
        pr = policy_resource(r.type, r.name, r.urn, r.inputs, by_urn.get(r.parent or ""))
        by_urn[r.urn] = pr
        out.append(pr)
    return out


def run_policies(
    resources: list[PolicyResource], config: Mapping[str, Any] | None = None
) -> list[Violation]:
    """Every resource policy on every resource, then every stack policy once."""
    config = config or {}
    out: list[Violation] = []
    for pol in RESOURCE_POLICIES:
        level = _level(pol.name, config)
        if level == "disabled":
            continue
        for r in resources:
            args = ResourceValidationArgs(
                r.resource_type,
                r.props,
                r.urn,
                r.name,
                r.opts,
                None,
                _policy_config(pol.name, config),
            )
            pol.validate(
                args,
                lambda msg, urn=None, r=r, pol=pol, level=level: out.append(  # type: ignore[misc]
                    Violation(pol.name, level, urn or r.urn, msg)
                ),
            )
    for spol in STACK_POLICIES:
        level = _level(spol.name, config)
        if level == "disabled":
            continue
        sargs = StackValidationArgs(resources, _policy_config(spol.name, config))
        spol.validate(
            sargs,
            lambda msg, urn=None, spol=spol, level=level: out.append(  # type: ignore[misc]
                Violation(spol.name, level, urn or "stack", msg)
            ),
        )
    return out
