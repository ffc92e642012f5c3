"""Turn a `WorkloadSpec` and a seed into the request list, deterministically.

The list is a pandas DataFrame with one row per request, in arrival order:

    id             int64   0, 1, 2, ...
    arrival_s      float64 real-world seconds from the first request (which is at 0), rounded
                           to the microsecond; the client sends at arrival_s / scale.time
    input_len      int64   prompt tokens
    output_len     int64   tokens to generate
    prefix_blocks  object  per request an int64 numpy array of chained 512-token block ids
                           (Mooncake `hash_ids`); empty when the workload has no prefix sharing
    source_line    int64   the trace line the request's input came from; -1 if synthetic

`df.attrs["trace"]` holds what reading the trace did (rows read, skipped, clipped), when a trace
was used. The same spec and seed give the same list on any machine: numpy's PCG64 generator,
one independent stream per quantity (arrivals, input, output, prefixes), with no dependence on
wall clock, hash seeds or dict order. `fingerprint(df)` hashes a list for comparison.
"""

import hashlib
import logging

import numpy as np
import pandas as pd
from scipy import special

from testbed.errors import ConfigError
from testbed.workload import prefix, traces

log = logging.getLogger(__name__)

COLUMNS = ("id", "arrival_s", "input_len", "output_len", "prefix_blocks", "source_line")
SUMMARY_KEYS = ("count", "rate_per_s", "interarrival_cv", "input_mean", "input_p50", "input_p90",
                "input_p99", "output_mean", "output_p50", "output_p90", "output_p99",
                "prefix_hit_share")
_STREAM = {"arrival": 1, "input": 2, "output": 3, "prefix": 4}
_ONOFF_BATCH = 256  # on/off periods drawn at a time; even, so every batch starts "on" alike


def _rng(seed, stream):
    return np.random.Generator(np.random.PCG64([seed, _STREAM[stream]]))


# ---- arrival processes ----

def arrivals(spec, rng, n=None, until_s=None):
    """Arrival times (s) of synthetic process `spec` (ArrivalSpec), the first at 0.

    `n` of them, or all before `until_s`, or the fewer of the two when both are given.
    """
    if n is None and until_s is None:
        raise ValueError("need n or until_s")
    if spec.process == "onoff":
        t = _onoff(spec, rng, n, until_s)
    else:
        t = _renewal(spec, rng, n, until_s)
    if until_s is not None:
        t = t[t < until_s]
    return t[:n] if n is not None else t


def _gaps(spec, rng, m):
    """m inter-arrival gaps of a renewal process (poisson, gamma, constant)."""
    rate = spec.rate
    if spec.process == "constant":
        return np.full(m, 1.0 / rate)
    if spec.process == "gamma":
        # vllm bench serve: theta = 1 / (rate * burstiness), gap ~ Gamma(burstiness, theta).
        g = spec.burstiness
        return rng.gamma(shape=g, scale=1.0 / (rate * g), size=m)
    return rng.exponential(1.0 / rate, size=m)


def _renewal(spec, rng, n, until_s):
    if n is not None:
        g = _gaps(spec, rng, n)
        return np.cumsum(g) - g[0]
    chunk = int(np.ceil(spec.rate * until_s * 1.05)) + 64
    parts, end = [], 0.0
    while end <= until_s:
        g = _gaps(spec, rng, chunk)
        parts.append(g)
        end += g.sum()
    g = np.concatenate(parts)
    return np.cumsum(g) - g[0]


def _onoff(spec, rng, n, until_s):
    """Markov-modulated Poisson process with two states (on, off), exponential sojourns.

    The first period starts on with the stationary probability of being on; within a period of
    length d at rate r there are Poisson(r*d) arrivals placed uniformly (order statistics).
    """
    means = np.array([spec.on_duration, spec.off_duration])
    rates = np.array([spec.on_rate, spec.off_rate])
    first = 0 if rng.random() < means[0] / means.sum() else 1
    state = (first + np.arange(_ONOFF_BATCH)) % 2
    parts, count, t0, t_first = [], 0, 0.0, None
    while True:
        d = rng.exponential(1.0, _ONOFF_BATCH) * means[state]
        start = t0 + np.cumsum(d) - d
        k = rng.poisson(rates[state] * d)
        times = np.repeat(start, k) + rng.random(k.sum()) * np.repeat(d, k)
        times.sort()
        parts.append(times)
        count += len(times)
        t0 = start[-1] + d[-1]
        if t_first is None and count:
            t_first = next(p[0] for p in parts if len(p))
        if count and ((n is not None and count >= n)
                      or (until_s is not None and t0 - t_first > until_s)):
            break
    t = np.concatenate(parts)
    return t - t[0]


# ---- length distributions ----

def lengths(spec, n, rng):
    """n lengths (int tokens) drawn from synthetic `spec` (LengthSpec: fixed, uniform, lognormal)."""
    if spec.dist == "fixed":
        return np.full(n, spec.tokens, dtype=np.int64)
    if spec.dist == "uniform":
        return rng.integers(spec.min, spec.max + 1, size=n, dtype=np.int64)
    if spec.dist == "lognormal":
        return _truncated_lognormal(spec, n, rng)
    raise ValueError(f"dist {spec.dist} needs a trace")


def _truncated_lognormal(spec, n, rng):
    # Inverse CDF on the truncated range: exact, no rejection loop. ndtr and ndtri are the
    # standard normal's CDF and its inverse, the functions scipy.stats.norm's cdf and ppf call
    # (bit for bit the same draws) without scipy.stats' import (a second of CPU per run).
    lo = special.ndtr((np.log(spec.min) - spec.mu) / spec.sigma)
    hi = special.ndtr((np.log(spec.max) - spec.mu) / spec.sigma)
    u = rng.uniform(lo, hi, size=n)
    x = np.exp(spec.mu + spec.sigma * special.ndtri(u))
    return np.clip(np.rint(x), spec.min, spec.max).astype(np.int64)


def _column_lengths(spec, name, n, trace, rng):
    """(lengths, trace rows they came from or None) for `input` or `output`."""
    col = "input_len" if name == "input" else "output_len"
    if spec.dist == "trace":
        rows = np.arange(n)
        return getattr(trace, col)[rows], rows
    if spec.dist == "empirical":
        rows = rng.integers(0, len(trace), size=n)
        return getattr(trace, col)[rows], rows
    return lengths(spec, n, rng), None


# ---- the request list ----

def _schedule(spec, seed, trace, requests, duration_s):
    """Arrival times (s) of the requests, after every limit is applied."""
    a = spec.arrival
    in_order = "trace" in (spec.input.dist, spec.output.dist)
    if a.process == "trace":
        t = (trace.time_s - trace.time_s[0]) / spec.trace.speedup
        if duration_s is not None:
            t = t[t < duration_s]
        if requests is not None:
            if requests > len(t):
                raise ConfigError(f"{requests} requests asked for, but workload.trace selects "
                                  f"only {len(t)} rows; lower 'requests' or widen the window",
                                  key="requests")
            t = t[:requests]
        return t
    if requests is None and duration_s is None:
        if not in_order:
            raise ConfigError("give 'requests' or 'duration' (only a trace replay may omit both)",
                              key="requests")
        requests = len(trace)
    t = arrivals(a, _rng(seed, "arrival"), n=requests, until_s=duration_s)
    if in_order and len(t) > len(trace):
        raise ConfigError(f"{len(t)} requests, but the lengths replay workload.trace's rows in "
                          f"order and it selects only {len(trace)}; lower 'requests'/'duration'"
                          f" or widen the trace window", key="workload")
    return t


def _phased(spec, seed, requests, duration_s):
    """(arrival times, input lengths, output lengths) of a workload with `phases`: each phase's
    process runs from the previous phase's end to its `until` (or the run's end), and each
    request's lengths come from the phase it arrives in. One random stream per quantity, drawn
    phase after phase, so the list is as deterministic as an unphased one."""
    if requests is None and duration_s is None:
        raise ConfigError("give 'requests' or 'duration'", key="requests")
    rng = {k: _rng(seed, k) for k in ("arrival", "input", "output")}
    times, inp, out = [], [], []
    start, count = 0.0, 0
    for ph in spec.phases:
        a, i, o = spec.phase_specs(ph)
        end = ph.until if ph.until is not None else duration_s
        if duration_s is not None and end is not None:
            end = min(end, duration_s)
        left = None if requests is None else requests - count
        if left == 0 or (end is not None and end <= start):
            break
        t = arrivals(a, rng["arrival"], n=left, until_s=None if end is None else end - start)
        times.append(t + start)
        inp.append(lengths(i, len(t), rng["input"]))
        out.append(lengths(o, len(t), rng["output"]))
        count += len(t)
        if end is None:
            break
        start = end
    return np.concatenate(times), np.concatenate(inp), np.concatenate(out)


def generate(spec, seed, requests=None, duration_s=None, *, base_dir=None, trace=None):
    """The request list of `spec` (WorkloadSpec) for `seed`: a DataFrame with COLUMNS.

    `requests` caps the number of requests, `duration_s` keeps those arriving before it
    (real-world s); a trace replay may omit both (all selected rows). A relative trace path
    resolves against `base_dir` (the experiment file's folder), then the CWD. `trace` passes
    an already loaded `traces.Trace` (benchmarks, tests).
    """
    if trace is None and spec.trace is not None:
        trace = traces.load(spec.trace, base_dir)
    if getattr(spec, "phases", ()):
        t, inp, out = _phased(spec, seed, requests, duration_s)
        n, in_rows = len(t), None
    else:
        t = _schedule(spec, seed, trace, requests, duration_s)
        n = len(t)
        inp, in_rows = _column_lengths(spec.input, "input", n, trace, _rng(seed, "input"))
        out, _ = _column_lengths(spec.output, "output", n, trace, _rng(seed, "output"))
    if spec.trace_prefixes() and trace.blocks is not None:
        blocks = list(trace.blocks[:n])
    else:
        blocks = prefix.synthetic_blocks(spec.prefix, inp, _rng(seed, "prefix"))
    source = (trace.line[in_rows] if spec.input.dist == "trace"
              else np.full(n, -1, dtype=np.int64))
    df = pd.DataFrame({
        "id": np.arange(n, dtype=np.int64),
        "arrival_s": np.round(t, 6),
        "input_len": np.asarray(inp, dtype=np.int64),
        "output_len": np.asarray(out, dtype=np.int64),
        "prefix_blocks": pd.Series(blocks, dtype=object),
        "source_line": np.asarray(source, dtype=np.int64),
    })
    if trace is not None:
        df.attrs["trace"] = _trace_report(trace, in_rows)
    return df


def _trace_report(trace, in_rows):
    rep = trace.report()
    # Clipping counts for the rows actually used as inputs, not the whole window.
    rep["clipped"] = 0 if in_rows is None or trace.clipped is None else int(
        trace.clipped[in_rows].sum())
    if rep["clipped"]:
        log.warning("%s: clipped %d inputs to workload.trace.max_input", trace.path,
                    rep["clipped"])
    return rep


# ---- what a list is ----

def summarize(df):
    """Statistics of a request list, in real-world units: exactly SUMMARY_KEYS.

    The rate is (count - 1) / span of arrival times; `prefix_hit_share` is the share of input
    tokens an unbounded prefix cache would hit, replaying the list in arrival order.
    """
    t = df.arrival_s.to_numpy()
    gaps = np.diff(t)
    span = float(t[-1] - t[0]) if len(t) > 1 else 0.0
    out = {
        "count": int(len(df)),
        "rate_per_s": (len(df) - 1) / span if span > 0 else float("nan"),
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0
        else float("nan"),
    }
    for col, name in (("input_len", "input"), ("output_len", "output")):
        v = df[col].to_numpy(dtype=float)
        out[f"{name}_mean"] = float(v.mean()) if len(v) else float("nan")
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = float(np.percentile(v, q)) if len(v) else float("nan")
    blocks = df["prefix_blocks"] if "prefix_blocks" in df else prefix.empty(len(df))
    out["prefix_hit_share"] = prefix.hit_share(list(blocks), df.input_len.to_numpy())
    return out


def fingerprint(df):
    """sha256 hex of a request list: arrival (integer microseconds), lengths, prefix blocks.

    Integer microseconds make the hash immune to float formatting; the block lists are
    length-prefixed so [1, 2], [3] and [1], [2, 3] differ.
    """
    h = hashlib.sha256()
    h.update(np.rint(df.arrival_s.to_numpy() * 1e6).astype("<i8").tobytes())
    h.update(df.input_len.to_numpy().astype("<i8").tobytes())
    h.update(df.output_len.to_numpy().astype("<i8").tobytes())
    blocks = list(df["prefix_blocks"]) if "prefix_blocks" in df else []
    h.update(np.array([len(b) for b in blocks], dtype="<i8").tobytes())
    if blocks:
        h.update(np.concatenate([np.asarray(b, dtype="<i8") for b in blocks]).tobytes())
    return h.hexdigest()
