"""The Lookup channel's wire: KVCache.Lookup, Store and Load without gRPC, on a plain Unix stream socket.

  lookup_socket_path(socket_path)    where a daemon serves it: beside its gRPC socket
  frame(payload) -> bytes            a 4-byte little-endian length, then that many bytes
  read_frame(sock, limit) -> bytes   one frame from a blocking socket (the engine's side)
  request_frame(session_id, hashes)  frame(LookupRequest(session_id=..., hashes=b"".join(hashes))
                                     .SerializeToString()), the same bytes built in one join
  data_request_parts(...)            a Store or Load ChannelRequest's serialization as parts (the
                                     packed hashes among them, not copied; the ids as block_ids_le32)
  le32(block_ids) -> bytes           the ids as ChannelRequest.block_ids_le32 carries them

The engine sends ChannelRequest frames (a LookupRequest's bytes are one, of call LOOKUP; Store and
Load name their call), the daemon answers each with a ChannelReply frame, in the order asked
(kvservice.v1, proto/kvservice/v1/kvcache.proto). Nothing else travels on it: no descriptors, no
other call. Why it exists: gRPC Python's own empty unary round trip is 0.4-0.6 ms, above the 0.3 ms
a Lookup of 1024 hashes may take (DESIGN §7), and more than an engine's small Store or Load costs
the daemon; a frame on a Unix socket costs ~0.02 ms.
"""

from __future__ import annotations

import socket
import struct
import sys
from array import array
from collections.abc import Sequence

from kvwire.v1 import kvcache_pb2

LOOKUP_SUFFIX = ".lookup"
HEADER = struct.Struct("<I")
MAX_REPLY_BYTES = 1 << 20  # a ChannelReply: a byte per looked-up block, or a status message
RECV_BYTES = 1 << 16
HASH_BYTES = 32
# LookupRequest's field tags (kvservice.v1: session_id = 1, namespace_id = 3, hashes = 4; wire type 2)
_SESSION_ID, _NAMESPACE_ID, _HASHES = b"\x0a", b"\x1a", b"\x22"
_BLOCK_IDS_LE32 = b"\x42"  # ChannelRequest field 8, length-delimited


class LookupFrameError(Exception):
    """The other end sent something that is not a frame, or closed the connection mid-frame."""


def lookup_socket_path(socket_path: str) -> str:
    return socket_path + LOOKUP_SUFFIX


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def request_frame(session_id: str, hashes: Sequence[bytes], namespace_id: str = "") -> bytes | None:
    """A LookupRequest of these hashes, framed: the bytes frame(LookupRequest(session_id=...,
    namespace_id=..., hashes=b"".join(hashes)).SerializeToString()) gives (fields in number order,
    empty ones left out, as protobuf writes them), without the message: the packed hashes are
    copied once more, into the frame (the message, its serialization and the frame copied them
    three times: ~2 of an engine's ~10 us for 1024 hashes). None when the hashes are not n x
    HASH_BYTES bytes-like (the caller says which)."""
    try:
        packed = b"".join(hashes)
    except TypeError:  # not bytes-like
        return None
    size = len(packed)
    if size != HASH_BYTES * len(hashes):
        return None
    parts = [b""]
    if session_id:
        sid = session_id.encode()
        parts += [_SESSION_ID, _varint(len(sid)), sid]
    if namespace_id:
        nid = namespace_id.encode()
        parts += [_NAMESPACE_ID, _varint(len(nid)), nid]
    if size:
        parts += [_HASHES, _varint(size)]
    parts[0] = HEADER.pack(sum(map(len, parts)) + size)
    parts.append(packed)
    return b"".join(parts)


def data_request_parts(call: int, session_id: str, hashes: bytes | memoryview, block_ids: Sequence[int],
                       ttl_seconds: float = 0.0, namespace_id: str = "") -> list[bytes | memoryview]:
    """A Store or Load ChannelRequest (`call`: kvcache_pb2.STORE / LOAD), serialized as parts whose
    concatenation parses as ChannelRequest(call=..., session_id=..., namespace_id=..., hashes=hashes,
    block_ids_le32=<the ids as little-endian uint32>, ttl_seconds=...): the small fields, the hashes
    field's tag and length, the packed hashes themselves (the caller's buffer, not copied), the ids'
    field. Protobuf reads a message's fields in any order, each of these once. Why: a 32768-block
    batch's message and its serialization copied the 1 MiB of hashes twice more, fresh memory each
    call (page faults: ~1 ms a MiB on a VM); the channel writes these parts one after another. The
    ids as 4 bytes each (array('I'): one C pass) rather than packed varints (~0.9 ms for 32768 in
    protobuf). An id outside uint32 raises ValueError, as protobuf's uint32 field does."""
    head = kvcache_pb2.ChannelRequest(call=call, session_id=session_id, namespace_id=namespace_id,
                                      ttl_seconds=ttl_seconds).SerializeToString()
    parts: list[bytes | memoryview] = [head]
    if len(hashes):
        parts += [_HASHES + _varint(len(hashes)), hashes]
    if len(block_ids):
        ids = le32(block_ids)
        parts += [_BLOCK_IDS_LE32 + _varint(len(ids)), ids]
    return parts


def le32(block_ids: Sequence[int]) -> bytes:
    """Block ids as ChannelRequest.block_ids_le32 carries them: little-endian uint32, 4 bytes each."""
    try:
        a = array("I", block_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"block ids must be integers in [0, 2**32): {e}") from None
    if a.itemsize != 4:  # C's unsigned int is 4 bytes on every platform CPython runs on
        raise ValueError("array('I') is not 4 bytes a value on this platform")
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def read_frame(sock: socket.socket, limit: int = MAX_REPLY_BYTES) -> bytes:
    """One frame's payload, on a connection with one request in flight (nothing follows the frame).
    Raises EOFError when the peer closed before a frame began, LookupFrameError when it closed
    inside one, announced more than `limit` bytes or sent more than one frame."""
    buf = sock.recv(RECV_BYTES)  # usually header and payload in one call
    if not buf:
        raise EOFError("the connection was closed")
    while len(buf) < HEADER.size:
        more = sock.recv(RECV_BYTES)
        if not more:
            raise LookupFrameError("the connection was closed inside a frame header")
        buf += more
    (length,) = HEADER.unpack_from(buf)
    if length > limit:
        raise LookupFrameError(f"frame of {length} bytes is longer than {limit}")
    end = HEADER.size + length
    if len(buf) < end:
        chunks = [buf]
        got = len(buf)
        while got < end:
            more = sock.recv(end - got)
            if not more:
                raise LookupFrameError(f"the connection was closed after {got - HEADER.size} of {length} frame bytes")
            chunks.append(more)
            got += len(more)
        buf = b"".join(chunks)
    elif len(buf) > end:
        raise LookupFrameError(f"{len(buf) - end} bytes after the answer: one request, one frame")
    return buf[HEADER.size:]
