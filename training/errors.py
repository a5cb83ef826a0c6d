"""Every exception geotrain raises on purpose, in one place.

The CLI turns any `GeotrainError` into one line on stderr and exit code 2, with no
traceback. Messages say what failed, the value, where, and the fix or allowed values.
`training` owns this module because it is the bottom layer: infra and policies import it,
training never imports them.
"""

from __future__ import annotations

import reprlib

MAX_ERROR_CHARS = 283
"""Longest `str()` of a ConfigError. The CLI adds `geotrain: error: ` (17 characters), so
an error line stays within 300 characters whatever the stack file echoes into it."""
_PART_CHARS = 80
"""Share of MAX_ERROR_CHARS the file name and the key path may each take; the rest is the
message, which carries the fix."""


class GeotrainError(Exception):
    """Base of all expected, user-facing failures."""

    exit_code = 2


class ConfigError(GeotrainError):
    """A stack file (or Pulumi config) is malformed or inconsistent.

    `source` is the file, `path` the key path such as `geotrain:regions[1].asn`.
    """

    def __init__(self, source: str, path: str, message: str) -> None:
        self.source = clip(source, _PART_CHARS)
        self.path = clip(path, _PART_CHARS)
        self.message = clip(message, MAX_ERROR_CHARS - len(self.source) - len(self.path) - 4)
        super().__init__(f"{self.source}: {self.path}: {self.message}")


def clip(text: str, limit: int) -> str:
    """`text` as one printable line of at most `limit` characters.

    Line breaks and other unprintable characters are escaped (`\\n`, `\\x00`, `\\u202e`).
    A longer text keeps its head and tail around ` … `: the echoed value usually sits in
    the middle of a message and the fix at its end.
    """
    if len(text) > 4 * limit:  # bound the escaping work; the cut below still applies
        text = text[: 2 * limit] + text[-2 * limit :]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else _escape(c) for c in text)
    if len(text) <= limit:
        return text
    tail = (limit - 3) * 2 // 5
    return text[: limit - 3 - tail] + " … " + text[len(text) - tail :]


def _escape(c: str) -> str:
    return c.encode("unicode_escape").decode("ascii")


class _ShortRepr(reprlib.Repr):
    """reprlib bounded for values from a stack file: a few items, a few levels, and no
    `str()` of a huge int (which raises past 4300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = self.maxlong = 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()


def short_repr(value: object) -> str:
    """repr() of a value from a stack file, short enough to echo in an error message."""
    return clip(_SHORT_REPR.repr(value), 60)


class SpecError(GeotrainError):
    """A launch spec is malformed or does not match the running world."""


class OutputError(GeotrainError):
    """A directory or file geotrain would write cannot be written, or holds something
    geotrain did not write (it is never replaced)."""


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


class TransientReject(PayloadRejected):
    """A payload or control message that fails authentication or framing: corrupted in
    transit, or forged by someone without the run key. Nothing of it is used; the worker
    exits with 3 and the launcher restarts the group from the newest checkpoint."""

    exit_code = 3


class ReplayReject(TransientReject):
    """A payload that authenticates but is addressed elsewhere (another run, session,
    epoch, step, rank, bucket, part or stage): honest traffic replayed or redirected, which
    anyone on the path can do without the run key. Nothing of it is used; it is counted
    (the rejected-payload alert fires) and, as for any transient reject, the group restarts
    from the newest checkpoint in a new session, whose keys no recorded payload matches.
    Never a reason to stop the job."""


class HostileReject(PayloadRejected):
    """A payload that authenticates at the receiver's own address but that no honest
    sender writes (another shape, quantizer or cipher; a body of the wrong size; an unused
    code): a peer holding the run key misbehaves, which restarting cannot help. Nothing of
    it is used; the job stops (exit 2) and the rejected-payload alert fires."""


class SessionError(GeotrainError):
    """The ranks of a launch could not agree on its session (another run key on some
    node, or a tampered agreement)."""


class RendezvousTimeout(GeotrainError):
    """Not every rank reached the rendezvous store in time (a node's workers never
    started, or started too late); the launcher restarts and the ranks meet again."""

    exit_code = 3


class RollbackError(CheckpointError):
    """Committed checkpoints went missing or backwards behind the high-water mark."""


class LedgerError(GeotrainError):
    """The training ledger cannot be written, or does not verify (a chain, a signature, a
    cross-check between regions, or a file an entry names)."""


class SecureAggregationError(GeotrainError):
    """Secure aggregation cannot run as configured, or would reuse a mask."""


class RoundReused(SecureAggregationError):
    """A secure aggregation round whose step does not advance past the bucket's last one:
    its masks could repeat."""


class RoundAborted(SecureAggregationError):
    """A region's masked contribution is missing from a secure aggregation round (it
    dropped, or its payload was refused): without it the masks do not cancel, so nothing
    is applied; the worker exits with 3 and the launcher restarts from the checkpoint."""

    exit_code = 3


class PrivacyBudgetSpent(GeotrainError):
    """A region's differential-privacy budget would be exceeded by the next step; every
    rank stops at the same step (training.privacy.agreed_stop) and the run ends, exit 2."""


class QuorumLost(GeotrainError):
    """Fewer regions than `fault_tolerance.min_replicas` stayed in training (training.ft.quorum):
    the survivors stop, and the whole job restarts from its checkpoints."""

    exit_code = 3
