"""The GPU data path: engine pools registered by CUDA IPC, moved to and from the host and disk tiers.

Tests marked `gpu` need a CUDA device and skip elsewhere; the others check the pieces that need no
GPU (batch shapes, layout plans, run coalescing) and run everywhere. The gpu tests drive a real
daemon over its Unix socket and real engine processes (harness/engine_proc.py --pool cuda, owning a
CudaKVPool and obeying one JSON command per stdin line). Block number i has content content(i) and
hash h(i) in every process; loads land in poisoned slots and come back checked byte for byte
("exact"), failed ones checked untouched.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvservice.memory import cuda_memory  # noqa: E402
from kvservice.core.sessions_api import PoolRegion, PoolSpec  # noqa: E402
from harness.blocks import h  # noqa: E402
from harness.wait import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOST, DISK = 2, 3  # kvservice.v1.Tier
STORED, LOADED, LOAD_FAILED = 1, 1, 3
POISON = 0xAB


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: engine pools are registered by CUDA IPC (torch.cuda.is_available() is False)"
    try:
        import cuda.bindings.runtime  # noqa: F401  # (only whether it imports)
    except ImportError:
        try:
            import cupy  # noqa: F401
        except ImportError:
            return "needs cuda-bindings or CuPy for cudaMalloc / CUDA IPC handles"
    return None


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(_gpu_skip_reason() is not None, reason=_gpu_skip_reason() or "")


# --- pieces that need no GPU


def test_batches_move_in_power_of_two_pieces():
    """Scenario: a batch is cut into chunks of a power-of-two number of rows (torch's pinned
    allocator rounds to powers of two, so these waste nothing), full chunks first."""
    assert cuda_memory.chunk_rows(37, 1 << 20, 16 << 20) == [16, 16, 4, 1]
    assert cuda_memory.chunk_rows(4096, 64 << 10, 16 << 20) == [256] * 16
    assert cuda_memory.chunk_rows(3, 64 << 20, 16 << 20) == [1, 1, 1]
    assert cuda_memory.chunk_rows(0, 4096) == []
    for n in range(1, 300):
        pieces = cuda_memory.chunk_rows(n, 3 * 4096, 1 << 20)
        assert sum(pieces) == n and all(p & (p - 1) == 0 for p in pieces)


def _spec(layout: str, num_blocks: int, block_bytes: int, layers: int = 1) -> PoolSpec:
    from engine_client.shm_pool import _regions

    regions = tuple(PoolRegion(r.offset, r.block_stride, r.block_bytes)
                    for r in _regions(num_blocks, block_bytes, layout, layers))
    return PoolSpec("cuda", num_blocks, regions, num_blocks * block_bytes)


def _cpu_memory(spec: PoolSpec, base: torch.Tensor) -> cuda_memory.CudaEngineMemory:
    """The layout plan of CudaEngineMemory over a CPU tensor: its gather/scatter kernels are plain torch."""
    m = object.__new__(cuda_memory.CudaEngineMemory)
    m.spec, m.num_blocks, m.block_bytes, m._ptr = spec, spec.num_blocks, spec.block_bytes, 0
    m._plan(base)
    return m


def _reference_block(spec: PoolSpec, base: torch.Tensor, b: int) -> torch.Tensor:
    return torch.cat([base[r.offset + b * r.block_stride: r.offset + b * r.block_stride + r.block_bytes]
                      for r in spec.regions])


@pytest.mark.parametrize("layout, layers, regions", [
    ("block-contiguous", 1, None),
    ("layer-first", 4, None),
    ("irregular", 1, ((0, 96, 32), (4096, 64, 16), (8192, 16, 8))),
])
def test_layout_plan_gathers_and_scatters_whole_blocks(layout, layers, regions):
    """Scenario: for block-contiguous, layer-first and an irregular region list, the device-side
    gather returns each block as its rows in region order, and scatter writes exactly those bytes
    back to other blocks and nothing else (checked on CPU tensors, same torch kernels)."""
    if regions is None:
        spec = _spec(layout, 16, 512, layers)
    else:
        spec = PoolSpec("cuda", 16, tuple(PoolRegion(*r) for r in regions), 8192 + 16 * 16)
    base = torch.randint(0, 256, (spec.size,), dtype=torch.uint8)
    m = _cpu_memory(spec, base)
    assert m._uniform == (regions is None)
    src, dst = [3, 0, 7, 5], [9, 12, 8, 15]
    rows = m._gather_dev(torch.tensor(src))
    assert rows.view(torch.uint8).shape == (4, spec.block_bytes)
    for k, b in enumerate(src):
        assert torch.equal(rows[k].view(torch.uint8), _reference_block(spec, base, b))
    staged = torch.zeros((2, 4 * spec.block_bytes), dtype=torch.uint8)  # a lane's staging: gather into slot 1
    into = staged[1].view(rows.dtype).view(rows.shape)
    assert m._gather_dev(torch.tensor(src), out=into) is into and torch.equal(into, rows)
    assert not staged[0].any()
    before = base.clone()
    m._scatter_dev(torch.tensor(dst), rows)
    for b in range(16):
        want = _reference_block(spec, before, src[dst.index(b)]) if b in dst else _reference_block(spec, before, b)
        assert torch.equal(_reference_block(spec, base, b), want), b
    untouched = torch.ones(spec.size, dtype=torch.bool)
    for b in dst:
        for r in spec.regions:
            untouched[r.offset + b * r.block_stride: r.offset + b * r.block_stride + r.block_bytes] = False
    assert torch.equal(base[untouched], before[untouched])


def test_driver_launches_see_uniform_aligned_layouts_as_one_strided_view():
    """Scenario: the lean launch path (kvservice.memory.cuda_launch) takes a layout only when its regions
    are one [regions, blocks, row] view with 8-byte alignment, and moves 16-byte words where it can;
    anything else stays on the torch path (PoolRows.of is None)."""
    from kvservice.memory.cuda_launch import PoolRows

    lf = _spec("layer-first", 64, 256 << 10, 32)  # 64 regions of 4 KiB
    rows = PoolRows.of(1 << 20, lf.regions)
    assert (rows.regions, rows.rstride, rows.bstride, rows.row_bytes, rows.width) == (
        64, lf.regions[1].offset - lf.regions[0].offset, 4096, 4096, 16)
    assert rows.threads() == 256
    bc = PoolRows.of(1 << 20, _spec("block-contiguous", 8, 2 << 20).regions)
    assert (bc.regions, bc.rstride, bc.bstride, bc.row_bytes, bc.width) == (1, 0, 2 << 20, 2 << 20, 16)
    assert PoolRows.of(8, _spec("block-contiguous", 8, 4096).regions).width == 8
    odd = tuple(PoolRegion(8 + i * 48, 24 * 4, 24) for i in range(2))  # 24-byte rows: 8-byte words
    assert PoolRows.of(0, odd).width == 8 and PoolRows.of(0, odd).threads() == 32
    assert PoolRows.of(0, (PoolRegion(0, 96, 32), PoolRegion(4096, 64, 16))) is None  # not one view
    assert PoolRows.of(0, (PoolRegion(4, 12, 12),)) is None  # 4-byte aligned only


def test_element_width_follows_the_layout_alignment():
    """Scenario: kernels move 8-byte elements when every offset, stride and row allows it."""
    assert cuda_memory.element_bytes(_spec("layer-first", 8, 4096, 2)) == 8
    odd = PoolSpec("cuda", 4, (PoolRegion(2, 6, 6),), 32)
    assert cuda_memory.element_bytes(odd) == 2


def test_host_rows_back_to_back_coalesce_into_runs():
    """Scenario: rows of one pinned chunk, in order, are one copy; a gap, a reordering or another
    base tensor starts a new run; a lone buffer is its own run."""
    a = torch.empty((8, 64), dtype=torch.uint8).unbind(0)
    b = torch.empty((4, 64), dtype=torch.uint8).unbind(0)
    lone = torch.empty(64, dtype=torch.uint8)
    srcs = [a[0], a[1], a[2], a[4], a[5], b[0], b[1], lone, a[7], a[6]]
    runs = [(first, n) for first, n, _ in cuda_memory.host_runs(srcs, 64)]
    assert runs == [(0, 3), (3, 2), (5, 2), (7, 1), (8, 1), (9, 1)]
    with pytest.raises(ValueError, match="not a host buffer of 64 bytes"):
        cuda_memory.host_runs([torch.empty(32, dtype=torch.uint8)], 64)


def test_gpu_crc_tables_reproduce_crc32c():
    """Scenario: the tables the GPU CRC kernels use, applied the way the kernels apply them (raw
    CRC per segment with slice-by-8, segments folded with the shift tables, then the standard
    conditioning), give google_crc32c's value for rows of several lengths."""
    import google_crc32c

    t = cuda_memory.crc_slice_tables()

    def raw(seg: bytes) -> int:
        c = 0
        for i in range(0, len(seg), 8):
            x = int.from_bytes(seg[i:i + 8], "little") ^ c
            c = 0
            for k in range(8):
                c ^= t[7 - k][(x >> (8 * k)) & 0xFF]
        return c

    rng = random.Random(5)
    for length in (8, 520, 4096, 3 * 1024):
        row = bytes(rng.getrandbits(8) for _ in range(length))
        seg = cuda_memory.crc_segment_bytes(length)
        shift = cuda_memory.crc_shift_tables(seg)
        c = 0
        for i in range(0, length, seg):
            c = shift[0][c & 0xFF] ^ shift[1][(c >> 8) & 0xFF] ^ shift[2][(c >> 16) & 0xFF] ^ shift[3][c >> 24]
            c ^= raw(row[i:i + seg])
        assert c ^ google_crc32c.value(bytes(length)) == google_crc32c.value(row), length
    assert cuda_memory.crc_segment_bytes(12) == 0


def test_device_uuids_compare_with_or_without_the_gpu_prefix():
    assert cuda_memory.normalize_uuid("GPU-8F1E0000-aaaa") == cuda_memory.normalize_uuid("8f1e0000-AAAA")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_a_cuda_pool_on_a_host_without_cuda_is_refused_with_the_reason():
    from kvservice.memory.engine_memory import open_engine_memory
    from kvservice.core.types import CacheError, ErrorCode

    with pytest.raises(CacheError) as err:
        open_engine_memory(_spec("block-contiguous", 4, 4096))
    assert err.value.code == ErrorCode.FAILED_PRECONDITION
    assert "no CUDA device" in err.value.message


# --- helpers for the gpu scenarios


def GpuEngine(target: str, *args: str, env: dict[str, str] | None = None):
    """An engine process owning a CudaKVPool (harness/engine_proc.py --pool cuda)."""
    from harness.engine import EngineProc

    return EngineProc(target, "--pool", "cuda", *args, env=env, require_ready=True)


def _daemon(host: str, disk: str, *extra: str):
    from harness.daemon import Daemon

    return Daemon(host_capacity=host, disk_capacity=disk,
                  extra=["--io-backend", "auto", "--lease-seconds", "2", *extra]).start(timeout=60)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    wait_until(predicate, timeout, what)


def _sessions(d) -> int:
    return len(d.admin("ListSessions").sessions)


def _open_mappings(d) -> int:
    found = re.findall(r"open mappings: (\d+)", d.log())
    return int(found[-1]) if found else 0


def _expect_kvikio(d) -> None:
    from kvservice.disk.io_backend import kvikio_unavailable_reason

    backend = d.stats().io_backend
    if kvikio_unavailable_reason() is None:
        assert backend in ("kvikio-compat", "kvikio-gds"), backend
        assert f"io backend: {backend}" in d.log()


def _drop_page_cache() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


# --- gpu scenarios


@gpu
@needs_gpu
@pytest.mark.parametrize("layout, layers", [("block-contiguous", 1), ("layer-first", 4)])
def test_blocks_round_trip_exactly_through_host_and_disk_tiers(layout, layers):
    """Scenario: an engine with a CUDA pool stores 24 blocks of 256 KiB; the host tier keeps 8 and
    the other 16 spill to disk (kvikio backend). Loading all 24 into poisoned slots, in shuffled
    order, returns every byte from both tiers. A disk block whose file was damaged is reported
    failed and its slot is left untouched: the checksum is verified before bytes reach the GPU."""
    bb = 256 << 10
    d = _daemon("2MiB", "64MiB", "--disk-format", "files")  # block files through kvikio; segments: bench/disk_tier.py
    try:
        e = GpuEngine(d.target, "--layout", layout, "--layers", str(layers), "--blocks", "64", "--block-bytes", str(bb))
        try:
            _expect_kvikio(d)
            nums = list(range(24))
            for lo in (0, 8, 16):  # the host tier holds 8: each batch pushes the one before to disk
                r = e.call("store", numbers=nums[lo:lo + 8], slots=nums[lo:lo + 8])
                assert r["status"] == [STORED] * 8, r
            wait_for("16 spills", lambda: d.stats().counters.spills >= 16 and d.stats().write_queue_depth == 0)
            assert e.call("lookup", numbers=nums)["tiers"] == [DISK] * 16 + [HOST] * 8
            _drop_page_cache()
            order = nums[:]
            random.Random(7).shuffle(order)
            r = e.call("load", numbers=order, slots=[32 + k for k in range(24)])
            assert r["status"] == [LOADED] * 24 and r["exact"] == [True] * 24, r
            assert {t for t in r["tier"]} == {HOST, DISK}
            c = d.stats().counters
            assert c.loads_disk >= 16 and c.loads_host >= 1, c

            on_disk = [i for i, t in zip(nums, e.call("lookup", numbers=nums)["tiers"]) if t == DISK]
            assert on_disk, "every block went back to the host tier"
            victim = on_disk[0]
            path = Path(d.disk_path) / e.hello["namespace"] / h(victim).hex()[:2] / (h(victim).hex() + ".kvb")
            with open(path, "r+b") as f:
                f.seek(4096 + 1000)
                byte = f.read(1)
                f.seek(4096 + 1000)
                f.write(bytes([byte[0] ^ 0xFF]))
            r = e.call("load", numbers=[victim], slots=[60])
            assert r["status"] == [LOAD_FAILED] and r["untouched"] == [True], r
            assert "checksum" in r["message"][0]
            assert d.stats().counters.checksum_failures == 1
        finally:
            e.close()
    finally:
        d.stop()
        d.close()


_SCATTERED_SLOTS_CHILD = r"""
import json, random, sys
import torch
from kvservice.checksum import checksum
from kvservice.core.sessions_api import PoolRegion, PoolSpec
from kvservice.memory import cuda_memory
from kvservice.memory.host_arena import HostArena
from kvwire.v1 import kvcache_pb2
from engine_client.shm_pool import _regions

cuda_memory.CHUNK_BYTES = 1 << 20  # 64 rows a chunk: 16 chunks go round the staging slots many times
desc = kvcache_pb2.PoolDescription.FromString(bytes.fromhex(sys.stdin.readline().strip()))
bb, n = 16 << 10, 1000
nb = desc.cuda.size // bb
regs = _regions(nb, bb, "layer-first", 4)
spec = PoolSpec("cuda", nb, tuple(PoolRegion(r.offset, r.block_stride, r.block_bytes) for r in regs), desc.cuda.size,
                cuda_handle=desc.cuda.handle, cuda_device_index=desc.cuda.device_index)
m = cuda_memory.CudaEngineMemory(spec)
arena = HostArena(4 * n * bb, pin=True)
rng = random.Random(5)
ids = list(range(nb)); rng.shuffle(ids)
src, dst = ids[:n], ids[n:2 * n]
slots = list(range(4 * n)); rng.shuffle(slots)  # scattered: nearly every block is a run of its own
offs = [s * bb for s in slots[:n]]
dev = m._dev.device
want = m._gather_dev(torch.tensor(src, device=dev)).view(torch.uint8).cpu()
sums = m.gather_into(src, arena, offs)
landed = all(torch.equal(arena.row(o, bb), want[i]) for i, o in enumerate(offs))
crcs = sums == [checksum(want[i]) for i in range(n)]
order = list(range(n)); rng.shuffle(order)
m.scatter_from([dst[i] for i in order], arena, [offs[i] for i in order])
loaded = torch.equal(m._gather_dev(torch.tensor(dst, device=dev)).view(torch.uint8).cpu(), want)
m.close(); arena.close()
print(json.dumps({"landed": landed, "crcs": crcs, "loaded": loaded}))
"""


@gpu
@needs_gpu
def test_scattered_arena_slots_and_many_chunks_move_exactly():
    """Scenario: a fragmented host tier. 1000 blocks of 16 KiB (layer-first, 8 regions) are stored
    into arena slots in random order, so a chunk is dozens of runs (one batched copy), in chunks of
    1 MiB, so the lane's staging slots are reused four times over; then loaded back in another
    order into other blocks. Every slot holds its block's bytes, every CRC32C matches, and every
    loaded block equals its source (a helper process maps the pool, as the daemon does)."""
    assert _child_on_a_random_pool(_SCATTERED_SLOTS_CHILD, 120) == {"landed": True, "crcs": True, "loaded": True}


def _child_on_a_random_pool(script: str, timeout: float):
    """Run `script` in a helper process that maps a fresh layer-first CUDA pool of random bytes (2048
    blocks of 16 KiB, 4 layers; its PoolDescription in hex on stdin), as the daemon maps one; the
    JSON of its last line of output."""
    import json

    from engine_client import CudaKVPool
    from harness.daemon import child_env

    pool = CudaKVPool(2048, 16 << 10, layout="layer-first", num_layers=4)
    try:
        pool.buffer.random_(0, 256)
        torch.cuda.synchronize()
        p = subprocess.run([sys.executable, "-c", script], input=pool.description().SerializeToString().hex() + "\n",
                           capture_output=True, text=True, env=child_env(), timeout=timeout, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        pool.close()


_LEAN_CHILD = r"""
import json, random, sys
import torch
from kvservice.checksum import checksum
from kvservice.core.sessions_api import PoolRegion, PoolSpec
from kvservice.memory import cuda_memory
from kvservice.memory.host_arena import HostArena
from kvwire.v1 import kvcache_pb2
from engine_client.shm_pool import _regions

cuda_memory.CHUNK_BYTES = 1 << 20  # many chunks: the staging slots and their events go round
desc = kvcache_pb2.PoolDescription.FromString(bytes.fromhex(sys.stdin.readline().strip()))
size = desc.cuda.size
layouts = {  # name: (block bytes, blocks, regions over the same pool memory)
    "layer-first 16 KiB": (16 << 10, 2048, _regions(2048, 16 << 10, "layer-first", 4)),
    "block-contiguous 64 KiB": (64 << 10, 512, _regions(512, 64 << 10, "block-contiguous", 1)),
    "24-byte rows, 8-byte words": (48, 4096, [PoolRegion(8 + i * 24, 96, 24) for i in range(2)]),
}
out = {}
rng = random.Random(7)
for name, (bb, nb, regs) in layouts.items():
    spec = PoolSpec("cuda", nb, tuple(PoolRegion(r.offset, r.block_stride, r.block_bytes) for r in regs), size,
                    cuda_handle=desc.cuda.handle, cuda_device_index=desc.cuda.device_index)
    n = min(1000, nb // 2)
    cuda_memory.LEAN_LAUNCH = True
    lean = cuda_memory.CudaEngineMemory(spec)
    cuda_memory.LEAN_LAUNCH = False
    plain = cuda_memory.CudaEngineMemory(spec)
    arena = HostArena(4 * n * bb, pin=True)
    ids = list(range(nb)); rng.shuffle(ids)
    src, dst = ids[:n], ids[n:2 * n]
    slots = list(range(2 * n)); rng.shuffle(slots)
    offs = [s * bb for s in slots[:n]]  # scattered over the arena's first 2n slots
    back = [(i + 2 * n) * bb for i in range(n)]  # adjacent slots past them: runs, one copy each
    dev = plain._dev.device
    want = plain._gather_dev(torch.tensor(src, device=dev)).view(torch.uint8).cpu()
    sums = lean.gather_into(src, arena, offs)
    row = [checksum(want[i]) for i in range(n)]
    r = {"lean": lean._launcher is not None, "landed": all(torch.equal(arena.row(o, bb), want[i]) for i, o in enumerate(offs)),
         "crcs": sums == row, "plain_crcs": plain.gather_into(src, arena, back) == row,
         "both": all(torch.equal(arena.row(a, bb), arena.row(b, bb)) for a, b in zip(offs, back)),
         "plain_gather": all(torch.equal(x, want[i]) for i, x in enumerate(lean.gather(src[:5])))}
    order = list(range(n)); rng.shuffle(order)
    lean.scatter_from([dst[i] for i in order], arena, [offs[i] for i in order])
    r["loaded"] = torch.equal(plain._gather_dev(torch.tensor(dst, device=dev)).view(torch.uint8).cpu(), want)
    lean.scatter_from(dst[:n // 2], arena, back[n // 2:n // 2 * 2])  # adjacent slots: one copy a run
    r["loaded_runs"] = torch.equal(plain._gather_dev(torch.tensor(dst[:n // 2], device=dev)).view(torch.uint8).cpu(),
                                   want[n // 2:n // 2 * 2])
    out[name] = r
    lean.close(); plain.close(); arena.close()
print(json.dumps(out))
"""


@gpu
@needs_gpu
def test_driver_launches_move_the_same_bytes_and_crcs_as_the_torch_path():
    """Scenario: with KVTUNE_LEAN_LAUNCH the copy path launches its kernels and copies through libcuda
    (kvservice.memory.cuda_launch). For a layer-first pool (16-byte words), a block-contiguous one and
    a layout of 24-byte rows (8-byte words), blocks stored into scattered and adjacent arena slots land
    byte for byte as the torch path lands them, with the same CRC32C, and Loads through the driver put
    them back exactly; the lean path really ran (a helper process maps the pool, as the daemon does)."""
    got = _child_on_a_random_pool(_LEAN_CHILD, 180)
    assert got and all(all(r.values()) for r in got.values()), got


@gpu
@needs_gpu
def test_two_engines_on_one_gpu_share_blocks_and_the_store_event_orders_writes():
    """Scenario: two engine processes on one GPU, one namespace (layer-first, 8 layers), one of them
    allocating its pool through CuPy. Engine A queues its block writes behind a long GPU sleep and
    stores at once, without synchronising: the daemon's copy waits on A's IPC event, so engine B
    loads exactly the bytes A wrote. B stores, A loads, likewise."""
    d = _daemon("64MiB", "")
    try:
        args = ("--layout", "layer-first", "--layers", "8", "--blocks", "64", "--block-bytes", str(128 << 10))
        a = GpuEngine(d.target, *args)
        b = GpuEngine(d.target, *args, env={"KVSERVICE_CUDA_RUNTIME": "cupy"})
        try:
            assert a.hello["namespace"] == b.hello["namespace"]
            assert b.hello["runtime"] == "cupy"
            mine = list(range(100, 116))
            t0 = time.monotonic()
            r = a.call("store", numbers=mine, slots=list(range(16)), delay_cycles=400_000_000)  # ~0.2 s of GPU time
            assert r["status"] == [STORED] * 16, r
            assert time.monotonic() - t0 > 0.1, "the sleep did not delay the store"
            r = b.call("load", numbers=mine, slots=list(range(40, 56)))
            assert r["status"] == [LOADED] * 16 and r["exact"] == [True] * 16, r
            theirs = list(range(200, 208))
            assert b.call("store", numbers=theirs, slots=list(range(8)))["status"] == [STORED] * 8
            r = a.call("load", numbers=theirs + mine[:4], slots=list(range(20, 32)))
            assert r["status"] == [LOADED] * 12 and r["exact"] == [True] * 12, r
        finally:
            a.close()
            b.close()
        wait_for("sessions closed", lambda: _sessions(d) == 0)
        assert _open_mappings(d) == 0
    finally:
        d.stop()
        d.close()


@gpu
@needs_gpu
def test_an_engine_killed_during_a_load_leaves_the_daemon_serving():
    """Scenario: an engine stores 128 blocks of 2 MiB, 96 of which spill to disk, asks to load
    them all and is killed -9 while the daemon reads and copies them into its memory. The daemon
    finishes or drops the copy, keeps serving (another engine round-trips exactly), reaps the dead
    session within seconds and closes its mapping."""
    bb = 2 << 20
    d = _daemon("64MiB", "1GiB")
    try:
        a = GpuEngine(d.target, "--blocks", "256", "--block-bytes", str(bb))
        nums = list(range(128))
        for lo in range(0, 128, 32):  # the host tier holds 32 blocks
            assert a.call("store", numbers=nums[lo:lo + 32], slots=nums[lo:lo + 32])["status"] == [STORED] * 32
        wait_for("spills", lambda: d.stats().counters.spills >= 96 and d.stats().write_queue_depth == 0, 120)
        _drop_page_cache()
        a.send("load", numbers=nums, slots=[128 + k for k in range(128)])
        deadline = time.monotonic() + 2.0
        while d.stats().read_queue_depth == 0 and time.monotonic() < deadline:
            pass
        in_flight = d.stats().read_queue_depth
        a.kill9()
        print(f"killed with {in_flight} disk reads in flight")
        assert d.serving()
        b = GpuEngine(d.target, "--blocks", "32", "--block-bytes", str(bb))
        try:
            r = b.call("load", numbers=nums[:8], slots=list(range(8, 16)))
            assert r["status"] == [LOADED] * 8 and r["exact"] == [True] * 8, r
        finally:
            b.close()
        wait_for("the dead session reaped", lambda: _sessions(d) == 0)
        assert _open_mappings(d) == 0
        assert d.serving()
    finally:
        d.stop()
        d.close()


def _daemon_gpu_mib(pid: int) -> int | None:
    """The daemon's own GPU memory as nvidia-smi reports it (None where it cannot say)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            return int(parts[1])
    return None


@gpu
@needs_gpu
def test_twenty_kill9_cycles_leave_no_gpu_memory_or_mapping_behind():
    """Scenario: 20 times, an engine with a 128 MiB pool connects, loads 4 blocks and is killed -9.
    Once the daemon has reaped the sessions, the GPU's free memory, the daemon's own GPU memory,
    its open IPC mappings and its open file descriptors are back where they were after the first."""
    bb = 1 << 20
    d = _daemon("64MiB", "")
    args = ("--blocks", "128", "--block-bytes", str(bb))
    try:
        first = GpuEngine(d.target, *args)
        assert first.call("store", numbers=[0, 1, 2, 3], slots=[0, 1, 2, 3])["status"] == [STORED] * 4
        first.kill9()
        wait_for("the first session reaped", lambda: _sessions(d) == 0)
        torch.cuda.init()
        time.sleep(1.0)
        free0, _ = torch.cuda.mem_get_info()
        daemon0 = _daemon_gpu_mib(d.proc.pid)
        fds0 = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        for cycle in range(20):
            e = GpuEngine(d.target, *args)
            r = e.call("load", numbers=[0, 1, 2, 3], slots=[64, 65, 66, 67])
            assert r["status"] == [LOADED] * 4 and r["exact"] == [True] * 4, (cycle, r)
            e.kill9()
        wait_for("20 dead sessions reaped", lambda: _sessions(d) == 0, 60)
        assert _open_mappings(d) == 0
        time.sleep(1.0)
        free1, _ = torch.cuda.mem_get_info()
        daemon1 = _daemon_gpu_mib(d.proc.pid)
        fds1 = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        print(f"GPU free {free0 >> 20} -> {free1 >> 20} MiB; daemon GPU {daemon0} -> {daemon1} MiB; fds {fds0} -> {fds1}")
        assert abs(free1 - free0) < (32 << 20), (free0, free1)
        if daemon0 is not None and daemon1 is not None:
            assert abs(daemon1 - daemon0) <= 16, (daemon0, daemon1)
        assert fds1 <= fds0 + 2, (fds0, fds1)
        assert d.serving()
    finally:
        d.stop()
        d.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))


@gpu
@needs_gpu
def test_keys_of_four_gpu_blocks_round_trip_exactly_through_host_and_disk_tiers():
    """Scenario: an engine with a CUDA pool of 64 KiB blocks (layer-first, 8 regions) registers it with
    blocks_per_key = 4: the daemon keeps 256 KiB keys. It stores 24 keys (96 scattered blocks) in three
    Stores into a host tier of 8 keys, so 16 spill to disk (segments, kvikio); with the page cache
    dropped, Loading all 24 into 96 other poisoned blocks returns every byte from both tiers. The
    disk reads verify each key's CRC32C, folded from the GPU's per-block ones at Store: a wrong fold
    would fail them."""
    from engine_client import CudaKVPool, KVClient, Namespace

    bb, k = 64 << 10, 4
    d = _daemon("2MiB", "64MiB")
    pool = CudaKVPool(256, bb, layout="layer-first", num_layers=4)
    try:
        pool.buffer.random_(0, 256)
        torch.cuda.synchronize()
        ids = list(range(256))
        random.Random(11).shuffle(ids)
        src, dst = ids[:96], ids[96:192]
        want = [pool.read_block(b) for b in src]
        ns = Namespace("gpu-keys", "bfloat16", 16 * k, "layer-first")
        with KVClient(d.target, ns, pool, client_name="gpu-keys", blocks_per_key=k) as kv:
            hs = kv._client.hasher.hash_blocks(range(24 * 16 * k))
            for lo in (0, 8, 16):  # the host tier holds 8 keys: each Store pushes the one before to disk
                r = kv.store(hs[lo:lo + 8], src[lo * k:(lo + 8) * k])
                assert [x.status for x in r] == [STORED] * 8, [x.message for x in r]
            wait_for("16 spills", lambda: d.stats().counters.spills >= 16 and d.stats().write_queue_depth == 0)
            assert kv.lookup(hs) == (24, [DISK] * 16 + [HOST] * 8)
            _drop_page_cache()
            for b in dst:
                pool.write_block(b, bytes([POISON]) * bb)
            torch.cuda.synchronize()
            r = kv.load(hs, dst)
            assert [x.status for x in r] == [LOADED] * 24, [x.message for x in r]
            assert {x.tier for x in r} == {HOST, DISK}
            assert [pool.read_block(b) for b in dst] == want
            assert d.stats().counters.checksum_failures == 0
    finally:
        pool.close()
        d.stop()
        d.close()
