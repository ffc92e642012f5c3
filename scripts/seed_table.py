"""Median and spread (min..max) over seeds of each variant's headline metrics, as Markdown.

    python scripts/seed_table.py RUN_TOP [RUN_TOP ...]

Each RUN_TOP is one `testbed run` output directory (one seed) holding a directory per variant
with its summary.json; rows are variants, cells `median (min..max)` over the RUN_TOPs.
"""

import json
import pathlib
import statistics
import sys

METRICS = [("request_throughput", "throughput (req/s)", 1, 3),
           ("steady_throughput", "steady (req/s)", 1, 3),
           ("median_ttft_ms", "TTFT p50 (s)", 1e-3, 2),
           ("p90_ttft_ms", "TTFT p90 (s)", 1e-3, 2),
           ("request_goodput", "goodput (req/s)", 1, 3),
           ("mean_tpot_ms", "TPOT (ms)", 1, 1),
           ("offload_fraction", "offload", 1, 2)]


def main(tops):
    runs = {}
    for top in map(pathlib.Path, tops):
        for s in sorted(top.glob("*/summary.json")):
            runs.setdefault(s.parent.name, []).append(json.loads(s.read_text()))
    print("| variant | seeds | " + " | ".join(m[1] for m in METRICS) + " |")
    print("|---" * (len(METRICS) + 2) + "|")
    for name, ss in runs.items():
        cells = []
        for key, _, f, nd in METRICS:
            v = [s[key] * f for s in ss if s.get(key) is not None]
            cells.append(f"{statistics.median(v):.{nd}f} ({min(v):.{nd}f}..{max(v):.{nd}f})"
                         if v else "-")
        print(f"| {name} | {len(ss)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
