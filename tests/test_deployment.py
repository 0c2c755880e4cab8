"""The sidecar deployment: docker-compose.yml, its CPU override, the Dockerfile and the health probe.

No Docker engine is needed. The compose file is checked against the Compose specification's JSON schema
(vendored in tests/data/, see its README) and for its wiring; then the very commands it runs (the
`command:`, `environment:` and `healthcheck:` entries, interpolated with deploy/cpu.env) are started
natively on the CPU: named volumes become temporary directories mounted at the same places, and
container ports become free loopback ports. Nothing else about the commands is changed.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import yaml

from kvwire.v1 import admin_pb2, admin_pb2_grpc
from tests.daemon_kit import Daemon, free_tcp_port, short_tmpdir

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "deploy" / "compose.cpu.yml"
CPU_ENV = ROOT / "deploy" / "cpu.env"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
DOCKERFILE = ROOT / "Dockerfile"
SCHEMA = ROOT / "tests" / "data" / "compose_spec.json"
PROBE = ROOT / "scripts" / "grpc_health_probe.py"
DAEMON, ENGINES = "kvservice", ("runner-a", "runner-b")


# --- reading compose files the way Compose does


class _ComposeLoader(yaml.SafeLoader):
    """YAML 1.1 with merge keys (as Compose reads it), plus Compose's `!reset` override tag."""


def _reset(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """`key: !reset []` clears what an earlier file set; read here as the (empty) value it carries."""
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    return None


_ComposeLoader.add_constructor("!reset", _reset)


def load_yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.load(f, Loader=_ComposeLoader)  # noqa: S506  # a SafeLoader subclass


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


_VAR = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
                  r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation ($$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err},
    ${VAR:+alt}) over every string of a loaded compose file. An unset variable without a default is an
    error here (Compose would warn and use ""), so that a typo in a variable name cannot pass."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m["dollar"]:
            return "$"
        name = m["braced"] or m["plain"]
        op, arg, v = m["op"], m["arg"], env.get(name)
        if op in (":-", "-"):
            return arg if (v is None or (op == ":-" and v == "")) else v
        if op in (":+", "+"):
            return arg if (v is not None and (op == "+" or v != "")) else ""
        if v is None or (op == ":?" and v == ""):
            raise KeyError(f"variable {name} is not set ({arg or 'no default'})")
        return v

    return _VAR.sub(one, value)


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA.read_text())


def schema_errors(schema: dict, doc: dict) -> list[str]:
    # The file's "$schema" is draft 2019-09 spelt with http and a trailing "#", which jsonschema does not
    # recognise by name: name the draft here.
    assert "2019-09" in schema["$schema"]
    jsonschema.Draft201909Validator.check_schema(schema)
    errors = jsonschema.Draft201909Validator(schema).iter_errors(doc)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


@pytest.fixture(scope="module")
def compose() -> dict:
    """docker-compose.yml as Compose sees it with no variables set: every default applies."""
    return interpolate(load_yaml(COMPOSE), {})


# --- the file against the Compose specification


def test_compose_files_follow_the_compose_specification(schema: dict, compose: dict) -> None:
    """Scenario: docker-compose.yml (with its defaults, and with deploy/cpu.env) and the CPU override
    validate against the Compose specification's JSON schema."""
    assert schema_errors(schema, compose) == []
    assert schema_errors(schema, interpolate(load_yaml(COMPOSE), read_env_file(CPU_ENV))) == []
    assert schema_errors(schema, load_yaml(CPU_OVERRIDE)) == []


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


def _reservation(c: dict) -> dict:
    return c["services"][DAEMON]["deploy"]["resources"]["reservations"]["devices"][0]


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda c: _rename(c["services"][DAEMON], "healthcheck", "healthchek"), id="healthchek"),
    pytest.param(lambda c: _rename(c["services"]["runner-a"], "depends_on", "depend_on"), id="depend_on"),
    pytest.param(lambda c: _rename(c["services"]["runner-b"], "ipc", "icp"), id="icp"),
    pytest.param(lambda c: _rename(c, "volumes", "volume"), id="top-level volume"),
    pytest.param(lambda c: _rename(c["services"][DAEMON]["healthcheck"], "start_period", "startperiod"),
                 id="startperiod"),
    pytest.param(lambda c: _rename(_reservation(c), "capabilities", "capabilites"), id="capabilites"),
    pytest.param(lambda c: c["services"]["runner-a"]["depends_on"][DAEMON].update(condition="service_healty"),
                 id="service_healty"),
])
def test_a_misspelt_key_fails_the_schema(schema: dict, compose: dict, mutate: Callable[[dict], None]) -> None:
    """Scenario: one misspelt key or value anywhere in the file, and the schema rejects it."""
    broken = copy.deepcopy(compose)
    mutate(broken)
    assert schema_errors(schema, broken)


# --- the wiring


def mounts(service: dict) -> dict[str, str]:
    """Container path -> named volume, from short-syntax `volume:/path[:mode]` entries."""
    out = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        if not source.startswith((".", "/")):
            out[target] = source
    return out


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_engines_reach_the_daemon_socket_through_a_shared_volume(compose: dict) -> None:
    """Scenario: the daemon's socket lies on a named volume that both engines mount at the same path,
    and each engine's --service names that socket."""
    services = compose["services"]
    socket_path = services[DAEMON]["environment"]["KVSERVICE_SOCKET_PATH"]
    socket_dir = os.path.dirname(socket_path)
    volume = mounts(services[DAEMON])[socket_dir]
    assert volume in compose["volumes"]
    for name in ENGINES:
        assert mounts(services[name]).get(socket_dir) == volume, name
        assert flag(services[name]["command"], "--service") == f"unix://{socket_path}", name


def test_the_disk_tier_has_a_volume_of_its_own(compose: dict) -> None:
    """Scenario: the disk tier is on a named volume (it outlives the container), mounted by the daemon
    only, and not the socket's volume."""
    services = compose["services"]
    env = services[DAEMON]["environment"]
    daemon_mounts = mounts(services[DAEMON])
    disk = daemon_mounts[env["KVSERVICE_DISK_PATH"]]
    assert disk in compose["volumes"]
    assert disk != daemon_mounts[os.path.dirname(env["KVSERVICE_SOCKET_PATH"])]
    assert all(disk not in mounts(services[name]).values() for name in ENGINES)
    assert env["KVSERVICE_DISK_CAPACITY_BYTES"]  # a disk tier needs both path and capacity


def test_sidecar_containers_share_ipc_and_reserve_gpus(compose: dict) -> None:
    """Scenario: daemon and engines share the host's IPC (CUDA IPC handles, /dev/shm pools) and PID
    namespaces, and reserve GPUs through the NVIDIA driver; engines run on CUDA by default."""
    services = compose["services"]
    for name in (DAEMON, *ENGINES):
        s = services[name]
        assert s["ipc"] == "host", name
        assert s["pid"] == "host", name
        (device,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
    assert services[DAEMON]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    for name in ENGINES:
        assert flag(services[name]["command"], "--device").startswith("cuda"), name


def test_daemon_healthcheck_probes_grpc_health_over_the_socket(compose: dict) -> None:
    """Scenario: the daemon's healthcheck runs scripts/grpc_health_probe.py (shipped in the image, run
    from its WORKDIR) against the daemon's own socket."""
    daemon = compose["services"][DAEMON]
    test = daemon["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert test[1:3] == ["python", "scripts/grpc_health_probe.py"]
    assert test[3] == f"unix://{daemon['environment']['KVSERVICE_SOCKET_PATH']}"
    assert PROBE.is_file()
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^COPY scripts scripts$", dockerfile, re.M)
    assert re.search(r"^WORKDIR /opt/kvservice$", dockerfile, re.M)
    assert "healthcheck" not in compose["services"]["runner-a"]  # the probe speaks for the daemon only


def test_engines_start_once_the_daemon_is_healthy(compose: dict) -> None:
    services = compose["services"]
    for name in ENGINES:
        assert services[name]["depends_on"] == {DAEMON: {"condition": "service_healthy"}}, name
    assert "depends_on" not in services[DAEMON]


def test_prometheus_profile_scrapes_the_daemon_and_both_engines(compose: dict) -> None:
    """Scenario: `--profile monitoring` adds Prometheus, whose targets are the daemon's metrics port and
    each engine's HTTP port; without the profile only the sidecar stack starts."""
    services = compose["services"]
    prom = services["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    assert any(v.startswith("./deploy/prometheus.yml:/etc/prometheus/prometheus.yml") for v in prom["volumes"])
    assert all("profiles" not in services[name] for name in (DAEMON, *ENGINES))
    assert metrics_targets() == expected_targets(compose)


def metrics_targets() -> set[str]:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    return {t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}


def expected_targets(compose: dict) -> set[str]:
    services = compose["services"]
    metrics_port = services[DAEMON]["environment"]["KVSERVICE_METRICS_ADDRESS"].rpartition(":")[2]
    return {f"{DAEMON}:{metrics_port}"} | {f"{n}:{flag(services[n]['command'], '--port')}" for n in ENGINES}


def test_published_ports_are_loopback_only_and_match_the_listeners(compose: dict) -> None:
    services = compose["services"]
    listening = {DAEMON: services[DAEMON]["environment"]["KVSERVICE_METRICS_ADDRESS"].rpartition(":")[2]}
    listening |= {n: flag(services[n]["command"], "--port") for n in ENGINES}
    for name, port in listening.items():
        (published,) = services[name]["ports"]
        host_ip, _host_port, container_port = published.split(":")
        assert host_ip == "127.0.0.1" and container_port == port, name
    assert "KVSERVICE_TCP_ADDRESS" not in services[DAEMON]["environment"]  # no gRPC beyond the socket


def test_cpu_override_and_env_file_turn_the_gpu_stack_into_a_cpu_one(schema: dict) -> None:
    """Scenario: deploy/compose.cpu.yml resets the GPU reservations of every GPU service, and every
    variable in deploy/cpu.env is one docker-compose.yml uses (a misspelt one would silently do nothing);
    with them the engines run on the CPU, from the CPU image."""
    raw = COMPOSE.read_text()
    env = read_env_file(CPU_ENV)
    for name in env:
        assert "${" + name + ":-" in raw, f"{name} in cpu.env is not used by docker-compose.yml"
    cpu = interpolate(load_yaml(COMPOSE), env)
    for name in ENGINES:
        assert flag(cpu["services"][name]["command"], "--device") == "cpu"
    assert cpu["services"][DAEMON]["build"]["args"]["VARIANT"] == "cpu"
    override = load_yaml(CPU_OVERRIDE)["services"]
    gpu_services = {n for n, s in load_yaml(COMPOSE)["services"].items() if "deploy" in s}
    assert set(override) == gpu_services
    for name in gpu_services:
        assert override[name]["deploy"]["resources"]["reservations"]["devices"] == []
    assert "!reset" in CPU_OVERRIDE.read_text()


def test_build_args_are_declared_by_the_dockerfile(compose: dict) -> None:
    declared = set(re.findall(r"^ARG (\w+)", DOCKERFILE.read_text(), re.M))
    for name, s in compose["services"].items():
        if "build" in s:
            assert set(s["build"]["args"]) <= declared, name
            assert s["image"].startswith("kvservice:"), name


# --- the health probe against a real daemon


def run_probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=30)


def test_health_probe_exit_status() -> None:
    """Scenario: the probe exits 0 for a serving daemon (whole server, or one service by name), 1 for a
    service the health service does not know, 2 when nothing listens on the socket."""
    with Daemon(disk_capacity="") as d:
        ok = run_probe(d.target)
        assert (ok.returncode, ok.stdout.strip()) == (0, f"{d.target}: server SERVING")
        assert run_probe(d.socket_path, "--service", "kvservice.v1.KVCache").returncode == 0
        unknown = run_probe(d.target, "--service", "no.such.Service")
        assert unknown.returncode == 1 and "unknown" in unknown.stdout
    gone = run_probe(d.target, "--timeout", "1")
    assert gone.returncode == 2 and "no answer" in gone.stdout


# --- the compose file's commands, run natively


@dataclass
class NativeStack:
    """docker-compose.yml's sidecar services as native processes: volumes are directories under `root`,
    container ports are free loopback ports."""

    compose: dict
    root: Path
    ports: dict[str, int] = field(default_factory=dict)  # "service:container port" -> native port
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def volume_dirs(self, name: str) -> dict[str, str]:
        dirs = {}
        for target, volume in mounts(self.compose["services"][name]).items():
            d = self.root / volume
            d.mkdir(mode=0o700, exist_ok=True)  # as the image creates the mount points
            dirs[target] = str(d)
        return dirs

    def native_port(self, name: str, port: str) -> int:
        return self.ports.setdefault(f"{name}:{port}", free_tcp_port())

    def remap(self, name: str, words: list[str]) -> list[str]:
        """Mount targets -> volume directories; 0.0.0.0 listeners -> loopback on a free port."""
        dirs = sorted(self.volume_dirs(name).items(), key=lambda kv: -len(kv[0]))
        out = []
        for i, w in enumerate(words):
            for target, d in dirs:
                w = re.sub(rf"{re.escape(target)}(?=/|$)", d, w)
            if m := re.fullmatch(r"0\.0\.0\.0:(\d+)", w):
                w = f"127.0.0.1:{self.native_port(name, m[1])}"
            elif i and words[i - 1] == "--host" and w == "0.0.0.0":
                w = "127.0.0.1"
            elif i and words[i - 1] == "--port":
                w = str(self.native_port(name, w))
            out.append(w)
        return out

    def env(self, name: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVICE_")}
        base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"  # `python` is the venv's
        environment = self.compose["services"][name].get("environment", {})
        keys, values = list(environment), self.remap(name, [str(v) for v in environment.values()])
        return {**base, **dict(zip(keys, values))}

    def command(self, name: str) -> list[str]:
        return self.remap(name, self.compose["services"][name]["command"])

    def start(self, name: str, stdout: int | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")
        proc = subprocess.Popen(self.command(name), env=self.env(name), cwd=str(ROOT),
                                stdout=stdout or log, stderr=log, text=stdout is not None)
        log.close()
        self.procs[name] = proc
        return proc

    def healthcheck(self, name: str) -> subprocess.CompletedProcess:
        test = self.compose["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        return subprocess.run(self.remap(name, test[1:]), env=self.env(name), cwd=str(ROOT),
                              capture_output=True, text=True, timeout=30)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, name: str, timeout: float = 30.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # what `docker compose stop` sends
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
                raise
        return proc.returncode

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 30.0, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def start_engine(stack: NativeStack, name: str, timeout: float = 90.0) -> str:
    """Start an engine service; its base URL once it prints its listening line."""
    proc = stack.start(name, stdout=subprocess.PIPE)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"{name} not listening after {timeout}s:\n{stack.log(name)}") from None
    prefix = "model-runner listening on "
    assert line.startswith(prefix), f"{name}: unexpected first line {line!r}:\n{stack.log(name)}"
    return line[len(prefix):].strip()


def complete(url: str, prompt: str, max_tokens: int = 8) -> dict:
    req = urllib.request.Request(f"{url}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def admin(target: str, method: str) -> Any:
    with grpc.insecure_channel(target) as ch:
        return getattr(admin_pb2_grpc.AdminStub(ch), method)(getattr(admin_pb2, f"{method}Request")(), timeout=10)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.fixture
def native_stack() -> Iterator[NativeStack]:
    root = short_tmpdir("kvc")  # the socket path must stay short
    stack = NativeStack(interpolate(load_yaml(COMPOSE), read_env_file(CPU_ENV)), root)
    try:
        yield stack
    finally:
        stack.kill_all()
        shutil.rmtree(root, ignore_errors=True)


def test_compose_commands_run_natively_and_engines_share_prefixes(native_stack: NativeStack) -> None:
    """Scenario: the compose file's own commands, with deploy/cpu.env, on this host. The daemon starts;
    the engines start only once the daemon's healthcheck command passes, as `service_healthy` orders
    them. runner-a computes prompt P and offloads it; runner-b, cold, loads P from the daemon instead of
    recomputing it and produces the same greedy tokens; then the same the other way round with prompt Q.
    Each Prometheus target answers with its metrics, and SIGTERM stops every service cleanly."""
    stack = native_stack
    socket_path = stack.env(DAEMON)["KVSERVICE_SOCKET_PATH"]
    target = f"unix://{socket_path}"

    assert stack.healthcheck(DAEMON).returncode == 2  # nothing listens yet: unhealthy
    daemon = stack.start(DAEMON)

    def healthy() -> bool:
        assert daemon.poll() is None, f"daemon exited:\n{stack.log(DAEMON)}"
        return stack.healthcheck(DAEMON).returncode == 0

    wait_for("the daemon's healthcheck to pass", healthy)
    assert oct(os.stat(socket_path).st_mode & 0o777) == "0o600"

    with ThreadPoolExecutor(len(ENGINES)) as ex:  # each imports torch: start them side by side
        urls = dict(zip(ENGINES, ex.map(lambda n: start_engine(stack, n), ENGINES)))
    wait_for("both engines' sessions", lambda: sorted(s.client_name for s in admin(target, "ListSessions").sessions)
             == sorted(ENGINES))

    def shares(producer: str, consumer: str, prompt: str) -> None:
        stores = admin(target, "Stats").counters.stores
        first = complete(urls[producer], prompt)
        assert first["kv_cache"]["kv_source"] == "none", first
        blocks = (len(prompt) + 1) // 16  # + BOS; the tiny model's 16-token blocks, full ones only
        wait_for(f"{producer}'s blocks stored", lambda: admin(target, "Stats").counters.stores >= stores + blocks)
        again = complete(urls[consumer], prompt)
        assert again["token_ids"] == first["token_ids"]
        assert again["kv_cache"]["kv_source"] == "loaded", again
        tiers = again["kv_cache"]["cached_tokens_by_tier"]
        assert tiers["gpu"] == 0 and tiers["host"] + tiers["disk"] == blocks * 16, tiers

    shares("runner-a", "runner-b", "the shared system prompt of runner a " * 6)
    shares("runner-b", "runner-a", "a different conversation that runner b started " * 5)
    stats = admin(target, "Stats")
    assert stats.counters.loads_host + stats.counters.loads_disk > 0 and len(stats.namespaces) == 1

    assert set(stack.ports) == metrics_targets()  # every port the stack listens on is scraped
    for address in sorted(metrics_targets()):  # each Prometheus target, at its native port
        name, port = address.split(":")
        text = scrape(f"http://127.0.0.1:{stack.ports[address]}/metrics")
        assert ("kvservice_recovery_ratio" if name == DAEMON else "model_runner_ttft_seconds_count") in text, name
        assert "process_resident_memory_bytes" in text and "_created" not in text, name

    for name in (*ENGINES, DAEMON):  # engines first, as `docker compose down` stops dependents first
        assert stack.stop(name) == 0, f"{name}:\n{stack.log(name)}"


def test_the_dockerignore_keeps_local_state_out_of_the_image() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "tests"} <= ignored
    copied = [src for line in re.findall(r"^COPY (.+)$", DOCKERFILE.read_text(), re.M) for src in line.split()[:-1]]
    assert "scripts" in copied
    for src in copied:
        assert src not in ignored and (ROOT / src).exists(), src

