"""PNG plots of an end-to-end results dict (matplotlib, Agg backend).

ttft_distribution.png: client TTFT per multi-round configuration (empirical CDF, log scale, and a box plot).
ttft_by_round.png: p50 TTFT per round of each multi-round configuration.
"""

from __future__ import annotations

from pathlib import Path

from e2e.report import MR_ORDER, pct


def _ttfts(res: dict, rnd: int | None = None) -> list[float]:
    return [r["ttft_ms"] for r in res.get("requests_detail", [])
            if r.get("ok") and r.get("ttft_ms") is not None and (rnd is None or r["round"] == rnd)]


def plot(results: dict, out: Path) -> list[str]:
    """Draws what the results hold; returns the PNG file names written into `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    cfg = results.get("configs", {})
    names = [n for n in MR_ORDER if n in cfg and _ttfts(cfg[n])]
    if not names:
        return written
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for n in names:
        xs = sorted(_ttfts(cfg[n]))
        ax1.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                 label=f"{cfg[n]['label']} (p50 {pct(xs, 50):.0f} ms)")
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT, ms (client: request sent -> first token)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("Multi-round QA: TTFT distribution")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7, loc="lower right")
    ax2.boxplot([_ttfts(cfg[n]) for n in names], whis=(10, 90))
    ax2.set_xticks(range(1, len(names) + 1), [cfg[n]["label"].replace(": ", "\n").replace(", ", "\n") for n in names],
                   fontsize=7)
    ax2.set_yscale("log")
    ax2.set_ylabel("TTFT, ms")
    ax2.set_title("box: p25-p75, whiskers p10-p90")
    ax2.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "ttft_distribution.png", dpi=120)
    plt.close(fig)
    written.append("ttft_distribution.png")

    rounds = max(r["round"] for n in names for r in cfg[n]["requests_detail"]) + 1
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in names:
        ax.plot(range(rounds), [pct(_ttfts(cfg[n], i), 50) or float("nan") for i in range(rounds)], "o-",
                label=cfg[n]["label"])
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("p50 TTFT, ms")
    ax.set_xticks(range(rounds))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Multi-round QA: p50 TTFT by round")
    fig.tight_layout()
    fig.savefig(out / "ttft_by_round.png", dpi=120)
    plt.close(fig)
    written.append("ttft_by_round.png")
    return written
