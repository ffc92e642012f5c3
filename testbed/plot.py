"""Plot: figures drawn from run directories only (Pantheon habit: analysis reads the run dir).

`STYLE` is the one registry of label, colour and marker per policy, used by every figure. Files
are read through `testbed.rundir` (names, schema check) and real-world time comes from the run's
`testbed.scale.Scale`.
`run_figures(top)` draws `figures/ttft_cdf.png`, `figures/egress.png` and
`figures/ttft_timeline.png` (and PDFs) for a run directory: one line per run found below it (a single run, or every variant of an experiment).
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from testbed import fidelity, plot_cache, plot_control, plot_load, rundir  # noqa: E402
from testbed.rundir import find_runs  # noqa: E402,F401  (plot.find_runs: callers' name)
from testbed.scale import Scale  # noqa: E402
from testbed.faultspec import WAN_KINDS  # noqa: E402

from testbed.figstyle import STYLE  # noqa: E402  (the one registry; plot.STYLE: callers' name)


def _save(fig, out_dir: pathlib.Path, stem: str) -> pathlib.Path:
    """Write `stem`.png and .pdf into out_dir; returns the PNG's path."""
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    for ext in ("pdf", "png"):
        fig.savefig(out_dir / f"{stem}.{ext}", dpi=150)
    plt.close(fig)
    return out_dir / f"{stem}.png"


def _label(summary: dict) -> str:
    style = STYLE.get(summary.get("policy"), {})
    lab = summary.get("label") or summary.get("policy")
    if lab == summary.get("policy") and style:
        return style["label"]
    return lab


def load_requests(top) -> pd.DataFrame:
    """All runs' requests.parquet below `top`, concatenated, with `run` and `policy` columns."""
    frames = []
    for d in find_runs(top):
        s = rundir.summary(d)
        df = rundir.requests(d)
        df["run"] = _label(s)
        df["policy"] = s.get("policy")
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def ttft_cdf(top, out_dir: pathlib.Path) -> pathlib.Path | None:
    df = load_requests(top)
    ok = df[df.status == "ok"] if len(df) else df
    if not len(ok):
        return None
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    palette = {}
    for run, pol in ok[["run", "policy"]].drop_duplicates().itertuples(index=False):
        palette[run] = STYLE.get(pol, {}).get("color")
    if any(v is None for v in palette.values()):
        palette = None
    sns.ecdfplot(data=ok, x="ttft_ms", hue="run", palette=palette, ax=ax)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, real-world)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Time to first token")
    return _save(fig, out_dir, "ttft_cdf")


def _run_csvs(top, name, min_rows=1):
    """(run dir, its summary, its `name` CSV as a DataFrame) for each run below `top` that has
    the file with at least `min_rows` rows."""
    for d in find_runs(top):
        df = rundir.csv_table(d, name)
        if df is not None and len(df) >= min_rows:
            yield d, rundir.summary(d), df


def _arrival_clock(d, ts: pd.DataFrame, scale: Scale) -> pd.Series:
    """Real-world seconds since the first arrival for each timeseries row of run dir `d`."""
    start = rundir.metadata(d).get("client_start_at", ts.time.iloc[0])
    return scale.real_s(ts.time - start)


def egress_timeline(top, out_dir: pathlib.Path) -> pathlib.Path | None:
    """KV-direction WAN egress over time (kernel counters, real-world units), one line per run;
    the configured link rate in force as a dashed line."""
    frames, link = [], None
    for d, s, ts in _run_csvs(top, rundir.RunDir.TIMESERIES, min_rows=3):
        scale = rundir.scale(d)
        # Smooth over ~1 s of real-world time so the line shows load, not packet trains.
        per_s = 1.0 / max(1e-9, scale.real_s(ts.t_s.diff().median()))
        window = max(1, int(round(per_s)))
        t = _arrival_clock(d, ts, scale)
        frames.append(pd.DataFrame({
            "time since first arrival (s, real-world)": t,
            # samples above the link rate are counter artifacts (testbed/fidelity.py)
            "KV egress (Gbit/s, real-world)": ts.kv_egress_gbps.mask(fidelity.artifact_mask(ts))
            .rolling(window, min_periods=1).mean(),
            "run": _label(s), "policy": s.get("policy")}))
        if link is None and "kv_link_gbps" in ts:
            link = (t, ts.kv_link_gbps * ts.kv_up)
    if not frames:
        return None
    df = pd.concat(frames, ignore_index=True)
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    sns.lineplot(data=df, x="time since first arrival (s, real-world)",
                 y="KV egress (Gbit/s, real-world)", hue="run", ax=ax, linewidth=1.0)
    if link is not None:
        top_y = df["KV egress (Gbit/s, real-world)"].max()
        shown = link[1].clip(upper=max(top_y * 1.5, 1e-9))    # a 100 Gbit/s line would flatten the rest
        ax.plot(link[0], shown, "k--", linewidth=0.8, label="link rate (clipped)")
        ax.legend()
    ax.set_title("WAN egress, PrfaaS -> local (kernel counters)")
    return _save(fig, out_dir, "egress")


def _down_spans(ts: pd.DataFrame) -> list[tuple[float, float]]:
    """(start, end) real-world times where the KV direction of the link was down."""
    down = ts.kv_up.to_numpy() == 0
    t = ts.t_real_s.to_numpy()
    spans, start = [], None
    for i, d in enumerate(down):
        if d and start is None:
            start = t[i]
        elif not d and start is not None:
            spans.append((start, t[i]))
            start = None
    if start is not None:
        spans.append((start, t[-1]))
    return spans


def ttft_timeline(top, out_dir: pathlib.Path) -> pathlib.Path | None:
    """TTFT of each request against its arrival time; link-down periods shaded."""
    runs = find_runs(top)
    frames, spans = [], []
    for d in runs:
        s = rundir.summary(d)
        df = rundir.requests(d)
        ok = df[df.status == "ok"]
        if not len(ok):
            continue
        frames.append(pd.DataFrame({"arrival (s, real-world)": ok.arrival_s,
                                    "TTFT (ms, real-world)": ok.ttft_ms, "run": _label(s)}))
        ts = rundir.csv_table(d, rundir.RunDir.TIMESERIES)
        if ts is not None and len(ts):
            ts["t_real_s"] = _arrival_clock(d, ts, rundir.scale(d))
            spans += _down_spans(ts)
    if not frames:
        return None
    df = pd.concat(frames, ignore_index=True)
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for a, b in sorted(set(spans)):
        ax.axvspan(a, b, color="0.85", zorder=0)
    sns.scatterplot(data=df, x="arrival (s, real-world)", y="TTFT (ms, real-world)", hue="run",
                    s=12, ax=ax, linewidth=0)
    ax.set_yscale("log")
    ax.set_title("TTFT by arrival time" + (" (grey: WAN down)" if spans else ""))
    return _save(fig, out_dir, "ttft_timeline")


def threshold_timeline(top, out_dir: pathlib.Path) -> pathlib.Path | None:
    """The adaptive threshold over time (scheduler.csv), with the measured egress utilisation."""
    frames = []
    for d, s, df in _run_csvs(top, rundir.RunDir.SCHEDULER):
        df["t"] = _arrival_clock(d, df, rundir.scale(d))
        df["run"] = _label(s)
        frames.append(df)
    if not frames:
        return None
    df = pd.concat(frames, ignore_index=True)
    sns.set_theme(style="whitegrid", context="paper")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6.5, 4.2), sharex=True)
    sns.lineplot(data=df, x="t", y="threshold", hue="run", ax=ax1, drawstyle="steps-post")
    ax1.set_ylabel("threshold t (tokens)")
    sns.lineplot(data=df, x="t", y="egress_utilisation", hue="run", ax=ax2, legend=False)
    ax2.set_ylabel("egress / link rate")
    ax2.set_xlabel("time since first arrival (s, real-world)")
    ax1.set_title("Adaptive threshold (short timescale)")
    return _save(fig, out_dir, "threshold")


FAULT_COLORS = {"pause": "#8172b3", "kill": "#c44e52", "restart": "#dd8452", "link": "#64b5cd",
                "slow": "#ccb974"}


def _fault_spans(events, t0: float, scale: Scale, t_last: float) -> list:
    """[(kind, targets, start, end)] real-world seconds since the first arrival, per injection."""
    starts, spans = {}, []
    for t, kind, f in events:
        key = (f.get("fault"), f.get("occurrence"))
        if kind == "fault_inject":
            starts[key] = (t, f.get("fault_kind"), f.get("target", ""))
        elif kind == "fault_end" and key in starts:
            t1, k, tg = starts.pop(key)
            spans.append((k, tg, scale.real_s(t1 - t0), scale.real_s(t - t0)))
    spans += [(k, tg, scale.real_s(t1 - t0), t_last) for t1, k, tg in starts.values()]
    return spans


def _health_spans(events, t0: float, scale: Scale, t_last: float) -> dict:
    """{instance: [(start, end)]} real-world spans each instance was marked down."""
    down, out = {}, {}
    for t, kind, f in events:
        if kind != "health":
            continue
        name = f.get("instance")
        if f.get("state") == "down":
            down.setdefault(name, scale.real_s(t - t0))
        elif name in down:
            out.setdefault(name, []).append((down.pop(name), scale.real_s(t - t0)))
    for name, a in down.items():
        out.setdefault(name, []).append((a, t_last))
    return out


def fault_timeline(top, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Per run with faults: TTFT by arrival with every fault shaded and its detection marked;
    under it, each instance's health as the scheduler saw it and the WAN's state."""
    paths = []
    runs = [d for d in find_runs(top) if rundir.summary(d).get("faults")]
    for d in runs:
        s = rundir.summary(d)
        scale = rundir.scale(d)
        df = rundir.requests(d)
        meta = rundir.metadata(d)
        t0 = meta.get("client_start_at", df.send_time.min())
        t_last = float(max(df.arrival_s.max(), scale.real_s(df.end_time.max() - t0)
                           if "end_time" in df else 0))
        events = rundir.read_events(rundir.RunDir(d).events, meta.get("clocks"))
        sns.set_theme(style="whitegrid", context="paper")
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
        spans = _fault_spans(events, t0, scale, t_last)
        _ttft_with_faults(ax, df, s, spans)
        _instance_states(ax2, d, spans, _health_spans(events, t0, scale, t_last), scale)
        stem = "fault_timeline" if len(runs) == 1 else f"fault_timeline_{d.name}"
        paths.append(_save(fig, out_dir, stem))
    return paths


def _ttft_with_faults(ax, df, s, spans):
    """TTFT by arrival, each fault shaded, each detection dashed, failed requests crossed."""
    shown = set()
    for kind, target, a, b in spans:
        ax.axvspan(a, b, color=FAULT_COLORS.get(kind, "0.8"), alpha=0.25, zorder=0,
                   label=None if kind in shown else f"{kind} fault")
        shown.add(kind)
    for f in s["faults"]:
        if f.get("detect_s") is not None:
            ax.axvline(f["at_s"] + f["detect_s"], color="k", ls="--", lw=0.8,
                       label=None if "det" in shown else "detected")
            shown.add("det")
    ok = df[df.status == "ok"]
    ax.scatter(ok.arrival_s, ok.ttft_ms, s=6, color="#4c72b0", label="TTFT", zorder=2)
    bad = df[df.status != "ok"]
    if len(bad):
        y = ok.ttft_ms.max() if len(ok) else 1.0
        ax.scatter(bad.arrival_s, [y] * len(bad), s=14, marker="x", color="#c44e52",
                   label="failed", zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, real-world)")
    ax.legend(fontsize=6, loc="upper left")
    ax.set_title(f"{_label(s)}: TTFT by arrival, faults shaded, detection dashed")


def _instance_states(ax2, d, spans, health, scale):
    """Per instance (and the WAN): faults in force, and marked down / link down."""
    rt = rundir.runtime(d)
    names = [n for n, i in rt["instances"].items() if i["role"] in ("prefill", "decode")]
    rows = names + ["WAN"]
    for y, name in enumerate(rows):
        faulted = [(a, b - a) for k, tg, a, b in spans
                   if (name == "WAN" and k in WAN_KINDS) or name in tg.split(",")]
        ax2.broken_barh(faulted, (y - 0.4, 0.8), color="0.75")
        ts = rundir.csv_table(d, rundir.RunDir.TIMESERIES) if name == "WAN" else None
        if ts is not None:
            ts["t_real_s"] = _arrival_clock(d, ts, scale)
            cut = [(a, b - a) for a, b in _down_spans(ts)]
            ax2.broken_barh(cut, (y - 0.25, 0.5), color="#c44e52")
        else:
            ax2.broken_barh([(a, b - a) for a, b in health.get(name, [])],
                            (y - 0.25, 0.5), color="#c44e52")
    role = {n: rt["instances"][n]["role"][0] for n in names}
    ax2.set_yticks(range(len(rows)))
    ax2.set_yticklabels([f"{n} ({role[n]})" if n in role else n for n in rows], fontsize=7)
    ax2.set_xlabel("arrival / time since first arrival (s, real-world)")
    ax2.set_title("grey: fault in force; red: marked down (health) / link down (kernel)",
                  fontsize=8)


def _heat_axis(ax, title):
    ax.tick_params(axis="y", labelrotation=0)
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_title(title)
    ax.set_xlabel("")
    ax.set_ylabel("")


def failure_heatmap(top, out_dir: pathlib.Path) -> pathlib.Path | None:
    """failure_matrix.csv (written by a run of an experiment with faults and variants): p90 TTFT
    inflation over the fault-free run of the same policy and failover, and failed requests."""
    path = pathlib.Path(top) / rundir.RunDir.FAILURE_MATRIX
    if not path.exists():
        return None
    m = pd.read_csv(path)
    m = m[m.fault != "none"]
    if not len(m):
        return None
    m["column"] = m.policy + ", failover " + m.failover.map({True: "on", False: "off"})
    rows = "case" if "case" in m else "fault"
    sns.set_theme(style="white", context="paper")
    fig, axes = plt.subplots(1, 2, figsize=(10, 1.8 + 0.45 * m[rows].nunique()))
    for ax, (col, title, fmt) in zip(axes, (("p90_inflation", "p90 TTFT / fault-free p90", ".2f"),
                                            ("failed", "failed requests", ".0f"))):
        grid = m.pivot_table(index=rows, columns="column", values=col, aggfunc="first")
        if grid.empty:      # p90 inflation without a fault-free variant: nothing to divide by
            ax.set_axis_off()
            ax.set_title(f"{title}: no fault-free run")
            continue
        sns.heatmap(grid, annot=True, fmt=fmt, cmap="Reds", ax=ax, cbar=False)
        _heat_axis(ax, title)
    return _save(fig, out_dir, "failure_matrix")


def conformance_heatmap(top, out_dir: pathlib.Path) -> pathlib.Path | None:
    """conformance.csv (an experiment with WAN faults and variants): per case and column
    (policy, failover) done / failed / lost, and the longest a request stayed unfinished after
    the fault ended, with when success returned."""
    path = rundir.RunDir(top).conformance
    if not path.exists():
        return None
    m = pd.read_csv(path)
    m["column"] = m.policy + ", failover " + m.failover.map({True: "on", False: "off"})
    m["done/failed/lost"] = [f"{c}/{f}/{lo}" for c, f, lo in zip(m.completed, m.failed, m.lost)]
    sns.set_theme(style="white", context="paper")
    fig, axes = plt.subplots(1, 3, figsize=(14, 1.8 + 0.45 * m.case.nunique()))
    for ax, (col, title) in zip(axes, (("failed", "done / failed / lost"),
                                       ("unfinished_after_end_s",
                                        "longest unfinished after the fault (s)"),
                                       ("success_after_end_s", "success returns after (s)"))):
        grid = m.pivot_table(index="case", columns="column", values=col, aggfunc="first",
                             sort=False)
        annot = m.pivot_table(index="case", columns="column", values="done/failed/lost",
                              aggfunc="first", sort=False) if col == "failed" else True
        sns.heatmap(grid, annot=annot, fmt="" if col == "failed" else ".1f", cmap="Reds",
                    ax=ax, cbar=False)
        _heat_axis(ax, title)
    return _save(fig, out_dir, "conformance")


def run_figures(top) -> list[pathlib.Path]:
    """Every figure of a run directory (or an experiment's top directory), as PNG and PDF."""
    top = pathlib.Path(top)
    out = rundir.RunDir(top).figures
    figures = (ttft_cdf(top, out), egress_timeline(top, out), ttft_timeline(top, out),
               plot_load.load_curve(top, out, _save),
               threshold_timeline(top, out), failure_heatmap(top, out),
               conformance_heatmap(top, out),
               plot_cache.cache_by_run(top, out, find_runs, _label, _save),
               plot_cache.cache_capacity(top, out, find_runs, _label, _save),
               plot_control.control_timeline(top, out, find_runs, _label, _save))
    return [p for p in figures if p is not None] + fault_timeline(top, out)
