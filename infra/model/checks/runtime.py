"""What the runtime could not run with although each field accepts it: checkpoint and key
paths, placeholders, the seed, metrics ports on a one-machine stack."""

from __future__ import annotations

from infra.model.checks.common import err
from infra.model.paths import AGENT_ETC_FILES
from infra.model.schema import StackModel
from training.spec import PLACEHOLDERS

SYSTEM_TREES: tuple[str, ...] = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64")
SYSTEM_TREES += ("/libx32", "/proc", "/sbin", "/sys", "/usr")
"""Absolute checkpoint dirs refused anywhere under these: the system's own files."""
SHARED_DIRS: tuple[str, ...] = ("/", "/data", "/home", "/media", "/mnt", "/opt", "/root")
SHARED_DIRS += ("/run", "/snap", "/srv", "/tmp", "/var", "/var/lib", "/var/tmp")
"""Absolute checkpoint dirs refused as they are (a directory under them is fine): other
users' and programs' files live there."""


def checkpoint_dir_problem(template: str) -> str | None:
    """Why `template` (training.checkpoint.dir) cannot be a checkpoint root, or None. The
    root is geotrain's: the host agent makes it the service user's with mode 0750 and
    `geotrain train --fresh` deletes checkpoints in it, so it must be a directory of its
    own, never the launch directory, one above it or a system directory."""
    return _path_problem(template, file=False)


def key_file_problem(template: str) -> str | None:
    """Why `template` (training.key_file) cannot hold the run key, or None: the host agent
    writes the key there (replacing what is there), so never a system file or one of the
    files it manages; directly in /etc/geotrain is fine (the global stack's
    /etc/geotrain/run.key)."""
    return _path_problem(template, file=True)


def _path_problem(template: str, file: bool) -> str | None:
    d = template
    if not d.strip():
        return "is empty" + ("" if file else ": the launch directory")
    if d.startswith("~"):
        return "starts with '~', which is not expanded"
    if file and d.endswith("/"):
        return "ends with '/': it names a directory, not a file"
    probe = d
    for known in PLACEHOLDERS:
        probe = probe.replace(known, "x")
    parts = probe.split("/")
    if ".." in parts:
        return "climbs out with '..'"
    real = [p for p in parts if p not in ("", ".")]
    if not real:
        return "is the filesystem root" if d.startswith("/") else "is the launch directory"
    if d.startswith("/"):
        path = "/" + "/".join(real)
        if file and real[:2] == ["etc", "geotrain"] and len(real) == 3:  # geotrain's own
            taken = real[2] in AGENT_ETC_FILES  # a key file there takes another name
            return f"is the host agent's {path}" if taken else None
        if any(path == t or path.startswith(t + "/") for t in SYSTEM_TREES):
            return f"is in /{real[0]}: system files"
        if path in SHARED_DIRS:
            return f"is {path} itself: others' files"
    return None


def check(m: StackModel, source: str) -> None:
    """Settings each field accepts but the runtime could not run with."""
    t, mon = m.training, m.monitoring
    problem = checkpoint_dir_problem(t.checkpoint.dir)
    if problem is not None:
        raise err(
            source,
            "training.checkpoint.dir",
            f"'{t.checkpoint.dir}' {problem}; use a directory of its own (geotrain owns it: "
            "mode 0750, --fresh empties it), e.g. /var/lib/geotrain/checkpoints",
        )
    problem = key_file_problem(t.key_file)
    if problem is not None:
        raise err(
            source,
            "training.key_file",
            f"'{t.key_file}' {problem}; hosts write the run key there, replacing what is "
            "there: give a file of its own, e.g. .geotrain/{stack}/run.key",
        )
    rest = t.checkpoint.dir
    for known in PLACEHOLDERS:
        rest = rest.replace(known, "")
    if "{" in rest or "}" in rest:
        raise err(
            source,
            "training.checkpoint.dir",
            f"'{t.checkpoint.dir}' has a placeholder the runtime does not fill in; "
            "use only {stack}, {node} and {region}",
        )
    if not 0 <= t.seed < 2**32:
        raise err(
            source,
            "training.seed",
            f"{t.seed} is outside 0-{2**32 - 1}; the runtime seeds each rank's data order "
            "with seed * 1000 + rank, which must fit in 64 bits",
        )
    if mon.metrics_port and any(r.pool.kind == "local" for r in m.regions):
        # one machine: every worker serves on metrics_port + its global rank
        world = sum(n.gpus for r in m.regions for n in r.pool.nodes)
        span = range(mon.metrics_port, mon.metrics_port + world)
        for key in type(mon).model_fields:
            port = getattr(mon, key)
            if key.endswith("_port") and key != "metrics_port" and port in span:
                raise err(
                    source,
                    f"monitoring.{key}",
                    f"{port} collides with the runtime metrics ports {span.start}-"
                    f"{span.stop - 1} (on a local stack every worker takes metrics_port + "
                    "its rank); move one of them",
                )
