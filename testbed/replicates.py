"""Replicates of one experiment: the summaries of each variant (or sweep point) over seeds,
reduced to a median and a 95% confidence interval per metric (`testbed.stats`).

Pure functions of summary dicts, on the analysis floor. A replicate counts when it finished: a
run that failed (its summary carries `error`, written by the runner) or was cut short
(`incomplete`) is excluded from the intervals, and `excluded` names it with the reason, so a
table never shrinks N without saying so. `replicates.csv` at an experiment's top holds one row
per run label and metric.
"""

from __future__ import annotations

import pandas as pd

from testbed import stats
from testbed.records import RunDir

METRICS = ("request_throughput", "steady_throughput", "request_goodput", "mean_ttft_ms",
           "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
           "mean_e2el_ms", "egress_mean_gbps", "offload_fraction", "completed", "failed",
           "cache_hit_share")


def has_replicates(summaries: list[dict]) -> bool:
    """True when some run label has more than one summary (several seeds of it)."""
    labels = [s.get("label") for s in summaries]
    return len(set(labels)) < len(labels)


def excluded_reason(summary: dict) -> str | None:
    """Why a replicate does not count, or None when it does."""
    if summary.get("error"):
        return f"failed: {summary['error']}"
    if summary.get("incomplete"):
        return f"incomplete: {summary.get('incomplete_reason') or 'cut short'}"
    return None


def groups(summaries: list[dict]) -> dict[str, list[dict]]:
    """Summaries by run label, in the order the labels first ran."""
    out: dict[str, list[dict]] = {}
    for s in summaries:
        out.setdefault(str(s.get("label")), []).append(s)
    return out


def aggregate(summaries: list[dict]) -> list[dict]:
    """One row per label: `n` counted of `n_total`, `excluded` [(replicate, seed, reason)],
    `first` (a counted summary, for what does not vary: policy, prediction) and an
    `stats.Interval` per metric of METRICS."""
    rows = []
    for label, group in groups(summaries).items():
        ok = [s for s in group if excluded_reason(s) is None]
        row = {"label": label, "n": len(ok), "n_total": len(group),
               "excluded": [(s.get("replicate"), s.get("seed"), excluded_reason(s))
                            for s in group if excluded_reason(s) is not None],
               "first": ok[0] if ok else group[0]}
        for key in METRICS:
            row[key] = stats.interval([s.get(key) for s in ok])
        rows.append(row)
    return rows


def warnings(rows: list[dict]) -> list[str]:
    """One line per excluded replicate."""
    return [f"{r['label']}: replicate {rep} (seed {seed}) excluded from the intervals: {why}"
            for r in rows for rep, seed, why in r["excluded"]]


def frame(summaries: list[dict]) -> pd.DataFrame:
    """replicates.csv's rows: label, metric, center, lo, hi, n, n_total, method."""
    out = []
    for r in aggregate(summaries):
        for key in METRICS:
            iv = r[key]
            if iv.n:
                out.append({"label": r["label"], "metric": key, "center": iv.center,
                            "lo": iv.lo, "hi": iv.hi, "n": iv.n, "n_total": r["n_total"],
                            "method": iv.method})
    return pd.DataFrame(out)


def write(top, summaries: list[dict]) -> None:
    frame(summaries).to_csv(RunDir(top).replicates, index=False)
