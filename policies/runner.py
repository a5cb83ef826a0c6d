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
from training.errors import ConfigError


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


LEVELS = ("advisory", "mandatory", "disabled")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "number": (int, float),
    "array": (list,),
    "null": (type(None),),
    "object": (dict,),
    "string": (str,),
    "boolean": (bool,),
}


def check_config(config: Any, source: str) -> dict[str, Any]:
    """A policy config (`--policy-config`, the JSON `pulumi preview --policy-config` takes)
    checked as the engine checks it: known policies, enforcement levels, and each policy's
    config schema (its keys and their JSON types). One ConfigError naming the entry."""
    if not isinstance(config, dict):
        raise ConfigError(
            source, "-", "a policy config is a JSON object of policy name -> level or settings"
        )
    schemas = {p.name: (p.config_schema.properties if p.config_schema else {}) for p in ALL}
    for name, entry in config.items():
        if name not in schemas and name != "all":
            raise ConfigError(
                source, str(name), f"unknown policy; the pack has {', '.join(schemas)}"
            )
        level = entry.get("enforcementLevel") if isinstance(entry, dict) else entry
        if isinstance(entry, dict) and "enforcementLevel" not in entry:
            level = None
        if level is not None and level not in LEVELS:
            raise ConfigError(
                source, str(name), f"enforcement level {level!r}; use one of {', '.join(LEVELS)}"
            )
        if not isinstance(entry, (str, dict)):
            raise ConfigError(
                source, str(name), 'give a level ("mandatory") or an object of settings'
            )
        if not isinstance(entry, dict):
            continue
        props = schemas.get(name, {})
        for key, value in entry.items():
            if key == "enforcementLevel":
                continue
            if key not in props:
                allowed = ", ".join(props) or "none"
                raise ConfigError(
                    source, f"{name}.{key}", f"unknown setting; settings here: {allowed}"
                )
            kinds = props[key].get("type")
            kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
            ok = any(
                isinstance(value, _JSON_TYPES.get(k, ()))
                and not (k == "number" and isinstance(value, bool))
                for k in kinds
            )
            if kinds and not ok:
                raise ConfigError(source, f"{name}.{key}", f"{value!r} is not {' or '.join(kinds)}")
    return config


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
