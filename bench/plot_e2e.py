#!/usr/bin/env python3
"""Redraw the plots of a bench/e2e_multiround.py run from its results.json (bench/e2e/plots.py).

    python bench/plot_e2e.py RESULTS.json [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e.plots import plot  # noqa: E402


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
