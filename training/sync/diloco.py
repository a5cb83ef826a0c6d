"""DiLoCo (Douillard et al. 2023, as in torchft's `local_sgd.DiLoCo`): each region trains
its own replica with in-region gradient averaging, and every H inner steps (or T minutes)
the regions merge. The merge sends each region's pseudo-gradient (global - local) through
the cross-region sync (codec, secure aggregation, error feedback), and an outer optimizer
(SGD, Nesterov when momentum > 0) steps the global copy with the average; every replica then
restarts from the new global weights.

Warm-up: the first `warmup_steps` steps sync every step across regions (as `sync: allreduce`
does); when they end, the global copy is taken from the (identical) weights and the merge
schedule starts counting.

Streaming (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication";
torchft's `DiLoCo(fragment_sync_delay=...)`): the sync buckets are cut into `fragments`
contiguous groups of about equal size. Fragment f is sent k inner steps after the warm-up
when k % H == f * H // fragments (so each fragment still merges every H steps, the
fragments staggered), and its merge lands `tau` inner steps later: meanwhile a background
thread runs the exchange (training.sync.streaming) and the loop computes. The outer step uses
the pseudo-gradient of the snapshot taken when it was sent (global - local at send time);
the fragment then becomes the new global values plus `mix` times the local progress made
since the send (0: replaced, as torchft's default fragment_update_alpha; 1: kept). The
last step merges every fragment at once, blocking, so the regions end with one model.

Drift correction (`drift_correction: scaffold`; SCAFFOLD, Karimireddy et al. 2020, option
II, in update space): on non-IID shards each region's inner steps pull toward its own
optimum (client drift). Each rank keeps c_i, its region's own mean inner step over the
last round, and c, the mean of every region's; after every inner step the weights move by
-(c - c_i), so a region follows its own gradient's detail plus the others' mean direction.
Both come out of the merge with no extra bytes: for a round of K inner steps, with
pseudo-gradients d_i = global - local_i and their cross-region average d,

    c   <- d / K
    c_i <- d_i / K - (c - c_i)   (the round's own correction taken back out, so c_i is the
                                  inner optimizer's own mean step; without it the
                                  correction would cancel itself every second round)

and c stays the mean of the c_i, up to the codec's rounding, which error feedback carries
into the next merge. Why update space, not `grad += c - c_i` before the inner step: with
AdamW the inner step is not lr x gradient, and c in gradient units would need every
region's mean gradient, a second model-sized exchange. A pseudo-gradient is in update
units, so the shift is applied to the weights after `opt.step()` (decoupled, as AdamW
decouples weight decay) and AdamW's moments never see it; with plain SGD at a constant lr
the two are the same. With one region d == d_i bitwise (the sync returns the
pseudo-gradient itself), so c == c_i and the shift is an exact no-op.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from training.errors import SpecError
from training.spec import SCAFFOLD_STREAMING, DilocoSpec
from training.sync.streaming import Background


class Reducer(Protocol):
    """The cross-region average (training.sync.hier.HierarchicalAllReduce)."""

    def all_reduce_many(
        self, xs: Sequence[torch.Tensor], step: int, buckets: Sequence[int]
    ) -> list[torch.Tensor]:
        """Each flat x averaged across regions (its bucket id), in one sync."""

    def clear_residuals(self) -> None:
        """Forget the error-feedback residuals: a gradient's must not carry into merges."""


class Digest(Protocol):
    """Fed every bucket's pseudo-gradient as sent (training.audit.hooks.hasher)."""

    def update(self, t: torch.Tensor) -> Any: ...


def rounds_in(k: float, h: int, start: int | None = None, start_for: int | None = None) -> float:
    """Merge rounds in the first k inner steps after the warm-up, the last one counted by
    the share of it done (a round ends where the whole part grows): rounds of h; with
    growing H (`start`) rounds of start, twice that, ... up to h; with early H (`start`
    and `start_for`) rounds of start for start_for steps, rounded down to whole rounds,
    then of h. The runtime's schedule (DiLoCo._round_ends) and the planner's count of
    merges (infra.planner) both read it."""
    if k <= 0:
        return 0.0
    r = start or h
    if start_for is not None:
        t = start_for // r * r  # the early rounds' end: a whole number of them
        return min(k, t) / r + max(0.0, k - t) / h
    n, t = 0, 0
    while r < h:  # the ramp: a few rounds (log2 of h / start)
        if k < t + r:
            return n + (k - t) / r
        n, t, r = n + 1, t + r, r * 2
    return n + (k - t) / h


@dataclass(frozen=True)
class Applied:
    """A merge applied to the global weights: its pseudo-gradient's digest, and which
    fragment it set (None: the whole model)."""

    digest: Digest
    fragment: int | None = None


@dataclass
class _InFlight:
    """A fragment's merge between its send and its landing."""

    fragment: int
    lands: int
    """The step after which it is applied (0-based, as `step` everywhere here)."""
    deltas: list[torch.Tensor]
    """This region's pseudo-gradient per bucket (N_b,), as sent."""
    averaged: Future[list[torch.Tensor]]
    """The cross-region averages, one per bucket (done at once when tau is 0)."""
    digest: Digest
    seconds: list[float] = field(default_factory=list)
    """The background exchange's own duration, set before `averaged` is (tau > 0)."""


class DiLoCo:
    """The global weights, the outer optimizer and the merge of one rank.

    `buckets`: the model's parameters in the buckets the sync sends (fixed for the run);
    every rank of the world must use the same bucketing. `stream`: the reducer late merges
    (tau > 0) exchange on from a background thread (training.sync.streaming.twin)."""

    def __init__(
        self,
        buckets: Sequence[Sequence[torch.nn.Parameter]],
        spec: DilocoSpec,
        sync: Reducer,
        stream: Reducer | None = None,
    ) -> None:
        self.buckets = [list(b) for b in buckets]
        self.params = [p for b in self.buckets for p in b]
        self.spec = spec
        self.sync = sync
        if spec.tau > 0 and stream is None:
            raise ValueError("tau > 0 needs a stream reducer on its own process groups")
        self.stream = stream
        self.fragments = split_fragments([sum(p.numel() for p in b) for b in self.buckets], spec)
        starts = [0]
        for b in self.buckets:
            starts.append(starts[-1] + len(b))
        self._first = starts  # bucket b's parameters: self.params[starts[b] : starts[b + 1]]
        self._flight: list[_InFlight] = []
        self._background = Background() if spec.tau > 0 else None
        self.global_params = [p.detach().clone() for p in self.params]
        m = spec.outer_momentum
        self.outer = torch.optim.SGD(  # Nesterov needs momentum; 0 is a plain outer SGD step
            self.global_params, lr=spec.outer_lr, momentum=m, nesterov=m > 0
        )
        self.merges = 0
        self.last_merge = time.monotonic()
        self.waited_s = 0.0
        """Seconds the loop waited at landings for exchanges that outlasted tau steps: a
        stall of the cross-region sync (the step reports it as sync time), unlike the
        exchange's own seconds, which overlap compute."""
        self.exchange_s: list[float] = []
        """Streaming: each fragment's exchange, in seconds from its start on the background
        thread to its end, in landing order since the loop last took them
        (`take_exchange_s`). Against tau steps of wall time it says how much slack tau
        leaves (an exchange queued behind another starts late: its wait shows in
        waited_s, not here)."""
        self.scaffold = spec.drift_correction == "scaffold"
        if self.scaffold and spec.streaming:  # DilocoSpec refuses it; a hand-built spec too
            raise SpecError(SCAFFOLD_STREAMING)
        self.drift = [torch.zeros_like(g) for g in self.global_params] if self.scaffold else []
        """c: every region's mean inner step over the last round (the same on every rank)."""
        self.own_drift = [torch.zeros_like(g) for g in self.drift]
        """c_i: this region's own mean inner step over the last round (its ranks agree)."""
        self._shift = [torch.zeros_like(g) for g in self.drift]  # c - c_i, set at each merge
        self.round_steps = 0
        """Inner steps since the global copy was last set (a warm-up's end or a merge)."""

    # -- schedule ---------------------------------------------------------------------
    def warming(self, step: int) -> bool:
        """Whether step `step` (0-based, about to run) syncs gradients across regions."""
        return step < self.spec.warmup_steps

    def due(self, step: int, steps: int) -> bool:
        """Step-based: whether a merge (or, streaming, a fragment's send or landing) follows
        step `step` of a run of `steps` steps."""
        s, w, h = step + 1, self.spec.warmup_steps, self.spec.every_steps
        if s <= w:
            return False
        if self.spec.streaming:
            return s == steps or bool(self.sends(step)) or self._lands(step)
        return s == steps or (h is not None and self._round_ends(s - w, h))

    def _round_ends(self, k: int, h: int) -> bool:
        """Whether a merge round ends k inner steps after the warm-up (`rounds_in`)."""
        start, early = self.spec.every_steps_start, self.spec.every_steps_start_for
        return int(rounds_in(k, h, start, early)) > int(rounds_in(k - 1, h, start, early))

    def sends(self, step: int) -> list[int]:
        """Streaming: the fragment sent after step `step` (none, or one: offsets differ)."""
        k, h, f = step + 1 - self.spec.warmup_steps, self.spec.every_steps, len(self.fragments)
        if k <= 0 or h is None:
            return []
        return [i for i in range(f) if k % h == i * h // f]

    def _lands(self, step: int) -> bool:
        return bool(self._flight) and self._flight[0].lands <= step

    def time_due(self, step: int, now: float) -> bool:
        """Time-based: whether this rank's clock says a merge is due after step `step`."""
        t = self.spec.interval_minutes
        return (
            t is not None and step + 1 > self.spec.warmup_steps and now - self.last_merge >= 60 * t
        )

    def step_done(self, step: int) -> None:
        """After step `step`'s inner update: the last warm-up step starts DiLoCo from the
        current weights (every rank holds the same ones after synced steps); an inner step
        counts into the round and, with scaffold, takes its drift correction."""
        if self.warming(step):
            if step + 1 == self.spec.warmup_steps:
                with torch.no_grad():
                    for g, p in zip(self.global_params, self.params, strict=True):
                        g.copy_(p)
                self.sync.clear_residuals()  # gradient residuals do not carry into merges
                self.last_merge = time.monotonic()
            return
        self.round_steps += 1
        if self.scaffold:
            with torch.no_grad():
                torch._foreach_sub_([p.detach() for p in self.params], self._shift)

    # -- merge ------------------------------------------------------------------------
    def advance(self, step: int, steps: int, new_digest: Callable[[], Digest]) -> list[Applied]:
        """After step `step`, when a merge is due (`due`, or the agreed clock): run the
        merge, or, streaming, send this step's fragment and land those whose tau steps
        are over. Returns the merges applied now (a landing sets one fragment)."""
        if not self.spec.streaming:
            digest = new_digest()
            self.merge(step, digest)
            return [Applied(digest)]
        if step + 1 == steps:  # the end: everything lands, then one blocking full merge
            done = self.settle()
            digest = new_digest()
            self.merge(step, digest)
            return [*done, Applied(digest)]
        for f in self.sends(step):
            self._send(f, step, new_digest())
        done = []
        while self._lands(step):
            done.append(self._land(self._flight.pop(0)))
        return done

    def take_exchange_s(self) -> list[float]:
        """The exchange times of the fragments landed since the last call (then cleared)."""
        out, self.exchange_s = self.exchange_s, []
        return out

    def settle(self) -> list[Applied]:
        """Land every merge in flight now (before a checkpoint: nothing may be in flight,
        and the exchange thread must not touch the residuals being saved)."""
        done = []
        while self._flight:
            done.append(self._land(self._flight.pop(0)))
        return done

    def _send(self, f: int, step: int, digest: Digest) -> None:
        """Fragment f's pseudo-gradient (global - local, now), exchanged in the background
        (tau > 0) or at once."""
        bs = list(self.fragments[f])
        deltas = [self._delta(b) for b in bs]
        for d in deltas:
            digest.update(d)
        seconds: list[float] = []
        if self._background is None:
            fut: Future[list[torch.Tensor]] = Future()
            fut.set_result(self.sync.all_reduce_many(deltas, step, bs))
        else:
            assert self.stream is not None  # checked in __init__
            stream = self.stream

            def exchange() -> list[torch.Tensor]:
                t0 = time.perf_counter()
                out = stream.all_reduce_many(deltas, step, bs)
                seconds.append(time.perf_counter() - t0)
                return out

            fut = self._background.submit(exchange)
        self._flight.append(_InFlight(f, step + self.spec.tau, deltas, fut, digest, seconds))

    def _delta(self, b: int) -> torch.Tensor:
        lo, hi = self._first[b], self._first[b + 1]
        return torch.cat(
            [
                (g - p.detach()).reshape(-1)
                for g, p in zip(self.global_params[lo:hi], self.params[lo:hi], strict=True)
            ]
        )

    def _land(self, m: _InFlight) -> Applied:
        """The outer step on fragment m's averaged pseudo-gradient; its local values become
        the new global ones plus `mix` times the local progress since the send."""
        t0 = time.perf_counter()
        averaged = m.averaged.result()  # waits only if the exchange outlasted tau steps
        self.waited_s += time.perf_counter() - t0
        self.exchange_s += m.seconds
        bs = list(self.fragments[m.fragment])
        lo, hi = self._first[bs[0]], self._first[bs[-1] + 1]
        gl, ps = self.global_params[lo:hi], self.params[lo:hi]
        mix = self.spec.mix
        kept: list[torch.Tensor] = []
        if mix > 0 and self.spec.tau > 0:  # local now - local at the send (= global - delta)
            sent = _split(torch.cat(m.deltas), gl)
            kept = [p.detach() - (g - d) for p, g, d in zip(ps, gl, sent, strict=True)]
        for b, avg in zip(bs, averaged, strict=True):
            _set_grads(avg, self.global_params[self._first[b] : self._first[b + 1]])
        self.outer.step()  # the other fragments have no gradient: SGD skips them
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(ps, gl, strict=True)):
                g.grad = None
                p.copy_(g)
                if kept:
                    p.add_(kept[i], alpha=mix)
        self.merges += 1
        self.last_merge = time.monotonic()
        return Applied(m.digest, m.fragment)

    def fragment_params(self, fragment: int | None) -> list[torch.Tensor]:
        """The global weights a merge sets: fragment `fragment`'s buckets, or every one."""
        if fragment is None:
            return self.global_params
        bs = self.fragments[fragment]
        return self.global_params[self._first[bs[0]] : self._first[bs[-1] + 1]]

    def merge(self, step: int, digest: Digest | None = None) -> None:
        """Average (global - local) across regions, every bucket in one sync, step the
        outer optimizer on it, and set every local parameter to the new global."""
        bs = range(len(self.buckets))
        deltas = [self._delta(b) for b in bs]
        if digest is not None:
            for d in deltas:
                digest.update(d)
        averaged = self.sync.all_reduce_many(deltas, step, list(bs))  # one exchange per stage
        for b, delta, avg in zip(bs, deltas, averaged, strict=True):
            lo, hi = self._first[b], self._first[b + 1]
            _set_grads(avg, self.global_params[lo:hi])
            if self.scaffold:  # a round failing in the sync above has changed nothing yet
                self._update_drift(lo, hi, delta, avg)
        self.outer.step()
        self.round_steps = 0
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params, strict=True):
                p.copy_(g)
        self.merges += 1
        self.last_merge = time.monotonic()

    # -- drift correction (scaffold) --------------------------------------------------
    def _update_drift(self, lo: int, hi: int, delta: torch.Tensor, avg: torch.Tensor) -> None:
        """c and c_i of one bucket (parameters lo..hi) from this round's pseudo-gradient and
        its cross-region average (module docstring). K is the same on every rank: merges
        are agreed, so every rank counted the same inner steps."""
        k = max(self.round_steps, 1)  # 0 only for a region healed into the merge (ft_loop)
        like = self.drift[lo:hi]
        for j, d_i, d in zip(range(lo, hi), _split(delta, like), _split(avg, like), strict=True):
            own, shift = self.own_drift[j], self._shift[j]
            own.copy_(d_i / k - shift)  # the inner optimizer's own mean step (shift = c - c_i)
            self.drift[j].copy_(d / k)
            torch.sub(self.drift[j], own, out=shift)

    def restart_drift(self) -> None:
        """A region without a round of its own (healed from a donor): c_i <- c, so it takes
        no correction until its next merge. The donor's c_i describes the donor's shard."""
        for c, own, shift in zip(self.drift, self.own_drift, self._shift, strict=True):
            own.copy_(c)
            shift.zero_()

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global weights, the outer optimizer and, with scaffold, c and the round's
        inner steps so far (the same on every rank). The tensors are the live ones: a
        checkpoint load fills them in place."""
        out: dict[str, Any] = {
            "params": {str(i): p for i, p in enumerate(self.global_params)},
            "outer": self.outer.state_dict(),
        }
        if self.scaffold:
            out["drift"] = {str(i): c for i, c in enumerate(self.drift)}
            out["round_steps"] = self.round_steps
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.outer.load_state_dict(state["outer"])
        with torch.no_grad():
            for g, v in zip(self.global_params, state["params"].values(), strict=True):
                g.copy_(v)
            if self.scaffold:
                for c, v in zip(self.drift, state["drift"].values(), strict=True):
                    c.copy_(v)
                self.round_steps = int(state["round_steps"])
                self._reshift()

    def region_state_dict(self) -> dict[str, Any]:
        """What the region's ranks share and other regions do not: c_i (scaffold; empty
        otherwise). A checkpoint keeps it under the region's key (training.resume)."""
        if not self.scaffold:
            return {}
        return {"own_drift": {str(i): c for i, c in enumerate(self.own_drift)}}

    def load_region_state_dict(self, state: Mapping[str, Any]) -> None:
        if not self.scaffold:
            return
        with torch.no_grad():
            for c, v in zip(self.own_drift, state["own_drift"].values(), strict=True):
                c.copy_(v)
        self._reshift()

    def _reshift(self) -> None:
        for c, own, shift in zip(self.drift, self.own_drift, self._shift, strict=True):
            torch.sub(c, own, out=shift)


OUTER_LR_ANCHORS = ((4, 0.6), (8, 0.8))
"""(replicas, best outer lr) anchors of issue #16 for Nesterov momentum 0.9; not measured
by geotrain (docs/architecture.md, "DiLoCo outer optimizer")."""


def suggested_outer_lr(regions: int) -> float:
    """The outer lr rule: 0.6 up to 4 regions (replicas), 0.8 from 8, linear between."""
    (r0, lr0), (r1, lr1) = OUTER_LR_ANCHORS
    if regions <= r0:
        return lr0
    if regions >= r1:
        return lr1
    return lr0 + (lr1 - lr0) * (regions - r0) / (r1 - r0)


def outer_hint(regions: int, outer_lr: float, outer_momentum: float) -> str | None:
    """A `geotrain validate` hint when the outer optimizer is neither near the rule nor
    plain averaging (outer SGD lr 1, momentum 0: what measured best here over tens of
    merges, benchmarks/results/diloco_parity.md). None: one of the two."""
    lr = suggested_outer_lr(regions)
    if abs(outer_lr - lr) <= 0.1 + 1e-9 and outer_momentum == 0.9:
        return None
    if outer_lr == 1.0 and outer_momentum == 0.0:
        return None
    return (
        f"hint: training.diloco outer_lr {outer_lr:g}, outer_momentum {outer_momentum:g} with "
        f"{regions} regions; the rule suggests outer_lr {lr:.2f} with Nesterov momentum 0.9 "
        "for runs of hundreds of merges, and plain averaging (outer_lr 1, outer_momentum 0) "
        "ended closest to per-step sync with tens of merges (docs/architecture.md, DiLoCo "
        "outer optimizer)"
    )


def split_fragments(sizes: Sequence[int], spec: DilocoSpec) -> list[range]:
    """Buckets (their sizes, in order) -> `spec.fragments` contiguous ranges of buckets,
    each ending where the running total first reaches its share of the whole."""
    f = spec.fragments
    if f > len(sizes):
        raise SpecError(
            f"training.diloco.fragments {f} is more than the model's {len(sizes)} sync "
            "buckets; lower fragments or training.bucket_mb"
        )
    out: list[range] = []
    total, start, run = sum(sizes), 0, 0
    for i, n in enumerate(sizes):
        run += n
        left = f - len(out) - 1  # fragments still to start after this one
        if left == 0:
            break
        if run * f >= total * (len(out) + 1) or len(sizes) - i - 1 == left:
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, len(sizes)))
    return out


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, i = [], 0
    for t in like:
        out.append(flat[i : i + t.numel()].view_as(t))
        i += t.numel()
    return out


def _set_grads(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Give each tensor its slice of `flat` as gradient (the outer optimizer's input)."""
    i = 0
    for t in tensors:
        n = t.numel()
        t.grad = flat[i : i + n].view_as(t).clone()
        i += n
