"""Readers of stack config: a stack file offline, or the Pulumi engine's config.

This module and `infra.model.pulumi_config` are the only code that reads `geotrain:*`
config; everything else receives a validated `StackModel`.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from infra.model.checks import check_model
from infra.model.schema import StackModel
from training.errors import ConfigError

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
    if not path.is_file():
        names = ", ".join(available_stacks(stacks_dir)) or "none"
        raise ConfigError(source, "-", f"no such stack file; available stacks: {names}")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "-"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(source, where, f"invalid YAML: {problem}; fix the syntax") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(source, "-", f"cannot read the file: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise ConfigError(source, "config", "the file must be a mapping with a 'config:' mapping")
    name = (
        path.name[len("Pulumi.") : -len(".yaml")] if path.name.startswith("Pulumi.") else path.stem
    )
    return model_from_config(doc["config"], name, source)


def model_from_config(config: dict[str, Any], stack: str, source: str) -> StackModel:
    """Build the model from flat Pulumi config (`geotrain:regions` -> value)."""
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
    check_model(model, source)
    return model


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
        msg = f"unknown key '{loc[-1]}'; allowed keys here: {', '.join(allowed)}"
    elif kind == "missing":
        msg = "required key is missing; add it"
    else:
        msg = f"{err['msg']} (got {err.get('input')!r})"
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
    except ValueError:
        return str(path)
