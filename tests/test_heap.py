"""kvservice.ops.heap: with the daemon's heap thresholds fixed, a call's MiB-sized transient buffers
are served from heap pages already mapped, where glibc's adaptive defaults unmap and fault them in
again every call. Each case runs in a fresh interpreter (the thresholds are process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# three 4 MiB buffers alive at once, as a large Store's frame, its parse and its packed hashes are; the
# page faults of the sixth round (after five to let glibc's thresholds adapt) are printed
PROBE = """
import resource, sys
from kvservice.ops.heap import keep_transient_buffers
if sys.argv[1] == "fixed" and not keep_transient_buffers():
    sys.exit(3)  # not glibc
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [b"\\x01" * (4 << 20) for _ in range(3)]
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del bufs
print(faults[-1])
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60)
    if out.returncode == 3:
        pytest.skip("no glibc mallopt here")
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_transient_buffers_stay_mapped_between_calls():
    adaptive, fixed = _faults("adaptive"), _faults("fixed")
    pages = 3 * (4 << 20) // 4096
    assert adaptive >= pages // 2, f"glibc's defaults faulted only {adaptive} pages a round (the probe shows nothing)"
    assert fixed < pages // 20, f"{fixed} page faults a round for buffers that should stay mapped"
