"""The adaptive codec: per link, the quantizer and zstd level predicted to make the sync
fastest (or the most precise one that fits a time budget), switched with hysteresis.

Cost of a choice c for a piece of n fp32 values sent over a set of links:
  t(c) = 4n / encode(c) + max over the links of (RTT / 2 + wire(c) / bandwidth) + 4n / decode(c)
  wire(c) = 4n / ratio(c)
encode and decode are fp32 bytes per second of this rank's codec with c, and ratio is fp32
bytes per wire byte: calibrated at start on a sample (`CostModel.calibrate`), then an EWMA
of the sync's own encodes and decodes. A higher zstd level of a quantizer is never
predicted to encode faster than a lower one (`CostModel.encode_speed`), and every level
decodes at its quantizer's speed (`decode_speed`). Bandwidth and RTT: training.sync.linkprobe.

Which choice (`pick`): with no budget, the fastest (choices within TIE of it tie, and the
more precise, then the lower zstd level, wins). With a budget (seconds per step, or a
fraction of the step's compute time), the most precise choice predicted to fit it, else
the fastest: the budget is time the operator lets the sync spend on precision.

Hysteresis (`Switch`): the current choice is judged as if `margin` faster than predicted,
and a challenger must win `patience` observations in a row before the link switches to it.
The first informed pick (once the link has an estimate) is taken at once.

Scope: the scatter stage sends a different payload to each region, one choice per link;
the gather stage sends one payload to every region, one choice for all its links (the
slowest bounds it). A piece a rank keeps (its own region's) is never sent: kept exact.

Agreement: the sender decides. The quantizer travels in the authenticated header and
receivers accept any quantizer of the configured set (training.sync.codec `decode(accept=)`);
zstd needs no level to decompress. Every region decodes the same bytes, so regions still
apply bitwise the same sums. Error feedback keeps x - decoded(x) of whichever codec was
used, so a switch needs nothing more: the next step's residual is the last codec's error.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from training.comm.session import Session
from training.spec import QUANTIZERS, AdaptiveSpec, CodecSpec
from training.sync.codec import Address, Codec, quant_of
from training.sync.linkprobe import Link, LinkMonitor

CALIBRATION_VALUES = 1 << 17
"""fp32 values each choice encodes and decodes at start (512 KiB)."""
CALIBRATION_REPS = 3
"""Timed encodes and decodes of each choice at start; the fastest counts."""
EWMA_ALPHA = 0.3
"""Weight of a new speed sample."""
TIE = 0.05
"""Predicted times this close to the fastest are a tie (the precise, cheap one wins)."""
MIN_OBSERVED_VALUES = 4096
"""Smaller pieces are dominated by fixed costs (headers, keys): not folded into speeds."""


class Choice(NamedTuple):
    """One codec setting the chooser may pick."""

    quantize: str
    level: int

    def __str__(self) -> str:
        return f"{self.quantize}/zstd{self.level}"


def precision(c: Choice) -> int:
    """0 is exact (none); larger loses more."""
    return QUANTIZERS.index(c.quantize)


@dataclass
class Speed:
    encode: float
    """fp32 bytes per second in."""
    decode: float
    """fp32 bytes per second out."""
    ratio: float
    """fp32 bytes per wire byte."""


@dataclass
class CostModel:
    """Predicted seconds of each choice, from measured codec speeds and link estimates."""

    speeds: dict[Choice, Speed]

    @staticmethod
    def calibrate(
        spec: CodecSpec, choices: list[Choice], values: int = CALIBRATION_VALUES
    ) -> CostModel:
        """Time every choice on a sample, with a throwaway key and session (this
        machine's speeds; the run's codec counters stay untouched). The timings go round
        the choices CALIBRATION_REPS times and each keeps its fastest: a burst of load on
        a shared core meets every choice, not one."""
        # a throwaway key of its own: the samples are sealed only to time the cipher, and
        # no key may seal the same nonce twice (not even one that never leaves the process)
        codec = Codec(spec, os.urandom(32), Session.unagreed("calibration"))
        x = torch.randn(values, generator=torch.Generator().manual_seed(0)) * 1e-3
        addr = Address(0, 0, 0, 1, 0)
        enc = dict.fromkeys(choices, float("inf"))
        dec = dict.fromkeys(choices, float("inf"))
        wire = {}
        for c in choices:  # warm-up: zstd contexts, keys
            wire[c] = len(codec.encode(x, addr, c.quantize, c.level)[0])
        for _ in range(CALIBRATION_REPS):
            for c in choices:
                t0 = time.perf_counter()
                payload, _ = codec.encode(x, addr, c.quantize, c.level)
                t1 = time.perf_counter()
                codec.decode(payload, addr, values, (c.quantize,))
                enc[c], dec[c] = min(enc[c], t1 - t0), min(dec[c], time.perf_counter() - t1)
        raw = 4 * values
        return CostModel({c: Speed(raw / enc[c], raw / dec[c], raw / wire[c]) for c in choices})

    def encode_speed(self, c: Choice) -> float:
        """c's encode speed, capped by that of every lower zstd level of its quantizer:
        zstd searches more at a higher level, so a higher level measured faster is noise
        (in the lab a rank's calibration so picked int4 at zstd 3, same bytes as zstd 1,
        for the whole run)."""
        return min(
            s.encode
            for k, s in self.speeds.items()
            if k.quantize == c.quantize and k.level <= c.level
        )

    def decode_speed(self, c: Choice) -> float:
        """The fastest decode of c's quantizer at any zstd level: zstd decodes every
        level at about one speed (`observe_decode` keeps one per quantizer too), so a gap
        between levels is noise (with encode_speed alone one lab rank still took zstd 3)."""
        return max(s.decode for k, s in self.speeds.items() if k.quantize == c.quantize)

    def seconds(self, c: Choice, n: int, links: list[Link]) -> float:
        """Predicted time to encode, send over every link of `links` and decode n values."""
        raw = 4 * n
        wire = raw / self.speeds[c].ratio
        return (
            raw / self.encode_speed(c)
            + max(link.seconds(wire) for link in links)
            + raw / self.decode_speed(c)
        )

    def observe_encode(self, c: Choice, n: int, seconds: float, wire: int) -> None:
        s = self.speeds.get(c)
        if s is None or n < MIN_OBSERVED_VALUES or seconds <= 0:
            return
        s.encode = _ewma(s.encode, 4 * n / seconds)
        s.ratio = _ewma(s.ratio, 4 * n / wire)

    def observe_decode(self, quantize: str | None, n: int, seconds: float) -> None:
        """A decode says how fast that quantizer decodes, whatever level it was sent at."""
        if n < MIN_OBSERVED_VALUES or seconds <= 0:
            return
        for c, s in self.speeds.items():
            if c.quantize == quantize:
                s.decode = _ewma(s.decode, 4 * n / seconds)


def _ewma(old: float, sample: float) -> float:
    return EWMA_ALPHA * sample + (1 - EWMA_ALPHA) * old


def pick(times: dict[Choice, float], budget: float | None) -> Choice:
    """The fastest choice; with a budget the most precise that fits it, else the fastest.
    Choices within TIE of the fastest count as fast: the more precise, then the lower
    zstd level of them wins (a prediction is no closer than that; deterministic)."""
    best = min(times.values())
    if budget is None or best > budget:
        budget = best * (1 + TIE)
    fits = [c for c in times if times[c] <= budget]
    return min(fits, key=lambda c: (precision(c), c.level, times[c]))


@dataclass
class Switch:
    """One link's choice over time (hysteresis)."""

    current: Choice
    challenger: Choice | None = None
    wins: int = 0
    """Consecutive observations the challenger won."""
    informed: bool = False
    """Whether `current` was picked from measurements (the first such pick is at once)."""
    switches: int = 0

    def decide(
        self, times: dict[Choice, float], budget: float | None, margin: float, patience: int
    ) -> Choice:
        if not self.informed:
            self.current, self.informed = pick(times, budget), True
            return self.current
        favoured = dict(times)
        if self.current in favoured:  # the incumbent is judged margin faster
            favoured[self.current] *= 1 - margin
        target = pick(favoured, budget)
        if target == self.current:
            self.challenger, self.wins = None, 0
        elif target == self.challenger:
            self.wins += 1
        else:
            self.challenger, self.wins = target, 1
        if self.wins >= patience:
            self.current, self.challenger, self.wins = target, None, 0
            self.switches += 1
        return self.current


@dataclass
class Window:
    """The step's compute time (between one step's last sync and the next step's first)
    and the values synced per step: what a budget fraction and a bucket's share need."""

    step: int = -1
    values: int = 0
    """Values synced so far this step."""
    last_values: int = 0
    """Values synced in the whole previous step."""
    bucket: int = 0
    """Values of the bucket being synced."""
    compute: float | None = None
    """EWMA of the compute seconds between syncs."""
    ended: float | None = None

    def begin(self, step: int, n: int) -> None:
        if step != self.step:
            if self.ended is not None:
                gap = time.perf_counter() - self.ended
                self.compute = gap if self.compute is None else _ewma(self.compute, gap)
            self.step, self.last_values, self.values = step, self.values, 0
        self.values += n
        self.bucket = n

    def end(self) -> None:
        self.ended = time.perf_counter()

    def share(self) -> float:
        """The bucket's fraction of a step's synced values (1 before a full step)."""
        return min(1.0, self.bucket / self.last_values) if self.last_values else 1.0


@dataclass
class AdaptiveCodec:
    """The choices of one rank's sync: per link of the scatter stage, one for the gather."""

    spec: AdaptiveSpec
    codec: Codec
    links: LinkMonitor
    costs: CostModel
    initial: Choice
    """Used on a link until it has a bandwidth estimate."""
    switches: dict[str, Switch] = field(default_factory=dict)
    uses: Counter[tuple[str, Choice]] = field(default_factory=Counter)
    window: Window = field(default_factory=Window)

    @staticmethod
    def of(codec: Codec, links: LinkMonitor) -> AdaptiveCodec:
        a = codec.spec.adaptive
        assert a is not None  # only built for an adaptive codec spec
        choices = [Choice(q, lv) for q in a.quantize for lv in a.zstd_levels]
        initial = Choice(codec.spec.quantize, codec.spec.zstd_level)
        return AdaptiveCodec(a, codec, links, CostModel.calibrate(codec.spec, choices), initial)

    @property
    def accept(self) -> tuple[str, ...]:
        return self.spec.quantize

    def budget(self) -> float | None:
        """Seconds one stage of the bucket being synced may take: half its share of the
        step's budget (a stage's pieces cross their links at the same time)."""
        a, w = self.spec, self.window
        step = a.budget_seconds
        if step is None and a.budget_fraction is not None and w.compute is not None:
            step = a.budget_fraction * w.compute
        return None if step is None else step * w.share() / 2

    def choose(self, key: str, peers: list[int], n: int) -> Choice:
        """The choice for `n` values sent to regions `peers` (key: which link or stage)."""
        links = [self.links.links[j] for j in peers]
        switch = self.switches.setdefault(key, Switch(self.initial))
        if all(link.bandwidth for link in links):
            times = {c: self.costs.seconds(c, n, links) for c in self.costs.speeds}
            switch.decide(times, self.budget(), self.spec.margin, self.spec.patience)
        self.uses[(key, switch.current)] += 1
        return switch.current

    def encode(self, x: torch.Tensor, addr: Address, c: Choice) -> tuple[bytes, torch.Tensor]:
        t0 = time.perf_counter()
        payload, decoded = self.codec.encode(x, addr, c.quantize, c.level)
        self.costs.observe_encode(c, x.numel(), time.perf_counter() - t0, len(payload))
        return payload, decoded

    def decode(self, payload: bytes, addr: Address, n: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.codec.decode(payload, addr, n, self.accept)
        self.costs.observe_decode(quant_of(payload), n, time.perf_counter() - t0)
        return out

    def report(self) -> dict[str, Any]:
        """Per link (peer region name, or `all` for the gather stage): the codec now, the
        switches so far, and how often each codec was used."""
        return {
            key: {
                "codec": str(s.current),
                "switches": s.switches,
                "uses": {str(c): k for (kk, c), k in sorted(self.uses.items()) if kk == key},
            }
            for key, s in sorted(self.switches.items())
        }
