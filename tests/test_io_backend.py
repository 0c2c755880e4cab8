"""Disk I/O backends against real files: atomic writes, exact reads, short reads and writes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvservice.disk.io_backend import (
    TMP_SUFFIX,
    BlockIOError,
    PosixIO,
    ShortReadError,
    ShortWriteError,
    kvikio_unavailable_reason,
    open_backend,
)

REPO = Path(__file__).resolve().parents[1]


def _pattern(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _leftover_tmps(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(TMP_SUFFIX)]


@pytest.mark.parametrize(
    "make_chunk",
    [
        pytest.param(lambda a: a.tobytes(), id="bytes"),
        pytest.param(lambda a: bytearray(a.tobytes()), id="bytearray"),
        pytest.param(lambda a: memoryview(a.tobytes()), id="memoryview"),
        pytest.param(lambda a: a, id="numpy"),
        pytest.param(lambda a: torch.from_numpy(a), id="torch-uint8"),
        pytest.param(lambda a: torch.from_numpy(a).view(torch.bfloat16), id="torch-bf16"),
    ],
)
def test_posix_write_then_read_is_byte_exact_for_every_buffer_kind(tmp_path, make_chunk):
    """Scenario: the core writes a header and a payload given as any host buffer kind; reading
    them back into a torch tensor, a numpy array and a bytearray yields the same bytes."""
    io = PosixIO()
    header, payload = _pattern(4096, 1), _pattern(3 * 4096 + 10, 2)
    path = str(tmp_path / "blk")
    io.write_file(path, [make_chunk(header), make_chunk(payload)])

    assert os.path.getsize(path) == 4096 + payload.size
    into_tensor = torch.empty(payload.size, dtype=torch.uint8)
    io.read_into(path, 4096, into_tensor)
    assert into_tensor.numpy().tobytes() == payload.tobytes()
    into_array = np.empty(4096, dtype=np.uint8)
    io.read_into(path, 0, into_array)
    assert np.array_equal(into_array, header)
    into_bytearray = bytearray(7)
    io.read_into(path, 4096 + 3, into_bytearray)
    assert bytes(into_bytearray) == payload[3:10].tobytes()
    assert _leftover_tmps(tmp_path) == []


def test_write_file_replaces_an_existing_file_whole(tmp_path):
    """Scenario: a block is rewritten under the same name; the new content replaces the old
    entirely (no tail of the longer old file survives) and no temporary file is left."""
    io = PosixIO(fsync=True)
    path = str(tmp_path / "blk")
    io.write_file(path, [b"a" * 10000])
    io.write_file(path, [b"b" * 100, b"c" * 50])
    assert Path(path).read_bytes() == b"b" * 100 + b"c" * 50
    assert _leftover_tmps(tmp_path) == []


def test_partial_reads_and_writes_are_resumed(tmp_path, monkeypatch):
    """Scenario: the kernel returns short counts from pwritev/preadv (signals, huge I/O); the
    backend resumes where each call stopped and the file and buffer end up byte-exact."""
    real_pwritev, real_preadv = os.pwritev, os.preadv
    calls = {"w": 0, "r": 0}

    def stingy_pwritev(fd, bufs, offset):
        calls["w"] += 1
        return real_pwritev(fd, [bufs[0][:777]], offset)

    def stingy_preadv(fd, bufs, offset):
        calls["r"] += 1
        return real_preadv(fd, [bufs[0][:1000]], offset)

    monkeypatch.setattr(os, "pwritev", stingy_pwritev)
    monkeypatch.setattr(os, "preadv", stingy_preadv)
    io = PosixIO()
    chunks = [_pattern(4096, 3), _pattern(5000, 4), _pattern(1, 5)]
    path = str(tmp_path / "blk")
    io.write_file(path, chunks)
    out = np.empty(9097, dtype=np.uint8)
    io.read_into(path, 0, out)

    assert out.tobytes() == b"".join(c.tobytes() for c in chunks)
    assert calls["w"] >= 9097 // 777 and calls["r"] >= 9097 // 1000


def test_more_chunks_than_iov_max_are_written_in_order(tmp_path):
    """Scenario: a write of thousands of small chunks (more than one pwritev may take) still
    lands them in order."""
    io = PosixIO()
    chunks = [bytes([i % 256]) * 3 for i in range(3000)]
    path = str(tmp_path / "blk")
    io.write_file(path, chunks)
    assert Path(path).read_bytes() == b"".join(chunks)


def test_read_past_end_of_file_raises_short_read_naming_path_and_sizes(tmp_path):
    """Scenario: a block file is shorter than its header says (truncated); the read fails with
    ShortReadError naming the file, the bytes wanted and the bytes the file still had."""
    io = PosixIO()
    path = str(tmp_path / "blk")
    io.write_file(path, [b"x" * 5000])
    with pytest.raises(ShortReadError) as info:
        io.read_into(path, 4096, bytearray(2000))
    err = info.value
    assert (err.wanted, err.got, err.path) == (2000, 904, path)
    assert path in str(err) and "2000" in str(err) and "904" in str(err)
    assert isinstance(err, BlockIOError) and isinstance(err, OSError)


def test_read_of_missing_file_is_file_not_found(tmp_path):
    """Scenario: a block file was deleted behind the service's back; the read fails with the
    OS's own FileNotFoundError (still an OSError, the family the core catches)."""
    with pytest.raises(FileNotFoundError):
        PosixIO().read_into(str(tmp_path / "gone"), 0, bytearray(1))


def test_short_write_raises_and_leaves_old_file_and_no_temp(tmp_path):
    """Scenario: the disk fills up (here: a file-size limit) in the middle of rewriting a block.
    The write fails as ShortWriteError carrying the OS errno, the previous complete file is
    still there untouched, and the partial temporary file is gone."""
    path = tmp_path / "blk"
    path.write_bytes(b"old" * 10)
    child = textwrap.dedent(
        f"""
        import resource, signal
        from kvservice.disk.io_backend import PosixIO, ShortWriteError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (10000, 10000))
        try:
            PosixIO().write_file({str(path)!r}, [b"h" * 4096, b"p" * 20000])
        except ShortWriteError as e:
            print("SHORT", e.wanted, e.got, e.errno)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split() == ["SHORT", "24096", "10000", str(errno.EFBIG)], proc.stderr
    assert path.read_bytes() == b"old" * 10
    assert _leftover_tmps(tmp_path) == []


def test_pwrite_rewrites_in_place_and_remove_tolerates_missing(tmp_path):
    """Scenario: a header is rewritten in place without touching the rest of the file; removing
    a block twice is not an error."""
    io = PosixIO()
    path = str(tmp_path / "blk")
    io.write_file(path, [b"a" * 8192])
    io.pwrite(path, 4096, b"b" * 10)
    assert Path(path).read_bytes() == b"a" * 4096 + b"b" * 10 + b"a" * 4086
    io.remove(path)
    io.remove(path)
    assert not os.path.exists(path)


def test_posix_refuses_read_only_and_device_buffers(tmp_path):
    """Scenario: the core passes a buffer the POSIX backend cannot fill; it says so instead of
    reading into a copy the caller never sees."""
    io = PosixIO()
    path = str(tmp_path / "blk")
    io.write_file(path, [b"a" * 100])
    with pytest.raises(ValueError, match="writable"):
        io.read_into(path, 0, b"\0" * 10)
    with pytest.raises(TypeError, match="host buffer"):
        io.read_into(path, 0, torch.empty(10, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="contiguous"):
        io.read_into(path, 0, torch.empty(10, 10, dtype=torch.uint8).t())


def test_open_backend_auto_picks_kvikio_only_with_cuda():
    """Scenario: the operator leaves io_backend at "auto"; a CPU-only host gets the POSIX
    backend, a CUDA host with kvikio gets kvikio."""
    io = open_backend("auto")
    if kvikio_unavailable_reason() is None:
        assert io.name in ("kvikio-gds", "kvikio-compat")
    else:
        assert io.name == "posix"
        assert isinstance(io, PosixIO)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_open_backend_kvikio_without_cuda_names_the_setting():
    """Scenario: io_backend = "kvikio" on a CPU-only host fails at start with a message that
    names the setting and the reason, instead of failing on the first block read."""
    with pytest.raises(ValueError, match="io_backend") as info:
        open_backend("kvikio")
    assert "CUDA" in str(info.value)


def test_open_backend_rejects_unknown_names():
    """Scenario: a typo in io_backend is refused with the allowed values."""
    with pytest.raises(ValueError, match="io_backend must be 'auto', 'posix' or 'kvikio'"):
        open_backend("posx")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="kvikio backend needs a CUDA GPU (libcuda) to do any I/O"
)
def test_kvikio_round_trip_host_and_device_buffers(tmp_path):
    """Scenario: on a GPU host the kvikio backend writes a host header plus a CUDA payload,
    then reads the payload back into GPU and host memory byte-exact; a read past the end of
    the file is a ShortReadError, as with POSIX."""
    io = open_backend("kvikio", fsync=True)
    assert io.name in ("kvikio-gds", "kvikio-compat")
    header = _pattern(4096, 7)
    payload = torch.from_numpy(_pattern(5 * 4096 + 123, 8)).cuda()
    path = str(tmp_path / "blk")
    io.write_file(path, [header, payload])
    assert os.path.getsize(path) == 4096 + payload.numel()
    assert _leftover_tmps(tmp_path) == []

    on_gpu = torch.empty_like(payload)
    io.read_into(path, 4096, on_gpu)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu, payload)
    on_host = torch.empty(payload.numel(), dtype=torch.uint8)
    io.read_into(path, 4096, on_host)
    assert torch.equal(on_host, payload.cpu())
    with pytest.raises(ShortReadError):
        io.read_into(path, 4096 + 200, torch.empty_like(payload))
