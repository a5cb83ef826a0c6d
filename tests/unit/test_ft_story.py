"""The fault-tolerance tests' shared check (tests.integration.helpers.trained_on_and_healed)
on hand-written event logs: it must fail on what fault_tolerance promises never happens."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.helpers import trained_on_and_healed

BACK, OTHERS, STEPS, HELD = "bj", ("fra", "sv"), 6, (90.0, 100.0)


Steps = list[tuple[float, int]]
ALL: Steps = [(float(s), s) for s in range(1, 7)]


def _log(sv_steps: Steps, sv_heals: Steps, fra: Steps = ALL, fra_heals: Steps = ()) -> list[Any]:
    log: list[dict[str, Any]] = [
        {"event": "start", "region": r, "t": 0.0, "torchrun_restart": 0} for r in (BACK, *OTHERS)
    ]
    for region, steps, heals in (("fra", fra, fra_heals), ("sv", sv_steps, sv_heals)):
        log += [{"event": "step", "region": region, "t": t, "step": s} for t, s in steps]
        log += [
            {"event": "healed", "region": region, "t": t, "step": s, "phase": "step"}
            for t, s in heals
        ]
    log += [
        {"event": "start", "region": BACK, "t": 101.0, "torchrun_restart": 1},
        {"event": "healed", "region": BACK, "t": 102.0, "step": 4, "phase": "step"},
    ]
    for e in log:
        if e["event"] == "start":
            e.update(torchrun_rank=0, torchrun_group_rank=0)
    log += [
        {"event": "done", "region": r, "t": 200.0, "step": STEPS, "digest": "d"}
        for r in (BACK, *OTHERS)
    ]
    return log


def test_every_step_in_order_passes() -> None:
    log = _log([(float(s), s) for s in range(1, 7)], [])
    assert trained_on_and_healed(log, BACK, OTHERS, STEPS, held=HELD)["step"] == 4


def test_a_skip_after_the_hold_that_ends_in_a_heal_passes() -> None:
    log = _log([(1.0, 1), (2.0, 2), (3.0, 3), (103.0, 5), (104.0, 6)], [(102.5, 4)])
    trained_on_and_healed(log, BACK, OTHERS, STEPS, held=HELD)


@pytest.mark.parametrize(
    ("steps", "heals"),
    [
        ([(1.0, 1), (2.0, 2), (3.0, 3), (103.0, 5), (104.0, 6)], []),  # skip, no heal
        ([(1.0, 1), (3.0, 3), (4.0, 4), (5.0, 5), (6.0, 6)], [(2.5, 2)]),  # before the hold
        ([(1.0, 1), (2.0, 2), (3.0, 3), (103.0, 3), (104.0, 4)], [(102.5, 2)]),  # repeat
        ([(1.0, 1), (2.0, 2), (3.0, 3)], []),  # never reached the end
    ],
    ids=["skip-without-heal", "skip-before-the-hold", "repeated-step", "short"],
)
def test_what_fault_tolerance_never_does_fails(
    steps: list[tuple[float, int]], heals: list[tuple[float, int]]
) -> None:
    with pytest.raises(AssertionError):
        trained_on_and_healed(_log(steps, heals), BACK, OTHERS, STEPS, held=HELD)


def test_churn_a_late_heal_or_both_survivors_skipping_fails() -> None:
    churn = [(1.0, 1), (2.0, 2), (103.0, 4), (110.0, 6)]  # left out and healing every round
    late = [(1.0, 1), (2.0, 2), (3.0, 3), (503.0, 5), (504.0, 6)]  # a heal long after waking
    both = [(1.0, 1), (2.0, 2), (3.0, 3), (103.0, 5), (104.0, 6)]
    for log in (
        _log(churn, [(102.5, 3), (109.0, 5)]),
        _log(late, [(502.0, 4)]),
        _log(both, [(102.5, 4)], fra=both, fra_heals=[(102.5, 4)]),
    ):
        with pytest.raises(AssertionError):
            trained_on_and_healed(log, BACK, OTHERS, STEPS, held=HELD)
