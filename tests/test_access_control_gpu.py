"""Access control on the CUDA path: a CUDA IPC pool registers on the registration socket and its
session is bound to its peer like a shared-memory one (issue 11). Needs a CUDA GPU and root."""

from __future__ import annotations

import os

import pytest

from harness.engine import EngineProc
from tests.test_access_control import (
    STRANGER,
    as_stranger,
    load_step,
    reachable_daemon,
    store_step,
)
from tests.test_gpu import gpu, needs_gpu

STORED, LOADED = 1, 1


@gpu
@needs_gpu
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process of another uid")
def test_a_cuda_pool_session_is_bound_to_its_peer():
    """Scenario: an engine registers a CUDA IPC pool (layer-first) on a root daemon that also
    serves uid 65534. ListSessions shows the cuda session with the engine's uid and pid (from the
    kernel); Store and Load round-trip on the GPU. uid 65534 opens its own session, and every
    call it makes with the CUDA engine's session id on its own data socket is refused; the
    engine's blocks still load exactly afterwards."""
    with reachable_daemon(extra=["--allowed-uids", str(STRANGER)], disk_capacity=0, host_capacity="16MiB",
                          io_backend="posix") as d:
        with EngineProc(d.target, "--pool", "cuda", "--layout", "layer-first", "--layers", "4") as g:
            assert g.hello["ready"], g.hello
            (s,) = d.admin("ListSessions").sessions
            assert (s.pool_kind, s.uid, s.pid, s.label) == ("cuda", os.getuid(), g.hello["pid"], g.hello["label"])
            assert g.call("store", numbers=[0, 1, 2])["status"] == [STORED] * 3
            loaded = g.call("load", numbers=[0, 1, 2])
            assert loaded["status"] == [LOADED] * 3 and all(loaded["exact"])

            sid = g.hello["session"]
            mine = f"unix:{d.socket_path}.uid{STRANGER}"
            reg, *theirs = as_stranger(d, {"op": "register"}, store_step(mine, sid, [(9, 0)]),
                                       load_step(mine, sid, [(0, 1)]),
                                       {"op": "call", "target": mine, "method": "CloseSession", "session": sid})
            assert reg["code"] == "OK"
            for r in theirs:
                assert r["code"] == "PERMISSION_DENIED", r
            assert g.call("state")["attached"] is True
            again = g.call("load", numbers=[0, 1, 2])
            assert again["status"] == [LOADED] * 3 and all(again["exact"])
            assert g.call("lookup", numbers=[9])["prefix"] == 0
