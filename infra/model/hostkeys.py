"""SSH host keys from stack config: the grammar of a pinned key, the lookup in an OpenSSH
known_hosts file, and the first-contact scan; shared by the stack check and the ssh backend.

A pinned key is what pulumi-command's `ConnectionArgs.host_key` takes: one
`TYPE BASE64` line, which the provider parses with Go's `ssh.ParseAuthorizedKey` and
checks with `ssh.FixedHostKey` during the key exchange, before it authenticates or sends
a byte of a command or its stdin. The provider also narrows the host key algorithms it
offers to that key's type, which is why RSA keys cannot be pinned (see `parse_host_key`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from infra.model.schema import Pool

PINNABLE = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521")
"""Host key types a pin may name, best first (the order known_hosts lookups prefer)."""
_ECDSA_POINT = {"nistp256": 65, "nistp384": 97, "nistp521": 133}
"""Uncompressed curve point sizes: 1 + 2 * field bytes (32, 48, 66)."""
SCAN_TYPES = "ed25519,ecdsa"
"""What the first-contact scan asks sshd for (`ssh-keyscan -t`): the pinnable types."""


class HostKeyError(ValueError):
    """A host key or known_hosts entry that cannot be pinned; `key` is the key path below
    `pool.ssh` (such as `host_keys.bj-0`) that the stack check names."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


def parse_host_key(text: str) -> str:
    """`TYPE BASE64 [COMMENT]` -> `TYPE BASE64`, or HostKeyError (message without location).
    The comment goes: it is not part of the key, and a changed comment must not change
    every connection's inputs."""
    fields = text.split()
    if len(fields) < 2:
        raise HostKeyError("", "is not an OpenSSH public key line `TYPE BASE64`")
    typ, b64 = fields[0], fields[1]
    if typ == "ssh-rsa":
        # pulumi-command offers only the key's own type as host key algorithm, and for RSA
        # that is SHA-1 `ssh-rsa`, which OpenSSH 8.8 and later no longer offer: it would
        # never connect
        raise HostKeyError(
            "",
            "is an RSA key, which pulumi-command can only check with SHA-1 ssh-rsa "
            "signatures that OpenSSH 8.8+ refuses; pin the host's ed25519 key "
            "(/etc/ssh/ssh_host_ed25519_key.pub)",
        )
    if typ not in PINNABLE:
        raise HostKeyError("", f"has key type {typ!r}; use one of {', '.join(PINNABLE)}")
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise HostKeyError("", "is not valid base64 after the key type") from None
    if not _well_formed(typ, blob):
        raise HostKeyError(
            "", f"is not a well-formed {typ} key (cut short, or pasted under another type)"
        )
    return f"{typ} {b64}"


def _well_formed(typ: str, blob: bytes) -> bool:
    """RFC 4253 6.6 / RFC 5656 3.1: the blob repeats its type, then the key material."""
    fields = _ssh_strings(blob)
    if fields is None or not fields or fields[0] != typ.encode():
        return False
    if typ == "ssh-ed25519":
        return len(fields) == 2 and len(fields[1]) == 32
    curve = typ.removeprefix("ecdsa-sha2-")
    return (
        len(fields) == 3
        and fields[1] == curve.encode()
        and len(fields[2]) == _ECDSA_POINT[curve]
        and fields[2][0] == 4
    )


def _ssh_strings(blob: bytes) -> list[bytes] | None:
    out: list[bytes] = []
    i = 0
    while i < len(blob):
        if i + 4 > len(blob):
            return None
        n = int.from_bytes(blob[i : i + 4], "big")
        if i + 4 + n > len(blob):
            return None
        out.append(blob[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def host_name(address: str, port: int) -> str:
    """The name OpenSSH files a host under in known_hosts: `host`, or `[host]:port` when
    the port is not 22."""
    return address if port == 22 else f"[{address}]:{port}"


def known_hosts_path(value: str) -> Path:
    """`known_hosts` as a path: absolute or `~/...` (a relative path would depend on the
    directory `pulumi up` happens to run in)."""
    p = Path(value).expanduser()
    if not p.is_absolute():
        raise HostKeyError(
            "known_hosts", f"{value!r} is relative; give an absolute path or ~/.ssh/known_hosts"
        )
    return p


def lookup_known_hosts(text: str, address: str, port: int) -> str | None:
    """The best pinnable key (PINNABLE order) that known_hosts `text` holds for
    address:port, or None. Reads plain and hashed (`|1|salt|hash`) host fields, `*`/`?`
    wildcards and `!` negations; keys on an `@revoked` line are never returned, whatever
    its host field; `@cert-authority` lines are skipped (a CA cannot be pinned through
    pulumi-command's one fixed key); lines OpenSSH would not parse are skipped, as
    OpenSSH skips them."""
    name = host_name(address.lower(), port)
    revoked: set[str] = set()
    found: dict[str, str] = {}
    for entry in _entries(text):
        if entry.marker == "@revoked":
            revoked.add(entry.key)
        elif entry.marker is None and _host_matches(entry.hosts, name):
            found.setdefault(entry.key.split()[0], entry.key)
    for typ in PINNABLE:
        if typ in found and found[typ] not in revoked:
            return found[typ]
    return None


@dataclass(frozen=True)
class _Entry:
    marker: str | None
    hosts: str
    key: str
    """`TYPE BASE64`, normalised by parse_host_key."""


def _entries(text: str) -> list[_Entry]:
    out: list[_Entry] = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if len(fields) < 3:
            continue
        try:
            key = parse_host_key(" ".join(fields[1:3]))
        except HostKeyError:
            continue  # RSA, DSA, a broken line: never a pin
        out.append(_Entry(marker, fields[0], key))
    return out


def _host_matches(hosts: str, name: str) -> bool:
    if hosts.startswith("|1|"):
        parts = hosts.split("|")
        if len(parts) != 4:
            return False
        try:
            salt, want = base64.b64decode(parts[2]), base64.b64decode(parts[3])
        except (binascii.Error, ValueError):
            return False
        got = hmac.new(salt, name.encode(), hashlib.sha1).digest()
        return hmac.compare_digest(got, want)
    matched = False
    for pattern in hosts.lower().split(","):
        negated = pattern.startswith("!")
        if _wildcard(pattern.removeprefix("!")).fullmatch(name):
            if negated:
                return False  # a negated match excludes the host outright (sshd(8))
            matched = True
    return matched


def _wildcard(pattern: str) -> re.Pattern[str]:
    # only * and ? are special: the brackets of `[host]:port` are literal
    return re.compile(
        "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    )


def pool_host_keys(pool: Pool) -> dict[str, str]:
    """Node -> its pinned key from the pool's stack settings: `host_keys`, then
    `known_hosts`; nodes with neither are absent. HostKeyError names the setting."""
    s = pool.ssh
    out: dict[str, str] = {}
    for node, key in s.host_keys.items():
        try:
            out[node] = parse_host_key(key)
        except HostKeyError as e:
            raise HostKeyError(f"host_keys.{node}", str(e)) from None
    if s.known_hosts is None:
        return out
    path = known_hosts_path(s.known_hosts)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise HostKeyError(
            "known_hosts",
            f"cannot read {path}: {e.strerror or e}; give the path of an OpenSSH known_hosts "
            "file on the machine that runs pulumi",
        ) from None
    for n in pool.nodes:
        if n.name not in out:
            known = lookup_known_hosts(text, str(n.address), s.port)
            if known is not None:
                out[n.name] = known
    return out


def scan_command(address: str, port: int, attempts: int) -> str:
    """The first-contact scan (trust on first use), run on the operator's machine: the
    host's ed25519 key, else its ecdsa key, as `TYPE BASE64` on stdout; `attempts` tries
    10 s apart for hosts still booting. Exits 1 with one line on stderr when the host
    offers neither."""
    a, p = shlex.quote(address), int(port)
    pick = (
        'awk \'$2=="ssh-ed25519"{e=$2" "$3} $2~/^ecdsa-sha2-/{if(c=="")c=$2" "$3} '
        'END{k=(e!="")?e:c; if(k=="")exit 1; print k}\''
    )
    return (
        f"i=0; while :; do i=$((i+1)); "
        f"k=$(ssh-keyscan -T 10 -p {p} -t {SCAN_TYPES} {a} 2>/dev/null | {pick}) && break; "
        f"if [ $i -ge {int(attempts)} ]; then echo 'ssh-keyscan got no ed25519 or ecdsa host "
        f"key from {address}:{p}; check the address and port, or pin the key "
        f"in pool.ssh.host_keys' >&2; exit 1; fi; sleep 10; done; printf '%s\\n' \"$k\""
    )


KEEP_RECORDED_KEY = (
    '[ -n "$PULUMI_COMMAND_STDOUT" ] || { echo "no host key recorded in state; run pulumi up '
    '--replace on this hostkey resource to scan again" >&2; exit 1; }; '
    "printf '%s\\n' \"$PULUMI_COMMAND_STDOUT\""
)
"""The scan's `update`: the key recorded at first contact, unchanged. pulumi-command runs a
local command's update with the previous stdout in PULUMI_COMMAND_STDOUT."""
