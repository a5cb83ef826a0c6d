"""SSH host keys of ssh pools: every pinned key parses, names a node of its pool, and with
`strict_host_key_checking: yes` every node has one (from `host_keys` or `known_hosts`)."""

from __future__ import annotations

from infra.model.checks.common import err
from infra.model.hostkeys import HostKeyError, pool_host_keys
from infra.model.schema import StackModel
from training.errors import short_repr


def check(m: StackModel, source: str) -> None:
    for i, r in enumerate(m.regions):
        s = r.pool.ssh
        base = f"regions[{i}].pool.ssh"
        if r.pool.kind != "ssh":
            if s.host_keys or s.known_hosts:
                setting = "host_keys" if s.host_keys else "known_hosts"
                raise err(
                    source,
                    f"{base}.{setting}",
                    f"applies to kind ssh pools, not {r.pool.kind}: "
                    + (
                        "the program pins the keys of the instances it creates; remove it"
                        if r.pool.kind in ("aws", "gcp", "alicloud")
                        else "these nodes are not reached over SSH; remove it"
                    ),
                )
            continue
        names = [n.name for n in r.pool.nodes]
        for node in s.host_keys:
            if node not in names:
                raise err(
                    source,
                    f"{base}.host_keys.{node[:40]}",
                    f"{short_repr(node)} is not a node of region {r.name}; "
                    f"use one of {', '.join(names)}",
                )
        try:
            keys = pool_host_keys(r.pool)
        except HostKeyError as e:
            node = e.key.removeprefix("host_keys.")
            shown = f"{short_repr(s.host_keys[node])} " if node in s.host_keys else ""
            raise err(source, f"{base}.{e.key}", f"{shown}{e}") from None
        missing = [n for n in r.pool.nodes if n.name not in keys]
        if s.strict_host_key_checking == "yes" and missing:
            n = missing[0]
            where = f" or in {s.known_hosts}" if s.known_hosts else ""
            raise err(
                source,
                f"{base}.host_keys",
                f"no host key for {n.name} ({n.address}:{s.port}){where} and "
                "strict_host_key_checking is yes; add host_keys."
                f"{n.name}: the host's /etc/ssh/ssh_host_ed25519_key.pub, checked out of "
                "band, or set strict_host_key_checking: accept-new",
            )
