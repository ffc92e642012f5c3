"""How long generating a request list takes: full public traces and a large synthetic workload.

Target (issue 6): the request list of a full trace in under 2 s on the 2-core machine. Prints
each case's time next to the target, measured in one run; its numbers are not part of the test
suite's pass/fail.

    .venv/bin/python benchmarks/workload_gen.py [--repeat 3]
    .venv/bin/python benchmarks/workload_gen.py --smoke     # once each, 5,000 synthetic requests
"""

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.schema import build  # noqa: E402
from testbed.workload import generate, summarize  # noqa: E402
from testbed.workload.spec import WorkloadSpec  # noqa: E402

TRACES = ROOT / "experiments" / "traces"
TARGET_S = 2.0

CASES = [
    ("mooncake conversation, full trace",
     {"trace": {"path": str(TRACES / "mooncake_conversation.jsonl"), "format": "mooncake"}}, {}),
    ("azure conv 2023, full trace",
     {"trace": {"path": str(TRACES / "azure_conv_2023.csv"), "format": "azure"}}, {}),
    ("synthetic 100k: onoff, lognormal, 100 Zipf documents",
     {"arrival": {"process": "onoff", "on_rate": "20/s", "on_duration": "5s",
                  "off_duration": "15s"},
      "input": {"dist": "lognormal", "mu": 9.9, "sigma": 1.0, "min": 128, "max": "128K"},
      "output": {"dist": "lognormal", "mu": 6, "sigma": 0.8, "min": 1, "max": 4096},
      "prefix": {"documents": 100, "zipf": 1.1, "length": "8K", "share": 0.7}},
     {"requests": 100_000}),
]


def best_of(repeat, fn):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--smoke", action="store_true",
                    help="every case once, the synthetic one with 5,000 requests: seconds")
    args = ap.parse_args()
    if args.smoke:
        args.repeat = 1
    print(f"{'case':<56} {'requests':>9} {'generate':>9} {'+summary':>9} {'vs 2 s':>7}")
    for name, section, limits in CASES:
        if args.smoke and "requests" in limits:
            name, limits = name.replace("100k", "5k"), {"requests": 5000}
        if "trace" in section and not pathlib.Path(section["trace"]["path"]).is_file():
            print(f"{name:<56} skipped: {section['trace']['path']} not found")
            continue
        spec = build(WorkloadSpec, section, "workload")
        gen_s, df = best_of(args.repeat, lambda: generate(spec, 1, **limits))
        sum_s, _ = best_of(args.repeat, lambda: summarize(df))
        print(f"{name:<56} {len(df):>9,} {gen_s:>8.3f}s {sum_s:>8.3f}s {gen_s / TARGET_S:>6.1%}")


if __name__ == "__main__":
    main()
