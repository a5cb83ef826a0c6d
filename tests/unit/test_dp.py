"""Record-level differential privacy per region (training/privacy/dpsgd.py): the accountant
against Opacus's, per-record clipping, the noise, Poisson sampling, the stack key, the
launch spec, metrics and report, and the dp-required policy. The all-rank stop on a spent
budget runs on real processes in tests/integration/test_privacy_run.py."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from prometheus_client import generate_latest
from pulumi_policy import ResourceValidationArgs

from infra.facts import training_facts
from infra.model import load_stack
from infra.model.schema import Policy
from infra.plan import build_plan
from infra.render.runtime import render_launch_spec
from policies.rules import ALL, TRAINING, config_from_policy_settings
from policies.runner import _opts
from training.comm.topology import Topology
from training.errors import ConfigError, SpecError
from training.models.deepseek import DeepSeekLM, ModelConfig
from training.observe import metric_names as mn
from training.observe.metrics import RuntimeMetrics
from training.observe.report import EventLog, format_report, summarize
from training.privacy.dpsgd import (
    Budget,
    PoissonLoader,
    RegionPrivacy,
    calibrate,
    epsilon_floor,
    private_backward,
)
from training.spec import LaunchSpec, PrivacySpec
from training.testing import make_spec

SPEC = PrivacySpec(target_epsilon=4.0, delta=1e-6, max_grad_norm=1.0)


def _opacus_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    acc = RDPAccountant()
    acc.history = list(history)
    return float(acc.get_epsilon(delta))


# -- accounting -----------------------------------------------------------------------
def test_calibrated_noise_multiplier_is_opacus_and_spends_just_the_target() -> None:
    q, steps = 16 / 300_000, 200
    sigma = calibrate(SPEC, q, steps)
    assert sigma == get_noise_multiplier(
        target_epsilon=4.0, target_delta=1e-6, sample_rate=q, steps=steps, accountant="rdp"
    )
    eps = _opacus_epsilon([(sigma, q, steps)], 1e-6)
    assert 4.0 - 0.05 <= eps <= 4.0
    assert calibrate(PrivacySpec(4.0, 1e-6, 1.0, noise_multiplier=0.9), q, steps) == 0.9


def test_epsilon_grows_with_steps_and_matches_opacus_across_segments() -> None:
    b = Budget(SPEC, sigma=0.8, rate=0.01)
    seen = []
    for _ in range(30):
        b.record()
        seen.append(b.epsilon())
    assert seen == sorted(seen) and seen[0] < seen[-1]
    assert b.history == [(0.8, 0.01, 30)]
    # a restart with other settings opens a segment; epsilon composes both
    b2 = Budget(SPEC, sigma=1.2, rate=0.02, history=list(b.history))
    for _ in range(10):
        b2.record()
    assert b2.history == [(0.8, 0.01, 30), (1.2, 0.02, 10)]
    assert b2.epsilon() == pytest.approx(_opacus_epsilon(b2.history, 1e-6), rel=1e-9)
    assert b2.epsilon(5) == pytest.approx(
        _opacus_epsilon([*b2.history, (1.2, 0.02, 5)], 1e-6), rel=1e-9
    )


def test_budget_limit_is_the_last_step_within_the_target() -> None:
    p = PrivacySpec(target_epsilon=2.0, delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0)
    b = Budget(p, sigma=1.0, rate=0.02)
    n = b.limit(10_000)
    assert 0 < n < 10_000
    assert _opacus_epsilon([(1.0, 0.02, n)], 1e-5) <= 2.0
    assert _opacus_epsilon([(1.0, 0.02, n + 1)], 1e-5) > 2.0
    assert b.limit(n // 2) == n // 2  # planned steps within the budget: run them all
    b.history = [(1.0, 0.02, n)]  # resumed with the budget spent: no step left
    assert b.limit(10_000) == n


# -- per-record clipping and noise ----------------------------------------------------
def _tiny_moe() -> DeepSeekLM:
    torch.manual_seed(0)
    c = ModelConfig(dim=32, layers=2, heads=2, kv_rank=8, nope_dim=8, rope_dim=8, v_dim=8)
    return DeepSeekLM(ModelConfig(**{**c.__dict__, "experts": 4, "expert_dim": 32}))


def test_per_record_gradients_are_exact_through_moe_routing() -> None:
    """Without clipping, the sum of per-record gradients is B x the batch-mean gradient,
    even though the MoE routes tokens of all records together."""
    m = _tiny_moe()
    params = list(m.parameters())
    tokens = torch.randint(0, 256, (3, 17))
    total, _ = private_backward(params, tokens, m.loss, max_norm=1e9)
    m.zero_grad()
    m.loss(tokens).backward()
    batch = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )
    torch.testing.assert_close(total, 3 * batch, rtol=1e-4, atol=1e-6)


def test_a_record_with_a_huge_gradient_moves_the_sum_by_at_most_the_clip_norm() -> None:
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 1, bias=False)

    def loss_of(rec: torch.Tensor) -> torch.Tensor:
        x = rec[:, :4].float()
        return (lin(x) - rec[:, 4:].float()).pow(2).mean()

    normal = torch.randint(0, 3, (5, 5))
    outlier = torch.tensor([[1000, 1000, 1000, 1000, -100000]])
    C = 0.5
    without, _ = private_backward(list(lin.parameters()), normal, loss_of, C)
    with_, _ = private_backward(list(lin.parameters()), torch.cat([normal, outlier]), loss_of, C)
    assert (with_ - without).norm() <= C * (1 + 1e-5)
    assert (with_ - without).norm() >= C * 0.99  # clipped to C, not dropped


def _privacy(local_size: int = 1, sigma: float = 2.0) -> RegionPrivacy:
    spec = make_spec(regions=1, local=local_size, batch_size=4, seq_len=16, steps=10)
    r = spec.regions[0]
    spec = LaunchSpec(
        **{
            **spec.__dict__,
            "regions": [type(r)(**{**r.__dict__, "privacy": PrivacySpec(8.0, 1e-6, 1.5, sigma)})],
        }
    )
    text = bytes(range(256)) * 64  # 16 KiB
    p = RegionPrivacy.for_rank(spec, Topology.of(spec, 0), text, torch.device("cpu"))
    assert p is not None
    return p


def test_noise_has_std_sigma_c_over_sqrt_l_per_rank_divided_by_the_batch() -> None:
    """Each of L ranks adds N(0, sigma^2 C^2 / L): the region's sum carries sigma x C."""
    p = _privacy(local_size=4, sigma=2.0)
    lin = torch.nn.Linear(500, 100)
    empty = torch.zeros((0, 17), dtype=torch.long)  # an empty Poisson sample: noise only
    loss = p.clipped_noisy_grads(lin, empty, lambda t: lin(t.float()).sum())
    assert math.isnan(loss)
    grads = torch.cat([q.grad.reshape(-1) for q in lin.parameters() if q.grad is not None])
    expect = 2.0 * 1.5 / math.sqrt(4) / 4  # sigma C / sqrt(L) / B
    assert grads.std().item() == pytest.approx(expect, rel=0.05)


def test_poisson_sampling_partitions_windows_between_ranks_and_resumes_exactly() -> None:
    data = torch.arange(250, dtype=torch.uint8)  # a window's first byte is its start
    g = [torch.Generator().manual_seed(s) for s in (1, 2)]
    loaders = [PoissonLoader(data, 8, 0.2, rank, 2, g[rank]) for rank in (0, 1)]
    sizes = []
    for _ in range(40):
        starts = [ld.next()[:, 0].tolist() for ld in loaders]
        sizes.append(sum(len(s) for s in starts))
        for rank, s in enumerate(starts):
            assert len(set(s)) == len(s) and all(x % 2 == rank for x in s)
    mean = sum(sizes) / len(sizes)
    assert 0.2 * 241 * 0.85 < mean < 0.2 * 241 * 1.15  # q x N windows per region
    state = loaders[0].state_dict()
    a = loaders[0].next()
    loaders[0].load_state_dict(state)
    assert torch.equal(loaders[0].next(), a)


def test_window_starts_of_a_rank_stay_its_own() -> None:
    data = torch.zeros(200, dtype=torch.uint8)
    data[::2] = 1  # odd starts read 0 first, even starts 1
    ld = PoissonLoader(data, 4, 0.5, 1, 2, torch.Generator().manual_seed(0))
    assert ld.windows == len(range(1, 195, 2))
    assert set(ld.next()[:, 0].tolist()) == {0}  # rank 1 of 2 draws only odd starts


def test_privacy_state_round_trips_history_and_noise() -> None:
    p = _privacy()
    p.budget.record()
    p.budget.record()
    state = p.state_dict()
    a = torch.normal(0.0, 1.0, (5,), generator=p.noise)
    q = _privacy()
    q.load_state_dict(state)
    assert q.budget.history == p.budget.history == [(2.0, p.budget.rate, 2)]
    assert torch.equal(torch.normal(0.0, 1.0, (5,), generator=q.noise), a)


def test_two_ranks_never_share_a_noise_stream() -> None:
    assert not torch.equal(
        torch.normal(0.0, 1.0, (8,), generator=_privacy().noise),
        torch.normal(0.0, 1.0, (8,), generator=_privacy().noise),
    )


# -- stack, spec, metrics, report ------------------------------------------------------
def _with_privacy(value: Any) -> Any:
    def mutate(cfg: dict[str, Any]) -> None:
        cfg["geotrain:regions"][0]["privacy"] = value

    return mutate


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"target_epsilon": 0}, "privacy.target_epsilon"),
        ({"target_epsilon": 4, "delta": 1.0}, "privacy.delta"),
        ({"target_epsilon": 4, "delta": 0}, "privacy.delta"),
        ({"target_epsilon": 4, "max_grad_norm": 0}, "privacy.max_grad_norm"),
        ({"delta": 1e-6}, "privacy.target_epsilon"),
    ],
)
def test_invalid_privacy_settings_name_the_key(write_stack: Any, value: Any, path: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_stack(str(write_stack("local", _with_privacy(value))))
    assert f"geotrain:regions[0].{path}" in str(e.value)


def test_a_target_epsilon_no_noise_reaches_is_refused_at_validate_and_by_the_worker(
    write_stack: Any,
) -> None:
    floor = epsilon_floor(1e-6, 10)
    assert 0.1 < floor < 0.2  # the accountant's orders and delta, not the data
    with pytest.raises(ConfigError, match=r"privacy.target_epsilon: 0.1 is below 0.141,"):
        load_stack(str(write_stack("local", _with_privacy({"target_epsilon": 0.1}))))
    load_stack(str(write_stack("local", _with_privacy({"target_epsilon": 0.1, "delta": 0.5}))))
    load_stack(str(write_stack("local", _with_privacy({"target_epsilon": 0.141}))))  # as named
    spec = make_spec(regions=1, local=1, batch_size=4, seq_len=16, steps=10)
    r = spec.regions[0]
    low = type(r)(**{**r.__dict__, "privacy": PrivacySpec(0.1, 1e-6, 1.0, None)})
    spec = LaunchSpec(**{**spec.__dict__, "regions": [low]})
    with pytest.raises(SpecError, match=r"region .*target_epsilon 0.1 .*floor is 0.141\)"):
        RegionPrivacy.for_rank(spec, Topology.of(spec, 0), bytes(4096), torch.device("cpu"))


def test_privacy_settings_reach_the_launch_spec_and_survive_json(write_stack: Any) -> None:
    m = load_stack(str(write_stack("local", _with_privacy({"target_epsilon": 4}))))
    spec = render_launch_spec(build_plan(m))
    assert spec.regions[0].privacy == PrivacySpec(4.0, 1e-6, 1.0, None)
    assert spec.regions[1].privacy is None
    assert LaunchSpec.from_json(spec.to_json()) == spec


def test_epsilon_is_exported_per_region_only_with_dp() -> None:
    m = RuntimeMetrics("beijing", "bj-0", 0)
    assert mn.PRIVACY_EPSILON + "{" not in generate_latest(m.registry).decode()
    m.privacy(1.25, 4.0)
    text = generate_latest(m.registry).decode()
    assert f'{mn.PRIVACY_EPSILON}{{node="bj-0",rank="0",region="beijing"}} 1.25' in text


def _eps(e: float) -> dict[str, float]:
    return {"epsilon": e, "epsilon_target": 4, "delta": 1e-6}


def test_report_shows_epsilon_per_region_and_the_budget_stop(tmp_path: Any) -> None:
    path = tmp_path / "events.jsonl"
    lines = [
        {"event": "start", "params": 10, "world": 2, "regions": 2, "t": 0},
        *[
            {
                "event": "step",
                "region": r,
                "step": s,
                "loss": 2.0,
                "t": s,
                "cross_wire": 1,
                "cross_raw": 4,
                "sync_s": 0.1,
                "step_s": 1.0,
                **(
                    {"epsilon": 0.5 * s, "epsilon_target": 4, "delta": 1e-6}
                    if r == "beijing"
                    else {}
                ),
            }
            for s in (1, 2, 3)
            for r in ("beijing", "frankfurt")
        ],
        {"event": "privacy_budget_spent", "step": 3, "stopped_by": "beijing", "t": 4},
    ]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    r = summarize(EventLog(path), 3)
    assert r["privacy"]["epsilon_per_region"] == {
        "beijing": {"epsilon": 1.5, "epsilon_target": 4, "delta": 1e-6}
    }
    text = format_report(r)
    assert "beijing 1.50/4 (delta 1e-06)" in text
    assert "beijing spent its budget: stopped at step 3" in text


# -- the dp-required policy ------------------------------------------------------------
POLICY = {p.name: p for p in ALL}
GLOBAL = build_plan(load_stack("global"))


def _dp_violations(privacy: dict[str, Any], config: dict[str, Any]) -> list[str]:
    f = copy.deepcopy(training_facts(GLOBAL))
    f["privacy"].update(privacy)
    out: list[str] = []
    args = ResourceValidationArgs(TRAINING, {"facts": f}, "urn:t", "t", _opts(), None, config)
    POLICY["dp-required"].validate(args, lambda msg, urn=None: out.append(msg))  # type: ignore[operator]
    return out


def test_dp_required_passes_by_default_and_when_the_jurisdiction_trains_with_dp() -> None:
    assert _dp_violations({}, {}) == []  # nothing required by default
    cn = {"beijing": {"target_epsilon": 4.0, "delta": 1e-6}}
    assert _dp_violations(cn, {"requiredFor": ["CN"], "maxEpsilon": 8}) == []


def test_dp_required_fails_a_required_jurisdiction_without_dp_and_an_epsilon_over_the_cap() -> None:
    [msg] = _dp_violations({}, {"requiredFor": ["EU"]})
    assert "region frankfurt (EU) trains without differential privacy" in msg
    eu = {"frankfurt": {"target_epsilon": 10.0, "delta": 1e-6}}
    [msg] = _dp_violations(eu, {"requiredFor": ["EU"], "maxEpsilon": 8})
    assert "targets epsilon 10, above the cap 8" in msg


def test_policy_settings_configure_dp_required() -> None:

    cfg = config_from_policy_settings(Policy(dp_required_for=["CN"], max_dp_epsilon=4).model_dump())
    assert cfg["dp-required"] == {"requiredFor": ["CN"], "maxEpsilon": 4}
