"""Calibration, the fitting side: raw measurements of a real engine -> a profile file.

    testbed calibrate (testbed/commands/calibrate.py) -> calibrun (measures a vLLM server)
        -> calibfit (this: fit, write) -> profile YAML + raw CSV -> model.profile

What `testbed.calibrun` measured (`Measurements`: prefill wall times at several prompt lengths,
with and without a cached prefix, decode step times at several batch sizes and contexts, the
model's KV bytes per token and the server's KV cache blocks) becomes a profile in the very form
`testbed.profile` reads: the measured points (medians per length) as `prefill_latency` and
`kv_size.points`, which the loader fits to T_prefill(l) = a + b*l + c*l^2 and S_kv(l) = a + b*l,
and the decode step's `DecodeModel` (`step_time`, `bs_max`, `step_shares`,
`reference_context`, `kv_capacity`), fitted here by non-negative least squares to
T_step(B, C) = alpha + beta*B + gamma*C. Everything measured is also written, one row a
measurement, to a CSV beside the profile; `calibration:` in the YAML says where it came from
and how well the fits meet the points (the loader ignores that key).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import pathlib
import statistics

import yaml

from testbed import profile as profiles

RAW_FIELDS = ("kind", "length", "cached", "batch", "context", "seconds", "repeat")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measurement: `kind` prefill (seconds of a max_tokens=1 request of `length` tokens,
    `cached` of them a prefix already in the cache) or step (median inter-token seconds of a
    batch of `batch` streams holding `context` tokens together)."""

    kind: str
    length: int = 0
    cached: int = 0
    batch: int = 0
    context: int = 0
    seconds: float = 0.0
    repeat: int = 0


@dataclasses.dataclass
class Measurements:
    samples: list = dataclasses.field(default_factory=list)
    kv_bytes_per_token: float = 0.0     # layers x kv heads x head dim x 2 x dtype bytes
    block_tokens: int = 16
    kv_blocks: int = 0                  # the server's KV cache blocks (vllm:cache_config_info)
    weights_bytes: float = 0.0
    layers: int = 1
    bs_max: int = 8                     # --max-num-seqs
    info: dict = dataclasses.field(default_factory=dict)   # server, model, versions, timings

    def of(self, kind):
        return [s for s in self.samples if s.kind == kind]


def prefill_points(m):
    """{length: median seconds} of the uncached prefills."""
    by = {}
    for s in m.of("prefill"):
        if s.cached == 0:
            by.setdefault(s.length, []).append(s.seconds)
    return {k: statistics.median(v) for k, v in sorted(by.items())}


def _lstsq(rows, ys):
    import numpy as np      # reason: the command's fit only; profiles stay numpy-free
    coef, *_ = np.linalg.lstsq(np.asarray(rows, float), np.asarray(ys, float), rcond=None)
    return [float(c) for c in coef]


def fit_step(points):
    """(alpha, beta, gamma) >= 0 minimising the squared error of alpha + beta*B + gamma*C over
    `points` ((B, C, seconds)): every subset of the three terms is fitted and the best one
    whose coefficients are all non-negative is kept (a non-negative least squares this small)."""
    best = None
    for k in (3, 2, 1):
        for terms in itertools.combinations(range(3), k):
            rows = [[(1.0, b, c)[t] for t in terms] for b, c, _ in points]
            if len(rows) < k:
                continue
            coef = _lstsq(rows, [y for *_, y in points])
            if min(coef) < 0:
                continue
            full = [0.0, 0.0, 0.0]
            for t, v in zip(terms, coef):
                full[t] = v
            err = sum((full[0] + full[1] * b + full[2] * c - y) ** 2 for b, c, y in points)
            if best is None or err < best[0] - 1e-18:
                best = (err, full)
    if best is None:
        raise ValueError("no decode step points to fit")
    return tuple(best[1])


def decode_section(m):
    """The profile's `decode:` section: T_step(B, C) in DecodeModel's shares, the reference
    context the mean per-request context measured, and the KV cache as decode memory."""
    pts = [(s.batch, s.context, s.seconds) for s in m.of("step")]
    alpha, beta, gamma = fit_step(pts)
    ref = max(1, round(statistics.mean(c / b for b, c, _ in pts)))
    step_s = alpha + beta * m.bs_max + gamma * m.bs_max * ref
    shares = {"base": alpha / step_s, "per_request": beta * m.bs_max / step_s,
              "context": gamma * m.bs_max * ref / step_s}
    shares = {k: round(v, 12) for k, v in shares.items()}
    shares["base"] = 1.0 - shares["per_request"] - shares["context"]
    out = {"step_time": f"{step_s * 1e3:.9g}ms", "bs_max": m.bs_max, "step_shares": shares,
           "reference_context": ref}
    if m.kv_blocks:
        out["kv_capacity"] = float(m.kv_blocks * m.block_tokens * m.kv_bytes_per_token)
    return out, (alpha, beta, gamma)


def pull_fit(m, step_fit):
    """{latency_s, per_token_s, points} from the `pull` samples (testbed/calibpair.py), None
    without two lengths of them: the hand-off less one decode step (alpha + beta + gamma*l),
    medians per length, fitted to a + b*l by least squares; the latency is a, never below 0."""
    alpha, beta, gamma = step_fit
    by = {}
    for s in m.of("pull"):
        by.setdefault(s.length, []).append(s.seconds - (alpha + beta + gamma * s.length))
    if len(by) < 2:
        return None
    pts = {l: statistics.median(v) for l, v in sorted(by.items())}
    n = len(pts)
    mx, my = sum(pts) / n, sum(pts.values()) / n
    sxx = sum((x - mx) ** 2 for x in pts)
    b = sum((x - mx) * (y - my) for x, y in pts.items()) / sxx
    a = my - b * mx
    return {"latency_s": max(0.0, a), "per_token_s": b,
            "points": {l: round(v, 6) for l, v in pts.items()}}


def document(m, name, accelerator, raw_name):
    """The profile YAML's mapping (what `testbed.profile.load` reads, plus `calibration:`)."""
    pre = prefill_points(m)
    if len(pre) < 3:
        raise ValueError(f"need prefill times at 3 or more lengths, got {len(pre)}")
    kv = {l: float(m.kv_bytes_per_token * l) for l in pre}
    decode, (alpha, beta, gamma) = decode_section(m)
    kv_cache = decode.get("kv_capacity", 0.0)
    doc = {
        "name": name,
        "description": f"calibrated from vLLM serving {m.info.get('model', '?')} "
                       f"(testbed calibrate)",
        "kv_size": {"source": "model config: layers x kv heads x head dim x 2 x dtype bytes "
                              f"= {m.kv_bytes_per_token:g} B/token", "points": kv},
        "accelerators": {accelerator: {
            "source": f"measured by testbed calibrate (median of repeats; raw: {raw_name})",
            "prefill_latency": {l: f"{t:.9g}s" for l, t in pre.items()}}},
        "decode": decode,
        "stream_chunks": int(m.layers),
        "weights": float(m.weights_bytes),
        "memory": {accelerator: float(m.weights_bytes + kv_cache)},
        "calibration": {"raw": raw_name, **m.info,
                        "step_fit_s": {"alpha": alpha, "beta_per_request": beta,
                                       "gamma_per_context_token": gamma}},
    }
    pull = pull_fit(m, (alpha, beta, gamma))
    if pull is not None:        # measured between two servers (testbed calibrate --pair)
        doc["kv_transfer"] = "pull"
        doc["kv_pull_latency"] = f"{pull['latency_s'] * 1e3:.6g}ms"
        doc["calibration"]["pull_fit_s"] = pull
    return doc


def checks(m, prof, accelerator):
    """How far the fitted profile is from every measured point: {kind: [(point, measured,
    fitted, error %)]}; a cached prefill is checked against T(l) - T(P) + T(0)."""
    out = {"prefill": [], "prefill_cached": [], "step": []}
    for s in m.of("prefill"):
        fitted = prof.t_prefill_cached(accelerator, s.length, s.cached)
        kind = "prefill_cached" if s.cached else "prefill"
        out[kind].append(((s.length, s.cached), s.seconds, fitted,
                          100.0 * (fitted - s.seconds) / s.seconds))
    for s in m.of("step"):
        fitted = prof.decode.step_time(s.batch, s.context)
        out["step"].append(((s.batch, s.context), s.seconds, fitted,
                            100.0 * (fitted - s.seconds) / s.seconds))
    return out


def error_summary(chk):
    """{kind: median |error %|} of `checks`."""
    return {k: round(statistics.median(abs(e) for *_, e in v), 2) for k, v in chk.items() if v}


def write_raw(m, path):
    """Every sample of `m`, one row each, at `path` (CSV of RAW_FIELDS); the path."""
    with pathlib.Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(RAW_FIELDS)
        for s in m.samples:
            w.writerow([getattr(s, k) for k in RAW_FIELDS])
    return pathlib.Path(path)


def write(m, out, accelerator="cpu", name=None):
    """Write the profile at `out` and the raw measurements beside it (same stem, .csv); the
    profile is loaded back through `testbed.profile` (what model.profile will do) and the fit
    errors added to its `calibration:`. Returns (profile path, csv path, errors)."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = write_raw(m, out.with_suffix(".csv"))
    doc = document(m, name or out.stem, accelerator, raw.name)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    errors = error_summary(checks(m, profiles.load(str(out)), accelerator))
    doc["calibration"]["median_abs_error_pct"] = errors
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out, raw, errors
