"""Every exception geotrain raises on purpose, in one place.

The CLI turns any `GeotrainError` into one line on stderr and exit code 2, with no
traceback. Messages say what failed, the value, where, and the fix or allowed values.
`training` owns this module because it is the bottom layer: infra and policies import it,
training never imports them.
"""

from __future__ import annotations


class GeotrainError(Exception):
    """Base of all expected, user-facing failures."""

    exit_code = 2


class ConfigError(GeotrainError):
    """A stack file (or Pulumi config) is malformed or inconsistent.

    `source` is the file, `path` the key path such as `geotrain:regions[1].asn`.
    """

    def __init__(self, source: str, path: str, message: str) -> None:
        self.source = source
        self.path = path
        self.message = message
        super().__init__(f"{source}: {path}: {message}")


class SpecError(GeotrainError):
    """A launch spec is malformed or does not match the running world."""


class KeyFileError(GeotrainError):
    """The run's key file is missing, unreadable or malformed."""


class DataError(GeotrainError):
    """A data shard is missing, empty or placed outside its jurisdiction."""


class PayloadRejected(GeotrainError):
    """A cross-region payload failed verification and was not applied."""


class CheckpointError(GeotrainError):
    """A checkpoint cannot be written or does not verify."""


class LabError(GeotrainError):
    """The network-namespace lab could not be built or torn down."""
