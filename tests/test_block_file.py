"""The disk tier's block file format against real files: round trips, damage, crash recovery."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvservice.disk.block_file import (
    HEADER_BYTES,
    BlockMeta,
    ChecksumMismatchError,
    CorruptHeaderError,
    block_path,
    decode_header,
    encode_header,
    meta_for,
    read_header,
    read_payload,
    rewrite_header,
    scan,
    verify,
    write_block,
)
from kvservice.checksum import CHECKSUM_NAME, checksum
from kvservice.disk.io_backend import BlockIOError, PosixIO, ShortReadError, open_backend

REPO = Path(__file__).resolve().parents[1]
NS = "0f3a9c" * 10  # a 60-char hex namespace id, as the core derives them


def _hash(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def _payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _store(root: Path, i: int, n: int = 10_000, deadline: float = 0.0) -> tuple[str, BlockMeta, torch.Tensor]:
    payload = _payload(n, seed=i)
    meta = meta_for(NS, _hash(i), payload, stored_at=1_700_000_000.0 + i, deadline=deadline)
    return write_block(PosixIO(), str(root), meta, payload), meta, payload


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("size", [100_000, (1 << 20) + 3])  # below and above the GIL-free cutoff
def test_checksum_is_crc32c_of_the_concatenation_without_copies(size):
    """Scenario: the core checksums a payload given as a tensor, an array, or a list of pieces;
    all agree with CRC32C of the joined bytes (standard check value for "123456789")."""
    assert CHECKSUM_NAME == "crc32c"
    assert checksum(b"123456789") == 0xE3069283
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    expected = google_crc32c.value(data.tobytes())
    assert checksum(data.tobytes()) == expected
    assert checksum(torch.from_numpy(data)) == expected
    assert checksum(torch.from_numpy(data[: size // 2 * 2]).view(torch.bfloat16)) == google_crc32c.value(
        data[: size // 2 * 2].tobytes()
    )
    assert checksum(memoryview(bytearray(data.tobytes()))) == expected
    cut = size - 4096
    assert checksum([data[:4096], data[4096:cut].tobytes(), torch.from_numpy(data[cut:])]) == expected


namespaces = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:=+-]{0,63}", fullmatch=True)
times = st.floats(min_value=0.0, max_value=1e13, allow_nan=False, allow_infinity=False)
metas = st.builds(
    BlockMeta,
    namespace=namespaces,
    hash=st.binary(min_size=32, max_size=32),
    payload_len=st.integers(0, 2**64 - 1),
    checksum=st.integers(0, 2**32 - 1),
    deadline=times,
    stored_at=times,
    reuse=st.integers(0, 2**64 - 1),
)


@given(metas)
def test_header_round_trips_every_field(meta):
    """Scenario: any valid block meta encodes to exactly one 4 KiB header and decodes back equal."""
    header = encode_header(meta)
    assert len(header) == HEADER_BYTES
    assert header.startswith(b"KVBLK001")
    assert decode_header(header) == meta


@given(metas, st.integers(0, HEADER_BYTES - 1), st.integers(1, 255))
def test_any_damaged_header_byte_is_detected(meta, offset, mask):
    """Scenario: one byte anywhere in a header (fields, padding or its own CRC) is damaged;
    decoding refuses it rather than returning wrong metadata."""
    header = bytearray(encode_header(meta))
    header[offset] ^= mask
    with pytest.raises(CorruptHeaderError):
        decode_header(header)


def test_encode_refuses_values_the_format_cannot_hold():
    """Scenario: the core hands over a key that would escape the disk root or a malformed
    field; the format refuses it with a message instead of writing it."""
    good = BlockMeta(NS, _hash(0), 10, 0)
    bad = [
        BlockMeta("../etc", _hash(0), 10, 0),
        BlockMeta("a" * 65, _hash(0), 10, 0),
        BlockMeta(NS, b"short", 10, 0),
        BlockMeta(NS, _hash(0), -1, 0),
        BlockMeta(NS, _hash(0), 10, 2**32),
        BlockMeta(NS, _hash(0), 10, 0, deadline=float("nan")),
    ]
    encode_header(good)
    for meta in bad:
        with pytest.raises(ValueError):
            encode_header(meta)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 17, (1 << 20) + 3])
def test_write_then_read_is_byte_exact(tmp_path, size):
    """Scenario: blocks of many sizes, including ones that are not multiples of 4 KiB, are
    written and read back verified; the payload starts at 4096 and the file has no slack."""
    io = PosixIO()
    payload = _payload(size, seed=size)
    meta = meta_for(NS, _hash(size), payload, stored_at=time.time())
    path = write_block(io, str(tmp_path), meta, payload)

    hx = _hash(size).hex()
    assert path == str(tmp_path / NS / hx[:2] / f"{hx}.kvb")
    assert os.path.getsize(path) == HEADER_BYTES + size
    assert read_header(path) == meta
    out = torch.empty(size, dtype=torch.uint8)
    read_payload(io, path, meta, out)
    assert torch.equal(out, payload)


def test_write_block_refuses_a_payload_of_the_wrong_length(tmp_path):
    """Scenario: meta and payload disagree on the size; nothing is written."""
    meta = meta_for(NS, _hash(1), b"x" * 100, stored_at=0.0)
    with pytest.raises(ValueError, match="100"):
        write_block(PosixIO(), str(tmp_path), meta, b"x" * 99)
    assert list(tmp_path.iterdir()) == []


def test_flipped_payload_byte_is_a_checksum_mismatch(tmp_path):
    """Scenario: one payload byte rots on disk; reading the block fails with
    ChecksumMismatchError (a BlockIOError, so the core's one except clause catches it)."""
    path, meta, _ = _store(tmp_path, 1)
    _flip(path, HEADER_BYTES + 5000)
    with pytest.raises(ChecksumMismatchError) as info:
        read_payload(PosixIO(), path, meta, torch.empty(meta.payload_len, dtype=torch.uint8))
    assert isinstance(info.value, BlockIOError)
    assert path in str(info.value)


def test_truncated_block_is_a_short_read_and_removed_by_scan(tmp_path):
    """Scenario: a block file lost its tail (disk full, crash of an older writer); reading it
    is a ShortReadError, and restart recovery deletes it."""
    path, meta, _ = _store(tmp_path, 2)
    keep_path, keep_meta, _ = _store(tmp_path, 3)
    os.truncate(path, HEADER_BYTES + meta.payload_len - 1)
    with pytest.raises(ShortReadError):
        read_payload(PosixIO(), path, meta, torch.empty(meta.payload_len, dtype=torch.uint8))

    result = scan(str(tmp_path))
    assert result.blocks == [(keep_path, keep_meta)]
    assert (result.corrupt_removed, result.torn_removed) == (1, 0)
    assert not os.path.exists(path)


def test_flipped_header_byte_is_corrupt_and_removed_by_scan(tmp_path):
    """Scenario: a header byte is damaged on disk; reading the header fails with
    CorruptHeaderError, and restart recovery deletes the block instead of serving it."""
    path, _, _ = _store(tmp_path, 4)
    _flip(path, 60)
    with pytest.raises(CorruptHeaderError):
        read_header(path)

    result = scan(str(tmp_path))
    assert (result.blocks, result.corrupt_removed) == ([], 1)
    assert not os.path.exists(path)


def test_scan_removes_leftover_temp_files_and_misplaced_blocks(tmp_path):
    """Scenario: the previous run died mid-write (a .tmp is left) and a block file sits under a
    name that is not its key; recovery deletes both, keeps good blocks, ignores other files."""
    good_path, good_meta, _ = _store(tmp_path, 5)
    misplaced, _, _ = _store(tmp_path, 6)
    wrong_name = os.path.join(os.path.dirname(misplaced), _hash(99).hex() + ".kvb")
    os.rename(misplaced, wrong_name)
    torn = good_path + ".1234-0.tmp"
    Path(torn).write_bytes(b"partial")
    notes = tmp_path / "README"
    notes.write_text("operator notes")

    result = scan(str(tmp_path))
    assert result.blocks == [(good_path, good_meta)]
    assert (result.torn_removed, result.corrupt_removed) == (1, 1)
    assert not os.path.exists(torn) and not os.path.exists(wrong_name)
    assert notes.exists()


def test_scan_of_missing_root_is_empty(tmp_path):
    """Scenario: first start, the disk directory does not exist yet."""
    result = scan(str(tmp_path / "none"))
    assert (result.blocks, result.torn_removed, result.corrupt_removed) == ([], 0, 0)


def test_rewrite_header_extends_deadline_and_keeps_payload(tmp_path):
    """Scenario: a retained block's TTL is extended; the new deadline is on disk (it survives a
    restart) and the payload still reads back verified."""
    path, meta, payload = _store(tmp_path, 7, n=3 * 4096 + 1, deadline=1_800_000_000.0)
    meta.deadline = 1_900_000_000.0
    meta.reuse = 3
    rewrite_header(PosixIO(), path, meta)

    assert os.path.getsize(path) == HEADER_BYTES + payload.numel()
    assert scan(str(tmp_path)).blocks == [(path, meta)]
    out = torch.empty_like(payload)
    read_payload(PosixIO(), path, read_header(path), out)
    assert torch.equal(out, payload)


_WRITER = textwrap.dedent(
    """
    import hashlib, sys
    import numpy as np
    from kvservice.disk.block_file import meta_for, write_block
    from kvservice.disk.io_backend import PosixIO

    root, size = sys.argv[1], int(sys.argv[2])
    io = PosixIO()
    payload = (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)
    for i in range(1_000_000):
        payload[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
        h = hashlib.sha256(i.to_bytes(8, "little")).digest()
        write_block(io, root, meta_for("ns", h, payload, stored_at=float(i)), payload)
        print(i, flush=True)
    """
)


def _expected_payload(i: int, size: int) -> np.ndarray:
    payload = (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)
    payload[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return payload


def test_kill_9_mid_burst_leaves_only_complete_valid_blocks(tmp_path):
    """Scenario: the service is SIGKILLed while a writer is in the middle of a burst of block
    writes. After recovery every block present is complete and verifies, every block the writer
    had finished is present, nothing under a real name was corrupt, and the torn write is gone.
    Repeated until one kill has landed mid-write (leaving a .tmp), which takes one or two tries."""
    size = 8 << 20  # large enough that most of the writer's time is spent inside a write
    saw_torn = False
    for attempt in range(10):
        root = tmp_path / f"run{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(root), str(size)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        finished = []
        while len(finished) < 3 + attempt % 3:
            line = proc.stdout.readline()
            assert line, f"writer died early: {proc.stderr.read()}"
            finished.append(int(line))
        time.sleep(0.001 * (2 + attempt))  # land inside the next write, not before it
        os.kill(proc.pid, signal.SIGKILL)
        finished += [int(line) for line in proc.stdout.read().split()]
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL

        tmps = [p for p in root.rglob("*.tmp")]
        result = scan(str(root))
        assert result.corrupt_removed == 0
        assert result.torn_removed == len(tmps)
        assert list(root.rglob("*.tmp")) == []
        stored = {meta.hash: (path, meta) for path, meta in result.blocks}
        assert len(stored) in (len(finished), len(finished) + 1)  # +1: renamed, not yet reported
        io = PosixIO()
        for i in range(len(stored)):
            path, meta = stored[_hash(i)]
            out = np.empty(meta.payload_len, dtype=np.uint8)
            read_payload(io, path, meta, out)
            assert np.array_equal(out, _expected_payload(i, size))
        saw_torn = saw_torn or result.torn_removed > 0
        if saw_torn:
            break
    assert saw_torn, "no kill landed mid-write in 10 tries"


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="kvikio backend needs a CUDA GPU (libcuda) to do any I/O"
)
def test_block_round_trip_through_gpu_memory(tmp_path):
    """Scenario: on a GPU host a block goes from GPU memory to disk and back into GPU memory via
    kvikio. read_payload leaves verifying a CUDA buffer to the caller; verify() passes on the
    good bytes and catches a damaged byte."""
    io = open_backend("kvikio")
    host_payload = _payload(2 * 4096 + 9, seed=11)
    meta = meta_for(NS, _hash(11), host_payload, stored_at=time.time())
    path = write_block(io, str(tmp_path), meta, host_payload.cuda())

    out = torch.empty(meta.payload_len, dtype=torch.uint8, device="cuda")
    read_payload(io, path, meta, out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), host_payload)
    verify(out, meta, path)
    out[100] ^= 1
    with pytest.raises(ChecksumMismatchError):
        verify(out, meta, path)
