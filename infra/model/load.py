"""Readers of stack config: a stack file offline, or the Pulumi engine's config.

This module and `infra.model.pulumi_config` are the only code that reads `geotrain:*`
config; everything else receives a validated `StackModel`.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from infra.model.checks import check_model
from infra.model.schema import StackModel
from infra.model.yaml_safe import read_yaml
from training.errors import ConfigError, short_repr

PREFIX = "geotrain:"
TOP_KEYS = ("regions", "network", "training", "monitoring", "policy", "tags")
"""`geotrain:<key>` entries that hold the model; other geotrain keys must be secrets."""
REPO_ROOT = Path(__file__).resolve().parents[2]
STACKS_DIR = REPO_ROOT / "stacks"


def stack_file(stack: str, stacks_dir: Path = STACKS_DIR) -> Path:
    """Path of a stack's config file; `stack` may also be a path to a yaml file."""
    p = Path(stack)
    if p.suffix in (".yaml", ".yml"):
        return p
    return stacks_dir / f"Pulumi.{stack}.yaml"


def available_stacks(stacks_dir: Path = STACKS_DIR) -> list[str]:
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in stacks_dir.glob("Pulumi.*.yaml"))


def load_stack(stack: str, stacks_dir: Path = STACKS_DIR) -> StackModel:
    """Read, parse and validate a stack file; raises ConfigError with file and key path."""
    path = stack_file(stack, stacks_dir)
    source = _display(path)
    _check_is_file(stack, path, source, stacks_dir)
    doc = read_yaml(path, source)
    config = _config_mapping(doc, source)
    stem = path.name[: -len(path.suffix)] if path.suffix in (".yaml", ".yml") else path.name
    name = stem.removeprefix("Pulumi.")
    return model_from_config(config, name, source)


def _check_is_file(stack: str, path: Path, source: str, stacks_dir: Path) -> None:
    """Raise unless `path` is a regular file: say whether it is missing, a directory (the
    stack path itself, or a name that is a folder) or something else (a FIFO, a device)."""
    given = Path(stack)
    try:
        if path.is_file():
            return
        folder = path if path.is_dir() else given if given.is_dir() else None
        exists = path.exists()
    except OSError as e:  # a name too long for the file system, a symlink loop, ...
        raise ConfigError(source, "-", f"cannot read the file: {e.strerror or e}") from None
    names = ", ".join(available_stacks(stacks_dir)) or "none"
    if folder is not None:
        inside = ", ".join(available_stacks(folder)[:3])
        hint = f" (it holds {inside})" if inside else ""
        raise ConfigError(
            _display(folder),
            "-",
            f"is a directory, not a stack file{hint}; give a stack name ({names}) "
            "or the path of a Pulumi.<stack>.yaml file",
        )
    if exists:
        raise ConfigError(
            source, "-", "not a regular file; give a stack file (Pulumi.<stack>.yaml)"
        )
    raise ConfigError(source, "-", f"no such stack file; available stacks: {names}")


def _config_mapping(doc: Any, source: str) -> dict[str, Any]:
    """The `config:` mapping of a parsed stack file, or a ConfigError saying what is there."""
    fix = "a stack file is a mapping with a 'config:' mapping of geotrain:* keys"
    if doc is None:
        raise ConfigError(source, "-", f"the file is empty (or only comments); {fix}")
    if not isinstance(doc, dict):
        raise ConfigError(source, "-", f"the top level is {_kind(doc)}, not a mapping; {fix}")
    if "config" not in doc:
        keys = short_repr(sorted(map(str, doc)))
        raise ConfigError(source, "config", f"no 'config:' key (keys here: {keys}); {fix}")
    config = doc["config"]
    if config is None:
        raise ConfigError(source, "config", f"'config:' is empty; {fix}")
    if not isinstance(config, dict):
        raise ConfigError(source, "config", f"'config:' holds {_kind(config)}; {fix}")
    return config


def _kind(value: Any) -> str:
    """'a list', 'a string', 'an integer', ... for messages."""
    names = {list: "list", str: "string", int: "integer", float: "number", bool: "boolean"}
    name = names.get(type(value), type(value).__name__)
    return ("an " if name[0] in "aeiou" else "a ") + name


STACK_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
"""A stack name: Pulumi's characters, and what geotrain builds from it must stay valid (one
directory `.geotrain/<stack>`, Kubernetes label values, systemd and config comments)."""


def model_from_config(config: dict[str, Any], stack: str, source: str) -> StackModel:
    """Build the model from flat Pulumi config (`geotrain:regions` -> value)."""
    if not STACK_NAME.fullmatch(stack):
        raise ConfigError(
            source,
            "-",
            f"stack name {short_repr(stack)} (from the file name Pulumi.<stack>.yaml): use "
            "letters, digits, '-', '_' and '.', at most 63, starting and ending with a "
            "letter or digit, e.g. Pulumi.prod-eu.yaml",
        )
    raw: dict[str, Any] = {"stack": stack}
    secrets = _secret_keys(config)
    for key, value in config.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue  # other providers' config (aws:region, ...) is not ours
        short = key[len(PREFIX) :]
        if short in TOP_KEYS:
            raw[short] = value
        elif key not in secrets:
            allowed = ", ".join(PREFIX + k for k in TOP_KEYS)
            raise ConfigError(
                source, key, f"unknown key; allowed keys: {allowed} (or a secret a pool names)"
            )
    return validate(raw, source)


def validate(raw: dict[str, Any], source: str) -> StackModel:
    try:
        model = StackModel.model_validate(raw)
    except ValidationError as e:
        raise _config_error(e, source) from None
    _check_numbers(model, source)
    check_model(model, source)
    return model


def with_steps(model: StackModel, steps: int) -> StackModel:
    """The stack with `training.steps` set to `steps` (`geotrain train --steps`), checked as
    if the file said so: a warm-up or a schedule the new count breaks is refused, in one
    line that names the override."""
    if steps < 1:
        raise ConfigError("--steps", "training.steps", f"{steps}: a run has at least 1 step")
    training = model.training.model_copy(update={"steps": steps})
    changed = model.model_copy(update={"training": training})
    check_model(changed, f"--steps {steps}")
    return changed


def _check_numbers(model: StackModel, source: str) -> None:
    """Every number is finite and fits in 64 bits, before any check does arithmetic on it.

    YAML reads `.inf`, `.nan` and integers of any size. Pydantic's float fields take inf
    and nan (inf even passes `gt=0`) and unbounded int fields (seed, steps) take 16**20000;
    downstream they break integer seconds, JSON, torch seeds and even f-strings (str() of
    an int past 4300 digits raises).
    """
    for loc, value in _numbers(model.model_dump(exclude={"stack"}), ()):
        if isinstance(value, float) and not math.isfinite(value):
            fix = "use a finite number (YAML's .inf and .nan are not allowed here)"
            raise ConfigError(source, key_path(loc), f"{value} is not a finite number; {fix}")
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            msg = f"{short_repr(value)} does not fit in 64 bits; use a smaller number"
            raise ConfigError(source, key_path(loc), msg)


def _numbers(value: Any, loc: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, (int, float)):
        yield loc, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, (*loc, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _numbers(v, (*loc, i))


def _secret_keys(config: dict[str, Any]) -> set[str]:
    """Secret keys are `{secure: ...}` values; pools name them for SSH keys or kubeconfigs."""
    return {k for k, v in config.items() if isinstance(v, dict) and set(v) == {"secure"}}


def _config_error(e: ValidationError, source: str) -> ConfigError:
    err = e.errors(include_url=False)[0]
    loc = tuple(err["loc"])
    path = key_path(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = sorted(_model_at(StackModel, loc[:-1]).model_fields)
        msg = f"unknown key {short_repr(loc[-1])}; allowed keys here: {', '.join(allowed)}"
    elif kind == "missing":
        msg = "required key is missing; add it"
    elif kind == "value_error":  # our own validators' messages name the value and the fix
        msg = err["msg"].removeprefix("Value error, ")
    else:
        msg = f"{err['msg']} (got {short_repr(err.get('input'))})"
    return ConfigError(source, path, msg)


def key_path(loc: tuple[Any, ...]) -> str:
    """('regions', 1, 'asn') -> 'geotrain:regions[1].asn'."""
    out = PREFIX.rstrip(":")
    first = True
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += (":" if first else ".") + str(part)
        first = False
    return out


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel]:
    """Walk field annotations down `loc` to the model class that owns the last key."""
    cur: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        ann = cur.model_fields[part].annotation
        args = [a for a in typing.get_args(ann) if isinstance(a, type)] or [ann]
        cur = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), cur)
    return cur


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except (ValueError, OSError, RuntimeError):  # outside cwd, cwd gone, a symlink loop
        return str(path)
