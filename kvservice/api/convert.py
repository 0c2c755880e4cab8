"""Protobuf <-> core translations for the servicers; the only module that knows both shapes.

Request parsing validates what the core cannot see from its own arguments (the pool description
and namespace fields); malformed input raises CacheError(INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

from kvservice.core.sessions_api import NamespaceSpec, OpenedSession, PoolRegion, PoolSpec, SessionInfo
from kvservice.ops.stats import Counters, Histogram
from kvservice.core.types import HASH_BYTES, CacheError, ErrorCode, LoadResults, PrefetchResult, StoreResults
from kvwire.ids import MAX_BLOCKS_PER_KEY
from kvwire.v1 import admin_pb2, kvcache_pb2

CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)
MAX_LABEL_CHARS = 256  # model ids, dtypes, layouts, salts, client names
UINT32_MAX = (1 << 32) - 1
# the most one block adds to a data or admin request: a packed Store/Load block is 32 hash bytes plus
# its packed uint32 ids (<= 5 bytes each, MAX_BLOCKS_PER_KEY of them), a hash as hex text
# (Admin.DescribeBlocks) 67
REQUEST_BYTES_PER_BLOCK = 32 + 5 * MAX_BLOCKS_PER_KEY + 16
REQUEST_BASE_BYTES = 2 << 20  # session id, namespace id, options: an odd 1 MiB string still gets its reason


def max_request_bytes(max_batch_blocks: int) -> int:
    """The gRPC receive limit: the largest valid request of max_batch_blocks blocks, with headroom.
    Anything larger is refused (RESOURCE_EXHAUSTED) before it is parsed, so no client can make the
    daemon buffer and decode a giant message."""
    return REQUEST_BASE_BYTES + REQUEST_BYTES_PER_BLOCK * max_batch_blocks


def _invalid(message: str) -> CacheError:
    return CacheError(ErrorCode.INVALID_ARGUMENT, message)


def _label(field: str, value: str, *, required: bool) -> str:
    if required and not value:
        raise _invalid(f"{field} is required")
    if len(value) > MAX_LABEL_CHARS:
        raise _invalid(f"{field} is longer than {MAX_LABEL_CHARS} characters")
    return value


# --- requests -> core


def namespace_spec(request: kvcache_pb2.OpenSessionRequest) -> NamespaceSpec:
    if not request.HasField("namespace"):
        raise _invalid("namespace is required")
    ns = request.namespace
    if ns.tokens_per_block == 0:
        raise _invalid("namespace.tokens_per_block must be > 0")
    if ns.tp_size == 0:
        raise _invalid("namespace.tp_size must be >= 1")
    if ns.tp_rank >= ns.tp_size:
        raise _invalid(f"namespace.tp_rank {ns.tp_rank} must be < namespace.tp_size {ns.tp_size}")
    return NamespaceSpec(
        model_id=_label("namespace.model_id", ns.model_id, required=True),
        kv_dtype=_label("namespace.kv_dtype", ns.kv_dtype, required=True),
        tokens_per_block=ns.tokens_per_block,
        layout=_label("namespace.layout", ns.layout, required=False),
        tp_rank=ns.tp_rank,
        tp_size=ns.tp_size,
        cache_salt=_label("namespace.cache_salt", ns.cache_salt, required=False),
    )


def pool_spec(request: kvcache_pb2.OpenSessionRequest, shm_fd: int = -1) -> PoolSpec:
    """Checks that every block of every region lies inside the described allocation. `shm_fd` is
    the descriptor that came with the request (the pool's memory for a shared-memory pool)."""
    if not request.HasField("pool"):
        raise _invalid("pool is required")
    pool = request.pool
    kind = pool.WhichOneof("handle")
    if kind is None:
        raise _invalid("pool must have exactly one handle: pool.shm or pool.cuda")
    if pool.num_blocks == 0:
        raise _invalid("pool.num_blocks must be > 0")
    if not pool.regions:
        raise _invalid("pool.regions must not be empty")
    size = pool.shm.size if kind == "shm" else pool.cuda.size
    if size == 0:
        raise _invalid(f"pool.{kind}.size must be > 0")
    regions = []
    for i, r in enumerate(pool.regions):
        if r.block_bytes == 0:
            raise _invalid(f"pool.regions[{i}].block_bytes must be > 0")
        if pool.num_blocks > 1 and r.block_stride < r.block_bytes:
            raise _invalid(f"pool.regions[{i}].block_stride {r.block_stride} is smaller than its block_bytes {r.block_bytes}")
        end = r.offset + (pool.num_blocks - 1) * r.block_stride + r.block_bytes
        if end > size:
            raise _invalid(
                f"pool.regions[{i}] ends at byte {end} (offset + (num_blocks-1)*block_stride + block_bytes), "
                f"past pool.{kind}.size {size}"
            )
        regions.append(PoolRegion(offset=r.offset, block_stride=r.block_stride, block_bytes=r.block_bytes))
    if sum(r.block_bytes for r in regions) > UINT32_MAX:
        raise _invalid("pool block size (sum of regions' block_bytes) must fit in 32 bits")
    per_key = pool.blocks_per_key or 1
    if per_key > MAX_BLOCKS_PER_KEY:
        raise _invalid(f"pool.blocks_per_key must be 1..{MAX_BLOCKS_PER_KEY} (0 means 1), got {per_key}")
    if per_key > pool.num_blocks:
        raise _invalid(f"pool.blocks_per_key {per_key} is more than the pool's {pool.num_blocks} blocks")
    if sum(r.block_bytes for r in regions) * per_key > UINT32_MAX:
        raise _invalid("a daemon block (pool block size x blocks_per_key) must fit in 32 bits")

    if kind == "shm":
        if shm_fd < 0:
            raise _invalid("pool.shm: the segment's file descriptor must travel with the registration (SCM_RIGHTS); "
                           "the daemon never opens a segment by name")
        return PoolSpec(kind="shm", num_blocks=pool.num_blocks, regions=tuple(regions), size=size, shm_fd=shm_fd,
                        blocks_per_key=per_key)
    cuda = pool.cuda
    if len(cuda.handle) != CUDA_IPC_HANDLE_BYTES:
        raise _invalid(f"pool.cuda.handle must be {CUDA_IPC_HANDLE_BYTES} bytes, got {len(cuda.handle)}")
    if cuda.event_handle and len(cuda.event_handle) != CUDA_IPC_HANDLE_BYTES:
        raise _invalid(f"pool.cuda.event_handle must be empty or {CUDA_IPC_HANDLE_BYTES} bytes, got {len(cuda.event_handle)}")
    if cuda.device_index < 0:
        raise _invalid("pool.cuda.device_index must be >= 0")
    return PoolSpec(
        kind="cuda",
        num_blocks=pool.num_blocks,
        regions=tuple(regions),
        size=size,
        cuda_handle=cuda.handle,
        cuda_device_index=cuda.device_index,
        cuda_device_uuid=_label("pool.cuda.device_uuid", cuda.device_uuid, required=False),
        cuda_event_handle=cuda.event_handle,
        blocks_per_key=per_key,
    )


def client_name(request: kvcache_pb2.OpenSessionRequest) -> str:
    return _label("client_name", request.client_name, required=False)


# --- core -> replies


def open_session_reply(opened: OpenedSession) -> kvcache_pb2.OpenSessionReply:
    return kvcache_pb2.OpenSessionReply(
        session_id=opened.session_id,
        namespace_id=opened.namespace_id,
        lease_seconds=opened.lease_seconds,
        max_batch_blocks=opened.max_batch_blocks,
        block_bytes=opened.block_bytes,
        label=opened.label,
    )


def lookup_reply(tiers: Sequence[int]) -> kvcache_pb2.LookupReply:
    """`tiers`: the stored prefix's tier values (BlockCache.lookup stops at the first miss)."""
    return kvcache_pb2.LookupReply(prefix_blocks=len(tiers), tiers=tiers)


def lookup_channel_reply(tiers: Sequence[int]) -> kvcache_pb2.ChannelReply:
    """The same answer for the Lookup channel: its tiers one byte each (Tier values are < 256).
    A prefix all in one tier (the usual answer: all in host memory) is one repeated byte:
    list.count and a bytes repeat cost ~1 us for 1024 blocks, bytes(list) ~6."""
    n = len(tiers)
    if n and isinstance(tiers, list) and tiers.count(tiers[0]) == n:
        packed = bytes((tiers[0],)) * n
    else:
        packed = bytes(tiers)
    return kvcache_pb2.ChannelReply(prefix_blocks=n, tiers=packed)


def _messages(messages: Mapping[int, str]) -> list[kvcache_pb2.BlockMessage]:
    return [kvcache_pb2.BlockMessage(index=i, message=m) for i, m in sorted(messages.items())]


def store_reply(results: StoreResults) -> kvcache_pb2.StoreReply:
    """Packed: a status per block, deadlines only when one is set, messages for the exceptions."""
    return kvcache_pb2.StoreReply(statuses=results.status, deadlines=results.deadline or (),
                                  messages=_messages(results.messages))


def load_reply(results: LoadResults) -> kvcache_pb2.LoadReply:
    return kvcache_pb2.LoadReply(statuses=results.status, tiers=results.tier, messages=_messages(results.messages))


def channel_block_ids(request: kvcache_pb2.ChannelRequest):
    """A Store's or Load's block ids off the frames channel: block_ids_le32 (what KVClient sends) as a
    numpy array over the request's bytes, or the packed block_ids field. INVALID_ARGUMENT for both at
    once, or a block_ids_le32 that is not a whole number of 4-byte ids."""
    raw = request.block_ids_le32
    if not raw:
        return request.block_ids
    if len(request.block_ids):
        raise CacheError(ErrorCode.INVALID_ARGUMENT, "ChannelRequest has both block_ids and block_ids_le32: send one")
    if len(raw) % 4:
        raise CacheError(ErrorCode.INVALID_ARGUMENT,
                         f"block_ids_le32 has {len(raw)} bytes, not a multiple of 4 (little-endian uint32 ids)")
    return np.frombuffer(raw, dtype="<u4")


def store_channel_reply(results: StoreResults) -> kvcache_pb2.ChannelReply:
    """store_reply's answer for the frames channel: the statuses one byte each (values < 256)."""
    return kvcache_pb2.ChannelReply(statuses=bytes(results.status), deadlines=results.deadline or (),
                                    messages=_messages(results.messages))


def load_channel_reply(results: LoadResults) -> kvcache_pb2.ChannelReply:
    """load_reply's answer for the frames channel: statuses and tiers one byte each."""
    return kvcache_pb2.ChannelReply(statuses=bytes(results.status), tiers=bytes(results.tier),
                                    messages=_messages(results.messages))


def prefetch_reply(results: Sequence[PrefetchResult]) -> kvcache_pb2.PrefetchReply:
    return kvcache_pb2.PrefetchReply(
        results=[int(r.status) for r in results],
        messages=[kvcache_pb2.BlockMessage(index=i, message=r.message) for i, r in enumerate(results) if r.message])


_COUNTER_FIELDS = frozenset(admin_pb2.Counters.DESCRIPTOR.fields_by_name)


def counters(c: Counters) -> admin_pb2.Counters:
    """Copied by field name, including the derived blocks_offloaded, blocks_loaded_back and recovery_rate."""
    return admin_pb2.Counters(**{k: v for k, v in c.as_dict().items() if k in _COUNTER_FIELDS})


def histogram(h: Histogram) -> admin_pb2.Histogram:
    return admin_pb2.Histogram(name=h.name, bounds=list(h.bounds), counts=list(h.counts), count=h.count, sum=h.sum)


_TIER_FIELDS = frozenset(admin_pb2.TierStats.DESCRIPTOR.fields_by_name)
_NS_FIELDS = frozenset(admin_pb2.NamespaceStats.DESCRIPTOR.fields_by_name) - {"counters"}


def tier_stats(d: Mapping[str, object]) -> admin_pb2.TierStats:
    return admin_pb2.TierStats(**{k: v for k, v in d.items() if k in _TIER_FIELDS})


def namespace_stats(d: Mapping[str, object]) -> admin_pb2.NamespaceStats:
    msg = admin_pb2.NamespaceStats(**{k: v for k, v in d.items() if k in _NS_FIELDS})
    c = d.get("counters")
    if isinstance(c, Counters):
        msg.counters.CopyFrom(counters(c))
    return msg


def timestamp(unix_seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(round(unix_seconds * 1e9)))
    return ts


def hex_hashes(hashes: Sequence[str]) -> list[bytes]:
    """Admin.DescribeBlocks hashes: hex strings of HASH_BYTES bytes each (grpcurl-friendly)."""
    out = []
    for i, h in enumerate(hashes):
        try:
            b = bytes.fromhex(h.strip())
        except ValueError:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, f"hashes[{i}]: {h[:80]!r} is not a hex string") from None
        if len(b) != HASH_BYTES:
            raise CacheError(ErrorCode.INVALID_ARGUMENT,
                             f"hashes[{i}]: {len(b)} bytes, expected {HASH_BYTES} ({2 * HASH_BYTES} hex digits)")
        out.append(b)
    return out


def block_info(hash_hex: str, d: Mapping[str, object] | None) -> admin_pb2.BlockInfo:
    if d is None:
        return admin_pb2.BlockInfo(hash=hash_hex, stored=False)
    msg = admin_pb2.BlockInfo(hash=hash_hex, stored=True, tiers=d["tiers"], disk=d["disk"], retained=d["retained"],
                              pinned=d["pinned"], bytes=d["bytes"], reuse=d["reuse"],
                              stored_at=timestamp(float(d["stored_at"])))  # type: ignore[arg-type]
    if d["deadline"]:
        msg.retained_until.CopyFrom(timestamp(float(d["deadline"])))  # type: ignore[arg-type]
    return msg


def session_info(s: SessionInfo) -> admin_pb2.SessionInfo:
    return admin_pb2.SessionInfo(
        label=s.label,
        uid=s.uid,
        pid=s.pid,
        namespace_id=s.namespace_id,
        client_name=s.client_name,
        pool_kind=s.pool_kind,
        pool_blocks=s.pool_blocks,
        blocks_per_key=s.blocks_per_key,
        opened_at=timestamp(s.opened_at),
        lease_expires_in=s.lease_expires_in,
        pinned_blocks=s.pinned_blocks,
    )
