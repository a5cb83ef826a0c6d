"""The training job: data shards in their jurisdiction, DiLoCo and streaming cadence,
compression, secure aggregation, exchange, and (through fault_tolerance) quorums."""

from __future__ import annotations

from infra.model.checks import fault_tolerance
from infra.model.checks.common import err
from infra.model.schema import StackModel
from training.spec import (
    SCAFFOLD_STREAMING,
    adaptive_problems,
    exchange_conflict,
    growing_h_problem,
)


def shards(m: StackModel, source: str) -> None:
    seen: set[str] = set()
    for i, s in enumerate(m.training.data_shards):
        if s.name in seen:
            raise err(source, f"training.data_shards[{i}].name", f"duplicate shard '{s.name}'")
        seen.add(s.name)
        try:
            region = m.region(s.region)
        except KeyError:
            raise err(
                source,
                f"training.data_shards[{i}].region",
                f"unknown region '{s.region}'; use one of {', '.join(r.name for r in m.regions)}",
            ) from None
        if region.jurisdiction != s.jurisdiction:
            ok = [r.name for r in m.regions if r.jurisdiction == s.jurisdiction]
            hint = f"place it in {' or '.join(ok)}" if ok else "add a region in that jurisdiction"
            raise err(
                source,
                f"training.data_shards[{i}].region",
                f"shard '{s.name}' is "
                f"{s.jurisdiction} data but region {s.region} is in "
                f"{region.jurisdiction}; data must stay in its jurisdiction: {hint}",
            )
        if not (s.uri == "pydoc-topics:auto" or s.uri.startswith(("file:", "tokens:"))):
            raise err(
                source,
                f"training.data_shards[{i}].uri",
                f"unsupported uri '{s.uri}'; use pydoc-topics:auto, file:/path/to/text or "
                "tokens:/prepared/dir (geotrain data prepare)",
            )
        if s.uri.strip() in ("file:", "file:.", "file:./"):  # every .txt under the launch dir
            raise err(
                source,
                f"training.data_shards[{i}].uri",
                f"'{s.uri}' names the launch directory, and the shard would take every .txt "
                "under it; give the shard's own file or directory, e.g. file:/data/cn",
            )
    have = {s.region for s in m.training.data_shards}
    for i, r in enumerate(m.regions):
        if r.name not in have:  # its workers would stop at start, after the deployment
            raise err(
                source,
                "training.data_shards",
                f"region {r.name} (regions[{i}]) has no data shard and its workers train on "
                f"their region's data only: add {{name: ..., jurisdiction: {r.jurisdiction}, "
                f"region: {r.name}}}",
            )


def settings(m: StackModel, source: str) -> None:
    d = m.training.diloco
    if d.inner_steps is not None and d.interval_minutes is not None:
        raise err(source, "training.diloco", "set inner_steps or interval_minutes, not both")
    if d.interval_minutes is not None and d.interval_minutes <= 0:
        raise err(source, "training.diloco.interval_minutes", f"{d.interval_minutes} must be > 0")
    if d.warmup_steps >= m.training.steps:
        fix = (
            "lower it or use sync: allreduce"
            if m.training.sync == "diloco"
            else "lower it, or drop training.diloco (sync: allreduce does not use it)"
        )
        raise err(
            source,
            "training.diloco.warmup_steps",
            f"{d.warmup_steps} must be < training.steps ({m.training.steps}): DiLoCo would "
            f"never start; {fix}",
        )
    streaming = d.fragments > 1 or d.tau > 0
    problem = growing_h_problem(
        d.every_steps, d.inner_steps_start, streaming, d.inner_steps_start_for
    )
    if problem:
        key = "inner_steps_start_for" if problem.startswith("inner_steps_start_for") else ""
        raise err(source, f"training.diloco.{key or 'inner_steps_start'}", problem)
    _streaming(m, source)
    _secure_aggregation(m, source)
    _adaptive(m, source)
    _exchange(m, source)
    fault_tolerance.check(m, source)


def _exchange(m: StackModel, source: str) -> None:
    c = m.training.compression
    x = m.training.exchange
    conflict = exchange_conflict(
        x, secure_aggregation=c.secure_aggregation, adaptive=c.adaptive is not None
    )
    if conflict:
        raise err(source, "training.exchange", f"{x} {conflict}")


def _adaptive(m: StackModel, source: str) -> None:
    """The launch spec's own checks (training.spec.adaptive_problems), with the stack path."""
    c, path = m.training.compression, "training.compression.adaptive"
    if c.adaptive is None:
        return
    a = c.adaptive
    for key, message in adaptive_problems(a):
        raise err(source, f"{path}.{key}", message)
    if c.secure_aggregation:
        raise err(
            source,
            path,
            "cannot be combined with secure_aggregation (the masked stage needs one "
            "quantizer every region agreed on); drop one of them",
        )
    if c.quantize not in a.quantize:
        raise err(
            source,
            "training.compression.quantize",
            f"'{c.quantize}' (the codec before the first measurement) must be one of "
            f"adaptive.quantize {list(a.quantize)}",
        )


def _streaming(m: StackModel, source: str) -> None:
    """Streaming DiLoCo needs step-based merges, a step per fragment, and tau < H."""
    d = m.training.diloco
    if d.fragments == 1 and d.tau == 0:
        return
    if d.drift_correction != "none":
        raise err(source, "training.diloco.drift_correction", SCAFFOLD_STREAMING)
    h = d.every_steps
    if h is None:
        raise err(
            source,
            "training.diloco",
            "fragments/tau need step-based merges; set inner_steps instead of interval_minutes",
        )
    if d.fragments > h:
        raise err(
            source,
            "training.diloco.fragments",
            f"{d.fragments} must be <= inner_steps ({h}): each fragment merges on its own step",
        )
    if d.tau >= h:
        raise err(
            source,
            "training.diloco.tau",
            f"{d.tau} must be < inner_steps ({h}): a fragment's merge must land before its next",
        )
    if d.fragments > 1:
        from training.models.deepseek import sync_bucket_count  # torch: only for streaming stacks

        t = m.training
        count = sync_bucket_count(t.model, t.bucket_mb)
        if d.fragments > count:
            raise err(
                source,
                "training.diloco.fragments",
                f"{d.fragments} is more than the {count} sync buckets of {t.model} at "
                f"bucket_mb {t.bucket_mb:g} (a fragment is whole buckets); lower fragments "
                f"to <= {count}, or lower training.bucket_mb",
            )
    if m.training.sync == "diloco" and m.training.balance == "throughput":
        raise err(
            source,
            "training.balance",
            "throughput weights each merge by the samples of its interval, which streaming "
            "fragments (fragments/tau) do not share; set training.balance: off, or "
            "fragments: 1 and tau: 0",
        )


def _secure_aggregation(m: StackModel, source: str) -> None:
    """Masks add integers, and with 2 regions the sum less one's own is the other's."""
    c, path = m.training.compression, "training.compression.secure_aggregation"
    if not c.secure_aggregation:
        return
    if c.quantize not in ("int8", "int4"):
        raise err(
            source,
            path,
            f"needs quantize int8 or int4 (masks add integers), not '{c.quantize}'; "
            "set training.compression.quantize: int8",
        )
    if len(m.regions) < 3:
        raise err(
            source,
            path,
            f"hides nothing with {len(m.regions)} regions (the sum less a region's own "
            "contribution is the other's); use 3 or more regions, or set it false",
        )
