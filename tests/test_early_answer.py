"""A Store or Load answers its caller as soon as every block's status is final (pipeline.Answer, the
frames channel's hook): before a Store's commit and a Load's unpins, with no await from there to the
call's return, so nothing runs between the answer and that bookkeeping.
  - a Store (one part, in parts, head first) sends its answer while its blocks are not committed
    yet, and returns in the same event-loop step with the same results; once it returned, the
    blocks are stored;
  - a Load of host hits (one batch, in parts) sends LOADED while the blocks are still pinned, and
    drops the pins in the same step;
  - where a status is not final at that point (retention asked, a hash another Store is copying,
    no room for part of a chunk), nothing is sent early and the call returns its answer as before;
  - a send that raises sent nothing: the Store fails and leaves nothing reserved, and its hashes
    store again;
  - through a real daemon's frames channel, the Store's reply comes before its commit (the call
    timeline of KVTUNE_TRACE says so) and another connection's Load right after it finds every block.
The lifecycle property machine (tests/test_lifecycle_properties.py) passes an answer hook to every
Store and Load it runs, cancelled and concurrent ones included.
"""

from __future__ import annotations

import asyncio
import json

import pytest

import kvservice.core.pipeline as pipeline_mod
from engine_client import KVClient, Namespace, ShmKVPool
from harness.daemon import Daemon
from kvservice.core.types import LoadStatus, StoreResults, StoreStatus, Tier
from tests.corekit import BLOCK, content, engine_on, h, small_config, started_cache
from tests.test_lifecycle_properties import EarlyAnswer

STORED, LOADED = int(StoreStatus.STORED), int(LoadStatus.LOADED)


@pytest.fixture(params=["one-part", "parts", "head-first"])
def parts(monkeypatch, request):
    """How a Store of a few blocks goes: one part, parts of two blocks, or head first (its first
    part's hashes reserved and copied before the rest's)."""
    if request.param != "one-part":
        monkeypatch.setattr(pipeline_mod, "PIPELINE_BLOCKS", 2)
        monkeypatch.setattr(pipeline_mod, "PIPELINE_FIRST", 1)
        monkeypatch.setattr(pipeline_mod, "STORE_GROW", 2)
    monkeypatch.setattr(pipeline_mod, "STORE_FIRST_BYTES", 2 * BLOCK if request.param == "head-first" else 0)
    return request.param


class Watched(EarlyAnswer):
    """An EarlyAnswer that also records, at send time, what a Lookup of the call's hashes saw."""

    def __init__(self, cache, sid, hashes) -> None:
        super().__init__()
        self.cache, self.sid, self.hashes = cache, sid, hashes
        self.seen_at_send: list[int] | None = None

    def _send(self, results) -> None:
        self.seen_at_send = self.cache.lookup(self.sid, self.hashes)
        super()._send(results)


@pytest.mark.asyncio
async def test_a_store_answers_before_its_commit_and_returns_in_that_step(tmp_path, parts):
    async with started_cache(small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)) as cache:
        async with engine_on(cache, num_blocks=32) as eng:
            nums = list(range(7))
            for i in nums:
                eng.pool.write(i, content(i))
            hashes = [h(i) for i in nums]
            early = Watched(cache, eng.sid, hashes)
            res = await cache.store(eng.sid, hashes, nums, answer=early.hook)
            assert early.sent is not None, "no early answer"
            early.check(res)
            await asyncio.sleep(0)
            early.check_late()
            assert bytes(res.status) == bytes([STORED] * 7)
            # sent before the commit: a Lookup at that moment saw the head not stored yet
            assert early.seen_at_send == []
            assert cache.lookup(eng.sid, hashes) == [Tier.HOST] * 7
            assert [r.status for r in await eng.load(nums)] == [LOADED] * 7
            assert cache.audit() == []


@pytest.mark.asyncio
async def test_a_load_answers_before_its_unpins(tmp_path, parts):
    async with started_cache(small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)) as cache:
        async with engine_on(cache, num_blocks=32) as eng:
            nums = list(range(7))
            assert [r.status for r in await eng.store(nums)] == [STORED] * 7
            pins_at_send: list[int] = []
            early = EarlyAnswer()
            real = early._send

            def send(results) -> None:
                blocks = cache._t.index.namespace(cache._session(eng.sid, "").namespace)
                pins_at_send.append(sum(blocks[h(i)].pins for i in nums))
                real(results)
            early.hook = pipeline_mod.Answer(send)
            res = await cache.load(eng.sid, [h(i) for i in nums], list(range(16, 23)), answer=early.hook)
            assert early.sent is not None, "no early answer"
            early.check(res)
            await asyncio.sleep(0)
            early.check_late()
            assert bytes(res.status) == bytes([LOADED] * 7) and bytes(res.tier) == bytes([Tier.HOST] * 7)
            for k, i in enumerate(nums):
                assert eng.pool.read(16 + k) == content(i)
            assert pins_at_send[0] > 0, "sent after the unpins"
            assert cache.audit() == []  # every pin dropped by the time the call returned


@pytest.mark.asyncio
async def test_no_early_answer_where_a_status_is_not_final(tmp_path, parts):
    async with started_cache(small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)) as cache:
        async with engine_on(cache, num_blocks=32) as eng:
            for i in range(16):
                eng.pool.write(i, content(i))
            # retention asked: deadlines come with the commit
            early = EarlyAnswer()
            res = await cache.store(eng.sid, [h(i) for i in range(4)], list(range(4)), 60.0, answer=early.hook)
            assert early.sent is None and all(r.status == StoreStatus.STORED and r.deadline > 0 for r in res)
            # a Load with a miss among host hits still answers early (every status final after the copy)
            early = EarlyAnswer()
            res = await cache.load(eng.sid, [h(0), h(99), h(1)], [20, 21, 22], answer=early.hook)
            early.check(res)
            assert [r.status for r in res] == [LOADED, LoadStatus.MISSING, LOADED]
            # a hash another Store is still copying: answered once that one is over, not early
            first = asyncio.ensure_future(cache.store(eng.sid, [h(6), h(7)], [6, 7]))  # one part, held whole
            await asyncio.sleep(0)
            early = EarlyAnswer()
            second = await cache.store(eng.sid, [h(i) for i in range(6, 10)], list(range(6, 10)), answer=early.hook)
            early.check(second)
            await first
            early.check_late()
            assert early.sent is None
            assert [r.status for r in second] == [StoreStatus.ALREADY_STORED] * 2 + [StoreStatus.STORED] * 2
            assert cache.audit() == []


@pytest.mark.asyncio
async def test_a_send_that_raises_fails_the_store_and_leaves_nothing(tmp_path, parts):
    async with started_cache(small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * BLOCK)) as cache:
        async with engine_on(cache, num_blocks=32) as eng:
            nums = list(range(7))
            for i in nums:
                eng.pool.write(i, content(i))

            def broken(results) -> None:
                raise RuntimeError("the connection's write failed")
            hook = pipeline_mod.Answer(broken)
            with pytest.raises(RuntimeError):
                await cache.store(eng.sid, [h(i) for i in nums], nums, answer=hook)
            assert not hook.sent
            await asyncio.sleep(0.05)  # copy threads done
            assert cache.audit() == []
            assert cache.lookup(eng.sid, [h(i) for i in nums]) == []
            assert [r.status for r in await eng.store(nums)] == [STORED] * 7


def test_the_answer_is_not_sent_while_a_block_has_no_status():
    sent = []
    hook = pipeline_mod.Answer(sent.append)
    r = StoreResults(3)
    r.set(0, StoreStatus.STORED)
    r.set(2, StoreStatus.NOT_STORED, message="no room")
    hook(r)
    assert not sent and not hook.sent
    r.set(1, StoreStatus.STORED)
    hook(r)
    hook(r)
    assert sent == [r] and hook.sent


def test_through_the_frames_channel_the_reply_comes_before_the_commit(tmp_path):
    trace = tmp_path / "trace.jsonl"
    ns = Namespace("early-answer", "float32", 16, "block-contiguous")
    with Daemon(tmp_path / "d", host_capacity="1MiB", disk_capacity=0, env={"KVTUNE_TRACE": str(trace)}) as d, \
            ShmKVPool(64, BLOCK) as pool, ShmKVPool(64, BLOCK) as other_pool:
        for i in range(32):
            pool.write_block(i, content(i))
        with KVClient(d.target, ns, pool) as a, KVClient(d.target, ns, other_pool, client_name="other") as b:
            for round_ in range(20):
                hashes = a.hasher.hash_blocks(range(32 * 16 * (round_ + 1)))[-32:]
                res = a.store(hashes, list(range(32)))
                assert [r.status for r in res] == [STORED] * 32
                loaded = b.load(hashes, list(range(32)))  # another connection, right after the reply
                assert [r.status for r in loaded] == [LOADED] * 32
                assert all(other_pool.read_block(i) == content(i) for i in range(32))
                for i in range(32):
                    other_pool.write_block(i, bytes(BLOCK))
        d.stop()  # the daemon writes its call timelines as it exits
    events = [json.loads(line) for line in open(trace)]
    loop_events = [e for e in events if e["thread"] == events[0]["thread"]]
    begun = [k for k, e in enumerate(loop_events) if e["tag"] == "store:32"]
    assert len(begun) == 20, "not every Store went over the frames channel"
    for k in begun:
        call = loop_events[k]["call"]
        rest = loop_events[k:]
        committed = next(j for j, e in enumerate(rest) if e["call"] == call and e["tag"] == "committed")
        sent = next(j for j, e in enumerate(rest) if e["tag"] == "channel.sent")
        assert sent < committed, "the Store's reply was sent after its commit"


@pytest.mark.asyncio
async def test_the_work_after_an_answer_runs_in_steps_between_requests(tmp_path, monkeypatch):
    """An evicting Store leaves two things for after its answer: the entries it let go of are freed,
    and the blank entries it took are built again. For a Store with no early answer (gRPC: its return
    is its reply) they run as a task, a step at a time: when the Store returns, neither is done; a
    Load sent at once is served; a few loop steps later both are."""
    import kvservice.core.lifecycle as lifecycle_mod
    monkeypatch.setattr(lifecycle_mod, "TIDY_BLOCKS", 2)
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=8 * BLOCK, max_batch_blocks=16)
    async with started_cache(cfg) as cache:
        life = cache.tiers.life
        assert len(life.blanks) == life.blanks.limit == 16  # built at start
        async with engine_on(cache, num_blocks=32) as eng:
            assert [r.status for r in await eng.store(list(range(8)))] == [STORED] * 8  # fills the tier
            while cache._tidying is not None:
                await asyncio.sleep(0)
            assert [r.status for r in await eng.store(list(range(8, 16)))] == [STORED] * 8  # evicts 0-7
            assert len(life.blanks) < 16 and life._dropped, "tidied before the Store returned"
            assert cache._tidying is not None
            assert [r.status for r in await eng.load(list(range(8, 16)))] == [LOADED] * 8
            for _ in range(50):
                if cache._tidying is None:
                    break
                await asyncio.sleep(0)
            assert cache._tidying is None and not life._dropped and len(life.blanks) == 16
            assert cache.lookup(eng.sid, [h(i) for i in range(8)]) == []
            assert cache.audit() == []


@pytest.mark.asyncio
async def test_with_tidy_at_the_answer_an_answered_store_does_that_work_before_it_returns(tmp_path, monkeypatch):
    """KVTUNE_TIDY=answer: a Store whose answer is out (the frames channel's hook) frees the entries it
    let go of and builds the blank entries back before it returns, so the engine's next request (read
    after the call) runs with nothing of it left beside it; a Store with no early answer (gRPC) leaves
    that work to the stepped task, so its reply never waits for it."""
    monkeypatch.setattr(pipeline_mod, "TIDY", "answer")
    cfg = small_config(tmp_path, disk_blocks=0, host_capacity_bytes=8 * BLOCK, max_batch_blocks=16)
    async with started_cache(cfg) as cache:
        life = cache.tiers.life
        async with engine_on(cache, num_blocks=32) as eng:
            for i in range(24):
                eng.pool.write(i, content(i))
            assert [r.status for r in await eng.store(list(range(8)))] == [STORED] * 8  # fills the tier
            while cache._tidying is not None:
                await asyncio.sleep(0)
            hashes = [h(i) for i in range(8, 16)]
            early = EarlyAnswer()
            res = await cache.store(eng.sid, hashes, list(range(8, 16)), answer=early.hook)  # evicts 0-7
            assert early.sent is not None and bytes(res.status) == bytes([STORED] * 8)
            assert not life._dropped and len(life.blanks) == 16, "left for later although answered"
            assert cache._tidying is None
            assert [r.status for r in await eng.store(list(range(16, 24)))] == [STORED] * 8  # no hook: evicts 8-15
            assert life._dropped and cache._tidying is not None, "an unanswered Store did the work before its reply"
            for _ in range(50):
                if cache._tidying is None:
                    break
                await asyncio.sleep(0)
            assert not life._dropped and len(life.blanks) == 16
            assert [r.status for r in await eng.load(list(range(16, 24)))] == [LOADED] * 8
            assert cache.lookup(eng.sid, [h(i) for i in range(16)]) == []
            assert cache.audit() == []
