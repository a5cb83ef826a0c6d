"""The run key: 32 random bytes as hex in a file that only the run's user can read.

It never keys anything directly: every key is derived from it with HKDF-SHA256
(training.comm.session.derive), per run, session, link, direction, stage and purpose for
payloads and control messages, per purpose for checkpoint manifests and node records, so
one file serves every purpose. See docs/security.md.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from training.errors import KeyFileError

KEY_BYTES = 32


def create_key_file(path: Path) -> bool:
    """Create `path` with a fresh key (mode 0600) unless it exists; True if created."""
    if path.exists():
        load_key(path)  # an existing but broken key file must not be silently reused
        return False
    if path.is_symlink():  # exists() is False for a dangling link; O_EXCL refuses it
        raise KeyFileError(
            f"key file {path} is a symlink to a missing file; remove the link or give another path"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise KeyFileError(
            f"cannot create key file {path}: {e.strerror or e}; give a path in a directory "
            "you can write"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
    return True


def load_key(path: str | Path) -> bytes:
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise KeyFileError(
            f"key file {p} does not exist; create it with "
            f"`geotrain keygen --out {p}` and copy it to every node"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(
            f"key file {p} is not readable ({e}); check its owner and mode "
            "(0600, owned by the user that runs the workers)"
        ) from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise KeyFileError(
            f"key file {p} is not hex; it must hold {KEY_BYTES} bytes as "
            f"{2 * KEY_BYTES} hex digits (`geotrain keygen`)"
        ) from None
    if len(key) != KEY_BYTES:
        raise KeyFileError(
            f"key file {p} holds {len(key)} bytes, expected {KEY_BYTES}; "
            "recreate it with `geotrain keygen`"
        )
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"key file {p} has mode {mode:o}: readable by others; run `chmod 600 {p}`"
        )
    return key
