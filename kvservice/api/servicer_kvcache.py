"""KVCache servicer: protobuf in, BlockCache call, protobuf out. No logic of its own.

Sessions are opened on the registration socket (registration.py), not here; each listener's
SessionGuard (session_guard.py) refuses calls for sessions of another peer before they get here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Concatenate, ParamSpec, TypeVar

import grpc

from kvservice.api import convert
from kvservice.core.cache import BlockCache
from kvservice.core.types import CacheError, SessionId
from kvwire.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def maps_cache_errors(
    method: Callable[Concatenate[S, P], Awaitable[R]],
) -> Callable[Concatenate[S, P], Awaitable[R]]:
    """CacheError -> the gRPC status of the same name; anything else -> INTERNAL, logged."""

    @functools.wraps(method)
    async def wrapper(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        context: grpc.aio.ServicerContext = args[1]  # type: ignore[assignment]
        try:
            return await method(self, *args, **kwargs)
        except CacheError as e:
            await context.abort(grpc.StatusCode[e.code.value], e.message)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # a core bug must not take the daemon down, but must be visible
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {type(e).__name__}: {e}")
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, cache: BlockCache) -> None:
        self._cache = cache

    @maps_cache_errors
    async def Heartbeat(
        self, request: kvcache_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> kvcache_pb2.HeartbeatReply:
        return kvcache_pb2.HeartbeatReply(lease_seconds=self._cache.heartbeat(SessionId(request.session_id)))

    @maps_cache_errors
    async def CloseSession(
        self, request: kvcache_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> kvcache_pb2.CloseSessionReply:
        await self._cache.close_session(SessionId(request.session_id))
        return kvcache_pb2.CloseSessionReply()

    @maps_cache_errors
    async def Lookup(self, request: kvcache_pb2.LookupRequest, context: grpc.aio.ServicerContext) -> kvcache_pb2.LookupReply:
        tiers = self._cache.lookup(SessionId(request.session_id), request.hashes, request.namespace_id)
        return convert.lookup_reply(tiers)

    @maps_cache_errors
    async def Store(self, request: kvcache_pb2.StoreRequest, context: grpc.aio.ServicerContext) -> kvcache_pb2.StoreReply:
        results = await self._cache.store(SessionId(request.session_id), request.hashes, request.block_ids,
                                          request.ttl_seconds, request.namespace_id)
        return convert.store_reply(results)

    @maps_cache_errors
    async def Load(self, request: kvcache_pb2.LoadRequest, context: grpc.aio.ServicerContext) -> kvcache_pb2.LoadReply:
        results = await self._cache.load(SessionId(request.session_id), request.hashes, request.block_ids,
                                         request.namespace_id)
        return convert.load_reply(results)

    @maps_cache_errors
    async def Prefetch(
        self, request: kvcache_pb2.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> kvcache_pb2.PrefetchReply:
        results = await self._cache.prefetch(SessionId(request.session_id), request.hashes, request.namespace_id)
        return convert.prefetch_reply(results)

    @maps_cache_errors
    async def Retain(self, request: kvcache_pb2.RetainRequest, context: grpc.aio.ServicerContext) -> kvcache_pb2.RetainReply:
        deadlines = await self._cache.retain(
            SessionId(request.session_id), request.hashes, request.ttl_seconds, request.namespace_id
        )
        return kvcache_pb2.RetainReply(deadlines=deadlines)
