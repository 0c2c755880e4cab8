"""Admin servicer: the operator surface (grpcurl through reflection) over the same core figures."""

from __future__ import annotations

import hmac

import grpc

import kvservice
from kvservice.api import convert
from kvservice.core.cache import BlockCache
from kvservice.core.clock import Clock
from kvservice.ops.config import Config, config_to_toml
from kvservice.api.servicer_kvcache import maps_cache_errors
from kvservice.core.types import CacheError, ErrorCode, NamespaceId
from kvwire.v1 import admin_pb2, admin_pb2_grpc


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, cache: BlockCache, config: Config, clock: Clock, *, mutations: bool = True,
                 listener: str = "the Unix socket") -> None:
        """mutations=False: a read-only listener (TCP by default); Evict and ResetCanary are refused."""
        self._cache = cache
        self._config = config
        self._clock = clock
        self._started_at = clock.now()
        self._mutations = mutations
        self._listener = listener

    def _authorize_mutation(self, method: str, presented: str) -> None:
        if not self._mutations:
            raise CacheError(ErrorCode.PERMISSION_DENIED,
                             f"{method} is not served on {self._listener}: it serves read-only Admin calls; call it "
                             "on the Unix socket (or run the daemon with tcp_admin_mutations and an admin_token)")
        token = self._config.admin_token
        if token and not hmac.compare_digest(presented.encode(), token.encode()):
            raise CacheError(ErrorCode.PERMISSION_DENIED, "admin_token is missing or wrong")

    @maps_cache_errors
    async def Stats(self, request: admin_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> admin_pb2.StatsReply:
        c = self._cache
        queues = c.queue_depths()
        return admin_pb2.StatsReply(
            version=kvservice.__version__,
            io_backend=c.io_backend_name,
            tiers=[convert.tier_stats(t) for t in c.tier_stats()],
            counters=convert.counters(c.counters),
            namespaces=[convert.namespace_stats(n) for n in c.namespace_stats()],
            write_queue_depth=queues.get("write_queue_depth", 0),
            writes_in_progress=queues.get("writes_in_progress", 0),
            write_queue_high_water=queues.get("write_queue_high_water", 0),
            write_queue_capacity=queues.get("write_queue_capacity", 0),
            read_queue_depth=queues.get("read_queue_depth", 0),
            latencies=[convert.histogram(h) for h in c.latencies],
            sessions=len(c.sessions()),
            uptime_seconds=max(0.0, self._clock.now() - self._started_at),
        )

    @maps_cache_errors
    async def ListNamespaces(
        self, request: admin_pb2.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListNamespacesReply:
        return admin_pb2.ListNamespacesReply(namespaces=[convert.namespace_stats(n) for n in self._cache.namespace_stats()])

    @maps_cache_errors
    async def ListSessions(
        self, request: admin_pb2.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListSessionsReply:
        return admin_pb2.ListSessionsReply(sessions=[convert.session_info(s) for s in self._cache.sessions()])

    @maps_cache_errors
    async def Evict(self, request: admin_pb2.EvictRequest, context: grpc.aio.ServicerContext) -> admin_pb2.EvictReply:
        self._authorize_mutation("Evict", request.admin_token)
        target = request.WhichOneof("target")
        if target == "namespace_id" and request.namespace_id:
            evicted = await self._cache.evict(namespace=NamespaceId(request.namespace_id))
        elif target == "expired" and request.expired:
            evicted = await self._cache.evict(expired=True)
        elif target == "all" and request.all:
            evicted = await self._cache.evict(all=True)
        else:
            raise CacheError(
                ErrorCode.INVALID_ARGUMENT,
                'Evict needs exactly one target: namespace_id (non-empty), "expired": true or "all": true',
            )
        return admin_pb2.EvictReply(evicted_blocks=evicted)

    @maps_cache_errors
    async def DescribeBlocks(
        self, request: admin_pb2.DescribeBlocksRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DescribeBlocksReply:
        if not request.namespace_id:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, "namespace_id is required (see Admin/ListNamespaces)")
        hashes = convert.hex_hashes(request.hashes)
        details = self._cache.describe_blocks(NamespaceId(request.namespace_id), hashes)
        return admin_pb2.DescribeBlocksReply(
            blocks=[convert.block_info(h.hex(), d) for h, d in zip(hashes, details)])

    @maps_cache_errors
    async def ResetCanary(
        self, request: admin_pb2.ResetCanaryRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ResetCanaryReply:
        self._authorize_mutation("ResetCanary", request.admin_token)
        if not request.namespace_id:
            raise CacheError(ErrorCode.INVALID_ARGUMENT, "ResetCanary needs namespace_id (from ListNamespaces)")
        return admin_pb2.ResetCanaryReply(was_set=self._cache.reset_canary(NamespaceId(request.namespace_id)))

    async def GetConfig(
        self, request: admin_pb2.GetConfigRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetConfigReply:
        return admin_pb2.GetConfigReply(toml=config_to_toml(self._config))
