"""Record-level differential privacy inside each region: DP-SGD (Abadi et al. 2016,
"Deep Learning with Differential Privacy", Algorithm 1) with Opacus's RDP accountant.

A record is one training window (seq_len + 1 bytes) of the region's data. Per step, each
rank of the region:
  1. draws a Poisson sample of the region's windows (`PoissonLoader`), the sampling the
     accountant assumes;
  2. computes each record's gradient on its own (a backward pass per record: see
     `private_backward` for why not Opacus's GradSampleModule), clips it to norm C and
     sums;
  3. adds Gaussian noise N(0, sigma^2 C^2 / L) to its sum and divides by the expected
     batch per rank B.
The region's reduce-scatter then sums the L ranks: (sum of clipped grads + N(0, sigma^2
C^2)) / B, averaged over L ranks = the Gaussian mechanism on the region's batch of expected
size L x B, with noise std sigma x C (the variances of L independent draws add up). Only
that region sum, or pseudo-gradients made from it (diloco), crosses the border:
everything downstream (the codec, other regions, the outer step) is post-processing under
the region's budget.

The sampling and noise generators are seeded from os.urandom, never from the run key or
the stack's seed (every region holds the key; anyone who could replay the noise could
subtract it), and their states live in the node's own checkpoint: a step redone after a
restart draws the same sample and noise, so it releases the same bytes again and costs
nothing more. torch's generators are not cryptographically secure (Opacus's secure_mode
needs torchcsprng); see docs/privacy.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from training.comm.topology import Topology
from training.data.loader import Position
from training.errors import DataError, PrivacyBudgetSpent, SpecError
from training.spec import LaunchSpec, PrivacySpec

# Opacus is imported where it is used: it pulls in scipy (about a second per worker
# start), which runs without DP never need.


def _orders() -> list[float]:
    """Renyi orders the accountant tracks (Opacus's defaults)."""
    from opacus.accountants import RDPAccountant

    return list(RDPAccountant.DEFAULT_ALPHAS)


Segment = tuple[float, float, int]
"""(noise multiplier, sample rate, steps): Opacus's accountant history entry."""


# -- accounting -----------------------------------------------------------------------
def _sigma(p: PrivacySpec, rate: float, steps: int, region: str) -> float:
    try:
        return calibrate(p, rate, steps)
    except ValueError as e:  # Opacus: "The privacy budget is too low."
        floor = epsilon_floor(p.delta, steps)
        raise SpecError(
            f"region {region}: no noise multiplier reaches target_epsilon "
            f"{p.target_epsilon:g} at delta {p.delta:g} over {steps} steps ({e}; the "
            f"accountant's floor is {math.ceil(floor * 1000) / 1000:g}); raise "
            "regions[].privacy.target_epsilon "
            "or delta"
        ) from None


def calibrate(p: PrivacySpec, sample_rate: float, steps: int) -> float:
    """Noise multiplier sigma: the spec's fixed one, or the smallest (to 0.01 epsilon) that
    keeps `steps` steps at `sample_rate` within target_epsilon (Opacus, RDP)."""
    if p.noise_multiplier is not None:
        return p.noise_multiplier
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=p.target_epsilon,
            target_delta=p.delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant="rdp",
        )
    )


def epsilon_floor(delta: float, steps: int) -> float:
    """The smallest target_epsilon `calibrate` can reach at `delta` over `steps` steps:
    epsilon at the largest noise multiplier Opacus's search tries, at sample rate 1 (any
    smaller rate spends less). It comes from the accountant's Renyi orders and delta, not
    from the data (about 0.14 at delta 1e-6); below it Opacus finds no noise multiplier."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.utils import MAX_SIGMA

    sigma = 20.0
    while 2 * sigma <= MAX_SIGMA:  # get_noise_multiplier's doublings from 20
        sigma *= 2
    accountant = RDPAccountant()
    accountant.history = [(sigma, 1.0, steps)]
    with warnings.catch_warnings():  # "optimal order is the largest alpha": it is, here
        warnings.simplefilter("ignore", UserWarning)
        return float(accountant.get_epsilon(delta=delta))


@dataclass
class Budget:
    """Epsilon spent by one region: the RDP of every step so far, at each Renyi order,
    converted to (epsilon, delta). RDP adds up over steps, so a step costs one vector add."""

    spec: PrivacySpec
    sigma: float
    """Noise multiplier of this start's steps."""
    rate: float
    """Sample rate q of this start's steps."""
    history: list[Segment] = field(default_factory=list)
    """Steps taken so far, as segments (a restart with other settings opens a new one)."""

    def __post_init__(self) -> None:
        self._unit = _rdp(self.sigma, self.rate)

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.history)

    def epsilon(self, extra: int = 0) -> float:
        """Epsilon after the recorded steps and `extra` more at (sigma, rate)."""
        rdp = extra * self._unit
        for sigma, q, n in self.history:
            same = (sigma, q) == (self.sigma, self.rate)
            rdp = rdp + n * (self._unit if same else _rdp(sigma, q))
        if not np.any(rdp):
            return 0.0
        from opacus.accountants.analysis.rdp import get_privacy_spent

        eps, _ = get_privacy_spent(orders=_orders(), rdp=rdp, delta=self.spec.delta)
        return float(eps)

    def record(self) -> None:
        """One more step at (sigma, rate)."""
        if self.history and self.history[-1][:2] == (self.sigma, self.rate):
            s, q, n = self.history[-1]
            self.history[-1] = (s, q, n + 1)
        else:
            self.history.append((self.sigma, self.rate, 1))

    def limit(self, planned: int) -> int:
        """The most total steps (<= planned) whose epsilon stays within the target."""
        done = self.steps
        if self.epsilon(0) > self.spec.target_epsilon:
            return done
        lo, hi = 0, max(0, planned - done)  # extra steps: lo fits, find the largest
        if self.epsilon(hi) <= self.spec.target_epsilon:
            return done + hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.epsilon(mid) <= self.spec.target_epsilon else (lo, mid)
        return done + lo


def _rdp(sigma: float, rate: float) -> np.ndarray:
    """RDP of one subsampled Gaussian step at every order (Opacus's analysis)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    return np.asarray(compute_rdp(q=rate, noise_multiplier=sigma, steps=1, orders=_orders()))


# -- sampling -------------------------------------------------------------------------
@dataclass
class PoissonLoader(Position):
    """Poisson sampling of a region's windows for one of its L ranks. The region's N window
    starts are dealt round-robin to its ranks; a rank takes each of its own starts
    independently with probability `rate`, so the region's batch is a Poisson sample of
    rate q (expected size q x N = L x batch). Same interface as training.data.ByteLoader;
    batches vary in size (possibly 0)."""

    data: torch.Tensor  # (N + seq_len + 1,) uint8
    seq_len: int
    rate: float
    local_rank: int
    local_size: int
    gen: torch.Generator
    drawn: int = 0

    @property
    def windows(self) -> int:
        """Window starts of this rank (its share of the region's records)."""
        n = self.data.numel() - self.seq_len - 1
        return len(range(self.local_rank, n, self.local_size))

    def next(self) -> torch.Tensor:
        """(k, T+1) int64, k ~ Binomial(windows, rate)."""
        n = self.windows
        k = int(torch.binomial(torch.tensor(float(n)), torch.tensor(self.rate), generator=self.gen))
        picks = _distinct(n, k, self.gen)  # a uniform k-subset: with k ~ Binomial, Poisson
        start = self.local_rank + self.local_size * picks
        idx = start[:, None] + torch.arange(self.seq_len + 1)[None, :]
        self.drawn += 1
        return self.data[idx].long()


def _distinct(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct integers drawn uniformly from [0, n): draw, and redraw the duplicates
    (k << n, so almost never), without materialising a permutation of n."""
    picks = torch.randint(0, n, (k,), generator=gen).unique()
    while picks.numel() < k:
        more = torch.randint(0, n, (k - picks.numel(),), generator=gen)
        picks = torch.cat([picks, more]).unique()
    return picks[torch.randperm(k, generator=gen)]


# -- one region's DP-SGD --------------------------------------------------------------
def secret_generator(device: torch.device) -> torch.Generator:
    """A generator seeded from the OS's CSPRNG: neither the run key (which every region
    holds) nor the stack's seed may predict a region's sample or noise."""
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    return g


@dataclass
class RegionPrivacy:
    """DP-SGD state of one rank: the region's budget, its sampler and its noise."""

    region: str
    region_index: int
    spec: PrivacySpec
    budget: Budget
    loader: PoissonLoader
    batch: int
    """Expected records per rank per step (B): the divisor of the noisy sum."""
    local_size: int
    noise: torch.Generator

    @staticmethod
    def for_rank(
        spec: LaunchSpec, topo: Topology, text: bytes, device: torch.device
    ) -> RegionPrivacy | None:
        """This rank's DP-SGD state, or None when its region has no privacy settings."""
        p = spec.regions[topo.region_index].privacy
        if p is None:
            return None
        region, seq_len = topo.region, spec.seq_len
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        records = data.numel() - seq_len - 1
        rate = topo.local_size * spec.batch_size / records  # q = L x B / N
        if rate > 1:
            raise DataError(
                f"region {region} has {records} windows, fewer than its batch of "
                f"{topo.local_size * spec.batch_size} records per step; lower "
                "geotrain:training.batch_size or give the region more data"
            )
        if p.delta >= 1 / records:
            print(
                f"geotrain: warning: region {region}: privacy delta {p.delta:g} is not "
                f"below 1/records (1/{records}); a delta that large allows leaking a record "
                "outright; lower delta",
                file=sys.stderr,
            )
        cpu = secret_generator(torch.device("cpu"))
        loader = PoissonLoader(data, seq_len, rate, topo.local_rank, topo.local_size, cpu)
        return RegionPrivacy(
            region=region,
            region_index=topo.region_index,
            spec=p,
            budget=Budget(p, _sigma(p, rate, spec.steps, region), rate),
            loader=loader,
            batch=spec.batch_size,
            local_size=topo.local_size,
            noise=secret_generator(device),
        )

    def clipped_noisy_grads(
        self, model: torch.nn.Module, tokens: torch.Tensor, loss_of: Callable[..., torch.Tensor]
    ) -> float:
        """Set every parameter's .grad to this rank's share of the noisy clipped mean;
        returns the mean loss of the records (nan for an empty sample)."""
        params = [p for p in model.parameters() if p.requires_grad]
        total, loss = private_backward(params, tokens, loss_of, self.spec.max_grad_norm)
        std = self.budget.sigma * self.spec.max_grad_norm / math.sqrt(self.local_size)
        total.add_(torch.normal(0.0, std, total.shape, generator=self.noise, device=total.device))
        total.div_(self.batch)
        i = 0
        for p in params:
            p.grad = total[i : i + p.numel()].view_as(p).clone()
            i += p.numel()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """History as JSON (its length changes between starts), the noise state as bytes."""
        return {"history": json.dumps(self.budget.history), "noise": self.noise.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        segments = json.loads(state["history"])
        self.budget.history = [(float(s), float(q), int(n)) for s, q, n in segments]
        self.noise.set_state(state["noise"])

    def offer(self, planned: int) -> tuple[float, float, float, float]:
        """(steps this region can run, epsilon spent by then, epsilon one step later,
        target): what `agreed_stop` shares."""
        n = self.budget.limit(planned)
        extra = n - self.budget.steps
        return (
            n,
            self.budget.epsilon(extra),
            self.budget.epsilon(extra + 1),
            self.spec.target_epsilon,
        )


def private_backward(
    params: list[torch.nn.Parameter],
    tokens: torch.Tensor,
    loss_of: Callable[..., torch.Tensor],
    max_norm: float,
) -> tuple[torch.Tensor, float]:
    """(sum over records of each record's gradient clipped to `max_norm`, flat; mean loss).

    One backward pass per record (micro-batching). Opacus's GradSampleModule computes
    per-sample gradients per layer from the layer's input, whose first dimension must be
    the batch: DeepSeekMoE's router and experts see tokens gathered from the whole batch
    (N = B x T, or the tokens routed to an expert), so their "per-sample" gradients are per
    token and cannot be clipped per record (checked with Opacus 1.6, hooks and functorch);
    vmap cannot trace the data-dependent routing either. A pass per record is exact for any
    model, at about twice the cost of one batched pass for the demo model."""
    flat = sum(p.numel() for p in params)
    total = torch.zeros(flat, device=params[0].device)
    losses = []
    for record in tokens:  # (T+1,)
        for p in params:
            p.grad = None
        loss = loss_of(record[None])
        loss.backward()
        g = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        # clip factor min(1, C / ||g||): a record moves the sum by at most C
        total.add_(g, alpha=min(1.0, max_norm / (g.norm().item() + 1e-12)))
        losses.append(loss.detach())
    mean = torch.stack(losses).mean().item() if losses else float("nan")
    return total, mean


@dataclass(frozen=True)
class Stop:
    """Where the run stops, the same on every rank."""

    step: int
    """Steps to run."""
    region: int | None
    """Index of the region whose budget ends the run (None: it runs all its steps)."""
    spent: float = 0.0
    """That region's epsilon after `step` steps."""
    next: float = 0.0
    """Its epsilon had it taken one step more."""
    target: float = 0.0
    """Its target epsilon."""


def agreed_stop(offer: tuple[float, float, float, float], region_index: int, steps: int) -> Stop:
    """Every rank offers its region's `RegionPrivacy.offer` ((steps, 0, 0, 0) without
    DP); all take the smallest, so a region never stops alone (its peers would wait for it
    in the next collective). A peer can only lower the stop (a denial of service it could
    cause anyway by leaving), never raise a region's past its own limit."""
    mine = torch.tensor([min(offer[0], steps), region_index, *offer[1:]], dtype=torch.float64)
    views = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(views, mine)
    first = min(views, key=lambda v: (v[0].item(), v[1].item()))
    stop, who, spent, nxt, target = (float(x) for x in first)
    if stop >= steps:
        return Stop(steps, None)
    return Stop(int(stop), int(who), spent, nxt, target)


def budget_error(stop: Stop, spec: LaunchSpec) -> PrivacyBudgetSpent:
    """The one line every rank exits with when `stop` ends the run on a budget."""
    assert stop.region is not None  # only for a budget stop
    return PrivacyBudgetSpent(
        f"region {spec.regions[stop.region].name} spent its privacy budget: epsilon "
        f"{stop.next:.3f} >= target {stop.target:g} at step {stop.step + 1} (spent "
        f"{stop.spent:.3f} in {stop.step} steps); raise target_epsilon in "
        f"Pulumi.{spec.stack}.yaml:geotrain:regions[{stop.region}].privacy or lower "
        "geotrain:training.steps"
    )
