"""Prefix cache figures (docs/cache.md), drawn from run directories only.

`cache_by_run`: per run, the measured cache hit share (input tokens served from cache) beside
TTFT p50/p90, so placement policies (no cache / least_loaded / cache_aware) compare at a glance.
`cache_capacity`: hit share against the pool capacity when the runs differ in `cache.capacity`.
"""

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from testbed import rundir


def _summaries(top, find_runs, label):
    rows = []
    for d in find_runs(top):
        s = rundir.summary(d)
        if "cache_hit_share" not in s:
            continue
        path = rundir.RunDir(d).config
        cfg = rundir.config_mapping(path) if path.exists() else {}
        cap = (cfg.get("cache") or {}).get("capacity")
        rows.append({"run": label(s), "hit": 100 * (s.get("cache_hit_share") or 0.0),
                     "p50": s.get("median_ttft_ms"), "p90": s.get("p90_ttft_ms"),
                     "enabled": s.get("cache_enabled"), "capacity": cap})
    return pd.DataFrame(rows)


def cache_by_run(top, out_dir, find_runs, label, save):
    df = _summaries(top, find_runs, label)
    if not len(df) or not df.enabled.any():
        return None
    sns.set_theme(style="whitegrid", context="paper")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.4))
    sns.barplot(data=df, x="run", y="hit", ax=a1, color="#55a868")
    a1.set_ylabel("cache hit share (% of input tokens)")
    a1.set_xlabel("")
    long = df.melt(id_vars="run", value_vars=["p50", "p90"], var_name="TTFT", value_name="ms")
    sns.barplot(data=long, x="run", y="ms", hue="TTFT", ax=a2)
    a2.set_ylabel("TTFT (ms, real-world)")
    a2.set_xlabel("")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("Prefix cache: hit share and TTFT by run")
    return save(fig, out_dir, "cache_hit_ttft")


def cache_capacity(top, out_dir, find_runs, label, save):
    df = _summaries(top, find_runs, label)
    df = df[df.enabled.fillna(False) & df.capacity.notna()] if len(df) else df
    if len(df) < 2 or df.capacity.nunique() < 2:
        return None
    df = df.assign(capacity_gb=df.capacity.astype(float) / 1e9).sort_values("capacity_gb")
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for run, g in df.assign(policy=df.run.str.split(",").str[0]).groupby("policy"):
        ax.plot(g.capacity_gb, g.hit, marker="o", label=run)
    ax.set_xscale("log")
    ax.set_xlabel("pool capacity per cluster (GB, real-world)")
    ax.set_ylabel("cache hit share (%)")
    ax.legend()
    ax.set_title("Hit share as the pool shrinks")
    return save(fig, out_dir, "cache_capacity")
