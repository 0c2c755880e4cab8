"""The Lookup channel's encodings built without protobuf messages on the hot path: the engine's
framed LookupRequest (kvwire.lookup_frames.request_frame), its Store and Load requests in parts
(data_request_parts) and the daemon's ChannelReply (kvservice.api.convert.lookup_channel_reply)
carry exactly what the messages would."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from kvservice.api import convert
from kvwire.lookup_frames import HEADER, data_request_parts, frame, request_frame
from kvwire.v1 import kvcache_pb2


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 127, 1024, 8192])
def test_request_frame_is_the_framed_serialized_message(n):
    rng = random.Random(n)
    hashes = [rng.randbytes(32) for _ in range(n)]
    for session_id, namespace_id in [("s" * 43, ""), ("", ""), ("x", "a-namespace"), ("é" * 70, "ns/ü")]:
        want = kvcache_pb2.LookupRequest(session_id=session_id, namespace_id=namespace_id, hashes=b"".join(hashes))
        got = request_frame(session_id, hashes, namespace_id)
        assert got == frame(want.SerializeToString())
        (length,) = HEADER.unpack_from(got)
        assert length == len(got) - HEADER.size
        assert kvcache_pb2.LookupRequest.FromString(got[HEADER.size:]) == want


def test_request_frame_takes_any_bytes_like_hash():
    hashes = [bytes(range(32)), bytearray(b"b" * 32), memoryview(b"c" * 32)]
    want = kvcache_pb2.LookupRequest(session_id="s", hashes=b"".join(bytes(h) for h in hashes))
    assert request_frame("s", hashes) == frame(want.SerializeToString())


@pytest.mark.parametrize("hashes", [[b"x" * 31], [b"x" * 32, b"y" * 33], [b"x" * 32, 7], ["x" * 32], [None]])
def test_request_frame_refuses_hashes_that_are_not_32_bytes(hashes):
    assert request_frame("s", hashes) is None


@pytest.mark.parametrize("n", [0, 1, 5, 128, 8192])
@pytest.mark.parametrize("call", [kvcache_pb2.STORE, kvcache_pb2.LOAD])
def test_data_request_parts_concatenate_to_the_serialized_message(n, call):
    rng = random.Random(n)
    packed = rng.randbytes(32 * n)
    # block ids of every varint length, up to the largest uint32
    ids = [rng.choice((0, 1, 127, 128, 16383, 16384, 1 << 21, 1 << 28, (1 << 32) - 1, rng.randrange(1 << 32)))
           for _ in range(n)]
    for session_id, namespace_id, ttl in [("s" * 43, "", 0.0), ("", "", 7.5), ("x", "a-namespace", 1e9), ("é", "ü", 0.25)]:
        for hashes in (packed, memoryview(packed)):  # the caller's buffer travels as given
            parts = data_request_parts(call, session_id, hashes, ids, ttl, namespace_id)
            assert any(p is hashes for p in parts) == bool(n)  # not copied
            want = kvcache_pb2.ChannelRequest(call=call, session_id=session_id, namespace_id=namespace_id,
                                              hashes=packed, block_ids_le32=struct.pack(f"<{n}I", *ids),
                                              ttl_seconds=ttl)
            got = kvcache_pb2.ChannelRequest.FromString(b"".join(bytes(p) for p in parts))
            assert got == want
            assert list(np.frombuffer(got.block_ids_le32, dtype="<u4")) == ids  # as the daemon reads them


@pytest.mark.parametrize("ids", [[-1], [1 << 32], [0, 2.0], ["3"]])
def test_data_request_parts_refuse_an_id_outside_uint32(ids):
    with pytest.raises(ValueError, match="block ids must be integers"):
        data_request_parts(kvcache_pb2.STORE, "s", b"x" * 32 * len(ids), ids)


@pytest.mark.parametrize("tiers", [[], [2], [2] * 1024, [3] * 7, [2] * 100 + [3] + [2] * 5, [3, 2, 3], (2, 2, 2),
                                   [0, 1, 2, 3, 255]])
def test_lookup_channel_reply_carries_each_tier_as_one_byte(tiers):
    reply = convert.lookup_channel_reply(tiers)
    assert reply.prefix_blocks == len(tiers)
    assert list(reply.tiers) == list(tiers)
    assert reply.tiers == bytes(tiers)
    back = kvcache_pb2.ChannelReply.FromString(reply.SerializeToString())
    assert (back.prefix_blocks, list(back.tiers), back.code) == (len(tiers), list(tiers), "")


def test_lookup_channel_reply_refuses_a_tier_above_a_byte():
    with pytest.raises(ValueError):
        convert.lookup_channel_reply([256] * 3)
    with pytest.raises(ValueError):
        convert.lookup_channel_reply([2, 256])
