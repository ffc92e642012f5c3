"""Calibration in a deployment: a real engine's prefill and decode step as a run of it measured
them, refitted into a profile (`testbed calibrate --from-run RUN --base PROFILE`).

    testbed calibrate --from-run -> calibinsitu (this: samples from run records) -> calibfit

`testbed calibrate` alone (testbed.calibrun) times the engine on loopback with nothing else
running. Inside a deployment the same engine is slower: the decode server steps beside the
prefill server, the KV connector's threads, the testbed's scheduler, client and workers take
their share of the cores, and the loopback's few minutes catch the shared machine at one
speed (on 2 cores the deployment's prefills took 1.19x the loopback fit on one occasion and
0.93-0.98x on another: docs/vllm.md "Calibration in the deployment"). A profile fitted on
loopback then stands for another system than the deployment's. This module takes the samples from
a run of the real engine instead, what its processes stamped on the way:

- prefill: each request's prefill_start -> prefill_end at its prefill worker (the HTTP
  `max_tokens: 1` call, as calibrun times it; the worker hands its engine one prefill at a
  time, so the engine's own queue is not in it), its length the input, its cached part vLLM's
  prefix hit. The uncached ones are binned by length (up to 8 bins of at least 5, at least 3 bins) and each
  bin's median length and median time is a `prefill_latency` point; a run of fewer than 3
  lengths (one prompt length, say) scales the base's points by the median measured / base.
- step: every gap between two consecutive tokens of a request at its decode worker (stamped
  as they streamed from vLLM), with the batch B its instance held at the gap's middle (the
  requests between their first and last token there) and the context C those held (their
  inputs and the tokens they had so far). Gaps are grouped by B (and by context terciles
  where a group has 60 or more), each group's median is a point, and calibfit fits
  T_step(B, C) to the points as it does calibrun's; where the run batched fewer than 3 sizes
  (a light load), the base's T_step keeps its shape, scaled by the median measured / base.

Everything else (S_kv, decode memory, BS_max, the KV pull) comes from the base profile, which
the loopback calibration measured. The runs must be of a real engine (`model.engine: vllm`, which runs at scale.time 1).
"""

from __future__ import annotations

import pathlib
import statistics

import numpy as np
import pandas as pd
import yaml

from testbed import calibfit, rundir, units
from testbed import profile as profiles
from testbed.calibfit import Sample
from testbed.errors import ConfigError

PREFILL_BINS, PREFILL_BIN_MIN = 8, 5
STEP_SPLIT_MIN = 60
STEP_BATCHES = 3      # batch sizes needed to refit T_step(B, C) rather than scale it


def _check_run(run_dir):
    exp = rundir.experiment(run_dir)
    if exp.model.engine != "vllm":
        raise ConfigError(f"{run_dir}: model.engine is {exp.model.engine}; the in-deployment "
                          f"calibration fits a real engine's legs (model.engine: vllm)")
    req = rundir.requests(run_dir)
    tok = rundir.tokens(run_dir)
    return req[req.status == "ok"], tok


def prefill_samples(req, run):
    """One `prefill` Sample per request that has both stamps (seconds, input length, cached)."""
    out = []
    ok = req.dropna(subset=["prefill_start", "prefill_end"])
    for r in ok.itertuples():
        cached = 0 if pd.isna(r.cached_len) else int(r.cached_len)
        out.append(Sample("prefill", length=int(r.input_len), cached=cached,
                          seconds=float(r.prefill_end - r.prefill_start), repeat=run))
    return out


def binned_prefill(samples):
    """The uncached prefill samples as at most PREFILL_BINS points of at least PREFILL_BIN_MIN
    each (3 bins of fewer when there are fewer), by length: (median length, median seconds)
    as Samples."""
    pts = sorted((s.length, s.seconds) for s in samples if s.cached == 0)
    n_bins = min(len(pts), max(3, min(PREFILL_BINS, len(pts) // PREFILL_BIN_MIN)))
    out = []
    for chunk in np.array_split(np.asarray(pts, float), n_bins):
        if len(chunk):
            out.append(Sample("prefill", length=int(round(np.median(chunk[:, 0]))),
                              seconds=float(np.median(chunk[:, 1]))))
    return out


def step_gaps(req, tok):
    """DataFrame of every inter-token gap at the decode workers: seconds, batch, context."""
    rows = []
    for inst, rq in req.dropna(subset=["decode_instance"]).groupby("decode_instance"):
        t = tok[tok.id.isin(rq.id)].sort_values(["id", "index"])
        if t.empty:
            continue
        first = t.groupby("id").decode_time.min()
        last = t.groupby("id").decode_time.max()
        inp = rq.set_index("id").input_len.reindex(first.index).astype(float)
        times = np.sort(t.decode_time.to_numpy())
        f_ord, l_ord = np.argsort(first.to_numpy()), np.argsort(last.to_numpy())
        f_sorted, l_sorted = first.to_numpy()[f_ord], last.to_numpy()[l_ord]
        f_inp = np.concatenate([[0.0], np.cumsum(inp.to_numpy()[f_ord])])
        l_inp = np.concatenate([[0.0], np.cumsum(inp.to_numpy()[l_ord])])
        n_tok = t.groupby("id").size().reindex(first.index).to_numpy()[l_ord]
        l_tok = np.concatenate([[0.0], np.cumsum(n_tok)])
        gap = t.groupby("id").decode_time.diff().to_numpy()
        mid = t.decode_time.to_numpy() - gap / 2
        keep = ~np.isnan(gap)
        gap, mid = gap[keep], mid[keep]
        started = np.searchsorted(f_sorted, mid, side="right")
        ended = np.searchsorted(l_sorted, mid, side="left")
        batch = started - ended
        tokens_so_far = np.searchsorted(times, mid, side="right") - l_tok[ended]
        context = f_inp[started] - l_inp[ended] + tokens_so_far
        rows.append(pd.DataFrame({"instance": inst, "seconds": gap, "batch": batch,
                                  "context": context}))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(
        columns=["instance", "seconds", "batch", "context"])


def step_samples(gaps):
    """`step` Samples: the median gap per batch size (per context tercile where a batch size
    has STEP_SPLIT_MIN gaps or more)."""
    out = []
    for b, g in gaps[gaps.batch >= 1].groupby("batch"):
        parts = [g] if len(g) < STEP_SPLIT_MIN else [
            p for _, p in g.groupby(pd.qcut(g.context, 3, duplicates="drop"), observed=True)]
        for p in parts:
            out.append(Sample("step", batch=int(b), context=int(round(p.context.median())),
                              seconds=float(p.seconds.median())))
    return out


def measure(run_dirs, bs_max):
    """(Measurements of the fitted points, Measurements of every raw sample, info) from the
    runs; ConfigError (one line) when they hold too little to fit."""
    raw, gaps = [], []
    for i, run in enumerate(run_dirs):
        req, tok = _check_run(run)
        raw += prefill_samples(req, i)
        gaps.append(step_gaps(req, tok))
    gaps = pd.concat(gaps, ignore_index=True)
    pre = binned_prefill(raw)
    steps = step_samples(gaps)
    if not pre:
        raise ConfigError(f"--from-run: no uncached prefill in {len(run_dirs)} run(s) (every "
                          f"request failed, or every prompt was in the prefix cache)")
    if not steps:
        raise ConfigError("--from-run: no decode-step gaps (requests of 2 or more tokens)")
    info = {"runs": [str(pathlib.Path(r)) for r in run_dirs], "prefills": len(raw),
            "gaps": len(gaps), "gap_median_s": float(gaps.seconds.median()),
            "gap_mean_s": float(gaps.seconds.mean())}
    return (calibfit.Measurements(samples=pre + steps, bs_max=bs_max),
            calibfit.Measurements(samples=raw + steps, bs_max=bs_max), info)


def prefill_section(base_points, base, accelerator, fit, raw):
    """(the `prefill_latency` points, how they were made). With 3 or more lengths among the
    binned points they are the points; with fewer (a run of one prompt length) the base's
    points keep their shape, scaled by the median of measured / base over the prefills."""
    pts = calibfit.prefill_points(fit)
    if len(pts) >= 3:
        return {l: f"{t:.9g}s" for l, t in pts.items()}, "refit"
    factor = statistics.median(s.seconds / base.t_prefill_cached(accelerator, s.length, s.cached)
                               for s in raw.of("prefill"))
    points = {l: f"{units.duration_s(t) * factor:.9g}s" for l, t in base_points.items()}
    return points, {"scaled": round(factor, 6), "lengths": sorted(pts)}


def step_section(base_doc, base_model, fit):
    """(the profile's `decode:` section, how it was made). With gaps at STEP_BATCHES or more
    batch sizes the step is refitted (T_step(B, C) by calibfit); with fewer (a light load
    batches little) the batch's own term cannot be told from the fixed one, so the base's
    T_step is kept in shape and scaled by the median of measured / base over the points."""
    steps = fit.of("step")
    if len({s.batch for s in steps}) >= STEP_BATCHES:
        decode, (alpha, beta, gamma) = calibfit.decode_section(fit)
        for key in ("kv_capacity", "bs_max"):
            if key in base_doc:
                decode[key] = base_doc[key]
        return decode, {"refit": {"alpha": alpha, "beta_per_request": beta,
                                  "gamma_per_context_token": gamma}}
    factor = statistics.median(s.seconds / base_model.step_time(s.batch, s.context)
                               for s in steps)
    decode = dict(base_doc)
    decode["step_time"] = f"{base_model.step_s * factor * 1e3:.9g}ms"
    return decode, {"scaled": round(factor, 6),
                    "batches": sorted({s.batch for s in steps})}


def refit(base, run_dirs, out, accelerator="cpu"):
    """Write at `out` the profile `base` with its prefill latency (for `accelerator`) and its
    decode step refitted from the runs, the samples beside it (.csv); (path, csv, errors)."""
    base, out = pathlib.Path(base), pathlib.Path(out)
    doc = yaml.safe_load(base.read_text())
    acc = doc.get("accelerators", {})
    if accelerator not in acc or "decode" not in doc:
        raise ConfigError(f"--base {base}: expected a calibrated profile with "
                          f"accelerators.{accelerator} and decode (testbed calibrate writes one)")
    base_profile = profiles.load(str(base))
    fit, raw, info = measure(run_dirs, int(doc["decode"].get("bs_max", 8)))
    decode, how = step_section(doc["decode"], base_profile.decode, fit)
    acc[accelerator]["prefill_latency"], how_prefill = prefill_section(
        acc[accelerator]["prefill_latency"], base_profile, accelerator, fit, raw)
    acc[accelerator]["source"] = (f"refitted from the real engine's legs in {len(run_dirs)} "
                                  f"deployment run(s) (testbed calibrate --from-run)")
    doc["decode"] = decode
    doc["name"] = out.stem
    cal = doc.setdefault("calibration", {})
    cal["in_deployment"] = {**info, "base": str(base), "raw": out.with_suffix(".csv").name,
                            "prefill": how_prefill, "step": how}
    out.parent.mkdir(parents=True, exist_ok=True)
    csv_path = calibfit.write_raw(raw, out.with_suffix(".csv"))
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    errors = calibfit.error_summary(calibfit.checks(raw, profiles.load(str(out)), accelerator))
    cal["in_deployment"]["median_abs_error_pct"] = errors
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out, csv_path, errors
