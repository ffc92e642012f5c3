"""Plot: figures drawn from run directories only (Pantheon habit: analysis reads the run dir).

`STYLE` is the one registry of label, colour and marker per policy, used by every figure.
`run_figures(top)` draws `figures/ttft_cdf.png` (and .pdf) for a run directory: one line per run
found below it (a single run, or every variant of an experiment).
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

STYLE = {
    "homogeneous": {"label": "Homogeneous PD", "color": "#4c72b0", "marker": "o"},
    "naive": {"label": "Naive heterogeneous", "color": "#dd8452", "marker": "s"},
    "prfaas": {"label": "PrfaaS-PD", "color": "#55a868", "marker": "^"},
}


def find_runs(top):
    """Run directories at or below `top` (those holding a summary.json), sorted."""
    top = pathlib.Path(top)
    if (top / "summary.json").exists():
        return [top]
    return sorted(p.parent for p in top.glob("*/summary.json"))


def _label(summary):
    style = STYLE.get(summary.get("policy"), {})
    lab = summary.get("label") or summary.get("policy")
    if lab == summary.get("policy") and style:
        return style["label"]
    return lab


def load_requests(top):
    """All runs' requests.parquet below `top`, concatenated, with `run` and `policy` columns."""
    frames = []
    for d in find_runs(top):
        s = json.loads((d / "summary.json").read_text())
        df = pd.read_parquet(d / "requests.parquet")
        df["run"] = _label(s)
        df["policy"] = s.get("policy")
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def ttft_cdf(top, out_dir):
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
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "ttft_cdf.png", out_dir / "ttft_cdf.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths[0]


def run_figures(top):
    top = pathlib.Path(top)
    return [p for p in [ttft_cdf(top, top / "figures")] if p is not None]
