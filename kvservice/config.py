"""Daemon configuration: one frozen dataclass with documented defaults.

Precedence (lowest to highest): defaults, TOML file (`--config`), environment
(`KVSERVICE_<FIELD>` upper-case), command-line flags. Loading and validation live below the
dataclass; a bad value fails at start with a message that names the setting.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Config:
    # --- listeners
    socket_path: str = "/run/kvservice/kvservice.sock"  # Unix socket, created mode 0600
    tcp_address: str = ""  # e.g. "127.0.0.1:50051"; empty: no TCP listener
    allow_remote_tcp: bool = False  # TCP on a non-loopback address needs this set
    metrics_address: str = ""  # Prometheus endpoint, e.g. "127.0.0.1:9400"; empty: off
    admin_token: str = ""  # when set, Admin.Evict requires it
    # --- host tier
    host_capacity_bytes: int = 4 * GiB
    # --- disk tier (disk_path empty: no disk tier)
    disk_path: str = ""
    disk_capacity_bytes: int = 0
    admission_gate: str = "all"  # "all" | "retained-only" | "min-reuse=K"
    protect_unexpired: bool = False  # unexpired retained blocks are never evicted from disk
    retained_cap_bytes: int = 0  # per namespace; 0: no cap
    max_ttl_seconds: float = 7 * 24 * 3600.0  # larger TTLs are clamped to this
    write_queue_depth: int = 64  # spills waiting for a writer
    write_queue_policy: str = "wait"  # "wait": backpressure | "shed": drop best-effort spills
    writer_threads: int = 4
    reader_threads: int = 4
    io_backend: str = "auto"  # "auto" | "posix" | "kvikio"
    # --- sessions and limits
    lease_seconds: float = 5.0  # a session without a heartbeat for this long is reaped
    pin_lease_seconds: float = 10.0  # prefetched blocks stay pinned this long unless loaded
    max_batch_blocks: int = 8192  # blocks per data RPC
    max_sessions: int = 256
    log_level: str = "info"

    @property
    def has_disk(self) -> bool:
        return bool(self.disk_path) and self.disk_capacity_bytes > 0

    @property
    def min_reuse(self) -> int:
        """k of the `min-reuse=k` gate; 0 for the other gates."""
        if self.admission_gate.startswith("min-reuse="):
            return int(self.admission_gate.split("=", 1)[1])
        return 0
