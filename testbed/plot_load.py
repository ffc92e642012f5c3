"""Load-latency curves: TTFT p50 and p90, TPOT and throughput against offered load, one line per
policy, with 95% CI bands over replicates, each policy's predicted Lambda_max as a vertical line,
its measured capacity marked, the TTFT model's prediction dashed, and the paper's TTFT table.

Reads the summaries of an experiment whose runs carry `load` (a `sweep: {load: [...]}`):
`curve_frame(top)` is one row per run, `load_table(frame)` one row per policy and load with
median and interval per metric (`testbed.stats`), `paper_crossings` the offered load at which our
measurement meets each of the paper's TTFT numbers. `load_curve(top, out_dir, save, width)` draws
the figure; `testbed plot --style paper` draws it at a paper's column widths.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from testbed import rundir, stats
from testbed.figstyle import style_of
from testbed.records import RunDir

# The paper's TTFT table (PRFAAS.md; mean / p90 in seconds; the load is not stated).
PAPER_TTFT_S = {"homogeneous": (4.44, 9.73), "naive": (1.74, 3.51), "prfaas": (2.22, 3.51)}
PANELS = (("median_ttft_ms", "TTFT p50 (s)", 1e-3), ("p90_ttft_ms", "TTFT p90 (s)", 1e-3),
          ("mean_tpot_ms", "TPOT mean (ms)", 1.0), ("request_throughput", "throughput (req/s)",
                                                    1.0))
CAPACITY_LOAD = 1.3     # offered 1.3 x Lambda_max: the steady throughput there is the capacity


def curve_frame(top) -> pd.DataFrame:
    """One row per finished run with a `load`: policy, load, offered rate, the measured
    metrics, the TTFT model's prediction and the planner's Lambda_max (E[T])."""
    rows = []
    for d in rundir.find_runs(top):
        s = rundir.summary(d)
        if s.get("load") is None or s.get("error") or s.get("incomplete"):
            continue
        pred = s.get("prediction") or {}
        model = pred.get("ttft") or {}
        rows.append({"policy": s.get("policy"), "series": re.sub(r",load=[^,]*", "", s["label"]),
                     "load": s["load"], "offered_rate": s.get("offered_rate"),
                     "replicate": s.get("replicate", 0),
                     **{k: s.get(k) for k, _, _ in PANELS},
                     "steady_throughput": s.get("steady_throughput"),
                     "model_median_ttft_ms": model.get("median_ttft_ms"),
                     "model_p90_ttft_ms": model.get("p90_ttft_ms"),
                     "model_mean_ttft_ms": model.get("mean_ttft_ms"),
                     "mean_ttft_ms": s.get("mean_ttft_ms"),
                     "lambda_max": pred.get("lambda_max_expected"),
                     "capacity_ratio": _ratio(s.get("steady_throughput"),
                                              pred.get("lambda_max_expected"))})
    return pd.DataFrame(rows)


def _ratio(measured, predicted):
    return measured / predicted if measured is not None and predicted else None


def load_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per series and load: the offered rate and, per metric, median, lo, hi and n."""
    out = []
    keys = [k for k, _, _ in PANELS] + ["mean_ttft_ms", "steady_throughput", "capacity_ratio",
                                        "model_median_ttft_ms", "model_p90_ttft_ms"]
    for (series, load), g in frame.groupby(["series", "load"], sort=True):
        row = {"series": series, "policy": g.policy.iloc[0], "load": load,
               "offered_rate": float(g.offered_rate.median()),
               "lambda_max": float(g.lambda_max.median()), "n": len(g)}
        for k in keys:
            iv = stats.interval(g[k].tolist())
            row.update({k: iv.center, f"{k}_lo": iv.lo, f"{k}_hi": iv.hi, f"{k}_method": iv.method})
        out.append(row)
    return pd.DataFrame(out)


def capacity_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per series, at the capacity load (offered CAPACITY_LOAD x Lambda_max): the measured
    capacity (steady throughput) and its ratio to the prediction, each with its interval.

    The ratio is taken per replicate, against the Lambda_max predicted for that replicate's
    own drawn lengths, and then summarised: with a heavy-tailed length mix a short run's sample
    moves the capacity (and its prediction) by tens of percent between seeds, so a median of
    the measurements over a median of the predictions compares different samples."""
    cols = ["series", "policy", "load", "n", "lambda_max", "steady_throughput",
            "steady_throughput_lo", "steady_throughput_hi", "capacity_ratio",
            "capacity_ratio_lo", "capacity_ratio_hi", "capacity_ratio_method"]
    cap = table[table.load >= CAPACITY_LOAD]
    return cap[[c for c in cols if c in cap]].reset_index(drop=True)


def _crossing(x, y, target):
    """The first x at which the piecewise-linear y(x) reaches `target` (None if it never does)."""
    for i in range(len(x) - 1):
        lo, hi = y[i], y[i + 1]
        if np.isfinite(lo) and np.isfinite(hi) and min(lo, hi) <= target <= max(lo, hi):
            return float(x[i] if hi == lo else x[i] + (target - lo) * (x[i + 1] - x[i]) / (hi - lo))
    return None


def paper_crossings(table: pd.DataFrame) -> pd.DataFrame:
    """For each policy with a paper number: the load (fraction of Lambda_max) and rate at which
    the measured mean and p90 TTFT equal the paper's."""
    out = []
    for series, g in table.groupby("series"):
        pol = g.policy.iloc[0]
        if pol not in PAPER_TTFT_S:
            continue
        g = g.sort_values("load")
        for metric, value in zip(("mean_ttft_ms", "p90_ttft_ms"), PAPER_TTFT_S[pol]):
            at = _crossing(g.load.to_numpy(), g[metric].to_numpy(), value * 1e3)
            rate = None if at is None else float(np.interp(at, g.load, g.offered_rate))
            out.append({"series": series, "policy": pol, "metric": metric,
                        "paper_s": value, "load": at, "offered_rate": rate})
    return pd.DataFrame(out)


def _panel(ax, table, key, name, factor):
    for i, (series, g) in enumerate(table.groupby("series", sort=False)):
        st = style_of(g.policy.iloc[0], i)
        g = g.sort_values("offered_rate")
        x = g.offered_rate.to_numpy()
        ax.plot(x, g[key] * factor, color=st["color"], marker=st["marker"],
                linestyle=st["linestyle"], label=st["label"] if series == g.policy.iloc[0]
                else series)
        ax.fill_between(x, g[f"{key}_lo"] * factor, g[f"{key}_hi"] * factor, color=st["color"],
                        alpha=0.18, linewidth=0)
        if f"model_{key}" in g and g[f"model_{key}"].notna().any():
            ax.plot(x, g[f"model_{key}"] * factor, color=st["color"], linestyle=":",
                    linewidth=0.8)
        ax.axvline(g.lambda_max.iloc[0], color=st["color"], linestyle=(0, (1, 2)), linewidth=0.8)
        cap = g[g.load >= CAPACITY_LOAD]
        if key == "request_throughput" and len(cap):
            ax.plot(cap.offered_rate, cap.steady_throughput, color=st["color"], marker="x",
                    linestyle="none", markersize=6)
        pol = g.policy.iloc[0]
        if key in ("p90_ttft_ms",) and pol in PAPER_TTFT_S:
            ax.axhline(PAPER_TTFT_S[pol][1], color=st["color"], linestyle="--", linewidth=0.5)
    ax.set_ylabel(name)


def load_curve(top, out_dir, save, width_in=7.0, stem="load_curve"):
    """The 2x2 load-latency figure of an experiment top (None without runs that carry
    `load`); `save(fig, out_dir, stem)` writes it. Dotted verticals: predicted Lambda_max;
    dotted curves: the TTFT model; x: measured capacity (offered 1.3 x Lambda_max); thin
    dashed horizontals: the paper's p90 TTFT."""
    import matplotlib.pyplot as plt     # heavy: only where figures are drawn
    frame = curve_frame(top)
    if frame.empty:
        return None
    table = load_table(frame)
    # One x label and one legend for the figure, outside the panels, so that nothing overlaps
    # at a single column's width (3.3 in) either; a narrow figure is taller.
    fig, axes = plt.subplots(2, 2, figsize=(width_in, width_in * (0.72 if width_in > 5 else 1.0)),
                             sharex=True, layout="constrained")
    for ax, (key, name, factor) in zip(axes.flat, PANELS):
        _panel(ax, table, key, name, factor)
    fig.supxlabel("offered load (req/s, real-world)", fontsize="medium")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=len(labels), frameon=False,
               fontsize="small" if width_in < 5 else "medium")
    return save(fig, out_dir, stem)


def write_table(top) -> None:
    """load_curve.csv at an experiment's top (per series and load, with intervals and the
    paper's crossings appended as rows of kind `paper`), when its runs carry `load`."""
    frame = curve_frame(top)
    if frame.empty:
        return
    table = load_table(frame).assign(kind="measured")
    cross = paper_crossings(table).assign(kind="paper")
    pd.concat([table, cross], ignore_index=True).to_csv(RunDir(top).path / RunDir.LOAD_CURVE,
                                                        index=False)
