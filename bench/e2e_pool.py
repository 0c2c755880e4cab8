#!/usr/bin/env python3
"""Pool the disk-setting target over several bench/e2e_multiround.py runs (results.json files).

    python bench/e2e_pool.py RUN1/results.json RUN2/results.json ...

Configs run one after another see different machine conditions (on the H200 host the engine's decode
step time moved 33-43 ms between runs of identical code), so one prefetch-4 run against one prefetch-0
run is not a comparison of prefetch alone. Run them in both orders (disk_p4,disk_p0 then
disk_p0,disk_p4) and pool: in each run the disk-tier pairs are those of its prefetch-0 config, both
configs' TTFTs of those pairs are collected, and the p50s are taken over all runs. Prints one table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e.report import disk_regime_keys, pct  # noqa: E402


def main(paths: list[str]) -> int:
    p4_all, p0_all, errors = [], [], 0
    print("| run | order | disk-tier pairs | p50 prefetch 4 | p50 prefetch 0 | lower by |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for path in paths:
        cfg = json.loads(Path(path).read_text())["configs"]
        p4, p0 = cfg["disk_p4"], cfg["disk_p0"]
        keys = disk_regime_keys(p0)

        def ttfts(res: dict) -> list[float]:
            return [r["ttft_ms"] for r in res["requests_detail"] if r.get("ok") and (r["user"], r["round"]) in keys]
        a, b = ttfts(p4), ttfts(p0)
        errors += p4["errors"] + p0["errors"]
        p4_all += a
        p0_all += b
        order = " -> ".join(k for k in cfg if k in ("disk_p4", "disk_p0"))
        print(f"| {path} | {order} | {len(keys)} | {pct(a, 50):.0f} | {pct(b, 50):.0f} | {1 - pct(a, 50) / pct(b, 50):.0%} |")
    a, b = pct(p4_all, 50), pct(p0_all, 50)
    print(f"| pooled | | {len(p0_all)} | {a:.0f} | {b:.0f} | {1 - a / b:.0%} |")
    print(f"\ntarget: prefetch 4 >= 25% lower, zero errors; pooled: {1 - a / b:.0%} lower, {errors} errors -> "
          f"{'PASS' if 1 - a / b >= 0.25 and errors == 0 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
