#!/usr/bin/env python3
"""Plots of bench/e2e_multiround.py results (matplotlib, Agg backend).

    python bench/plot_e2e.py RESULTS.json [--out DIR]      # redraw from a results.json

ttft_distribution.png: client TTFT per multi-round configuration (empirical CDF, log scale, and a box plot).
prefetch.png: p50 / p90 TTFT (all requests and disk-tier requests) and the recovery rate against prefetch N.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ORDER = ["recompute", "host_only", "hd_p0", "hd_p2", "hd_p4", "hd_p8"]
PREFETCH = {0: "hd_p0", 2: "hd_p2", 4: "hd_p4", 8: "hd_p8"}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(len(s) - 1, int(k) + 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ttfts(res: dict, keys: set | None = None) -> list[float]:
    return [r["ttft_ms"] for r in res.get("requests_detail", [])
            if r.get("ok") and r.get("ttft_ms") is not None and (keys is None or (r["user"], r["round"]) in keys)]


def plot(results: dict, out: Path) -> list[str]:
    """Draws what the results hold; returns the PNG file names written into `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e_multiround import disk_regime_keys  # one definition of the disk-tier subset

    written: list[str] = []
    cfg = results.get("configs", {})
    names = [n for n in ORDER if n in cfg and _ttfts(cfg[n])]
    if names:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        for n in names:
            xs = sorted(_ttfts(cfg[n]))
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax1.step(xs, ys, where="post", label=f"{cfg[n]['label']} (p50 {_pct(xs, 50):.0f} ms)")
        ax1.set_xscale("log")
        ax1.set_xlabel("TTFT, ms (client: request sent -> first token)")
        ax1.set_ylabel("fraction of requests")
        ax1.set_title("Multi-round QA: TTFT distribution")
        ax1.grid(True, which="both", alpha=0.3)
        ax1.legend(fontsize=7, loc="lower right")
        ax2.boxplot([_ttfts(cfg[n]) for n in names], whis=(10, 90), showfliers=True)
        ax2.set_xticks(range(1, len(names) + 1),
                       [cfg[n]["label"].replace(", ", "\n").replace(" (", "\n(") for n in names], fontsize=7)
        ax2.set_yscale("log")
        ax2.set_ylabel("TTFT, ms")
        ax2.set_title("box: p25-p75, whiskers p10-p90")
        ax2.grid(True, axis="y", which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "ttft_distribution.png", dpi=120)
        plt.close(fig)
        written.append("ttft_distribution.png")

    sweep = [(n, cfg[c]) for n, c in sorted(PREFETCH.items()) if c in cfg and _ttfts(cfg[c])]
    if sweep:
        keys = disk_regime_keys(cfg["hd_p0"]) if "hd_p0" in cfg else set()
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ns = [n for n, _ in sweep]
        ax.plot(ns, [_pct(_ttfts(r), 50) for _, r in sweep], "o-", label="p50 TTFT, all requests")
        ax.plot(ns, [_pct(_ttfts(r), 90) for _, r in sweep], "s--", label="p90 TTFT, all requests")
        if keys:
            ax.plot(ns, [_pct(_ttfts(r, keys), 50) for _, r in sweep], "^-",
                    label=f"p50 TTFT, disk-tier requests ({len(keys)})")
        ax.set_xlabel("prefetch N (queued requests prefetched for)")
        ax.set_ylabel("TTFT, ms")
        ax.set_xticks(ns)
        ax.grid(True, alpha=0.3)
        ax2 = ax.twinx()
        rr = [r.get("recovery_rate") for _, r in sweep]
        ax2.plot(ns, [x if x is not None else float("nan") for x in rr], "d:", color="tab:red", label="recovery rate")
        ax2.set_ylabel("recovery rate (blocks loaded back / offloaded)", color="tab:red")
        ax2.set_ylim(bottom=0)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="best")
        ax.set_title("Host + disk tier: TTFT and recovery rate against prefetch N")
        fig.tight_layout()
        fig.savefig(out / "prefetch.png", dpi=120)
        plt.close(fig)
        written.append("prefetch.png")
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results")
    p.add_argument("--out", default="", help="directory for the PNGs [beside results.json]")
    a = p.parse_args()
    path = Path(a.results)
    out = Path(a.out) if a.out else path.parent
    out.mkdir(parents=True, exist_ok=True)
    for name in plot(json.loads(path.read_text()), out):
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
