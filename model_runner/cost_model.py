"""Load or recompute: what a stored prefix costs to load from each service tier, against prefilling it.

Primitives:
  observe_prefill(n, ctx, seconds)       a completed prefill of n tokens on top of ctx cached ones
  observe_load(tiers, block_bytes, s)    a completed Load of len(tiers) blocks (tier of each block)
  observe_staged(deep, shallow, n, bb, s) n blocks moved deep -> shallow tier in s (a prefetch): a Load of
                                         them from the deep tier costs that plus the shallow tier's copy
  estimate(tiers, block_bytes)           -> seconds a Load of those blocks is expected to take (or None)
  seed(tier, latency_s, bytes_per_s)     figures measured elsewhere (the daemon, a benchmark) as a start
  plan(tiers, block_bytes, tpb, ctx)     -> Plan(blocks to load, why): the rest is recomputed

A load costs a fixed latency (RPC, scheduling, a disk seek) plus bytes / bandwidth, and each tier gets
both fitted (weighted least squares over its recent loads, newest weighing most). One number per tier
is not enough: the first loads of a run are small and latency-dominated, so bytes / seconds of them
understates the bandwidth by an order of magnitude, and an engine that believes it never loads again.

A tier's very first load pays one-time costs (mappings, streams, cold caches: 1.5 s for a 2 GiB load
whose next one took 0.2 s on the H200), so it is dropped from the fit once a second load is seen.

An estimate is trusted only where it was measured: for load sizes within a factor of SPREAD of the
sizes seen (or larger ones, once loads of sizes SPREAD apart show the fixed cost to be a small share:
bytes then scale linearly), while its newest observation is younger than stale_s, and while that observation agreed
(within SURPRISE x) with what the fit predicted for it. Outside that (a tier never loaded, a load much
bigger or smaller than any seen, an estimate gone stale or contradicted) the tier is uncertain. The
plan then compares its choice with the one it would make were the uncertain tiers free; where the two
differ it loads the optimistic choice -- explores -- at most once per explore_gap_s per tier (a tier's
first two loads, the warm-up and the one that measures it, as they come), so that a tier that looked
slow once is measured again, a tier that is slow is not loaded from on every request, and exploring a
small uncertain share of a prefix never drags a slow known tier along. One tier is explored at a
time (a host prefix ahead of uncertain disk blocks is loaded alone, so the Load measures the host
tier), with at most EXPLORE_CAP_BYTES of it (a bandwidth-bound load, not a whole history from a slow
disk); a tier with no estimate yet is taken to be no slower than a deeper
tier that has one. A prefetch's reads (observe_staged) measure the disk without a Load and
count as its exploration. Every method
takes no time itself: `clock` (monotonic seconds) is injected, so tests drive it by hand.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

SPREAD = 2.0  # a fit is trusted for load sizes within this factor of the sizes it was fitted on
WINDOW = 16  # observations kept per tier
DECAY = 0.7  # weight of an observation relative to the next newer one
SURPRISE = 2.0  # an observation this many times off the fit's prediction makes the tier uncertain
BANDWIDTH_BOUND = 0.2  # a fit whose fixed cost is at most this share of its largest load extrapolates upward
EXPLORE_CAP_BYTES = 256 << 20  # an exploration loads at most this much of the tier it explores


class Plan(NamedTuple):
    blocks: int  # leading stored blocks to load; the rest is recomputed
    reason: str  # "load" (estimated faster) | "recompute" | "explore" (loaded to measure an uncertain tier)


@dataclass(frozen=True, slots=True)
class LoadFit:
    latency_s: float  # fixed cost of one load
    seconds_per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self.seconds_per_byte if self.seconds_per_byte > 0 else float("inf")


class _TierLoads:
    """Recent (bytes, seconds, when) of one tier and the affine fit through them."""

    __slots__ = ("explored", "last_explore", "obs", "prior_latency", "seen", "surprised")

    def __init__(self) -> None:
        self.obs: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self.last_explore = float("-inf")
        self.explored = 0  # explorations planned, ever
        self.prior_latency = 0.0  # used while all observations have one size
        self.seen = 0  # loads observed, ever
        self.surprised = False  # the newest observation disagreed with the fit before it

    def add(self, nbytes: float, seconds: float, now: float, *, seeded: bool = False) -> None:
        before = self.fit()
        if before is not None:
            predicted = before.seconds(nbytes)
            self.surprised = not predicted / SURPRISE <= seconds <= predicted * SURPRISE
        if self.seen == 1 and not seeded and len(self.obs) == 1:
            self.obs.clear()  # the first load paid one-time costs: the second one measures the tier
            self.surprised = False
        self.seen += 1
        self.obs.append((nbytes, seconds, now))

    def fit(self) -> LoadFit | None:
        if not self.obs:
            return None
        ws, xs, ys = [], [], []
        w = 1.0
        for x, y, _ in reversed(self.obs):  # newest first
            ws.append(w)
            xs.append(x)
            ys.append(y)
            w *= DECAY
        sw = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs)) / sw
        my = sum(w * y for w, y in zip(ws, ys)) / sw
        if max(xs) >= SPREAD * min(xs):
            var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
            b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / var
            a = my - b * mx
            if b > 0 and a >= 0:
                return LoadFit(a, b)
            if b > 0:  # noise put the intercept below zero: no fixed cost, slope through the origin
                return LoadFit(0.0, sum(w * y for w, y in zip(ws, ys)) / sum(w * x for w, x in zip(ws, xs)))
            return LoadFit(max(0.0, min(ys)), 0.0)  # time does not grow with size: all of it is fixed cost
        # One size seen: latency and bandwidth cannot be told apart; trusted near that size only.
        a = min(self.prior_latency, my)
        return LoadFit(a, max(0.0, my - a) / mx)

    def certain_for(self, nbytes: float, now: float, stale_s: float) -> bool:
        if self.seen < 2 or self.surprised or now - self.obs[-1][2] > stale_s:
            return False  # a first load alone, a contradicted fit or a stale one: not trusted
        xs = [x for x, _, _ in self.obs]
        lo, hi = min(xs), max(xs)
        if nbytes < lo / SPREAD:
            return False
        if nbytes <= hi * SPREAD:
            return True
        fit = self.fit()  # bigger than any seen: trusted when the fit separated a small fixed cost
        return hi >= SPREAD * lo and fit is not None and fit.latency_s <= BANDWIDTH_BOUND * fit.seconds(hi)


class _Rate:
    """The marginal prefill rate: seconds = overhead + amount / rate, fitted (least squares) over the
    recent prefills. A prefill's time is not proportional to its size: the short tails computed after
    a load (a hundred tokens on a 16k context) pay a per-step overhead that a 16k prefill does not, and
    an average rate over them collapses once most prefills are tails -- recompute then looks several
    times dearer than it is and a disk slower than prefill gets loaded from (1.8 s TTFT against 0.7 s,
    H200, 8B, 2026-12-01). The slope is what a decision needs: the extra time of computing more tokens.
    While the recent sizes are too alike to fit a slope, the last fitted rate stands (or, before any,
    the best amount / seconds seen)."""

    __slots__ = ("_obs", "_value")

    def __init__(self) -> None:
        self._obs: deque[tuple[float, float]] = deque(maxlen=4 * WINDOW)
        self._value: float | None = None

    def observe(self, amount: float, seconds: float) -> None:
        self._obs.append((amount, seconds))
        xs = [x for x, _ in self._obs]
        ys = [y for _, y in self._obs]
        if max(xs) >= 4 * min(xs):
            n = len(xs)
            mx, my = sum(xs) / n, sum(ys) / n
            var = sum((x - mx) ** 2 for x in xs)
            cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            if cov > 0 and my - cov / var * mx >= 0:
                self._value = var / cov
                return
        if self._value is None:
            self._value = max(x / y for x, y in self._obs)

    @property
    def value(self) -> float | None:
        return self._value


class CostModel:
    def __init__(self, flops: Callable[[int, int], float], *, clock: Callable[[], float] = time.monotonic,
                 stale_s: float = 30.0, explore_gap_s: float = 10.0) -> None:
        """flops(n_tokens, ctx): prefill FLOPs of n tokens on top of ctx cached ones (LlamaModel.prefill_flops)."""
        self._flops = flops
        self._clock = clock
        self.stale_s = stale_s
        self.explore_gap_s = explore_gap_s
        self._tiers: dict[int, _TierLoads] = {}
        self._prefill_flops = _Rate()
        self._prefill_tokens = _Rate()

    # --- estimates
    def fit(self, tier: int) -> LoadFit | None:
        t = self._tiers.get(tier)
        return t.fit() if t is not None else None

    @property
    def bandwidth(self) -> dict[int, float]:
        """Fitted load bandwidth per Tier value, bytes per second (for metrics)."""
        out = {}
        for tier in self._tiers:
            f = self.fit(tier)
            if f is not None and f.seconds_per_byte > 0:
                out[tier] = f.bytes_per_s
        return out

    @property
    def flops_per_s(self) -> float | None:
        return self._prefill_flops.value

    @property
    def tokens_per_s(self) -> float | None:
        return self._prefill_tokens.value

    # --- observations
    def seed(self, tier: int, latency_s: float, bytes_per_s: float, block_bytes: int) -> None:
        """Start a tier from figures measured elsewhere: two synthetic loads (1 and 64 blocks), as if seen now."""
        t = self._tiers.setdefault(tier, _TierLoads())
        t.prior_latency = latency_s
        now = self._clock()
        for n in (1, 64):
            t.add(n * block_bytes, latency_s + n * block_bytes / bytes_per_s, now, seeded=True)

    def observe_prefill(self, n_tokens: int, ctx: int, seconds: float) -> None:
        if n_tokens > 0 and seconds > 0:
            self._prefill_flops.observe(self._flops(n_tokens, ctx), seconds)
            self._prefill_tokens.observe(n_tokens, seconds)

    def observe_load(self, tiers: Sequence[int], block_bytes: int, seconds: float) -> None:
        """One completed load. Mixed tiers: the shallower tiers' byte time (where trusted) is taken off
        and the rest charged to the deepest tier, a pessimistic split when nothing is known."""
        if not tiers or seconds <= 0:
            return
        now = self._clock()
        count: dict[int, int] = {}
        for t in tiers:
            count[t] = count.get(t, 0) + 1
        deepest = max(count)
        rest = seconds
        for tier, n in count.items():
            if tier == deepest:
                continue
            f = self.fit(tier)
            state = self._tiers.get(tier)
            if f is not None and state is not None and state.certain_for(n * block_bytes, now, self.stale_s):
                rest -= n * block_bytes * f.seconds_per_byte
        if rest > 0:
            self._tiers.setdefault(deepest, _TierLoads()).add(count[deepest] * block_bytes, rest, now)

    def observe_staged(self, deep: int, shallow: int, n_blocks: int, block_bytes: int, seconds: float) -> None:
        """n_blocks were moved from tier `deep` to tier `shallow` in `seconds` (a prefetch's reads): a Load
        of them from `deep` would have taken that plus the copy from `shallow` (its byte time, where trusted)."""
        if n_blocks <= 0 or seconds <= 0:
            return
        now = self._clock()
        nbytes = n_blocks * block_bytes
        f, state = self.fit(shallow), self._tiers.get(shallow)
        if f is not None and state is not None and state.certain_for(nbytes, now, self.stale_s):
            seconds += nbytes * f.seconds_per_byte
        t = self._tiers.setdefault(deep, _TierLoads())
        t.add(nbytes, seconds, now)
        t.last_explore = now  # measured just now: exploring it by a Load within explore_gap_s adds nothing

    def estimate(self, tiers: Sequence[int], block_bytes: int) -> float | None:
        """Expected seconds of one Load of these blocks (tier of each), None while a tier has no fit."""
        count: dict[int, int] = {}
        for t in tiers:
            count[t] = count.get(t, 0) + 1
        byte_s, latency = 0.0, 0.0
        for tier, n in count.items():
            f = self.fit(tier)
            if f is None:
                return None
            byte_s += n * block_bytes * f.seconds_per_byte
            latency = max(latency, f.latency_s)
        return latency + byte_s

    def recompute_seconds(self, n_tokens: int, ctx: int) -> float | None:
        """Expected seconds to prefill n_tokens on top of ctx cached ones (None before any prefill)."""
        fps = self.flops_per_s
        return self._flops(n_tokens, ctx) / fps if fps else None

    # --- the decision
    def plan(self, tiers: Sequence[int], block_bytes: int, tokens_per_block: int, ctx: int) -> Plan:
        """How many leading blocks of a stored prefix (tier of each given) to load.

        The prefix length that saves the most estimated time (recompute time of those blocks on top
        of `ctx` cached tokens, minus one load's latency and their bytes' time), or all of them to
        explore a tier whose estimate is not trusted for this size (see the module docstring)."""
        if not tiers:
            return Plan(0, "recompute")
        now = self._clock()
        flops_per_s = self.flops_per_s
        count: dict[int, int] = {}
        for t in tiers:
            count[t] = count.get(t, 0) + 1
        uncertain = [t for t, n in count.items()
                     if t not in self._tiers or not self._tiers[t].certain_for(n * block_bytes, now, self.stale_s)]
        if flops_per_s is None:
            return Plan(len(tiers), "explore")  # nothing to compare with yet: loading is how it gets measured
        known = {t: self.fit(t) for t in self._tiers}
        fits: dict[int, LoadFit | None] = {}
        for t in count:
            f = known.get(t)
            if f is None:  # never loaded from: a shallower tier is taken to be no slower than a deeper one
                f = next((known[d] for d in sorted(known) if d > t and known[d] is not None), None)
            fits[t] = f  # None: no estimate at all (not loaded unless explored)
        best = self._best(tiers, fits, block_bytes, tokens_per_block, ctx, flops_per_s)
        if uncertain:
            free = LoadFit(0.0, 0.0)
            hopeful = self._best(tiers, {t: free if t in uncertain else f for t, f in fits.items()}, block_bytes,
                                 tokens_per_block, ctx, flops_per_s)
            if hopeful != best:
                k, target = self._explore_prefix(tiers[:hopeful], uncertain, block_bytes, now)
                if target is not None:
                    state = self._tiers[target]
                    state.last_explore = now
                    state.explored += 1
                    return Plan(max(best, k), "explore")
        return Plan(best, "load" if best else "recompute")

    def _explore_prefix(self, prefix: Sequence[int], uncertain: list[int], block_bytes: int,
                        now: float) -> tuple[int, int | None]:
        """(blocks to load, the tier explored): one uncertain tier at a time, the first in the chain that may
        be explored now (blocks before it are loaded too: they come first), cut where another uncertain
        tier's blocks begin after it -- so that the Load measures that tier alone (a host prefix ahead of
        disk blocks is measured as host, not charged to the disk) -- and where it holds EXPLORE_CAP_BYTES
        (enough to be bandwidth-bound; a whole 1.9 GB history from a 1 GB/s disk would cost the request
        2 s against 0.6 s of prefill)."""
        target = next((t for t in prefix if t in uncertain and self._may_explore(t, now)), None)
        if target is None:
            return 0, None
        cap = max(1, EXPLORE_CAP_BYTES // block_bytes)
        n, started = 0, False
        for i, t in enumerate(prefix):
            if t == target:
                started = True
                n += 1
                if n > cap:
                    return i, target
            elif started and t in uncertain:
                return i, target
        return len(prefix), target

    def _may_explore(self, tier: int, now: float) -> bool:
        """At most once per explore_gap_s -- but a tier's first two loads (a warm-up and the one that
        measures it) are explored as they come."""
        t = self._tiers.setdefault(tier, _TierLoads())
        return now - t.last_explore >= self.explore_gap_s or (t.seen < 2 and t.explored < 2)

    def _best(self, tiers: Sequence[int], fits: dict[int, LoadFit | None], block_bytes: int, tokens_per_block: int,
              ctx: int, flops_per_s: float) -> int:
        """The prefix length with the largest estimated saving (0: recompute everything)."""
        best, best_gain = 0, 0.0
        byte_s, latency = 0.0, 0.0
        for k, tier in enumerate(tiers, 1):
            f = fits[tier]
            if f is None:
                break  # no estimate for this tier: not loaded (from here on) unless explored
            byte_s += block_bytes * f.seconds_per_byte
            latency = max(latency, f.latency_s)
            gain = self._flops(k * tokens_per_block, ctx) / flops_per_s - (latency + byte_s)
            if gain > best_gain:
                best, best_gain = k, gain
        return best
