"""Turn a `WorkloadSpec` and a seed into the request list, deterministically.

The list is a pandas DataFrame with one row per request: `id`, `arrival_s` (real-world seconds
from the start), `input_len`, `output_len`. The same spec and seed give the same list on any
machine: numpy's PCG64 generator, seeded per stream, with no dependence on wall clock or order of
dict iteration.
"""

import numpy as np
import pandas as pd
from scipy import stats


def _rng(seed, stream):
    return np.random.Generator(np.random.PCG64([seed, stream]))


def arrivals(spec, n, rng):
    """n arrival times (s) of the process `spec` (ArrivalSpec), starting near 0."""
    rate = spec.rate
    if spec.process == "constant":
        gaps = np.full(n, 1.0 / rate)
    elif spec.process == "gamma":
        g = spec.burstiness
        gaps = rng.gamma(shape=g, scale=1.0 / (rate * g), size=n)
    else:
        gaps = rng.exponential(1.0 / rate, size=n)
    t = np.cumsum(gaps)
    return t - t[0]


def lengths(spec, n, rng):
    """n lengths (int tokens) drawn from `spec` (LengthSpec)."""
    if spec.dist == "fixed":
        return np.full(n, spec.tokens, dtype=np.int64)
    if spec.dist == "uniform":
        return rng.integers(spec.min, spec.max + 1, size=n, dtype=np.int64)
    # Truncated log-normal by inverse CDF on the truncated range: exact, no rejection loop.
    lo = stats.norm.cdf((np.log(spec.min) - spec.mu) / spec.sigma)
    hi = stats.norm.cdf((np.log(spec.max) - spec.mu) / spec.sigma)
    u = rng.uniform(lo, hi, size=n)
    x = np.exp(spec.mu + spec.sigma * stats.norm.ppf(u))
    return np.clip(np.rint(x), spec.min, spec.max).astype(np.int64)


def generate(spec, seed, requests=None, duration_s=None):
    """The request list for `spec`: `requests` of them, or as many as arrive in `duration_s`."""
    if requests is None:
        if duration_s is None:
            raise ValueError("need either requests or duration")
        requests = max(1, int(np.ceil(spec.arrival.rate * duration_s * 1.5)) + 10)
    t = arrivals(spec.arrival, requests, _rng(seed, 1))
    df = pd.DataFrame({
        "id": np.arange(requests, dtype=np.int64),
        "arrival_s": t,
        "input_len": lengths(spec.input, requests, _rng(seed, 2)),
        "output_len": lengths(spec.output, requests, _rng(seed, 3)),
    })
    if duration_s is not None:
        df = df[df.arrival_s < duration_s].reset_index(drop=True)
    return df


def summarize(df):
    """Statistics of a request list, in real-world units (`testbed workload` prints these)."""
    gaps = np.diff(df.arrival_s.to_numpy())
    span = float(df.arrival_s.iloc[-1] - df.arrival_s.iloc[0]) if len(df) > 1 else 0.0
    out = {
        "count": int(len(df)),
        "rate_per_s": (len(df) - 1) / span if span > 0 else float("nan"),
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0
        else float("nan"),
    }
    for col, name in (("input_len", "input"), ("output_len", "output")):
        v = df[col].to_numpy(dtype=float)
        out[f"{name}_mean"] = float(v.mean())
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = float(np.percentile(v, q))
    return out
