"""Cloud regions: a known cloud region that offers each node's GPUs, a disk the image fits
on, subnet addresses the cloud does not keep for itself (tables: infra/model/clouds.py)."""

from __future__ import annotations

import re

from infra.model.checks.common import err
from infra.model.names import WORKER_HOST_OFFSET
from infra.model.schema import StackModel

GCP_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
GCP_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


def check(m: StackModel, source: str) -> None:
    """Cloud regions: a known cloud region that offers each node's GPUs, a disk the image
    fits on, subnet addresses the cloud does not keep for itself (tables: clouds.py)."""
    from infra.model.clouds import CLOUD_KINDS

    regions = [(i, r) for i, r in enumerate(m.regions) if r.pool.kind in CLOUD_KINDS]
    if not regions:
        return
    if not m.network.admin_cidrs:
        raise err(
            source,
            "network.admin_cidrs",
            "cloud firewalls admit SSH only from the stack's admin networks and there are "
            "none: list the networks you run `pulumi up` from, e.g. admin_cidrs: [203.0.113.0/24]",
        )
    for i, r in regions:
        _cloud_region(m, source, i)
        for j in range(len(r.pool.nodes)):
            _cloud_node(m, source, i, j)
    if any(r.pool.kind == "gcp" for _, r in regions):
        _gcp_labels(m, source)
    _data_disk_mount(m, source)


def _data_disk_mount(m: StackModel, source: str) -> None:
    """Cloud nodes mount their checkpoint disk at the checkpoint root up to its first
    placeholder ({node}, {region}): that must be a directory of its own."""
    from infra.model.checks.runtime import checkpoint_dir_problem
    from infra.model.clouds import HOST_WORK_DIR, checkpoint_mount, checkpoint_root_on_host

    d = m.training.checkpoint.dir
    mount = checkpoint_mount(checkpoint_root_on_host(d, m.stack))
    if mount == HOST_WORK_DIR or HOST_WORK_DIR.startswith(mount + "/"):
        why = "over the agent's own files"
    else:
        problem = checkpoint_dir_problem(mount)
        if problem is None:
            return
        why = f"which {problem}"
    raise err(
        source,
        "training.checkpoint.dir",
        f"'{d}': cloud nodes mount their checkpoint disk at {mount}, {why}; "
        "use e.g. /var/lib/geotrain/checkpoints/{node}",
    )


def _cloud_region(m: StackModel, source: str, i: int) -> None:
    import difflib

    from infra.model.clouds import CLOUDS

    r = m.regions[i]
    c, s, path = CLOUDS[r.pool.kind], r.pool.cloud, f"regions[{i}].pool.cloud"
    if s.region is None:
        raise err(
            source,
            f"{path}.region",
            f"not set: region {r.name} needs the {c.title} region its instances run in, "
            f"e.g. region: {c.regions[0]}",
        )
    if s.region not in c.regions:
        near = difflib.get_close_matches(s.region, c.regions, n=3)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise err(
            source,
            f"{path}.region",
            f"unknown {c.title} region '{s.region}'; {hint}geotrain knows "
            f"{', '.join(c.regions[:8])}, ... ({len(c.regions)} in infra/model/clouds.py)",
        )
    if r.pool.kind == "gcp" and not s.project:
        raise err(
            source,
            f"{path}.project",
            "not set: GCP regions name their project (there is no fall-back to gcloud's "
            "default project); set project: <your-project-id>",
        )
    if s.zone is not None and not s.zone.startswith(s.region):
        raise err(
            source,
            f"{path}.zone",
            f"'{s.zone}' is not a zone of {s.region}; use a zone of that region or drop zone",
        )
    low, high = c.prefix_range
    if not low <= r.subnet.prefixlen <= high:
        raise err(
            source,
            f"regions[{i}].subnet",
            f"{r.subnet}: {c.title} subnets are /{low} to /{high}; pick a subnet in that range",
        )
    if r.pool.kind == "aws" and s.image and not s.image.startswith(("ami-", "ssm:")):
        raise err(
            source,
            f"{path}.image",
            f"'{s.image}' is neither an AMI id (ami-...) nor a public SSM parameter "
            f"(ssm:/aws/service/...); use one of those, or drop image for {c.image.ref}",
        )
    need, what = _image_need(r.pool.kind, s.image, s.image_disk_gb)
    if need is not None and s.disk_gb < need:
        raise err(
            source,
            f"{path}.disk_gb",
            f"{s.disk_gb} GiB is smaller than the image needs ({need} GiB for {what}); "
            f"use disk_gb: {need} or more",
        )
    if s.peering:
        _peering(m, source, i)


def _image_need(kind: str, image: str | None, declared: int | None) -> tuple[int | None, str]:
    from infra.model.clouds import CLOUDS

    default = CLOUDS[kind].image
    if image is None or image == default.ref:
        return default.min_disk_gb, default.description
    return declared, f"image {image} (image_disk_gb)"


def _cloud_node(m: StackModel, source: str, i: int, j: int) -> None:
    from infra.model.clouds import CLOUD_GATEWAY_HOST, CLOUDS

    r = m.regions[i]
    n, c, s = r.pool.nodes[j], CLOUDS[r.pool.kind], r.pool.cloud
    path = f"regions[{i}].pool.nodes[{j}]"
    if "address" in n.model_fields_set:
        raise err(
            source,
            f"{path}.address",
            f"{n.address}: a cloud instance gets its address when it is made; drop address "
            "(the public IP reaches peers and the agent at deploy time)",
        )
    t = c.instance(n.gpu_type, n.gpus)
    if t is None:
        shapes = ", ".join(f"{x.gpus} x {x.gpu_type} ({x.name})" for x in c.instances)
        raise err(
            source,
            f"{path}.gpu_type",
            f"{n.gpus} x {n.gpu_type}: {c.title} has no such instance in geotrain's table; "
            f"use one of {shapes}",
        )
    region = str(s.region)
    offer = t.offers.get(region)
    if offer is None:
        where = ", ".join(t.offers)
        here = [f"{x.gpu_type} ({x.name})" for x in c.instances if region in x.offers]
        alt = f", or a GPU type {region} offers: {', '.join(here)}" if here else ""
        raise err(
            source,
            f"{path}.gpu_type",
            f"{c.title} {region} does not offer {n.gpu_type} ({t.name} is in {where}); "
            f"put region {r.name} in one of those{alt}",
        )
    if s.zone is not None and offer.zones and s.zone not in offer.zones:
        raise err(
            source,
            f"regions[{i}].pool.cloud.zone",
            f"{s.zone} does not offer {t.name}; use one of {', '.join(offer.zones)}",
        )
    gw = r.pool.gateway or r.pool.nodes[0].name
    host = CLOUD_GATEWAY_HOST if n.name == gw else WORKER_HOST_OFFSET + j
    last = r.subnet.num_addresses - 1 - c.reserved_high
    if not c.reserved_low <= host <= last:
        raise err(
            source,
            f"regions[{i}].subnet",
            f"node {n.name} would get {r.subnet[host]}, which {c.title} keeps for itself (the "
            f"first {c.reserved_low} and last {c.reserved_high} of every subnet); use a "
            "larger subnet",
        )


def _peering(m: StackModel, source: str, i: int) -> None:
    r = m.regions[i]
    if r.pool.kind == "gcp":
        raise err(
            source,
            f"regions[{i}].pool.cloud.peering",
            "not on GCP: peered GCP networks exchange subnet routes, so the workers' traffic "
            "would take the peering beside the WireGuard overlay instead of under it; drop it",
        )
    peers = [
        o.name
        for link in m.network.links
        if r.name in (link.a, link.b)
        for o in m.regions
        if o.name in (link.a, link.b)
        and o.name != r.name
        and o.pool.kind == r.pool.kind
        and o.pool.cloud.peering
    ]
    if not peers:
        raise err(
            source,
            f"regions[{i}].pool.cloud.peering",
            f"true, but no region linked to {r.name} is on {r.pool.kind} with peering: true; "
            "peering joins two linked regions of the same cloud: set it on both or drop it",
        )


def _gcp_labels(m: StackModel, source: str) -> None:
    """GCP labels are stricter than tags elsewhere: lowercase keys and values, no dots."""
    for key, value in m.tags.items():
        if not GCP_LABEL_KEY.fullmatch(key) or not GCP_LABEL_VALUE.fullmatch(value.lower()):
            raise err(
                source,
                f"tags.{key}",
                f"{key}: {value!r} cannot be a GCP label (keys start with a lowercase letter; "
                "keys and values hold lowercase letters, digits, '-' and '_'); rename it",
            )
