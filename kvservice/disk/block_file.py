"""The on-disk format of the disk tier: one file per block.

    <root>/<namespace>/<hash[:2] hex>/<hash hex>.kvb
    bytes [0, 4096)        header: magic b"KVBLK001", format version, BlockMeta fields,
                           zero padding, CRC32C of bytes [0, 4092) in the last 4 bytes
    bytes [4096, 4096+n)   payload: the block's KV bytes, n = payload_len

Why one file per block (as LMCache's local disk backend does) rather than slots in big files:
- Crash safety comes from the filesystem. A block is written under a temporary name and renamed
  into place (io_backend.write_file), so a kill -9 or power cut mid-write leaves at worst a `*.tmp`
  that restart recovery deletes; a torn block never exists under a real name. Slot files would need
  a journal or per-slot generation numbers to tell a torn overwrite from a good block.
- The file's identity is its key. Recovery rebuilds the index from directory entries and headers
  alone; no separate index file has to be kept consistent with the data.
- Eviction is an unlink, and the filesystem does the free-space management.
- The payload starts 4 KiB-aligned, so O_DIRECT / GPUDirect Storage reads it straight into a host
  or GPU buffer with no bounce copy, and the header can be rewritten (deadline extended) with one
  aligned 4096-byte pwrite that never touches the payload.
The costs: one open/close per block read or write and one inode per block. With blocks of hundreds
of KiB to several MiB (16-64 tokens of an 8B-shaped model), that is a small fraction of the I/O.
The two-level fan-out (256 shard directories per namespace) keeps directories small.

Integrity: the payload checksum is computed when the block is first stored and travels in
BlockMeta; it is written, never recomputed, here, and checked on every host read (`read_payload`).
The header has its own CRC, so a torn or garbage header is detected (`CorruptHeaderError`).
A header rewrite is one 4 KiB pwrite in place; a crash in the middle of one can at worst corrupt
the header, which `scan` then detects and discards the block (a cache may lose a block, never
serve a wrong one).

Errors: everything here raises `OSError` subclasses. `CorruptHeaderError` and
`ChecksumMismatchError` join io_backend's `BlockIOError` family (with `ShortReadError` and
`ShortWriteError`); catch `BlockIOError` for "this block is bad, discard it", or `OSError` for any
disk failure including the OS's own (ENOENT, EIO, ENOSPC).

Concurrency: the functions are stateless. The caller serialises operations on one key: a
`rewrite_header` racing a `write_block` of the same key may be lost with the replaced file.
"""

from __future__ import annotations

import logging
import math
import os
import re
import struct
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvservice.checksum import Buffer, byte_view, checksum
from kvservice.disk.io_backend import TMP_SUFFIX, BlockIO, BlockIOError, nbytes, on_host
from kvservice.core.types import HASH_BYTES, BlockHash, NamespaceId

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
MAGIC = b"KVBLK001"
FORMAT_VERSION = 1
BLOCK_SUFFIX = ".kvb"
NAMESPACE_MAX = 64
_CHECKSUM_CRC32C = 1  # payload checksum algorithm id stored in the header

# magic, version, checksum algo, namespace length, namespace, hash, payload_len, checksum,
# deadline, stored_at, reuse. Little-endian, no implicit padding.
_FIELDS = struct.Struct(f"<8sHBB{NAMESPACE_MAX}s{HASH_BYTES}sQIddQ")
_CRC = struct.Struct("<I")
_CRC_AT = HEADER_BYTES - _CRC.size
# A path component: no '/', no NUL, never '.', '..' or hidden. Hex digests pass.
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=+-]{0,%d}" % (NAMESPACE_MAX - 1), re.ASCII)


class CorruptHeaderError(BlockIOError):
    """The first 4096 bytes are not a valid block header (torn, truncated, garbage, other version)."""


class ChecksumMismatchError(BlockIOError):
    """The payload read back does not have the CRC32C recorded when the block was stored."""

    def __init__(self, path: str, expected: int, got: int) -> None:
        where = f" of {path}" if path else ""
        super().__init__(f"payload checksum mismatch{where}: crc32c {got:#010x}, expected {expected:#010x}")
        self.path = path
        self.expected, self.got = expected, got


@dataclass(slots=True)
class BlockMeta:
    namespace: NamespaceId  # <= 64 ASCII chars, a valid path component
    hash: BlockHash  # 32 bytes
    payload_len: int
    checksum: int  # crc32c of the payload, computed when the block was first stored
    deadline: float = 0.0  # unix seconds; 0.0 = not retained
    stored_at: float = 0.0  # unix seconds
    reuse: int = 0  # times the block was loaded; informational (min-reuse gate)


@dataclass(slots=True)
class ScanResult:
    blocks: list[tuple[str, BlockMeta]] = field(default_factory=list)  # (path, meta) of good blocks
    torn_removed: int = 0  # leftover *.tmp files of interrupted writes, deleted
    corrupt_removed: int = 0  # *.kvb with a bad header, wrong size or wrong location, deleted


def meta_for(
    namespace: str, hash: bytes, payload: Buffer, *, stored_at: float, deadline: float = 0.0
) -> BlockMeta:
    """BlockMeta of a host payload, its checksum computed now (at store time)."""
    return BlockMeta(
        NamespaceId(namespace), BlockHash(hash), nbytes(payload), checksum(payload), deadline, stored_at
    )


def _check_key(namespace: str, hash: bytes) -> None:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(
            f"namespace {namespace!r} must be 1-{NAMESPACE_MAX} ASCII letters, digits or ._:=+- "
            "and not start with a dot"
        )
    if not isinstance(hash, bytes) or len(hash) != HASH_BYTES:
        raise ValueError(f"block hash must be {HASH_BYTES} bytes, got {len(hash)}")


def encode_header(meta: BlockMeta) -> bytes:
    """The 4096-byte header of `meta`. ValueError when a field does not fit the format."""
    _check_key(meta.namespace, meta.hash)
    for name in ("deadline", "stored_at"):
        value = getattr(meta, name)
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    ns = meta.namespace.encode("ascii")
    try:
        fields = _FIELDS.pack(
            MAGIC, FORMAT_VERSION, _CHECKSUM_CRC32C, len(ns), ns, meta.hash,
            meta.payload_len, meta.checksum, meta.deadline, meta.stored_at, meta.reuse,
        )  # fmt: skip
    except struct.error as e:  # negative or oversize integers
        raise ValueError(f"block meta does not fit the header: {e}") from e
    header = bytearray(HEADER_BYTES)
    header[: _FIELDS.size] = fields
    _CRC.pack_into(header, _CRC_AT, checksum(bytes(header[:_CRC_AT])))
    return bytes(header)


def decode_header(data: Buffer, path: str = "") -> BlockMeta:
    """BlockMeta from the first 4096 bytes of `data`; CorruptHeaderError when they are not a
    header this build wrote (or can read). `path` only goes into the message."""
    raw = bytes(byte_view(data)[:HEADER_BYTES])
    where = f" {path}" if path else ""
    if len(raw) < HEADER_BYTES:
        raise CorruptHeaderError(f"block header{where} is {len(raw)} bytes, expected {HEADER_BYTES}")
    if raw[: len(MAGIC)] != MAGIC:
        raise CorruptHeaderError(f"not a block file{where}: magic {raw[:len(MAGIC)]!r}")
    (stored_crc,) = _CRC.unpack_from(raw, _CRC_AT)
    if checksum(raw[:_CRC_AT]) != stored_crc:
        raise CorruptHeaderError(f"block header{where} fails its checksum (torn or damaged)")
    magic, version, algo, ns_len, ns, hash, payload_len, crc, deadline, stored_at, reuse = (
        _FIELDS.unpack_from(raw)
    )
    if version != FORMAT_VERSION or algo != _CHECKSUM_CRC32C:
        raise CorruptHeaderError(
            f"block{where} has format version {version}, checksum {algo}; "
            f"this build reads version {FORMAT_VERSION}, checksum {_CHECKSUM_CRC32C}"
        )
    try:
        if ns_len > NAMESPACE_MAX or any(ns[ns_len:]):
            raise ValueError(f"namespace length {ns_len}")
        namespace = ns[:ns_len].decode("ascii")
        _check_key(namespace, hash)
        if not (math.isfinite(deadline) and math.isfinite(stored_at)):
            raise ValueError("non-finite time")
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptHeaderError(f"block header{where} has invalid fields: {e}") from e
    return BlockMeta(
        NamespaceId(namespace), BlockHash(hash), payload_len, crc, deadline, stored_at, reuse
    )


def block_path(root: str, namespace: str, hash: bytes) -> str:
    _check_key(namespace, hash)
    hx = hash.hex()
    return os.path.join(root, namespace, hx[:2], hx + BLOCK_SUFFIX)


def write_block(io: BlockIO, root: str, meta: BlockMeta, payload: Buffer) -> str:
    """Write header + payload atomically (temp file, rename); return the block's path.
    The payload (host, or CUDA with the kvikio backend) is written as is; meta.checksum must
    already be its CRC32C."""
    if nbytes(payload) != meta.payload_len:
        raise ValueError(f"payload is {nbytes(payload)} bytes, meta says {meta.payload_len}")
    header = encode_header(meta)
    path = block_path(root, meta.namespace, meta.hash)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    io.write_file(path, [header, payload])
    return path


def verify(buf: Buffer, meta: BlockMeta, path: str = "") -> None:
    """ChecksumMismatchError unless `buf` has meta.checksum. A CUDA tensor is copied to host
    first (slow: callers landing disk reads in GPU memory should verify a host copy instead)."""
    if not on_host(buf):
        buf = buf.cpu() if hasattr(buf, "cpu") else buf.get()  # torch / CuPy
    got = checksum(buf)
    if got != meta.checksum:
        raise ChecksumMismatchError(path, meta.checksum, got)


def read_payload(io: BlockIO, path: str, meta: BlockMeta, out: Buffer) -> None:
    """Read the payload into `out` (exactly meta.payload_len bytes) and verify its checksum.

    Only host buffers are verified here: for a CUDA `out` (kvikio backend) the caller must
    call `verify` before the bytes reach an engine. Raises ShortReadError on a truncated file,
    ChecksumMismatchError on damaged bytes (out then holds the damaged bytes: do not use them).
    """
    if nbytes(out) != meta.payload_len:
        raise ValueError(f"out holds {nbytes(out)} bytes, the block's payload is {meta.payload_len}")
    io.read_into(path, HEADER_BYTES, out)
    if on_host(out):
        verify(out, meta, path)


def read_header(path: str) -> BlockMeta:
    """The header of the block file at `path` (CorruptHeaderError when short or invalid)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return decode_header(os.pread(fd, HEADER_BYTES, 0), path)
    finally:
        os.close(fd)


def rewrite_header(io: BlockIO, path: str, meta: BlockMeta) -> None:
    """Overwrite the header in place (one 4096-byte pwrite at offset 0), e.g. to extend the
    deadline. meta's key, payload_len and checksum must be the block's own."""
    io.pwrite(path, 0, encode_header(meta))


def _check_block_file(root: str, path: str) -> BlockMeta:
    """The meta of a complete, well-placed block file; CorruptHeaderError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        meta = decode_header(os.pread(fd, HEADER_BYTES, 0), path)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != HEADER_BYTES + meta.payload_len:
        raise CorruptHeaderError(
            f"block {path} is {size} bytes, header says {HEADER_BYTES} + {meta.payload_len}"
        )
    if block_path(root, meta.namespace, meta.hash) != path:
        raise CorruptHeaderError(f"block {path} holds {meta.namespace}/{meta.hash.hex()}")
    return meta


def scan(root: str, threads: int = 8) -> ScanResult:
    """Restart recovery: walk `root`, delete torn writes (*.tmp) and bad block files (corrupt or
    unreadable header, size != header + payload_len, or a location that does not match the
    header's key), and return the good blocks, in no particular order. Reads only the 4 KiB
    header of each block; directories are scanned by `threads` threads, since on a cold page
    cache the walk waits on disk latency. Other files are left alone. Run it before any writer
    starts: it deletes in-flight temporary files."""
    result = ScanResult()
    if not os.path.isdir(root):
        return result
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="kv-scan") as pool:
        pending = {pool.submit(_scan_dir, root, root)}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                subdirs, part = fut.result()
                result.blocks += part.blocks
                result.torn_removed += part.torn_removed
                result.corrupt_removed += part.corrupt_removed
                pending |= {pool.submit(_scan_dir, root, d) for d in subdirs}
    return result


def _scan_dir(root: str, directory: str) -> tuple[list[str], ScanResult]:
    part, subdirs = ScanResult(), []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return subdirs, part
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            subdirs.append(entry.path)
        elif entry.name.endswith(TMP_SUFFIX):
            _unlink(entry.path)
            part.torn_removed += 1
        elif entry.name.endswith(BLOCK_SUFFIX):
            try:
                part.blocks.append((entry.path, _check_block_file(root, entry.path)))
            except OSError as e:  # CorruptHeaderError, or the OS failing to read it
                log.warning("disk tier recovery: removing %s: %s", entry.path, e)
                _unlink(entry.path)
                part.corrupt_removed += 1
    return subdirs, part


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
