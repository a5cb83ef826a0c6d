"""Which backend serves a region: the table from pool kind to backend.

Apart from the protocol (`base.py`) so that the protocol imports no backend and each
backend imports only the protocol.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from infra.backends.base import Backend
from infra.plan import PlanRegion

CLOUD_BACKENDS = ("aws", "alicloud", "gcp")
"""Imported only by stacks that use them: each cloud SDK takes ~1 s to import."""


def backend_for(region: PlanRegion) -> Backend:
    from infra.backends import kubernetes, lab, local, ssh  # here: pulumi providers load slowly

    table: dict[str, Backend] = {
        "local": local.LocalBackend(),
        "lab": lab.LabBackend(),
        "ssh": ssh.SshBackend(),
        "kubernetes": kubernetes.KubernetesBackend(),
    }
    if region.kind in CLOUD_BACKENDS:
        module = importlib.import_module(f"infra.backends.{region.kind}")
        backend: Backend = module.backend()
        return backend
    return table[region.kind]


def backends_of(regions: Iterable[PlanRegion]) -> list[tuple[Backend, list[PlanRegion]]]:
    """The stack's backends, each with its regions, in region order."""
    out: dict[str, tuple[Backend, list[PlanRegion]]] = {}
    for r in regions:
        out.setdefault(r.kind, (backend_for(r), []))[1].append(r)
    return list(out.values())
