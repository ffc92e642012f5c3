"""`testbed plot RUN --style paper`: vector figures for a paper, and their caption stubs.

Each figure is drawn under `testbed.figstyle.paper()` (TrueType fonts embedded, 8 pt) at a
single-column (3.3 in) and a double-column (7 in) width, as PDF (and a PNG preview) in
figures/paper/. Caption stubs, one per figure, written from
the resolved configuration of the runs drawn (clusters, link, load, replicates) go to
figures/captions.md.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from testbed import figstyle, plot_load, rundir  # noqa: E402
from testbed.records import RunDir  # noqa: E402


def _save(fig, out_dir: pathlib.Path, stem: str) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / f"{stem}.pdf")
    fig.savefig(out_dir / f"{stem}.png", dpi=200)
    plt.close(fig)
    return out_dir / f"{stem}.pdf"


def ttft_cdf(top, out_dir, width_in, stem):
    """TTFT CDF per run label (replicates pooled), log x, one style per policy."""
    fig, ax = plt.subplots(figsize=(width_in, width_in * 0.62))
    drawn = 0
    for i, (label, (policy, ttft)) in enumerate(_ttfts(top).items()):
        st = figstyle.style_of(policy, i)
        x = np.sort(ttft)
        ax.step(x / 1e3, np.arange(1, len(x) + 1) / len(x), where="post", color=st["color"],
                linestyle=st["linestyle"], label=st["label"] if label == policy else label)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, real-world)")
    ax.set_ylabel("fraction of requests")
    ax.legend(frameon=False, loc="lower right")
    ax.grid(True, which="major", alpha=0.3)
    return _save(fig, out_dir, stem)


def _ttfts(top) -> dict:
    out: dict = {}
    for d in rundir.find_runs(top):
        s = rundir.summary(d)
        df = rundir.requests(d)
        ok = df.ttft_ms[df.status == "ok"].dropna().to_numpy()
        pol, prev = out.get(s["label"], (s.get("policy"), np.empty(0)))
        out[s["label"]] = (pol, np.concatenate([prev, ok]))
    return {k: v for k, v in out.items() if len(v[1])}


def caption(top, what: str) -> str:
    """A caption stub from the first run's resolved configuration and the replicate count."""
    runs = rundir.find_runs(top)
    exp = rundir.experiment(runs[0])
    c, w = exp.clusters, exp.network.wan.direction("kv")
    labels = {rundir.summary(d)["label"] for d in runs}
    reps = max(len(runs) // max(len(labels), 1), 1)
    load = (f"offered load {exp.workload.arrival.rate:.3g} req/s"
            if exp.load is None else "offered load swept as a fraction of each policy's "
                                     "predicted Lambda_max")
    return (f"{what} {exp.name}: PrfaaS cluster {c.prfaas.instances} x "
            f"{c.prfaas.accelerator}, local PD {c.local.instances} x {c.local.accelerator}; "
            f"WAN {w['rate'] / 1e9:g} Gbit/s, {w['delay'] * 1e3:g} ms one-way, loss "
            f"{w.get('loss') or 0:g}; {load}; {reps} replicate(s) per point"
            f"{', shaded: 95% CI' if reps > 1 else ''}; emulated at scale.time "
            f"{exp.scale.time:g}.")


def paper_figures(top) -> list[pathlib.Path]:
    """Every paper figure of a run directory at both widths, and captions.md."""
    top = pathlib.Path(top)
    out = RunDir(top).figures / RunDir.PAPER_FIGURES
    paths, captions = [], []
    with figstyle.paper():
        for name, width in figstyle.WIDTHS.items():
            for stem, what, draw in (("load_curve", "Load-latency curves of", _load),
                                     ("ttft_cdf", "TTFT distribution of", ttft_cdf)):
                p = draw(top, out, width, f"{stem}_{name}")
                if p is not None:
                    paths.append(p)
                    captions.append(f"- `{p.name}`: {caption(top, what)}")
    if paths:
        (RunDir(top).figures / RunDir.CAPTIONS).write_text("# Caption stubs\n\n" + "\n".join(captions) + "\n")
    return paths


def _load(top, out, width, stem):
    return plot_load.load_curve(top, out, _save, width, stem)
