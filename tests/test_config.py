"""Configuration: defaults, precedence (TOML < environment < flags), and refusals that name the setting."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from kvservice.ops import cli
from kvservice.ops import config as config_mod
from kvservice.ops.config import (
    GiB, MiB, Config, ConfigError, config_to_toml, format_duration, format_size, load_config, parse_bytes, parse_seconds,
)

REPO = Path(__file__).resolve().parents[1]


def load(tmp_path: Path, toml: str | None = None, env: dict[str, str] | None = None, **flags: object) -> Config:
    """load_config with the socket under tmp_path (the default /run path may not be writable here)."""
    path = None
    if toml is not None:
        path = tmp_path / "kvservice.toml"
        path.write_text(toml)
    flags.setdefault("socket_path", str(tmp_path / "kv.sock"))
    return load_config(str(path) if path else None, env or {}, flags)


def refused(tmp_path: Path, toml: str | None = None, env: dict[str, str] | None = None, **flags: object) -> str:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, toml, env, **flags)
    return str(e.value)


def test_defaults(tmp_path: Path) -> None:
    """Scenario: no file, no environment, no flags besides the socket: every other field keeps its default."""
    cfg = load(tmp_path)
    assert cfg == replace(Config(), socket_path=str(tmp_path / "kv.sock"))
    assert cfg.host_capacity_bytes == 4 * GiB
    assert not cfg.has_disk
    assert cfg.min_reuse == 0


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    """Scenario: each layer overrides the one below it, field by field."""
    toml = """
        host_capacity_bytes = "1GiB"
        writer_threads = 2
        reader_threads = 2
        admission_gate = "retained-only"
        protect_unexpired = true
    """
    env = {"KVSERVICE_WRITER_THREADS": "3", "KVSERVICE_ADMISSION_GATE": "min-reuse=2", "PATH": "/usr/bin"}
    cfg = load(tmp_path, toml, env, admission_gate="min-reuse=5", lease_seconds="2.5")
    assert cfg.host_capacity_bytes == GiB  # file
    assert cfg.reader_threads == 2  # file
    assert cfg.protect_unexpired is True  # file
    assert cfg.writer_threads == 3  # environment beats file
    assert cfg.admission_gate == "min-reuse=5" and cfg.min_reuse == 5  # flag beats environment
    assert cfg.lease_seconds == 2.5  # flag
    assert cfg.io_backend == "auto"  # default


def test_config_file_from_environment(tmp_path: Path) -> None:
    """Scenario: KVSERVICE_CONFIG names the file when --config is absent; it is not mistaken for a setting."""
    path = tmp_path / "k.toml"
    path.write_text('write_queue_policy = "shed"\n')
    cfg = load(tmp_path, env={"KVSERVICE_CONFIG": str(path)})
    assert cfg.write_queue_policy == "shed"


@pytest.mark.parametrize(
    ("text", "expected"),
    [(1234, 1234), ("4GiB", 4 * GiB), ("512MiB", 512 * MiB), ("100GB", 100 * 10**9), ("1.5KiB", 1536), ("64", 64)],
)
def test_byte_sizes(text: object, expected: int) -> None:
    """Scenario: operators write sizes the way they think of them."""
    assert parse_bytes(text) == expected


def test_byte_sizes_from_every_layer(tmp_path: Path) -> None:
    """Scenario: the same size syntax works in the file, the environment and on the command line."""
    disk = tmp_path / "disk"
    cfg = load(
        tmp_path,
        'retained_cap_bytes = "2MiB"',
        {"KVSERVICE_DISK_CAPACITY_BYTES": "1MiB", "KVSERVICE_DISK_PATH": str(disk)},
        host_capacity_bytes="3MiB",
    )
    assert (cfg.retained_cap_bytes, cfg.disk_capacity_bytes, cfg.host_capacity_bytes) == (2 * MiB, MiB, 3 * MiB)
    assert cfg.has_disk and cfg.disk_path == str(disk)


@pytest.mark.parametrize(
    ("toml", "setting"),
    [
        ("hots_capacity_bytes = 1", "hots_capacity_bytes"),
        ("[disk]\npath = '/x'", "disk"),
        ('writer_threads = "four"', "writer_threads"),
        ("host_capacity_bytes = true", "host_capacity_bytes"),
        ('host_capacity_bytes = "4 parsecs"', "host_capacity_bytes"),
        ('retained_cap_bytes = "-1GiB"', "retained_cap_bytes"),
        ("host_capacity_bytes = 0", "host_capacity_bytes"),
        ('write_queue_policy = "drop"', "write_queue_policy"),
        ('io_backend = "spdk"', "io_backend"),
        ("writer_threads = 0", "writer_threads"),
        ("reader_threads = 0", "reader_threads"),
        ("lease_seconds = 0", "lease_seconds"),
        ("lease_seconds = -1.0", "lease_seconds"),
        ("protect_unexpired = 'maybe'", "protect_unexpired"),
        ('log_level = "verbose"', "log_level"),
        ('metrics_address = "9400"', "metrics_address"),
    ],
)
def test_bad_file_setting_is_named(tmp_path: Path, toml: str, setting: str) -> None:
    """Scenario: a bad value in the file fails at start with a message that names the setting."""
    assert setting in refused(tmp_path, toml)


@pytest.mark.parametrize("gate", ["some", "min-reuse=0", "min-reuse=x", "min-reuse=", "min-reuse=-1", "ALL"])
def test_bad_gate(tmp_path: Path, gate: str) -> None:
    """Scenario: an admission gate other than all / retained-only / min-reuse=K (K >= 1) is refused."""
    message = refused(tmp_path, admission_gate=gate)
    assert "admission_gate" in message and "min-reuse=K" in message


def test_unknown_environment_variable(tmp_path: Path) -> None:
    """Scenario: a typo in a KVSERVICE_ variable is an error, not a silently ignored default."""
    message = refused(tmp_path, env={"KVSERVICE_HOST_CAPACITY": "8GiB"})
    assert "host_capacity" in message and "KVSERVICE_HOST_CAPACITY" in message


def test_bad_environment_value_names_variable(tmp_path: Path) -> None:
    """Scenario: a malformed environment value says which variable carried it."""
    message = refused(tmp_path, env={"KVSERVICE_WRITER_THREADS": "many"})
    assert "writer_threads" in message and "KVSERVICE_WRITER_THREADS" in message


def test_disk_path_under_a_file(tmp_path: Path) -> None:
    """Scenario: the disk tier directory cannot be created because a path component is a file."""
    (tmp_path / "afile").write_text("x")
    message = refused(tmp_path, disk_path=str(tmp_path / "afile" / "kv"), disk_capacity_bytes="1MiB")
    assert "disk_path" in message and "not a directory" in message


def test_disk_capacity_above_free_space(tmp_path: Path) -> None:
    """Scenario: a disk tier larger than the filesystem's free space is refused at start."""
    too_big = shutil.disk_usage(tmp_path).free + 1024 * GiB
    message = refused(tmp_path, disk_path=str(tmp_path / "disk"), disk_capacity_bytes=too_big)
    assert "disk_capacity_bytes" in message


def test_existing_kvservice_data_counts_as_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario: a restart with a full disk tier: the blocks already on disk are space the tier may reuse."""
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "slots.0").write_bytes(b"\0" * (2 * MiB))
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: real._replace(free=MiB))  # a nearly full filesystem
    assert load(tmp_path, disk_path=str(disk), disk_capacity_bytes="3MiB").disk_capacity_bytes == 3 * MiB
    assert "disk_capacity_bytes" in refused(tmp_path, disk_path=str(disk), disk_capacity_bytes="4MiB")


def test_disk_settings_must_come_together(tmp_path: Path) -> None:
    """Scenario: a capacity without a path, or a path without a capacity, is a half-configured disk tier."""
    assert "disk_path" in refused(tmp_path, disk_capacity_bytes="1GiB")
    assert "disk_capacity_bytes" in refused(tmp_path, disk_path=str(tmp_path / "disk"))


def test_socket_directory_not_creatable(tmp_path: Path) -> None:
    """Scenario: the socket's directory would have to be created under a regular file."""
    (tmp_path / "afile").write_text("x")
    assert "socket_path" in refused(tmp_path, socket_path=str(tmp_path / "afile" / "kv.sock"))


def test_socket_path_too_long(tmp_path: Path) -> None:
    """Scenario: a socket path beyond the kernel's sun_path limit fails here, not deep inside grpc."""
    assert "socket_path" in refused(tmp_path, socket_path=str(tmp_path / ("x" * 120) / "kv.sock"))


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "10.1.2.3:50051", "[::]:50051", "node7.example:50051"])
def test_remote_tcp_needs_opt_in(tmp_path: Path, address: str) -> None:
    """Scenario: the data plane is unauthenticated, so TCP beyond loopback must be asked for explicitly."""
    message = refused(tmp_path, tcp_address=address)
    assert "tcp_address" in message and "allow_remote_tcp" in message
    assert load(tmp_path, tcp_address=address, allow_remote_tcp=True).tcp_address == address


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "[::1]:50051", "localhost:0"])
def test_loopback_tcp_is_fine(tmp_path: Path, address: str) -> None:
    """Scenario: loopback TCP needs no opt-in."""
    assert load(tmp_path, tcp_address=address).tcp_address == address


def test_effective_toml_round_trips_and_masks_token(tmp_path: Path) -> None:
    """Scenario: Admin.GetConfig's TOML reads back as the same configuration, without revealing the token."""
    cfg = load(tmp_path, admin_token="s3cret", host_capacity_bytes="1GiB", admission_gate="min-reuse=3", max_ttl_seconds="2h")
    text = config_to_toml(cfg)
    assert "s3cret" not in text and tomllib.loads(text)["admin_token"] == "***"
    path = tmp_path / "effective.toml"
    path.write_text(text)
    assert load_config(str(path), {}, {}) == replace(cfg, admin_token="***")


def test_check_config_prints_effective_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario: `kvservice check-config` with flags prints the merged configuration."""
    monkeypatch.delenv("KVSERVICE_CONFIG", raising=False)
    rc = cli.main(["check-config", "--socket-path", str(tmp_path / "kv.sock"), "--host-capacity", "8GiB", "--protect-unexpired"])
    assert rc == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["host_capacity_bytes"] == 8 * GiB and printed["protect_unexpired"] is True


def _run_cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVICE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "kvservice", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_serve_with_bad_config_exits_2(tmp_path: Path) -> None:
    """Scenario: an operator starts the daemon with a typo'd gate; it exits 2 and says which setting is wrong."""
    bad = tmp_path / "bad.toml"
    bad.write_text(f'socket_path = "{tmp_path / "kv.sock"}"\nadmission_gate = "min-reuse=zero"\n')
    proc = _run_cli("serve", "--config", str(bad))
    assert proc.returncode == 2
    assert "kvservice: configuration error: admission_gate" in proc.stderr


def test_serve_with_unknown_env_var_exits_2(tmp_path: Path) -> None:
    """Scenario: a misspelt KVSERVICE_ variable in a container spec stops the daemon at start."""
    proc = _run_cli("serve", "--socket-path", str(tmp_path / "kv.sock"), env_extra={"KVSERVICE_DISK_PATHS": "/data"})
    assert proc.returncode == 2
    assert "configuration error: disk_paths" in proc.stderr and "KVSERVICE_DISK_PATHS" in proc.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8G", 8 * 10**9), ("8Gi", 8 * GiB), ("8gi", 8 * GiB), ("8GiB", 8 * GiB), ("512Mi", 512 * MiB),
     ("100k", 100_000), ("2T", 2 * 10**12), ("1.5Ki", 1536)],
)
def test_byte_sizes_in_kubernetes_forms(text: str, expected: int) -> None:
    """Scenario: an operator types sizes as Kubernetes and most tools print them (G = 10^9, Gi = 2^30)."""
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [(30, 30.0), ("30", 30.0), ("90s", 90.0), ("90min", 5400.0), ("1h30m", 5400.0), ("1h 30min", 5400.0),
     ("7d", 7 * 86400.0), ("1w", 7 * 86400.0), ("2 weeks", 14 * 86400.0), ("36h", 36 * 3600.0), ("500ms", 0.5),
     ("1.5h", 5400.0)],
)
def test_durations_in_the_forms_people_type(text: object, expected: float) -> None:
    assert parse_seconds(text) == expected


@pytest.mark.parametrize("text", ["1h30", "abc", "1x", "", "h", "90 minutes later"])
def test_durations_that_mean_nothing_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_seconds(text)


def test_units_reach_the_config_from_flags_and_env(tmp_path: Path) -> None:
    cfg = load(tmp_path, env={"KVSERVICE_MAX_TTL_SECONDS": "1w"}, host_capacity_bytes="64Mi", lease_seconds="90s")
    assert cfg.max_ttl_seconds == 7 * 86400 and cfg.host_capacity_bytes == 64 * MiB and cfg.lease_seconds == 90


@pytest.mark.parametrize(("n", "shown"), [(4 * GiB, "4GiB"), (64 * MiB, "64MiB"), (0, "0"), (1536, "1536")])
def test_sizes_print_in_a_form_that_reads_back(n: int, shown: str) -> None:
    assert format_size(n) == shown and parse_bytes(shown) == n


@pytest.mark.parametrize(("s", "shown"), [(7 * 86400.0, "7d"), (5.0, "5s"), (5400.0, "90min"), (0.5, "0.5s")])
def test_durations_print_in_a_form_that_reads_back(s: float, shown: str) -> None:
    assert format_duration(s) == shown and parse_seconds(shown) == s


def test_help_shows_defaults_as_people_write_them(capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: `kvservice serve --help` shows 4GiB and 7d, not 4294967296 and 604800.0."""
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 4GiB)" in text and "(default: 7d)" in text and "(default: 5s)" in text
    assert "4294967296" not in text and "604800" not in text


def test_host_capacity_beyond_physical_memory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scenario: --host-capacity 64GiB on a 24 GiB machine. The host tier lives in RAM, so it can never
    be honoured: refused at start, naming both sizes, rather than swapping or OOM-killed later."""
    monkeypatch.setattr(config_mod, "physical_memory_bytes", lambda: 24 * GiB)
    message = refused(tmp_path, host_capacity_bytes="64GiB")
    assert message.startswith("host_capacity_bytes:") and "64 GiB" in message and "24 GiB" in message
    assert load(tmp_path, host_capacity_bytes="16GiB").host_capacity_bytes == 16 * GiB


def test_host_capacity_beyond_available_memory_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario: the machine has the memory but other processes use most of it now: the daemon starts
    (check-config succeeds) and says so on stderr."""
    monkeypatch.setattr(config_mod, "physical_memory_bytes", lambda: 64 * GiB)
    monkeypatch.setattr(config_mod, "available_memory_bytes", lambda: 2 * GiB)
    rc = cli.main(["check-config", "--socket-path", str(tmp_path / "kv.sock"), "--host-capacity", "8GiB"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "warning: host_capacity_bytes: 8 GiB is more than the 2 GiB of memory available now" in err


def test_this_machine_reports_its_memory() -> None:
    assert config_mod.physical_memory_bytes() > 0 and config_mod.available_memory_bytes() > 0
