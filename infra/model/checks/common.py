"""What every check module shares: the error constructor, label syntax, pool kinds."""

from __future__ import annotations

import re

from training.errors import ConfigError

SINGLE_MACHINE_KINDS = ("local", "lab")


def err(source: str, path: str, msg: str) -> ConfigError:
    return ConfigError(source, "geotrain:" + path, msg)


LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")


def prefix_for(addresses: int) -> int:
    """The longest IPv4 prefix whose block holds `addresses` addresses."""
    return 32 - max(0, (addresses - 1).bit_length())
