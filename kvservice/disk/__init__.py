"""Disk tier v2: blocks in large preallocated segment files, metadata in SQLite (WAL).

    <disk_path>/seg-00000001-2097152.kvseg    slots of one size class, posix_fallocate'd
    <disk_path>/meta.sqlite3 (+ -wal, -shm)   loc -> (namespace, hash, length, crc32c, deadline, ...)

Modules: slots (which slot, pure), segment (files, the I/O boundary), batch_io (a batch as a few
large requests), metadata (SQLite), recovery (restart checks), store (DiskStore, the API).

How a spill is written: reserve() hands out adjacent slots of the block's size class; write()
issues one pwritev per run of adjacent slots (up to max_request_bytes), its iovecs the host
slots themselves, on the O_DIRECT descriptor when the buffers are aligned (no page-cache copy),
several runs in parallel; when the bytes are down (and fdatasync'd, if durable) one SQLite
transaction adds their rows. Data first, then metadata: a crash loses at most the spills whose
commit had not happened, and no row can name bytes that were not written. A freed slot is reused
only after its row's delete has committed, so a surviving row never names a slot rewritten by a
later block. Every read is verified against the row's CRC32C.

Why SQLite and not LMDB or our own log: it is in the standard library (nothing to install on
a CPU or GPU host), its WAL mode gives atomic batched commits that survive kill -9 without an
fsync per commit (synchronous=NORMAL; `durable=True` adds fsyncs for power loss), it refuses to
open what is not a database, and it reads back fast enough when rows are packed: one 64-byte
blob per block, decoded for all rows at once with numpy. Restart figure (BENCHMARKS.md, "Disk
tier v2", 2-core CPU box, cold page cache): 1,000,000 blocks of 4 KiB reopen in 1.25-1.4 s,
every check included (the same rows as ten columns took 6 s to fetch and decode), and a daemon
on them answers SERVING 7.5 s after it was started, index of 1M blocks built. LMDB would read
faster still, but it is a dependency with its own map-size sizing, for a gain a restart of a few
seconds does not need; a private log would need its own compaction and torn-tail handling,
which SQLite already has.

Faults are results, never exceptions: every block of a write or read gets None or a DiskFault
(no_room, no_space, read_only, io_error, short_io, checksum, wrong_size, missing) with a message
that says what happened where. Capacity covers everything the tier writes: segment files plus a
metadata reserve (a fixed WAL/schema part plus META_PER_SLOT per slot) never exceed the
configured capacity, and an ENOSPC from a filesystem smaller than the setting lowers the ceiling
to what the filesystem actually gave. Only regular, single-link files of our uid and naming are
opened (lstat + O_NOFOLLOW|O_NONBLOCK + fstat), so a planted FIFO or symlink is refused, never
waited on or followed.

kvikio: this tier reads into and writes from host memory (the host tier's slots), where kvikio
would do what this module does (parallel pread/pwrite on an O_DIRECT descriptor); a GPU-direct
path would need a GPU destination and is not used by the host-tier design.
"""

from kvservice.disk.segment import aligned_buffer
from kvservice.disk.slots import ALIGN, make_loc, slot_class, split_loc
from kvservice.disk.store import BlockWrite, DiskFault, DiskStore, FaultKind

__all__ = ["ALIGN", "BlockWrite", "DiskFault", "DiskStore", "FaultKind", "aligned_buffer", "make_loc",
           "slot_class", "split_loc"]
