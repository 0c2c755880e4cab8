"""Where a daemon's time goes, by sampling it with py-spy while a benchmark drives it.

    with recording(daemon.proc.pid, "out/host-256.txt"):   # py-spy record --format raw, stopped by SIGINT
        ...store / load ...
    python3 bench/daemon_sampling.py out/host-256.txt [--top 30]     # the table below

Why: bench/core_overhead.py models the core beside a modelled copy, but on the H200 the daemon's Store of
256 KiB blocks ran at 0.53 x D2H where that model says 0.85: the time goes somewhere the model leaves
out (gRPC threads, the copy thread's own Python, the GIL between them). A sample of the real daemon says
where. py-spy is optional: without the binary, recording() does nothing and says so once.

The summary prints, per thread (grouped by its name's stem), the share of samples, and the functions
with the most samples on top of the stack (self) and anywhere on it (inclusive), as a share of that
thread's samples. Idle samples are left out by py-spy unless --idle is given to recording().
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

_warned = False


def pyspy_binary() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else None


@contextlib.contextmanager
def recording(pid: int, path: str, rate: int = 997, gil: bool = False, idle: bool = False) -> Iterator[bool]:
    """Sample process `pid` (all its threads, native frames off) into `path` (py-spy's raw collapsed
    stacks) for the duration of the block. Yields whether a recorder runs."""
    global _warned
    exe = pyspy_binary()
    if exe is None:
        if not _warned:
            print("bench/daemon_sampling.py: no py-spy binary (pip install py-spy): not profiling", file=sys.stderr)
            _warned = True
        yield False
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--threads",
           "--nonblocking", "-o", path]
    if gil:
        cmd.append("--gil")
    if idle:
        cmd.append("--idle")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # py-spy attaches before the first sample
    try:
        yield True
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            err = b""
        if proc.returncode not in (0, -signal.SIGINT, 130) and not os.path.exists(path):
            print(f"bench/daemon_sampling.py: py-spy exited {proc.returncode}: {err.decode(errors='replace')[-500:]}",
                  file=sys.stderr)


_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:)]+)(?::\d+)?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m.group("file")
    for marker in ("/kvservice/", "/engine_client/", "/kvwire/", "/site-packages/", "/lib/python3"):
        if marker in f:
            f = f.split(marker, 1)[1]
            break
    return f"{m.group('func')} ({f})"


def _thread_stem(name: str) -> str:
    """'thread (14170): kv-copy_0' -> 'kv-copy'; an unnamed 'thread (14225)' -> 'unnamed' (numbers dropped,
    so the threads of one pool add up)."""
    name = re.sub(r"^(process \d+:|thread \(\w+\))\s*:?\s*", "", name.strip()).strip('"')
    return re.sub(r"[_-]?\d+$", "", name) or "unnamed"


def summarize(path: str, top: int = 25) -> str:
    """A text table from py-spy's raw output: one line per sampled stack, frames ';'-separated, the
    root first (the thread, with --threads), then a space and the sample count."""
    per_thread: collections.Counter[str] = collections.Counter()
    self_t: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    incl_t: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            try:
                n = int(count)
            except ValueError:
                continue
            frames = stack.split(";")
            threaded = frames[0].startswith(("process ", "thread ("))
            thread = _thread_stem(frames[0]) if threaded else "all"
            frames = frames[1:] if threaded else frames
            total += n
            per_thread[thread] += n
            if frames:
                self_t[thread][_short(frames[-1])] += n
            for fr in {_short(x) for x in frames}:
                incl_t[thread][fr] += n
    out = [f"{path}: {total} samples"]
    for thread, n in per_thread.most_common():
        out.append(f"\n## thread {thread}: {n} samples ({100 * n / max(1, total):.1f}%)")
        out.append("| self % | inclusive % | function |")
        out.append("|---:|---:|---|")
        names = [k for k, _ in self_t[thread].most_common(top)]
        names += [k for k, _ in incl_t[thread].most_common(top) if k not in names][: top // 2]
        for k in names:
            out.append(f"| {100 * self_t[thread][k] / n:.1f} | {100 * incl_t[thread][k] / n:.1f} | {k} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    for path in a.paths:
        print(summarize(path, a.top))


if __name__ == "__main__":
    main()
