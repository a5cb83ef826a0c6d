"""Naming rules and address positions, valid and unique by construction.

The lowest layer that needs them: the model's schema and checks use them before a plan
exists, the plan derives names and addresses with them, and renderers read them.
"""

from __future__ import annotations

import hashlib

SERVICE_USER = "geotrain"
"""The system user the workers run as on hosts (no login, no sudo)."""
DEFAULT_LOGIN_USER = "geotrain-admin"
"""The pools' default SSH login user (it needs sudo for the agent): never SERVICE_USER,
whose processes would otherwise inherit the login user's sudo."""
GATEWAY_HOST_INDEX = 1
"""A gateway's private IP is its region subnet's first host."""
WORKER_HOST_OFFSET = 10
"""Node j of a region (not the gateway) gets host 10 + j of the subnet."""
NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$"
"""Region, node, namespace and claim names: a DNS label of 2-32 characters, so it is a
valid host name, Kubernetes name and file name (no '/', no '..')."""
IFNAME_MAX = 15
"""Linux IFNAMSIZ - 1."""


def ifname(prefix: str, peer: str) -> str:
    """Interface towards region `peer`: prefix + name when that fits Linux's 15 characters;
    else prefix + the name's start + '-' + 4 hex digits of its SHA-256, so names that
    share a long prefix stay distinct (the model checks reject the 1-in-65536 collision)."""
    full = prefix + peer
    if len(full) <= IFNAME_MAX:
        return full
    tag = hashlib.sha256(peer.encode()).hexdigest()[:4]
    return f"{prefix}{peer[: IFNAME_MAX - len(prefix) - 5].rstrip('-')}-{tag}"


def lab_netns(stack: str, node: str) -> str:
    """The lab host's network namespace: the stack is in the name, so two stacks' labs
    never share a namespace (netns names are file names: no length limit to respect)."""
    return f"gt-{stack}-{node}"
