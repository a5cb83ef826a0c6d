"""What every check module shares: the error constructor, label syntax, pool kinds."""

from __future__ import annotations

import re

from training.errors import ConfigError

SINGLE_MACHINE_KINDS = ("local", "lab")
"""Pool kinds that run every region on this machine (they cannot mix with other kinds)."""


def err(source: str, path: str, msg: str) -> ConfigError:
    """The ConfigError for key `geotrain:<path>` of `source` (the stack file)."""
    return ConfigError(source, "geotrain:" + path, msg)


LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")
"""Kubernetes label names and values: tags become labels (geotrain.io/<key>)."""


def prefix_for(addresses: int) -> int:
    """The longest IPv4 prefix whose block holds `addresses` addresses."""
    return 32 - max(0, (addresses - 1).bit_length())
