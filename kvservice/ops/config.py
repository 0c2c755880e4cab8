"""Daemon configuration: one frozen dataclass with documented defaults.

Precedence (lowest to highest): defaults, TOML file (`--config`), environment
(`KVSERVICE_<FIELD>` upper-case), command-line flags. Loading and validation live below the
dataclass; a bad value fails at start with a message that names the setting.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import shutil
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Config:
    # --- listeners
    socket_path: str = "/run/kvservice/kvservice.sock"  # Unix socket, created mode 0600
    allowed_uids: str = ""  # other uids that may open sessions, e.g. "1000,1001"; each gets its own data socket
    tcp_address: str = ""  # e.g. "127.0.0.1:50051"; empty: no TCP listener (health, reflection, read-only Admin)
    allow_remote_tcp: bool = False  # TCP on a non-loopback address needs this set
    tcp_admin_mutations: bool = False  # serve Evict/ResetCanary over TCP too (needs admin_token)
    metrics_address: str = ""  # Prometheus endpoint, e.g. "127.0.0.1:9400"; empty: off
    allow_remote_metrics: bool = False  # metrics on a non-loopback address needs this set
    admin_token: str = ""  # when set, Admin.Evict and Admin.ResetCanary require it
    # --- host tier
    host_capacity_bytes: int = 4 * GiB
    # --- disk tier (disk_path empty: no disk tier)
    disk_path: str = ""
    disk_capacity_bytes: int = 0
    admission_gate: str = "all"  # "all" | "retained-only" | "min-reuse=K"
    protect_unexpired: bool = False  # unexpired retained blocks are never evicted from disk
    retained_cap_bytes: int = 0  # per namespace; 0: no cap
    max_ttl_seconds: float = 7 * 24 * 3600.0  # larger TTLs are clamped to this
    # spills waiting for a writer. They are blocks already in host slots (their bytes are on the tier or
    # the spill staging budget, not copied again), so a deep queue costs no memory; it lets the writers
    # take 32 MiB batches at small block sizes too (64 spills of 64 KiB are 4 MiB). 64 -> 1024: a spilled
    # 64 KiB block cost the loop ~9.8 -> ~7.8 us, ~43 -> ~36 us of wall (CPU box, BENCHMARKS.md).
    write_queue_depth: int = 1024
    write_queue_policy: str = "wait"  # "wait": backpressure | "shed": drop best-effort spills
    onboard_disk_hits: str = "always"  # a Load's disk blocks with no free or clean host slot: "always" onboarded
    # after the reply (the blocks they replace spill) | "clean": served only (a read never causes a disk write)
    writer_threads: int = 4
    reader_threads: int = 4
    io_backend: str = "auto"  # "auto" | "posix" | "kvikio"
    disk_format: str = "segments"  # "segments": disk tier v2 (kvservice/disk) | "files": one file per block (legacy)
    disk_read_bytes_per_second: int = 0  # cap on disk tier reads (shared disk); 0: unlimited
    disk_write_bytes_per_second: int = 0  # cap on spills and header rewrites; 0: unlimited
    # --- sessions and limits
    lease_seconds: float = 5.0  # a session without a heartbeat for this long is reaped
    pin_lease_seconds: float = 10.0  # prefetched blocks stay pinned this long unless loaded
    prefetch_share: float = 0.25  # most of the host tier one session's prefetch leases may pin
    prefetch_total_share: float = 0.5  # most of the host tier all sessions' prefetch leases together may pin
    max_batch_blocks: int = 8192  # blocks per data RPC
    max_sessions: int = 256
    max_sessions_per_uid: int = 64  # open sessions of one uid, so one client cannot lock out the node
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


# ---------------------------------------------------------------------------------------------
# Loading and validation
#
# The TOML file is flat: keys are the field names above, e.g.
#     socket_path = "/run/kvservice/kvservice.sock"
#     host_capacity_bytes = "16GiB"
#     disk_path = "/var/lib/kvservice"
#     disk_capacity_bytes = "500GB"
#     admission_gate = "min-reuse=2"
# Byte sizes (`*_bytes`) take an int or a string with a unit, case-insensitive, as Kubernetes
# quantities read: K/M/G/T and KB/MB/GB/TB are powers of 1000, Ki/Mi/Gi/Ti and KiB/MiB/GiB/TiB
# powers of 1024 ("8G" = 8e9 bytes, "8Gi" = "8GiB" = 8 * 2**30). Durations (`*_seconds`) take a
# number of seconds or a string of number-unit parts: ms, s/sec, m/min, h/hr, d/day, w/week
# (plurals too), e.g. "90s", "90min", "1h30m", "7d", "1w". Environment variables are
# KVSERVICE_<FIELD>, e.g. KVSERVICE_HOST_CAPACITY_BYTES=8GiB; KVSERVICE_CONFIG names the TOML file when no --config is given. Any other KVSERVICE_ variable
# is an error, so a typo cannot silently leave a default in place.


ENV_PREFIX = "KVSERVICE_"
ENV_CONFIG_FILE = "KVSERVICE_CONFIG"

ADMISSION_GATES = ("all", "retained-only", "min-reuse=K")
WRITE_QUEUE_POLICIES = ("wait", "shed")
ONBOARD_DISK_HITS = ("always", "clean")
IO_BACKENDS = ("auto", "posix", "kvikio")
DISK_FORMATS = ("segments", "files")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_DURATION_UNITS = {
    "": 1.0, "ms": 1e-3,
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0),
    **dict.fromkeys(("w", "week", "weeks"), 7 * 86400.0),
}
_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_NUMBER_UNIT = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z]*)\s*$")
_DURATION_PART = re.compile(rf"\s*{_NUMBER}\s*([A-Za-z]*)")
_MIN_REUSE = re.compile(r"^min-reuse=([0-9]+)$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(Exception):
    """A setting the daemon refuses to start with; the message names the setting."""


_FIELDS = {f.name: f for f in fields(Config)}


def _field_type(name: str) -> type:
    # `from __future__ import annotations` leaves the annotations as strings
    return {"str": str, "bool": bool, "int": int, "float": float}[str(_FIELDS[name].type)]


def parse_bytes(value: object) -> int:
    """4GiB -> 4294967296; ints pass through. Raises ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError("expected a byte size, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip()
        if s.startswith("-"):
            return -parse_bytes(s[1:])
        m = _NUMBER_UNIT.match(s)
        if m and m.group(2).lower() in _SIZE_UNITS:
            n = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
            if n != int(n):
                raise ValueError(f"{value!r} is not a whole number of bytes")
            return int(n)
    raise ValueError(f"{value!r} is not a byte size (e.g. 4294967296, \"4GiB\", \"8Gi\", \"512MiB\", \"100GB\")")


def parse_seconds(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a duration, got a boolean")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        s = value.strip()
        if s.startswith("-"):
            return -parse_seconds(s[1:])
        total, pos, parts = 0.0, 0, 0
        while pos < len(s):
            m = _DURATION_PART.match(s, pos)
            if not m or m.end() == pos or m.group(2).lower() not in _DURATION_UNITS:
                break
            if not m.group(2) and (parts or s[m.end():].strip()):  # a bare number only as the whole value
                break
            total += float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
            pos, parts = m.end(), parts + 1
        if parts and not s[pos:].strip():
            return total
    raise ValueError(f"{value!r} is not a duration (e.g. 30, \"90s\", \"90min\", \"1h30m\", \"7d\", \"1w\")")


def _coerce(name: str, value: object) -> object:
    """Turn a TOML value, an environment string or a flag value into the field's type."""
    kind = _field_type(name)
    if name.endswith(("_bytes", "_bytes_per_second")):
        return parse_bytes(value)
    if name.endswith("_seconds"):
        return parse_seconds(value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"{value!r} is not a boolean (true/false)")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
            return int(value)
        raise ValueError(f"{value!r} is not an integer")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{value!r} is not a number")
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _read_toml(path: str) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: not valid TOML: {e}") from None
    for key, value in data.items():
        if isinstance(value, dict):
            raise ConfigError(f"{key}: unknown table [{key}] in {path}; the config file is flat (field = value)")
    return data


def load_config(path: str | None, env: Mapping[str, str], overrides: Mapping[str, object]) -> Config:
    """defaults < TOML file < KVSERVICE_* environment < overrides (flags; None values are ignored).

    Raises ConfigError naming the first bad setting.
    """
    layers: list[tuple[str, Mapping[str, object], str]] = []
    path = path or env.get(ENV_CONFIG_FILE) or None
    if path:
        layers.append(("", _read_toml(path), f"in {path}"))
    env_values: dict[str, object] = {}
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_CONFIG_FILE:
            continue
        name = var[len(ENV_PREFIX):].lower()
        if name not in _FIELDS:
            raise ConfigError(
                f"{name}: unknown setting (environment variable {var}); KVSERVICE_* variables must name a "
                f"config field, e.g. KVSERVICE_HOST_CAPACITY_BYTES"
            )
        env_values[name] = value
    layers.append((ENV_PREFIX, env_values, "from the environment"))
    layers.append(("", {k: v for k, v in overrides.items() if v is not None}, "from the command line"))

    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for prefix, layer, where in layers:
        for name, raw in layer.items():
            if name not in _FIELDS:
                raise ConfigError(f"{name}: unknown setting {where}")
            source = f"{prefix}{name.upper()} {where}" if prefix else where
            try:
                values[name] = _coerce(name, raw)
            except ValueError as e:
                raise ConfigError(f"{name}: {e} ({source})") from None
            sources[name] = source
    for name in ("socket_path", "disk_path"):
        if values.get(name):
            values[name] = os.path.abspath(os.path.expanduser(str(values[name])))
    cfg = replace(Config(), **values)
    try:
        validate_config(cfg)
    except ConfigError as e:
        name = str(e).split(":", 1)[0]
        raise ConfigError(f"{e} ({sources[name]})" if name in sources else str(e)) from None
    return cfg


def parse_uids(text: str) -> tuple[int, ...]:
    """"1000, 1001" -> (1000, 1001); "" -> (). Raises ValueError."""
    uids = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) >= 1 << 32:
            raise ValueError(f"{part!r} is not a uid (a non-negative integer); give uids separated by commas")
        uids.append(int(part))
    return tuple(sorted(set(uids)))


def parse_host_port(address: str) -> tuple[str, int]:
    """"127.0.0.1:50051" / "[::1]:50051" / "localhost:0" -> (host, port). Raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{address!r} is not host:port (e.g. \"127.0.0.1:50051\", \"[::1]:50051\")")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def _nearest_existing(path: str) -> str:
    p = path
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _check_dir_creatable(name: str, path: str) -> None:
    """The directory exists and is writable, or the nearest existing ancestor would let us create it."""
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise ConfigError(f"{name}: cannot create directory {path}: {existing} exists and is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"{name}: directory {path} {what}")


def _bytes_under(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def validate_config(cfg: Config) -> None:
    """Raise ConfigError for the first setting the daemon cannot run with."""

    def one_of(name: str, allowed: tuple[str, ...]) -> None:
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name}: {getattr(cfg, name)!r} is not one of {', '.join(allowed)}")

    def at_least(name: str, low: float) -> None:
        if getattr(cfg, name) < low:
            raise ConfigError(f"{name}: must be at least {low:g}, got {getattr(cfg, name)}")

    def positive(name: str) -> None:
        v = getattr(cfg, name)
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{name}: must be a positive number of seconds, got {v}")

    for name in _FIELDS:
        if name.endswith(("_bytes", "_bytes_per_second")) and getattr(cfg, name) < 0:
            raise ConfigError(f"{name}: must not be negative, got {getattr(cfg, name)}")
    at_least("host_capacity_bytes", 1)
    m = _MIN_REUSE.match(cfg.admission_gate)
    if cfg.admission_gate not in ("all", "retained-only") and not (m and int(m.group(1)) >= 1):
        raise ConfigError(
            f"admission_gate: {cfg.admission_gate!r} is not one of {', '.join(ADMISSION_GATES)} (K an integer >= 1)"
        )
    one_of("write_queue_policy", WRITE_QUEUE_POLICIES)
    one_of("onboard_disk_hits", ONBOARD_DISK_HITS)
    one_of("io_backend", IO_BACKENDS)
    one_of("disk_format", DISK_FORMATS)
    one_of("log_level", LOG_LEVELS)
    for name in ("writer_threads", "reader_threads", "write_queue_depth", "max_batch_blocks", "max_sessions",
                 "max_sessions_per_uid"):
        at_least(name, 1)
    for name in ("lease_seconds", "pin_lease_seconds", "max_ttl_seconds"):
        positive(name)
    if not 0 < cfg.prefetch_share <= 1:
        raise ConfigError(f"prefetch_share: must be a fraction in (0, 1], got {cfg.prefetch_share}")
    if not 0 < cfg.prefetch_total_share <= 1:
        raise ConfigError(f"prefetch_total_share: must be a fraction in (0, 1], got {cfg.prefetch_total_share}")

    if not cfg.socket_path:
        raise ConfigError("socket_path: must be set (the Unix socket engines connect to)")
    if len(os.fsencode(cfg.socket_path)) > UNIX_PATH_MAX:
        raise ConfigError(f"socket_path: {cfg.socket_path} is longer than {UNIX_PATH_MAX} bytes (a Unix socket limit)")
    if os.path.isdir(cfg.socket_path):
        raise ConfigError(f"socket_path: {cfg.socket_path} is a directory")
    _check_dir_creatable("socket_path", os.path.dirname(cfg.socket_path) or ".")

    for name in ("tcp_address", "metrics_address"):
        address = getattr(cfg, name)
        if address:
            try:
                host, _port = parse_host_port(address)
            except ValueError as e:
                raise ConfigError(f"{name}: {e}") from None
            if name == "tcp_address" and not is_loopback(host) and not cfg.allow_remote_tcp:
                raise ConfigError(
                    f"tcp_address: {address} is not a loopback address; TCP callers are unauthenticated, "
                    f"so listening beyond this host needs allow_remote_tcp = true"
                )
            if name == "metrics_address" and not is_loopback(host) and not cfg.allow_remote_metrics:
                raise ConfigError(
                    f"metrics_address: {address} is not a loopback address; /metrics is unauthenticated and names "
                    f"every namespace, so listening beyond this host needs allow_remote_metrics = true"
                )
    if cfg.tcp_admin_mutations and not cfg.admin_token:
        raise ConfigError(
            "tcp_admin_mutations: a TCP listener that serves Evict and ResetCanary needs admin_token set "
            "(any local user can reach TCP); set admin_token or drop tcp_admin_mutations"
        )
    try:
        parse_uids(cfg.allowed_uids)
    except ValueError as e:
        raise ConfigError(f"allowed_uids: {e}") from None

    physical = physical_memory_bytes()
    if physical and cfg.host_capacity_bytes > physical:
        raise ConfigError(
            f"host_capacity_bytes: {format_bytes(cfg.host_capacity_bytes)} is more than this machine's "
            f"{format_bytes(physical)} of memory (MemTotal or the cgroup limit); the host tier lives in RAM"
        )

    if cfg.disk_capacity_bytes > 0 and not cfg.disk_path:
        raise ConfigError("disk_capacity_bytes: is set but disk_path is empty; set disk_path or drop the capacity")
    if cfg.disk_path:
        if cfg.disk_capacity_bytes == 0:
            raise ConfigError("disk_capacity_bytes: disk_path is set but the capacity is 0; give a size such as 100GiB")
        _check_dir_creatable("disk_path", cfg.disk_path)
        existing = _nearest_existing(cfg.disk_path)
        usable = shutil.disk_usage(existing).free
        if os.path.isdir(cfg.disk_path):
            usable += _bytes_under(cfg.disk_path)  # our own blocks from an earlier run are reusable space
        if cfg.disk_capacity_bytes > usable:
            raise ConfigError(
                f"disk_capacity_bytes: {format_bytes(cfg.disk_capacity_bytes)} is more than the "
                f"{format_bytes(usable)} available for {cfg.disk_path} (free space plus existing kvservice data)"
            )


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def format_size(n: int) -> str:
    """A byte size the way an operator types it and parse_bytes reads it back: 4GiB, 64MiB, 0."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def format_duration(seconds: float) -> str:
    """A duration the way an operator types it and parse_seconds reads it back: 7d, 90s, 1.5s."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


# ---------------------------------------------------------------------------------------------
# Host memory: a host tier larger than the machine's memory cannot be honoured


def physical_memory_bytes() -> int:
    """Memory this process may use: MemTotal, or a smaller cgroup (container) limit; 0 if unknown."""
    total = _meminfo("MemTotal")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and (total == 0 or int(raw) < total):
            total = int(raw)
        break
    return total


def available_memory_bytes() -> int:
    """MemAvailable: what can be allocated now without swapping; 0 if unknown."""
    return _meminfo("MemAvailable")


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == key:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def config_warnings(cfg: Config) -> list[str]:
    """Settings the daemon runs with but an operator should hear about at start."""
    out = []
    available = available_memory_bytes()
    if available and cfg.host_capacity_bytes > available:
        out.append(f"host_capacity_bytes: {format_bytes(cfg.host_capacity_bytes)} is more than the "
                   f"{format_bytes(available)} of memory available now (MemAvailable); the host tier may push "
                   f"this machine into swap or the OOM killer as it fills")
    return out


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def config_to_toml(cfg: Config) -> str:
    """The effective configuration as flat TOML that load_config reads back; admin_token is masked."""
    lines = ["# kvservice effective configuration"]
    for name in _FIELDS:
        value = getattr(cfg, name)
        if name == "admin_token" and value:
            value = "***"
        line = f"{name} = {_toml_value(value)}"
        if name.endswith("_bytes") and value >= 1 << 10:
            line += f"  # {format_bytes(value)}"
        lines.append(line)
    return "\n".join(lines) + "\n"
