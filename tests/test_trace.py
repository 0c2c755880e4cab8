"""KVTUNE_TRACE's call timelines (kvservice/ops/trace.py, bench/trace_timeline.py): a Store and a Load
in parts leave their stages in order, one `room` / `submitted` / `copied` per part, and the timeline
reader places them in their calls."""

from __future__ import annotations

import json
import os
import sys

import pytest

import kvservice.core.load_path as load_path_mod
import kvservice.core.pipeline as pipeline_mod
import kvservice.core.store_path as store_path_mod
from kvservice.ops.trace import Trace, _Off
from tests.corekit import engine_on, small_config, started_cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from trace_timeline import calls  # noqa: E402


def test_tracing_is_off_unless_asked():
    assert not _Off().enabled and _Off().begin("store", 3) == 0


@pytest.mark.asyncio
async def test_a_store_and_a_load_in_parts_leave_their_stages_in_order(tmp_path, monkeypatch):
    path = str(tmp_path / "trace.jsonl")
    trace = Trace(path)
    monkeypatch.setattr(store_path_mod, "TRACE", trace)
    monkeypatch.setattr(load_path_mod, "TRACE", trace)
    monkeypatch.setattr(pipeline_mod, "PIPELINE_BLOCKS", 2)
    monkeypatch.setattr(pipeline_mod, "PIPELINE_FIRST", 1)
    async with started_cache(small_config(tmp_path, disk_blocks=0, host_capacity_bytes=16 * 4096)) as cache:
        async with engine_on(cache, num_blocks=32) as eng:
            assert [r.status for r in await eng.store(list(range(7)))] == [1] * 7
            assert [r.status for r in await eng.load(list(range(7)))] == [1] * 7
    trace.dump()
    events = [json.loads(line) for line in open(path)]
    assert [e["tag"] for e in events if e["tag"].startswith(("store:", "load:"))] == ["store:7", "load:7"]
    got = calls(path)
    (store,) = got["store:7"]
    tags = [t for t, _ in store]
    # parts of 1, 2, 2, 2 blocks (pipeline.parts): four rooms and copies, one commit, in this order
    assert tags[0] == "reserved" and tags[-2:] == ["committed", "end"]
    assert sum(t.startswith("room") for t in tags) == 4 and sum(t.startswith("copied") for t in tags) == 4
    assert tags.index("room") < tags.index("submitted") < tags.index("room#2")
    assert [ms for _, ms in store] == sorted(ms for _, ms in store)
    (load,) = got["load:7"]
    ltags = [t for t, _ in load]
    assert ltags[0] == "pinned" and ltags[-1] == "end"
    assert sum(t.startswith("submitted") for t in ltags) == 4 == sum(t.startswith("copied") for t in ltags)
