"""Call timelines for benchmark runs: where a Store's or a Load's wall time goes, stamp by stamp.

    KVTUNE_TRACE=/path/trace.jsonl kvservice ...     (a benchmark's switch, as the other KVTUNE_* knobs)

Off (the default) every mark is one call of a no-op method: the hot paths mark once per call and per
part, never per block. On, each mark appends (perf_counter, thread id, call id, tag) to a list; the
daemon writes them as JSON lines when it exits (and on dump()). bench/trace_timeline.py reads the
file and prints, per call kind and size, the median time of each stamp from the call's start, with
the copy threads' stamps (gather_into / scatter_from: start, all queued, done) placed in the calls
whose window holds them. Why: on a GPU host the daemon's own Store of 256 KiB blocks took 54-60 ms
where its copy alone takes ~40; a sampling profiler says which functions run, not which parts of
the call run one after the other instead of beside the device's copy.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import threading
import time


class _Off:
    enabled = False

    def begin(self, kind: str, n: int) -> int:
        return 0

    def mark(self, call: int, tag: str) -> None:
        pass

    def dump(self) -> None:
        pass


class Trace:
    enabled = True

    def __init__(self, path: str) -> None:
        self.path = path
        self._events: list[tuple[float, int, int, str]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        atexit.register(self.dump)

    def begin(self, kind: str, n: int) -> int:
        """A new call of `kind` over n blocks: its id, for the marks of its stages."""
        call = next(self._ids)
        self._events.append((time.perf_counter(), threading.get_ident(), call, f"{kind}:{n}"))
        return call

    def mark(self, call: int, tag: str) -> None:
        self._events.append((time.perf_counter(), threading.get_ident(), call, tag))  # list.append: atomic

    def dump(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            if not events:
                return
            with open(self.path, "a") as f:
                for t, tid, call, tag in events:
                    f.write(json.dumps({"t": t, "thread": tid, "call": call, "tag": tag}) + "\n")


_path = os.environ.get("KVTUNE_TRACE", "")
TRACE: Trace | _Off = Trace(_path) if _path else _Off()
