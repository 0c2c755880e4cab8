"""The data plane's peer check: a session's calls are served only on its own uid's listener.

gRPC over a Unix socket does not tell a servicer who is calling (grpc.aio gives `context.peer()`
== "unix:" and an auth context without credentials). What the kernel does decide is who can
connect to a socket file: the daemon serves each uid's sessions on a socket only that uid can
open (its own uid's on socket_path, mode 0600; another allowed uid's on socket_path.uid<N>,
mode 0600 and owned by that uid). This interceptor, one per listener, refuses a call that names
a session registered by a peer of another listener, so a session id learned by another uid is
useless to it. Unknown ids pass through to the servicer, which answers NOT_FOUND.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvservice.core.cache import BlockCache

KVCACHE_PREFIX = "/kvservice.v1.KVCache/"


class SessionGuard(grpc.aio.ServerInterceptor):
    def __init__(self, cache: BlockCache, listener: str) -> None:
        self._cache = cache
        self._listener = listener
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}  # method -> its wrapped handler, built once

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        guarded = self._guarded.get(method)
        if guarded is not None:
            return guarded
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or not method.startswith(KVCACHE_PREFIX):
            return handler
        guarded = self._guarded[method] = self._wrap(handler)
        return guarded

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner = handler.unary_unary
        cache, listener = self._cache, self._listener

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            peer = cache.session_peer(request.session_id)
            if peer is not None and peer.listener != listener:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "this session was registered by another peer (uid): a session is served only on the data "
                    "socket of the uid that registered it",
                )
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
