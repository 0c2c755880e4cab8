#!/usr/bin/env python3
"""Container healthcheck: exit 0 when the kvservice daemon's standard gRPC health service says SERVING.

    python scripts/grpc_health_probe.py [TARGET] [--service NAME] [--timeout SECONDS]

TARGET is the daemon's Unix socket as `unix:///run/kvservice/kvservice.sock` or a bare absolute path,
or `host:port` of its TCP listener; without one, $KVSERVICE_SOCKET_PATH or /run/kvservice/kvservice.sock.
`--service` asks about one service (e.g. kvservice.v1.KVCache); the default "" is the whole server.

Exit status: 0 SERVING; 1 the daemon answered but is not serving (starting, or draining after SIGTERM);
2 no answer (no socket, refused, timed out). One line on stdout says which, so that
`docker inspect` shows why a container is unhealthy.

It imports only grpcio and grpcio-health-checking, not kvservice (no torch), so a probe every few
seconds stays cheap.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_SOCKET = "/run/kvservice/kvservice.sock"
SERVING, NOT_SERVING, UNREACHABLE = 0, 1, 2


def grpc_target(target: str) -> str:
    """A bare absolute path is a Unix socket; anything else is handed to grpc as written."""
    return f"unix:{target}" if target.startswith("/") else target


def probe(target: str, service: str = "", timeout: float = 3.0) -> tuple[int, str]:
    """(exit status, one-line reason) of one grpc.health.v1.Health/Check."""
    try:
        with grpc.insecure_channel(grpc_target(target)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=False
            )
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        if code == grpc.StatusCode.NOT_FOUND:  # the health service does not know this service name
            return NOT_SERVING, f"{target}: service {service!r} unknown to the health service"
        name = code.name if code is not None else "ERROR"
        return UNREACHABLE, f"{target}: no answer ({name}: {e.details() if hasattr(e, 'details') else e})"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    what = f"service {service!r}" if service else "server"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return SERVING, f"{target}: {what} SERVING"
    return NOT_SERVING, f"{target}: {what} {status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="grpc_health_probe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", default=os.environ.get("KVSERVICE_SOCKET_PATH") or DEFAULT_SOCKET,
                   help="unix:///path/to.sock, /path/to.sock or host:port [$KVSERVICE_SOCKET_PATH or %(default)s]")
    p.add_argument("--service", default="", help="service name to ask about; empty: the whole server")
    p.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS", help="deadline of the check")
    args = p.parse_args(argv)
    status, reason = probe(args.target, args.service, args.timeout)
    print(reason, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
