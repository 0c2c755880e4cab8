"""The package boundary (issue 10, item 6): an engine needs kvwire, not the daemon package."""

from __future__ import annotations

import subprocess
import sys

from harness.daemon import ROOT


def loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         cwd=str(ROOT), capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_engine_client_and_model_runner_load_no_daemon_module():
    mods = loaded_after("import engine_client, engine_client.client, engine_client.sync_client, model_runner.scheduler")
    assert not {m for m in mods if m == "kvservice" or m.startswith("kvservice.")}


def test_the_shared_package_loads_neither_torch_nor_the_daemon():
    mods = loaded_after("import kvwire.v1.kvcache_pb2, kvwire.v1.admin_pb2_grpc, kvwire.ids, kvwire.peer_socket")
    assert "torch" not in mods
    assert not {m for m in mods if m == "kvservice" or m.startswith("kvservice.")}
