"""`geotrain validate` hints: settings that are valid but that the run will not use."""

from __future__ import annotations

from infra.model.schema import StackModel


def idle_settings(m: StackModel) -> list[str]:
    """`geotrain validate` hints for settings the run will not use: valid, but a user who
    set them expected an effect."""
    t = m.training
    d = t.diloco
    out = []
    if t.sync == "allreduce" and d != type(d)():
        out.append(
            "hint: training.diloco is set but sync is allreduce, which does not use it; "
            "set sync: diloco to merge periodically"
        )
    elif d.mix > 0 and d.tau == 0:
        out.append(
            f"hint: training.diloco.mix {d.mix:g} has no effect with tau 0 (a merge lands at "
            "once, with no local progress since its send to keep); set tau, or drop mix"
        )
    if t.parallel.shard == "fsdp":
        one = [r.name for r in m.regions if sum(n.gpus for n in r.pool.nodes) == 1]
        if one:
            out.append(
                f"hint: parallel.shard fsdp has nothing to shard over in {', '.join(one)} (one "
                "worker per region): each rank still holds the whole model; give the regions "
                "more workers, or drop parallel"
            )
    from infra.model.clouds import CLOUD_KINDS

    for i, r in enumerate(m.regions):
        uses = {
            "ssh": r.pool.kind == "ssh" or r.pool.kind in CLOUD_KINDS,
            "kubernetes": r.pool.kind == "kubernetes",
            "cloud": r.pool.kind in CLOUD_KINDS,
        }
        for key, used in uses.items():
            value = getattr(r.pool, key)
            if not used and value != type(value)():
                out.append(
                    f"hint: regions[{i}].pool.{key} is set but pools of kind {r.pool.kind} "
                    "do not use it"
                )
    every = d.every_steps
    first = d.inner_steps_start or every  # the first round (a ramp starts shorter)
    inner = t.steps - d.warmup_steps
    if t.sync == "diloco" and first is not None and first >= inner:
        key = "inner_steps_start" if d.inner_steps_start else "inner_steps"
        out.append(
            f"hint: training.diloco.{key} {first} is not below the {inner} steps after the "
            "warm-up: the regions merge once, at the end, and train apart until then; set "
            f"it to {max(1, inner // 10)} or so for ten merges"
        )
    ft = t.fault_tolerance
    if ft is not None and ft.replicas(len(m.regions)) == len(m.regions):
        R = len(m.regions)
        out.append(
            f"hint: training.fault_tolerance needs all {R} regions in a quorum (min_replicas "
            f"{R}): losing any region stops the others too, until it is back; with 3 or more "
            "regions a majority trains on (below a majority, regions cut apart train apart)"
        )
    if t.checkpoint.interval_steps >= t.steps:
        out.append(
            f"hint: training.checkpoint.interval_steps {t.checkpoint.interval_steps} is not "
            f"below steps ({t.steps}): the run saves no checkpoint before its end, so a "
            "restart begins again at step 0"
        )
    return out
