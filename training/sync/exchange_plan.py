"""The topology-aware exchange's planner: from the agreed link matrix, how much of the shard
each region aggregates and which cross-region flows relay through a third region.

Pure arithmetic on a `LinkMatrix` (every region's measured links, codec speeds and wire
ratio, gathered by training.sync.topo_exchange); every rank of a cross group runs it on the same
matrix with the same code, so every rank derives the same `ExchangePlan` (plain Python
floats in a fixed order, ties broken by index: no solver whose answer could differ).

The exchange (training.sync.hier `_exchange`) is a reduce-scatter then an all-gather across R
regions. A plan sets:
- weights w_j (summing to `grid`): region j aggregates w_j / grid of the shard. A region
  behind slow links aggregates less (0: nothing), so less of the shard crosses them;
- routes[i][j]: the first hop of the flow from region i to region j, j itself (direct) or
  a relay k: k forwards i's payload to j in a second round. The payload stays encrypted
  for j under the i->j key (k cannot read it) and j checks its Address as for a direct one.

Predicted seconds of a plan for a shard of S values (`predict`), per stage:
  encode + round 1 + round 2 (only with relays) + forwarding (only with relays) + decode
  round = the slowest loaded link's RTT / 2 + its bytes / its bandwidth, plus half the
          largest RTT (the round's size exchange crosses every link), plus ROUND_S
  forwarding = the busiest relay's forwarded bytes / FORWARD_SPEED
Links carry what the plan puts on them, a relay's forwarded bytes included (its own load
counts). Scatter: i sends piece j (w_j S values) to j; j decodes R - 1 copies. Gather: j
encodes its sum once and sends it to every region (one copy per first hop); every region
decodes the pieces it did not aggregate. ROUND_S and FORWARD_SPEED are calibrated on the
lab measurement in benchmarks/results/topology_exchange.md (see their docstrings): without
them the model predicted the relay plan faster than pieces only, and it measured slower.

How (`plan`), after PCCL (Prime Intellect's collective library), which keeps a matrix of
measured point-to-point bandwidths, weighs each directed link 1 / bandwidth and solves the
ring order (an asymmetric TSP, exactly for small worlds) at points every peer agrees on:
here the pattern is a reduce-scatter + all-gather, not a ring, so the choices are the piece
weights and relays. Relay candidates are the two-hop paths whose bottleneck beats the
direct link by RELAY_GAIN; every combination of them is tried (at most MAX_COMBOS, else
the best single relay of every pair at once), each with a local search of the weights on
the grid from several starts. The direct plan (equal pieces, no relay) is kept unless the
best is predicted at least `margin` faster than the plan in force: equal links keep
today's direct exchange, and noise does not flip the plan.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

RELAY_GAIN = 1.25
"""A two-hop path is a relay candidate when its bottleneck bandwidth is this much above the
direct link's."""
MAX_COMBOS = 256
"""Combinations of relay candidates tried exhaustively (beyond: best single relays)."""
GRID_UNITS = 24
"""About this many weight units in all (rounded to a multiple of R: equal pieces fit)."""
DEFAULT_SPEED = 200e6
"""fp32 bytes/s of an encode or decode before any is measured."""
WIRE_RATIO = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": 0.27, "int4": 0.14, "ternary": 0.05}
"""Wire bytes per fp32 byte before any is measured (zstd on top of the quantizer)."""
ROUND_S = 0.0184
"""Seconds a round costs beyond its links' RTT and bytes (framing, the bounded all-to-all,
Python). Calibrated on benchmarks/results/topology_exchange.md (commit ca3207d), pieces
only: 0.752 s of sync per step measured, where this model without ROUND_S and
FORWARD_SPEED predicts 0.641 s for the plan agreed there (0/0/24, no relay; 3 exchanges a
step of 510,128 + 519,696 + 196,672 values, 2 rounds each) on the matrix that run agreed
at its first exchange (start probe: beijing-frankfurt 1.6, beijing-silicon-valley 66.3,
frankfurt-silicon-valley 46.8 Mbit/s, RTT 11 ms; DEFAULT_SPEED; int8's WIRE_RATIO):
(0.752 - 0.641) / 6 rounds = 18.4 ms. tests/unit/test_topo_exchange.py replays it."""
FORWARD_SPEED = 9.84e6
"""Bytes/s a relay forwards (it receives a payload whole, then sends it in a second round,
on the cores its own training shares). Calibrated on the same run after ROUND_S, pieces +
relays: 0.967 s measured, 0.567 s predicted without either constant for its plan (8/8/8,
beijing and frankfurt relaying through silicon-valley), plus 12 rounds x ROUND_S = 0.221 s;
the rest, 0.179 s, for 1.77 MB of model wire bytes forwarded a step: 9.84 MB/s."""


@dataclass(frozen=True)
class LinkMatrix:
    """What every region of a cross group measured, as every rank of it holds it."""

    bandwidth: tuple[tuple[float, ...], ...]
    """[a][b]: bytes/s from region a to region b (as b receives them; 0: unknown)."""
    rtt: tuple[tuple[float, ...], ...]
    """[a][b]: round-trip seconds of the link (0 on the diagonal)."""
    encode: tuple[float, ...]
    """Per region: fp32 bytes/s its codec encodes."""
    decode: tuple[float, ...]
    """Per region: fp32 bytes/s its codec decodes."""
    ratio: float
    """Wire bytes per fp32 byte (the codec's compression)."""

    @property
    def regions(self) -> int:
        return len(self.encode)

    def known(self) -> bool:
        """Whether every link has a bandwidth (a plan needs them all)."""
        R = self.regions
        return all(self.bandwidth[a][b] > 0 for a in range(R) for b in range(R) if a != b)


@dataclass(frozen=True)
class ExchangePlan:
    """Who aggregates how much, and which flows relay (identical on every rank)."""

    weights: tuple[int, ...]
    """Per region: its share of the shard, in units of sum(weights)."""
    routes: tuple[tuple[int, ...], ...]
    """[i][j]: first hop of the flow from region i to region j (j: direct)."""
    seconds: float = 0.0
    """Predicted seconds of one exchange of the shard it was planned for."""

    def __post_init__(self) -> None:
        R = len(self.weights)
        if min(self.weights) < 0 or not sum(self.weights) or len(self.routes) != R:
            raise ValueError(f"plan weights {self.weights} / routes do not fit {R} regions")
        for i, row in enumerate(self.routes):
            bad = [j for j, hop in enumerate(row) if hop != j and hop in (i, j)]
            if len(row) != R or row[i] != i or bad or not all(0 <= h < R for h in row):
                raise ValueError(f"plan routes[{i}] {row}: each hop must be j or a third region")

    @staticmethod
    def direct(regions: int) -> ExchangePlan:
        """Today's exchange: equal pieces, every flow on its direct link."""
        return ExchangePlan((1,) * regions, _direct_routes(regions))

    @property
    def regions(self) -> int:
        return len(self.weights)

    @property
    def is_direct(self) -> bool:
        return len(set(self.weights)) == 1 and self.routes == _direct_routes(self.regions)

    def relays(self) -> list[tuple[int, int, int]]:
        """(source, relay, destination) of every relayed flow."""
        R = self.regions
        return [
            (i, self.routes[i][j], j)
            for i in range(R)
            for j in range(R)
            if i != j and self.routes[i][j] != j
        ]

    def sizes(self, n: int, align: int) -> list[int]:
        """Values of each region's piece for a shard of n: equal weights give today's
        ceil(n / R) each; otherwise multiples of `align` (the codec's block), shared by
        largest remainder. The sizes sum to n or a little more (the padding)."""
        R = self.regions
        if len(set(self.weights)) == 1:
            return [-(-n // R)] * R
        units = -(-n // align)
        total = sum(self.weights)
        exact = [units * w / total for w in self.weights]
        out = [math.floor(e) for e in exact]
        by_remainder = sorted(range(R), key=lambda j: (-(exact[j] - out[j]), j))
        for j in by_remainder[: units - sum(out)]:
            out[j] += 1
        return [u * align for u in out]

    def describe(self, names: tuple[str, ...]) -> str:
        """One line: `beijing 0/24, frankfurt 0/24, silicon-valley 24/24; relays: ...`."""
        total = sum(self.weights)
        parts = ", ".join(f"{names[j]} {w}/{total}" for j, w in enumerate(self.weights))
        hops = ", ".join(f"{names[i]}->{names[k]}->{names[j]}" for i, k, j in self.relays())
        return f"{parts}; relays: {hops or 'none'}"


def _direct_routes(R: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(R)) for _ in range(R))


# -- the cost model ---------------------------------------------------------------------
def predict(plan: ExchangePlan, m: LinkMatrix, values: int) -> float:
    """Predicted seconds of one exchange of `values` fp32 values under `plan` (module doc)."""
    R, total = m.regions, sum(plan.weights)
    size = [values * w / total for w in plan.weights]  # values per piece
    wire = 4 * m.ratio  # wire bytes per value
    overhead = max(m.rtt[a][b] for a in range(R) for b in range(R)) / 2
    s1, s2 = _scatter_loads(plan, size, wire)
    g1, g2 = _gather_loads(plan, size, wire)
    rounds = sum(_round(load, m, overhead) for load in (s1, s2, g1, g2))
    rounds += sum(_forwarded(load) for load in (s2, g2)) / FORWARD_SPEED
    cpu = max(4 * (values - size[i]) / m.encode[i] for i in range(R))  # scatter encode
    cpu += max(4 * (R - 1) * size[j] / m.decode[j] for j in range(R))  # scatter decode
    cpu += max(4 * size[j] / m.encode[j] for j in range(R))  # gather encode
    cpu += max(4 * (values - size[i]) / m.decode[i] for i in range(R))  # gather decode
    return rounds + cpu


Loads = dict[tuple[int, int], float]


def _scatter_loads(plan: ExchangePlan, size: list[float], wire: float) -> tuple[Loads, Loads]:
    """Bytes on each directed link in round 1 and round 2 of the scatter stage."""
    one: Loads = {}
    two: Loads = {}
    for i, row in enumerate(plan.routes):
        for j, hop in enumerate(row):
            if i == j or not size[j]:
                continue
            one[(i, hop)] = one.get((i, hop), 0.0) + size[j] * wire
            if hop != j:
                two[(hop, j)] = two.get((hop, j), 0.0) + size[j] * wire
    return one, two


def _gather_loads(plan: ExchangePlan, size: list[float], wire: float) -> tuple[Loads, Loads]:
    """Bytes on each directed link in round 1 and round 2 of the gather stage: one copy of
    region i's sum to each first hop, then a copy per relayed destination."""
    one: Loads = {}
    two: Loads = {}
    for i, row in enumerate(plan.routes):
        if not size[i]:
            continue
        for hop in first_hops(plan, i):
            one[(i, hop)] = size[i] * wire
        for j, hop in enumerate(row):
            if i != j and hop != j:
                two[(hop, j)] = two.get((hop, j), 0.0) + size[i] * wire
    return one, two


def first_hops(plan: ExchangePlan, i: int) -> list[int]:
    """Regions region i sends its gathered piece to in round 1 (ascending)."""
    return sorted({hop for j, hop in enumerate(plan.routes[i]) if j != i})


def _round(load: Loads, m: LinkMatrix, overhead: float) -> float:
    if not load:
        return 0.0
    slowest = max(m.rtt[a][b] / 2 + n / m.bandwidth[a][b] for (a, b), n in load.items())
    return ROUND_S + overhead + slowest


def _forwarded(second: Loads) -> float:
    """Bytes the busiest relay forwards in a second round (a second round's loads are all
    forwarded: each relay sends what it received for others)."""
    out: dict[int, float] = {}
    for (k, _), n in second.items():
        out[k] = out.get(k, 0.0) + n
    return max(out.values(), default=0.0)


# -- the search ---------------------------------------------------------------------------
def plan(
    m: LinkMatrix,
    values: int,
    current: ExchangePlan | None = None,
    margin: float = 0.1,
    relays: bool = True,
) -> ExchangePlan:
    """The plan to use for shards of `values` values: the best found if it is predicted
    `margin` faster than `current` (default: the direct plan), else `current`. With
    relays=False only the piece weights are planned."""
    R = m.regions
    current = current or ExchangePlan.direct(R)
    if R < 2 or not m.known():
        return current
    now = _priced(current, m, values)
    best = _priced(ExchangePlan.direct(R), m, values)
    grid = R * max(1, round(GRID_UNITS / R))
    for routes in _route_sets(m) if relays else [_direct_routes(R)]:
        found = _best_weights(routes, m, values, grid)
        if found.seconds < best.seconds:
            best = found
    best = _without_idle_relays(best)
    return best if best.seconds < now.seconds * (1 - margin) else now


def _without_idle_relays(p: ExchangePlan) -> ExchangePlan:
    """Flows between two regions that both aggregate nothing carry nothing: direct."""
    table = [list(row) for row in p.routes]
    for i, _, j in p.relays():
        if not p.weights[i] and not p.weights[j]:
            table[i][j] = j
    return ExchangePlan(p.weights, tuple(tuple(row) for row in table), p.seconds)


def _priced(p: ExchangePlan, m: LinkMatrix, values: int) -> ExchangePlan:
    return ExchangePlan(p.weights, p.routes, predict(p, m, values))


def relay_candidates(m: LinkMatrix) -> dict[tuple[int, int], list[int]]:
    """(i, j) -> relays k whose path i->k->j has a bottleneck RELAY_GAIN above the direct
    link, widest first (ties: lower index)."""
    R, bw = m.regions, m.bandwidth
    out = {}
    for i, j in itertools.permutations(range(R), 2):
        ks = [k for k in range(R) if k not in (i, j)]
        wide = [k for k in ks if min(bw[i][k], bw[k][j]) > RELAY_GAIN * bw[i][j]]
        if wide:
            out[(i, j)] = sorted(wide, key=lambda k: (-min(bw[i][k], bw[k][j]), k))
    return out


def _route_sets(m: LinkMatrix) -> list[tuple[tuple[int, ...], ...]]:
    """Every route table to try: all direct, then the relay candidates' combinations."""
    R = m.regions
    cands = relay_candidates(m)
    pairs = sorted(cands)
    options = [[pair[1], *cands[pair]] for pair in pairs]  # direct first
    if math.prod(len(o) for o in options) > MAX_COMBOS:
        options = [o[:2] for o in options]  # direct or the widest relay
        if 2 ** len(options) > MAX_COMBOS:
            options = [o[1:2] for o in options]  # every pair on its widest relay at once
    out = [_direct_routes(R)]
    for choice in itertools.product(*options):
        table = [list(range(R)) for _ in range(R)]
        for (i, j), hop in zip(pairs, choice, strict=True):
            table[i][j] = hop
        routes = tuple(tuple(row) for row in table)
        if routes not in out:
            out.append(routes)
    return out


def _best_weights(
    routes: tuple[tuple[int, ...], ...], m: LinkMatrix, values: int, grid: int
) -> ExchangePlan:
    """The best weights for `routes`: a steepest descent moving one unit between two
    regions, from equal weights and from every corner (all on one region)."""
    R = m.regions
    starts = [(grid // R,) * R] + [tuple(grid if j == h else 0 for j in range(R)) for h in range(R)]
    best: ExchangePlan | None = None
    for start in starts:
        found = _descend(ExchangePlan(start, routes), m, values)
        if best is None or found.seconds < best.seconds:
            best = found
    assert best is not None  # starts is never empty
    return best


def _descend(p: ExchangePlan, m: LinkMatrix, values: int) -> ExchangePlan:
    R = m.regions
    here = _priced(p, m, values)
    while True:
        step = here
        for a, b in itertools.permutations(range(R), 2):
            if not here.weights[a]:
                continue
            w = list(here.weights)
            w[a], w[b] = w[a] - 1, w[b] + 1
            cand = _priced(ExchangePlan(tuple(w), p.routes), m, values)
            if cand.seconds < step.seconds:
                step = cand
        if step is here:
            return here
        here = step
