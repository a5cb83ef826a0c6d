"""Writing rendered files onto a node: one `command` resource per file, local or over SSH.

Content travels on stdin, never in the command line (it may be a secret, and it keeps
`ps` clean). A content digest in `triggers` makes a changed file re-apply; the delete
command removes exactly what create wrote.
"""

from __future__ import annotations

import hashlib
import posixpath
import shlex
from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi_command import local, remote

Content = str | pulumi.Output[str]


@dataclass(frozen=True)
class Target:
    """Where commands run: this machine (connection None) or a host over SSH."""

    connection: remote.ConnectionArgs | None
    """SSH connection, or None for local."""
    sudo: bool = False
    """Prefix commands with sudo (ssh hosts log in as an unprivileged user)."""

    def sh(self, script: str) -> str:
        return f"sudo sh -c {shlex.quote(script)}" if self.sudo else script


def digest(content: Content) -> pulumi.Output[str]:
    return pulumi.Output.from_input(content).apply(lambda c: hashlib.sha256(c.encode()).hexdigest())


def run(
    name: str,
    target: Target,
    create: str,
    opts: pulumi.ResourceOptions,
    delete: str | None = None,
    triggers: list[object] | None = None,
    stdin: Content | None = None,
) -> local.Command | remote.Command:
    """A command on the target; create/delete are POSIX sh."""
    kw: dict[str, Any] = {
        "create": target.sh(create),
        "delete": target.sh(delete) if delete else None,
        "triggers": triggers,
        "stdin": stdin,
    }
    if target.connection is None:
        return local.Command(name, **kw, opts=opts)
    return remote.Command(name, connection=target.connection, **kw, opts=opts)


def write_file(
    name: str,
    target: Target,
    path: str,
    content: Content,
    opts: pulumi.ResourceOptions,
    mode: str = "0644",
) -> local.Command | remote.Command:
    """Atomically write `content` to `path` (tmp file + rename: readers never see half)."""
    d = shlex.quote(posixpath.dirname(path) or ".")
    p = shlex.quote(path)
    create = (
        f"install -d -m 0755 {d} && umask 077 && cat > {p}.tmp && chmod {mode} {p}.tmp "
        f"&& mv {p}.tmp {p}"
    )
    return run(
        name, target, create, opts, delete=f"rm -f {p}", triggers=[digest(content)], stdin=content
    )
