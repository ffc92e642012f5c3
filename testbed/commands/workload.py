"""`testbed workload FILE [--set key=value ...] [--json]`: what an experiment would send.

Generates the experiment's request list exactly as `testbed run` does (same spec, seed and
limits) without starting anything, and prints count, mean rate, inter-arrival CV, input and
output length percentiles and the prefix-cache hit share, in real-world units (before
`scale`). Variants usually share one workload: it is printed once. Variants whose workload
differs (a sweep over `workload.*`, `seed`, `requests` or `duration`) are printed one after the
other, each under its label; with `--json`, one object per line in variant order.
"""

import json
import math
import pathlib

from testbed import deploy
from testbed.workload import generate, summarize


def register(subparsers):
    p = subparsers.add_parser(
        "workload", help="print the request list an experiment would send (nothing is run)",
        description=__doc__.split("\n\n")[1])
    p.add_argument("file", metavar="FILE", help="experiment YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set workload.trace.duration=600s (repeatable)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (per distinct workload) with the summary keys")
    p.set_defaults(func=run)


def _key(exp):
    """What decides an experiment's request list."""
    return (exp.workload, exp.seed, exp.requests, exp.duration)


def distinct(runs):
    """[(labels, experiment)] for each distinct workload, in variant order."""
    groups = {}
    for exp in runs:
        groups.setdefault(_key(exp), ([], exp))[0].append(exp.run_label)
    return list(groups.values())


def run(args):
    path = pathlib.Path(args.file)
    runs = [exp for exp, _ in deploy.load(path, args.overrides)]   # refused as `run` would
    groups = distinct(runs)
    for labels, exp in groups:
        df = generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration,
                      base_dir=path.parent)
        s = summarize(df)
        if args.json:
            print(json.dumps({k: _json_number(v) for k, v in s.items()}))
        else:
            title = (f"{path} ({len(runs)} run{'s' * (len(runs) > 1)}, one workload)"
                     if len(groups) == 1 else f"{path} [{', '.join(labels)}]")
            print(format_summary(s, df.attrs.get("trace"), title))
    return 0


def _json_number(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def format_summary(s, trace=None, title=""):
    """The human-readable form of `summarize` (and of the trace report, when there is one)."""
    lines = [f"workload of {title}"] if title else []
    if trace:
        lines.append(f"  trace        {trace['format']} {trace['path']}: {trace['rows_read']} "
                     f"rows read, {trace['rows_selected']} selected, {trace['skipped']} skipped, "
                     f"{trace['clipped']} inputs clipped")
        lines += [f"               skipped {e}" for e in trace["skip_examples"]]
    lines.append(f"  requests     {s['count']:,}")
    lines.append(f"  arrivals     {s['rate_per_s']:.3f}/s mean, inter-arrival CV "
                 f"{s['interarrival_cv']:.3g}")
    for name in ("input", "output"):
        lines.append(f"  {name:<12} mean {s[name + '_mean']:,.0f}  p50 {s[name + '_p50']:,.0f}"
                     f"  p90 {s[name + '_p90']:,.0f}  p99 {s[name + '_p99']:,.0f} tokens")
    lines.append(f"  prefix hits  {s['prefix_hit_share']:.1%} of input tokens "
                 f"(unbounded cache, arrival order)")
    return "\n".join(lines)
