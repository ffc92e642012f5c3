"""Figures of the planner (`testbed plan FILE --figures DIR`), seaborn, PNG and PDF.

Both Lambda_max figures use one latency mode of the planner (`--latency`, named in the titles).

1. `lambda_vs_np`: Lambda_max of PrfaaS-PD against N_p (best threshold for each split), with the
   prefill bound (both prefill stages, best t) and the decode bound Theta_pdd.
2. `lambda_vs_threshold`: at the optimal split, Lambda_max against t with the PrfaaS bound
   Theta_prfaas/p, the PD-prefill bound Theta_pdp/(1-p) and Theta_pdd; the optimum is marked.
3. `phi_kv_vs_length`: Phi_kv(l) (log x) of the catalog models (fits of the latencies the paper's
   Phi_kv implies, markers at the paper's points) and of the experiment's profile.

The figures read only the planner's numbers (`testbed.plan`, `testbed.catalog`); matplotlib runs
on the Agg backend, so nothing needs a display.
"""

import pathlib

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import seaborn as sns  # noqa: E402

from testbed import catalog  # noqa: E402
from testbed import plan as planner  # noqa: E402

# One registry of labels and colours for the model's curves (Pantheon habit).
CURVES = {
    "lambda_max": ("Lambda_max", "black", "-"),
    "prefill_bound": ("prefill bound", "tab:blue", "--"),
    "bound_prfaas": ("PrfaaS bound  Theta_prfaas / p", "tab:orange", "--"),
    "bound_pdp": ("PD-prefill bound  Theta_pdp / (1 - p)", "tab:blue", "--"),
    "decode_bound": ("decode bound  Theta_pdd", "tab:green", ":"),
    "bound_pdd": ("decode bound  Theta_pdd", "tab:green", ":"),
}


def _save(fig, out_dir, stem):
    paths = []
    for ext in ("png", "pdf"):
        p = pathlib.Path(out_dir) / f"{stem}.{ext}"
        fig.savefig(p, dpi=150, bbox_inches="tight")
        paths.append(p)
    plt.close(fig)
    return paths


def _line(ax, x, y, key, **kw):
    label, color, style = CURVES[key]
    y = np.where(np.isfinite(y), y, np.nan)
    ax.plot(x, y, label=label, color=color, linestyle=style, **kw)


def lambda_vs_np(inp, n_prfaas, n_local, out_dir, step=planner.DEFAULT_STEP_TOKENS,
                 latency=planner.DEFAULT_LATENCY):
    c = planner.curves_vs_n_p(inp, n_prfaas, n_local, step, latency)
    fig, ax = plt.subplots(figsize=(6, 4))
    _line(ax, c["n_p"], c["prefill_bound"], "prefill_bound", marker="o")
    _line(ax, c["n_p"], c["decode_bound"], "decode_bound", marker="s")
    _line(ax, c["n_p"], c["lambda_max"], "lambda_max", linewidth=2.2)
    best = int(np.argmax(c["lambda_max"]))
    ax.scatter([c["n_p"][best]], [c["lambda_max"][best]], s=90, color="red", zorder=5,
               label=f"optimum N_p = {c['n_p'][best]} ({c['lambda_max'][best]:.2f} req/s)")
    ax.set(xlabel=f"N_p (local prefill instances of {n_local}; N_d = {n_local} - N_p)",
           ylabel="throughput (requests/s)",
           title=f"PrfaaS-PD: Lambda_max vs N_p ({n_prfaas} PrfaaS instances, best t each; "
                 f"{latency} latency)")
    ax.set_xticks(c["n_p"])
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "lambda_vs_np")


def lambda_vs_threshold(inp, row, out_dir, step=planner.DEFAULT_STEP_TOKENS,
                        latency=planner.DEFAULT_LATENCY):
    c = planner.curves_vs_threshold(inp, row["n_prfaas"], row["n_p"], row["n_d"], step, latency)
    fig, ax = plt.subplots(figsize=(6, 4))
    _line(ax, c["threshold"], c["bound_prfaas"], "bound_prfaas")
    _line(ax, c["threshold"], c["bound_pdp"], "bound_pdp")
    _line(ax, c["threshold"], c["bound_pdd"], "bound_pdd")
    _line(ax, c["threshold"], c["lambda_max"], "lambda_max", linewidth=2.2)
    ax.scatter([row["threshold"]], [row["lambda_max"]], s=90, color="red", zorder=5,
               label=f"optimum t = {row['threshold']:,} ({row['lambda_max']:.2f} req/s)")
    ax.set_xscale("log")
    top = 2.0 * max(row["lambda_max"], row["theta_pdd"])
    ax.set_ylim(0, top)
    ax.set(xlabel="routing threshold t (tokens, log scale)", ylabel="throughput (requests/s)",
           title=f"PrfaaS-PD: Lambda_max vs t (N_p = {row['n_p']}, N_d = {row['n_d']}; "
                 f"{latency} latency)")
    ax.legend(fontsize=8)
    return _save(fig, out_dir, "lambda_vs_threshold")


def phi_kv_vs_length(inp, out_dir):
    ls = np.geomspace(1024, 131072, 200)
    fig, ax = plt.subplots(figsize=(6, 4))
    palette = sns.color_palette("tab10", len(catalog.available()) + 2)
    for color, m in zip(palette, catalog.models()):
        curve = m.phi_kv_curve(ls)
        if curve is None:
            continue
        line, = ax.plot(ls, curve, color=color, label=m.name)
        pts = sorted(m.paper_phi_kv_gbps.items())
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=line.get_color(), s=18)
    for color, acc in zip(palette[-2:], dict.fromkeys((inp.remote, inp.local))):
        ax.plot(ls, inp.profile.phi_kv(acc, ls) * 8 / planner.GBPS, color=color,
                linestyle="--", label=f"{inp.profile.name} on {acc} (profile)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1024, 8192, 32768, 131072], ["1K", "8K", "32K", "128K"])
    ax.set(xlabel="input length l (tokens, log scale)",
           ylabel="Phi_kv per instance (Gbps, log scale)",
           title="KV throughput Phi_kv(l) = S_kv(l) / T_prefill(l)")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out_dir, "phi_kv_vs_length")


def draw_all(runs, out_dir, lengths=None, b_out_bps=None, step=planner.DEFAULT_STEP_TOKENS,
             latency=planner.DEFAULT_LATENCY):
    """All three figures for the runs of one experiment file; returns the written paths.

    The Lambda_max curves are those of one latency mode (`testbed.plan`, `latency`)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="paper")
    sizings, _ = planner.policy_sizings(runs)
    sz = sizings.get("prfaas")
    base = sz.exp if sz else runs[0]
    inp = planner.inputs_for(base, lengths, b_out_bps)
    paths = []
    if sz is not None:
        row = planner.best_prfaas(inp, sz.n_prfaas, sz.n_local, step, latency)
        if row is not None:
            paths += lambda_vs_np(inp, sz.n_prfaas, sz.n_local, out, step, latency)
            paths += lambda_vs_threshold(inp, row, out, step, latency)
    paths += phi_kv_vs_length(inp, out)
    return paths
