"""KVClientError, and which gRPC status codes mean "the daemon is not there right now".

Detaching codes do not raise: the data call answers as if the cache were empty and the client
re-attaches in the background. Every other code is a real error in the request or the setup
and raises KVClientError, so that, for example, a hash-canary mismatch is never silent.
"""

from __future__ import annotations

import grpc

DETACHING_CODES: frozenset[grpc.StatusCode] = frozenset({
    grpc.StatusCode.UNAVAILABLE,  # daemon down, restarting, or socket missing
    grpc.StatusCode.DEADLINE_EXCEEDED,  # daemon hung or overloaded past the per-call timeout
    grpc.StatusCode.CANCELLED,  # connection torn down mid-call
    grpc.StatusCode.NOT_FOUND,  # session unknown: the daemon restarted or reaped our lease
})


class KVClientError(Exception):
    """A request the daemon (or the client, before sending) refused; `code` says which kind."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def from_rpc_error(err: grpc.aio.AioRpcError) -> KVClientError:
    code = err.code()
    return KVClientError(code, err.details() or code.name)
