"""A process of another uid, for tests/test_access_control.py: it tries things against a daemon.

    python -m tests.uid_probe UID SOCKET_PATH '[{"op": "register"}, {"op": "call", ...}, ...]'

The test starts it as root; it loads everything it needs, then drops to UID with os.setgid /
os.setuid (so the interpreter may live where that uid cannot read), and from then on is a plain
process of that uid to the kernel and the daemon. It runs the steps in order and prints one
JSON list of results, the first being {"uid": its uid}. Steps:
  {"op": "register", "model": "m", "blocks": 16, "canary": "<hex, optional>", "fill": "<text>"}
        open a session on SOCKET_PATH.reg with a pool of its own (kept open, lease included) ->
        {"code": "OK"|name, "message", "session", "label", "data_socket", "namespace"}
        with "cuda_handle": "<hex>" (and "size") it sends a CUDA IPC pool description instead, no fd
  {"op": "call", "target": "unix:/path" | "host:port", "method": "Store", "session": "<id>" | "$own",
   "blocks": [[hash hex, block id]], "hashes": [hex], "namespace_id": ""}
        one KVCache RPC with the generated stub -> {"code", "details", "results"}
  {"op": "admin", "target": ..., "method": "Evict", "request": {...}} -> {"code", "details", "reply"}
  {"op": "read", "blocks": [0]} -> {"blocks": [hex of the own pool's block]}
  {"op": "connect", "path": "/path"} -> {"errno": name or "OK"}: can this uid open the socket at all?
  {"op": "client"} -> {"ready", "data_target", "stored", "loaded", "exact"}: engine_client's KVClient,
        as an engine of this uid uses it: connect, store 4 blocks, load them into other blocks
  {"op": "hold", "connects": 20} -> {"held": n}: open n connections to the registration socket and
        send nothing; prints "holding" on a line of its own and waits for a line on stdin
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
from google.protobuf import json_format  # noqa: E402

from engine_client import BlockHasher, KVClient, Namespace, ShmKVPool  # noqa: E402
from engine_client.errors import KVClientError  # noqa: E402
from engine_client.registration import register  # noqa: E402
from kvwire.v1 import admin_pb2, admin_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc  # noqa: E402

BLOCK = 4096


def drop_privileges(uid: int) -> None:
    """Load what the steps use while still root, then become `uid` (and its group) for good."""
    warm = ShmKVPool(1, BLOCK)  # imports torch's pieces and starts the resource_tracker
    warm.close()
    warm.unlink()
    grpc.insecure_channel("unix:/nonexistent").close()
    KVClient("/nonexistent", Namespace("m", "float32", 16, "block-contiguous"), warm).close()  # its loop thread
    json_format.MessageToDict(kvcache_pb2.RegistrationReply())
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit(f"could not become uid {uid}")


def main() -> None:
    uid, socket_path, steps = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    drop_privileges(uid)
    pools: list[ShmKVPool] = []
    leases: list[socket.socket] = []
    own = ""
    out: list[dict] = [{"uid": os.getuid(), "gid": os.getgid()}]
    for step in steps:
        op = step["op"]
        if op == "register":
            ns = Namespace(step.get("model", "m"), "float32", 16, "block-contiguous")
            canary = bytes.fromhex(step["canary"]) if step.get("canary") else BlockHasher(ns).canary()
            if step.get("cuda_handle"):
                n = step.get("blocks", 16)
                description = kvcache_pb2.PoolDescription(
                    num_blocks=n, regions=[kvcache_pb2.PoolRegion(offset=0, block_stride=BLOCK, block_bytes=BLOCK)],
                    cuda=kvcache_pb2.CudaIpcHandle(handle=bytes.fromhex(step["cuda_handle"]), size=n * BLOCK))
                fds = []
            else:
                pool = ShmKVPool(step.get("blocks", 16), BLOCK)
                pools.append(pool)
                for b in range(pool.num_blocks):
                    pool.write_block(b, (step.get("fill", "STRANGER").encode() * BLOCK)[:BLOCK])
                description = pool.description()
                fds = pool.registration_fds()
            request = kvcache_pb2.OpenSessionRequest(namespace=ns.to_proto(), pool=description,
                                                     hash_canary=canary, client_name=f"uid_probe uid {os.getuid()}")
            try:
                lease, reply = register(socket_path, request, fds, timeout=10)
            except KVClientError as e:
                out.append({"code": e.code.name, "message": e.message})
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            leases.append(lease)
            own = reply.session_id
            out.append({"code": "OK", "session": reply.session_id, "label": reply.label,
                        "data_socket": reply.data_socket, "namespace": reply.namespace_id})
        elif op == "call":
            out.append(call(step, own))
        elif op == "admin":
            with grpc.insecure_channel(step["target"]) as ch:
                stub = admin_pb2_grpc.AdminStub(ch)
                req = json_format.ParseDict(step.get("request", {}), getattr(admin_pb2, f"{step['method']}Request")())
                try:
                    reply = getattr(stub, step["method"])(req, timeout=10)
                    out.append({"code": "OK", "reply": json_format.MessageToDict(reply)})
                except grpc.RpcError as e:
                    out.append({"code": e.code().name, "details": e.details()})
        elif op == "read":
            out.append({"blocks": [pools[-1].read_block(b).hex() for b in step["blocks"]]})
        elif op == "client":
            out.append(client_round_trip(socket_path))
        elif op == "hold":
            held = []
            for _ in range(step["connects"]):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(socket_path + ".reg")
                held.append(c)
            print("holding", flush=True)
            sys.stdin.readline()
            out.append({"held": len(held)})
            for c in held:
                c.close()
        elif op == "connect":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(step["path"])
                out.append({"errno": "OK"})
            except OSError as e:
                out.append({"errno": errno.errorcode.get(e.errno or 0, str(e))})
            finally:
                s.close()
        else:
            out.append({"error": f"unknown op {op}"})
    print(json.dumps(out))
    for lease in leases:
        lease.close()
    for pool in pools:
        pool.close()
        pool.unlink()


def client_round_trip(socket_path: str) -> dict:
    ns = Namespace("m", "float32", 16, "block-contiguous")
    with ShmKVPool(16, BLOCK) as pool:
        client = KVClient(socket_path, ns, pool, client_name=f"uid_probe client uid {os.getuid()}")
        try:
            client.connect(required=True)
        except KVClientError as e:
            return {"ready": False, "code": e.code.name, "message": e.message}
        try:
            hashes = client.hasher.hash_blocks(list(range(64)))
            for b in range(4):
                pool.write_block(b, bytes([b + 1]) * BLOCK)
            stored = [r.status for r in client.store(hashes, [0, 1, 2, 3])]
            loaded = [r.status for r in client.load(hashes, [8, 9, 10, 11])]
            exact = [pool.read_block(8 + b) == bytes([b + 1]) * BLOCK for b in range(4)]
            return {"ready": True, "data_target": client._client._data_target, "stored": stored, "loaded": loaded,
                    "exact": exact, "label": client.session_label}
        finally:
            client.close()


def call(step: dict, own: str) -> dict:
    sid = own if step.get("session") == "$own" else step.get("session", "")
    method = step["method"]
    fields: dict = {"session_id": sid}
    if "blocks" in step:
        fields["hashes"] = b"".join(bytes.fromhex(h) for h, _ in step["blocks"])  # packed: n x 32 bytes
        fields["block_ids"] = [b for _, b in step["blocks"]]
    if "hashes" in step:
        fields["hashes"] = b"".join(bytes.fromhex(h) for h in step["hashes"])
    if step.get("namespace_id"):
        fields["namespace_id"] = step["namespace_id"]
    request = getattr(kvcache_pb2, f"{method}Request")(**fields)
    with grpc.insecure_channel(step["target"]) as ch:
        try:
            reply = getattr(kvcache_pb2_grpc.KVCacheStub(ch), method)(request, timeout=10)
        except grpc.RpcError as e:
            return {"code": e.code().name, "details": e.details()}
    # per-block statuses, as {"status": NAME} rows (Store/Load replies carry them packed)
    got = json_format.MessageToDict(reply)
    statuses = got.get("statuses", [r.get("status") for r in got.get("results", [])])
    return {"code": "OK", "results": [{"status": st} for st in statuses]}


if __name__ == "__main__":
    main()
