"""`kvservice serve` and `kvservice check-config`: flags -> load_config -> serve.

Every Config field has a flag; flags override KVSERVICE_* environment variables, which override
the TOML file (--config, or KVSERVICE_CONFIG), which overrides the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import kvservice
from kvservice.ops.config import (
    Config, ConfigError, config_to_toml, config_warnings, format_duration, format_size, load_config,
)

# field -> (flag, metavar, help); booleans get --flag / --no-flag
FLAGS: dict[str, tuple[str, str, str]] = {
    "socket_path": ("--socket-path", "PATH", "Unix socket engines connect to (created mode 0600)"),
    "tcp_address": ("--tcp", "HOST:PORT", "also listen on TCP (loopback unless --allow-remote-tcp)"),
    "allowed_uids": ("--allowed-uids", "UIDS", "other uids that may open sessions, e.g. 1000,1001 (each gets a data socket)"),
    "allow_remote_tcp": ("--allow-remote-tcp", "", "allow --tcp on a non-loopback address"),
    "tcp_admin_mutations": ("--tcp-admin-mutations", "", "serve Evict/ResetCanary over TCP too (needs --admin-token)"),
    "metrics_address": ("--metrics", "HOST:PORT", "serve Prometheus /metrics here (loopback unless allowed)"),
    "allow_remote_metrics": ("--allow-remote-metrics", "", "allow --metrics on a non-loopback address"),
    "admin_token": ("--admin-token", "TOKEN", "require this token for Evict/ResetCanary (prefer KVSERVICE_ADMIN_TOKEN)"),
    "host_capacity_bytes": ("--host-capacity", "SIZE", "host tier size, e.g. 4GiB, 8Gi, 16G (G = 10^9, Gi = 2^30)"),
    "disk_path": ("--disk-path", "DIR", "disk tier directory; empty: no disk tier"),
    "disk_capacity_bytes": ("--disk-capacity", "SIZE", "disk tier size, e.g. 100GiB"),
    "admission_gate": ("--admission-gate", "GATE", "all | retained-only | min-reuse=K"),
    "protect_unexpired": ("--protect-unexpired", "", "never evict unexpired retained blocks from disk"),
    "retained_cap_bytes": ("--retained-cap", "SIZE", "retained bytes per namespace; 0: no cap"),
    "max_ttl_seconds": ("--max-ttl", "DURATION", "clamp retention TTLs to this (e.g. 7d, 1w, 36h)"),
    "write_queue_depth": ("--write-queue-depth", "N", "disk writes that may wait for a writer (beyond those in progress)"),
    "write_queue_policy": ("--write-queue-policy", "POLICY", "wait | shed, when the write queue is full"),
    "onboard_disk_hits": ("--onboard-disk-hits", "MODE",
                          "always | clean: a Load's disk blocks that find no free or clean host slot are onboarded "
                          "after the reply, spilling the blocks they replace (always), or only served (clean)"),
    "writer_threads": ("--writer-threads", "N", "disk writer threads"),
    "reader_threads": ("--reader-threads", "N", "disk reader threads"),
    "io_backend": ("--io-backend", "BACKEND", "auto | posix | kvikio"),
    "disk_format": ("--disk-format", "FORMAT", "segments (default: segment files + SQLite metadata) | files (legacy: one file per block)"),
    "disk_read_bytes_per_second": ("--disk-read-bytes-per-second", "SIZE", "cap disk reads, e.g. 200MiB; 0: no cap"),
    "disk_write_bytes_per_second": ("--disk-write-bytes-per-second", "SIZE", "cap disk writes, e.g. 200MiB; 0: no cap"),
    "lease_seconds": ("--lease-seconds", "DURATION", "reap a session after this long without a heartbeat"),
    "pin_lease_seconds": ("--pin-lease-seconds", "DURATION", "how long prefetched blocks stay pinned"),
    "prefetch_share": ("--prefetch-share", "FRACTION", "most of the host tier one session's prefetch leases may pin"),
    "prefetch_total_share": ("--prefetch-total-share", "FRACTION",
                             "most of the host tier all sessions' prefetch leases together may pin"),
    "max_batch_blocks": ("--max-batch-blocks", "N", "blocks per data RPC"),
    "max_sessions": ("--max-sessions", "N", "open engine sessions"),
    "max_sessions_per_uid": ("--max-sessions-per-uid", "N", "open engine sessions of one uid"),
    "log_level": ("--log-level", "LEVEL", "debug | info | warning | error | critical"),
}
assert set(FLAGS) == set(Config.__dataclass_fields__), "every Config field needs a flag"


def _shown_default(field: str, default: object) -> str:
    """A default as an operator would type it: 4GiB, 7d, off."""
    if field.endswith(("_bytes", "_bytes_per_second")):
        return format_size(int(default))  # type: ignore[call-overload]
    if field.endswith("_seconds"):
        return format_duration(float(default))  # type: ignore[arg-type]
    if default == "":
        return "none"
    return str(default)


def _config_flags() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--config", metavar="FILE", help="TOML file (flat: field = value); default $KVSERVICE_CONFIG")
    for field, (flag, metavar, help_text) in FLAGS.items():
        default = getattr(Config(), field)
        if isinstance(default, bool):
            parent.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parent.add_argument(flag, dest=field, metavar=metavar, default=None,
                                help=f"{help_text} (default: {_shown_default(field, default)})")
    return parent


def build_parser() -> argparse.ArgumentParser:
    parent = _config_flags()
    parser = argparse.ArgumentParser(prog="kvservice", description="Node-local KV-cache daemon for LLM inference engines")
    parser.add_argument("--version", action="version", version=f"kvservice {kvservice.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", parents=[parent], help="run the daemon")
    sub.add_parser("check-config", parents=[parent], help="validate the configuration and print it as TOML")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {field: getattr(args, field) for field in FLAGS}
    try:
        config = load_config(args.config, os.environ, overrides)
    except ConfigError as e:
        print(f"kvservice: configuration error: {e}", file=sys.stderr)
        return 2
    for warning in config_warnings(config):
        print(f"kvservice: warning: {warning}", file=sys.stderr)
    if args.command == "check-config":
        sys.stdout.write(config_to_toml(config))
        return 0

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from kvservice.api.server import StartupError, serve  # grpc and the core load only when serving
    from kvservice.ops.heap import keep_transient_buffers

    keep_transient_buffers()  # the daemon's own process: a call's MiB-sized buffers stay mapped (ops/heap.py)
    try:
        asyncio.run(serve(config))
    except StartupError as e:
        print(f"kvservice: cannot start: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
