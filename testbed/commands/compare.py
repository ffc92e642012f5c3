"""`testbed compare RUN_A[:variant] RUN_B[:variant]`: B against A on every headline metric,
with 95% confidence intervals over replicates and whether the difference is distinguishable
from run noise.

A side is a directory: every analysed run below it (any depth) whose summary has that
variant's label is one replicate (the sub-directories `replicates:` writes, or the tops of
several runs of the same file with other seeds). Without `:variant` a side must hold exactly
one label. The statistics are `testbed.stats`'; the table says which interval each row uses.
"""

from __future__ import annotations

import json
import pathlib

from testbed import rundir, stats
from testbed.errors import ConfigError

# (summary key, what the table calls it, True where a ratio B/A is meaningful)
HEADLINE = (
    ("request_throughput", "throughput (req/s)", True),
    ("steady_throughput", "steady throughput (req/s)", True),
    ("mean_ttft_ms", "TTFT mean (ms)", True),
    ("median_ttft_ms", "TTFT p50 (ms)", True),
    ("p90_ttft_ms", "TTFT p90 (ms)", True),
    ("p99_ttft_ms", "TTFT p99 (ms)", True),
    ("mean_tpot_ms", "TPOT mean (ms)", True),
    ("p99_tpot_ms", "TPOT p99 (ms)", True),
    ("mean_e2el_ms", "E2EL mean (ms)", True),
    ("request_goodput", "goodput (req/s)", True),
    ("offload_fraction", "offload share", False),
    ("egress_mean_gbps", "WAN egress mean (Gbit/s)", True),
    ("failed", "failed requests", False),
)


def register(sub):
    p = sub.add_parser("compare", help="B against A per headline metric, with 95%% CIs over "
                                       "replicates (RUN_A[:variant] RUN_B[:variant])")
    p.add_argument("a", metavar="RUN_A[:variant]")
    p.add_argument("b", metavar="RUN_B[:variant]")
    p.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    p.set_defaults(func=main)


def split_side(text: str) -> tuple[pathlib.Path, str | None]:
    """'DIR:variant' -> (DIR, variant); a ':' that is part of an existing path is kept."""
    path = pathlib.Path(text)
    if path.exists() or ":" not in text:
        return path, None
    head, _, variant = text.rpartition(":")
    return pathlib.Path(head), variant or None


def replicates(top: pathlib.Path, variant: str | None) -> tuple[str, list[dict]]:
    """(label, the summaries of that label) found at or below `top`."""
    if not top.is_dir():
        raise ConfigError("not a directory", path=str(top))
    by_label: dict[str, list[dict]] = {}
    for path in sorted(top.rglob(rundir.RunDir.SUMMARY)):
        s = json.loads(path.read_text())
        by_label.setdefault(str(s.get("variant") or s["label"]), []).append(s)
    if not by_label:
        raise ConfigError("no analysed run (summary.json) at or below it", path=str(top))
    if variant is None:
        if len(by_label) != 1:
            raise ConfigError(f"holds several variants ({', '.join(sorted(by_label))}): name "
                              f"one as {top}:VARIANT", path=str(top))
        variant = next(iter(by_label))
    if variant not in by_label:
        raise ConfigError(f"no variant {variant!r} (there are: {', '.join(sorted(by_label))})",
                          path=str(top))
    return variant, by_label[variant]


def _values(summaries, key):
    return stats.clean(s.get(key) for s in summaries)


def contrast(sa: list[dict], sb: list[dict]) -> list[dict]:
    """One row per headline metric both sides have: A, B, B-A and B/A with intervals."""
    rows = []
    for key, name, has_ratio in HEADLINE:
        a, b = _values(sa, key), _values(sb, key)
        if a.size == 0 or b.size == 0:
            continue
        diff = stats.difference(a, b)
        rat = stats.ratio(a, b) if has_ratio else None
        rows.append({"metric": key, "name": name, "a": stats.interval(a), "b": stats.interval(b),
                     "difference": diff, "ratio": rat})
    return rows


def render(label_a, label_b, sa, sb, rows) -> str:
    head = ["metric", f"A: {label_a} (n={len(sa)})", f"B: {label_b} (n={len(sb)})", "B - A",
            "B / A", "distinguishable"]
    table = [head]
    methods = []
    for r in rows:
        d, q = r["difference"], r["ratio"]
        methods += [r["a"].method, r["b"].method, d.method]
        table.append([r["name"], r["a"].fmt(), r["b"].fmt(), d.fmt(),
                      q.fmt("{:.3f}") if q is not None else "",
                      ("yes" if d.distinguishable else "no") if d.method != "single"
                      else "n/a (one replicate)"])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(stats.method_note(methods) + "; distinguishable: the interval of B - A "
                 "excludes 0")
    return "\n".join(lines)


def main(args):
    pa, va = split_side(args.a)
    pb, vb = split_side(args.b)
    label_a, sa = replicates(pa, va)
    label_b, sb = replicates(pb, vb)
    rows = contrast(sa, sb)
    print(render(label_a, label_b, sa, sb, rows))
    if args.json:
        out = [{"metric": r["metric"], "a": r["a"].as_dict(), "b": r["b"].as_dict(),
                "difference": r["difference"].as_dict(),
                "ratio": r["ratio"].as_dict() if r["ratio"] is not None else None}
               for r in rows]
        pathlib.Path(args.json).write_text(json.dumps(
            {"a": {"path": str(pa), "variant": label_a, "n": len(sa)},
             "b": {"path": str(pb), "variant": label_b, "n": len(sb)}, "metrics": out},
            indent=1))
    return 0
