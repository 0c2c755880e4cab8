"""The Prefetch path of BlockCache (a mixin: it runs on BlockCache's state).

  prefetch(hashes)  stage disk blocks into host memory under a lease, lease host blocks once; a
                    session's leases hold at most prefetch_share of the host tier and all
                    sessions' prefetch_total_share, and a refusal says which cap (DESIGN §5).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvservice.core.sessions import Session
from kvservice.core.types import PrefetchResult, PrefetchStatus, SessionId, Tier
from kvservice.placement.index import Entry


class PrefetchPath:
    """Prefetch and its lease caps; mixed into BlockCache, whose state it uses:
    self._t (Tiers), self.stats, self.clock, self.config, self._sessions, self._prefetch_latency,
    self._prefetch_read_latency, self._session(), self._hashes()."""

    async def prefetch(self, session_id: SessionId, hashes: bytes | Sequence[bytes],
                       namespace_id: str = "") -> list[PrefetchResult]:
        """Stage disk blocks into the host tier under a lease. A session's leases hold at most
        prefetch_share of the host tier, and all sessions' leases together prefetch_total_share
        (the rest is refused, with the reason: many sessions must not pin the whole tier between
        them); a block already in host memory is leased once, never renewed by another prefetch
        while its lease runs."""
        t0 = time.perf_counter()
        s = self._session(session_id, namespace_id)
        hashes = self._hashes(hashes)
        t = self._t
        life = t.life
        now = self.clock.now()
        seconds = self.config.pin_lease_seconds
        out: list[PrefetchResult] = []
        get = t.index.namespace(s.namespace).get
        to_read: list[tuple[int, Entry]] = []
        life.end_expired_leases(now)  # ran out, not reaped yet: no longer count
        budget = min(self._lease_cap() - life.leases.owned_bytes(s.id),
                     self._total_lease_cap() - life.leases.total_bytes)
        not_found = PrefetchResult(PrefetchStatus.NOT_FOUND)
        in_host = PrefetchResult(PrefetchStatus.ALREADY_IN_HOST)
        lease_now: dict[int, Entry] = {}  # in host memory, no lease running: leased as one batch below
        leasing = 0  # their bytes
        for h in hashes:
            e = get(h)
            if e is None or not e.ready or e.tier == Tier.NONE:
                out.append(not_found)
            elif e.in_memory:
                # a running lease (this session's or another's) is not renewed
                if e.lease_until <= now and id(e) not in lease_now:
                    if e.size > budget:
                        out.append(self._over_cap(s, leasing))
                        continue
                    budget -= e.size
                    leasing += e.size
                    lease_now[id(e)] = e
                out.append(in_host)
            elif e.size > budget:
                out.append(self._over_cap(s, leasing))
            else:
                budget -= e.size
                to_read.append((len(out), e))
                out.append(PrefetchResult(PrefetchStatus.STAGED))
        if lease_now:
            life.lease_many(s.id, list(lease_now.values()), now, seconds, staged=False)
        reading = [e for _, e in to_read]
        if not reading:
            self._prefetch_latency.observe(time.perf_counter() - t0)
            return out
        life.pin(reading)
        try:
            # one coalesced read, straight into host slots where there is room (no copy on the loop)
            reads = await t.read_batch(reading, s.memory.alloc_host, s.block_bytes)
            self._prefetch_read_latency.observe(time.perf_counter() - t0)
            late: list[tuple[int, Entry, torch.Tensor]] = []  # landed in scratch, no free or clean slot left
            for (pos, e), (r, onboarded) in zip(to_read, reads):
                if isinstance(r, BaseException):
                    out[pos] = PrefetchResult(PrefetchStatus.FAILED, f"disk read failed, block discarded: {r}")
                elif not onboarded and not e.in_memory:
                    late.append((pos, e, r))
            if late:  # one eviction plan and one wait for its spills, not a wait per block
                await t.onboard_many([e for _, e, _ in late], [r for _, _, r in late])
                for pos, e, _ in late:
                    if not e.in_memory:
                        out[pos] = PrefetchResult(PrefetchStatus.FAILED,
                                                  "no room in the host tier: it is pinned by loads and prefetches")
            for pos, e in to_read:
                if out[pos].status != PrefetchStatus.STAGED:
                    continue
                if e.lease_until <= now and self._sessions.find(s.id) is s:  # its session may have closed meanwhile
                    life.lease(s.id, e, now, seconds, staged=True)
                self.stats.bump(s.namespace, "prefetch_staged")
        finally:
            life.unpin(reading)
        self._prefetch_latency.observe(time.perf_counter() - t0)
        return out

    def _lease_cap(self) -> int:
        return int(self.config.prefetch_share * self._t.host.capacity_bytes)

    def _total_lease_cap(self) -> int:
        return int(self.config.prefetch_total_share * self._t.host.capacity_bytes)

    def _over_cap(self, s: Session, leasing: int = 0) -> PrefetchResult:
        """Why a prefetch is refused; `leasing`: bytes this call is about to lease."""
        book = self._t.life.leases
        mine, total = book.owned_bytes(s.id) + leasing, book.total_bytes + leasing
        if self._lease_cap() - mine <= self._total_lease_cap() - total:
            why = (f"this session's prefetch leases hold {mine} bytes; its cap is "
                   f"{self._lease_cap()} (prefetch_share {self.config.prefetch_share:g} of the host tier)")
        else:
            why = (f"the prefetch leases of all sessions hold {total} bytes; their cap is {self._total_lease_cap()} "
                   f"(prefetch_total_share {self.config.prefetch_total_share:g} of the host tier)")
        return PrefetchResult(PrefetchStatus.FAILED, why)
