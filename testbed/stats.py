"""Replicate statistics: the centre and 95% confidence interval of a metric over seeds, and the
difference and ratio of two configurations with whether they are distinguishable from run noise.

Pure functions of arrays of per-replicate values (one number per replicate run), on the
analysis floor beside `metrics`. scipy does the statistics:

- fewer than `BOOTSTRAP_MIN` (5) replicates: a Student t-interval of the mean
  (`scipy.stats.t`; for two configurations Welch's interval, `scipy.stats.ttest_ind(...,
  equal_var=False).confidence_interval`). With so few values a bootstrap cannot resample
  enough distinct sets, and the t-interval is the textbook choice.
- `BOOTSTRAP_MIN` replicates or more: a bootstrap interval of the median
  (`scipy.stats.bootstrap`, BCa, fixed random state so a table is reproducible).
- one replicate: the value, and no interval (`method` "single").

Every result says which method produced it, and tables print it, so a reader knows whether a
bracket is a t-interval of a mean or a bootstrap interval of a median. Ratios (B/A of a
throughput, say) are formed on the log scale for the t form (the interval of the ratio of
geometric means), and as the ratio of medians for the bootstrap.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_MIN = 5           # from this many replicates up: bootstrap of the median
BOOTSTRAP_RESAMPLES = 2000
SEED = 0                    # the bootstrap's random state: the same table every time


@dataclasses.dataclass(frozen=True)
class Interval:
    """A metric over replicates: `center` (the median) and a confidence interval [lo, hi]."""

    center: float
    lo: float
    hi: float
    n: int
    method: str             # "t" (t-interval of the mean), "bootstrap" (of the median), "single"

    def fmt(self, spec="{:.4g}") -> str:
        if not math.isfinite(self.center):
            return "-"
        if self.method == "single" or not math.isfinite(self.lo):
            return spec.format(self.center)
        return f"{spec.format(self.center)} [{spec.format(self.lo)}, {spec.format(self.hi)}]"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Contrast:
    """B against A: `estimate` with its interval; distinguishable when the interval excludes
    `null` (0 for a difference, 1 for a ratio)."""

    estimate: float
    lo: float
    hi: float
    method: str
    null: float
    n_a: int
    n_b: int

    @property
    def distinguishable(self) -> bool:
        return (math.isfinite(self.lo) and math.isfinite(self.hi)
                and not (self.lo <= self.null <= self.hi))

    def fmt(self, spec="{:+.4g}") -> str:
        if not math.isfinite(self.estimate):
            return "-"
        if not math.isfinite(self.lo):
            return spec.format(self.estimate)
        return f"{spec.format(self.estimate)} [{spec.format(self.lo)}, {spec.format(self.hi)}]"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["distinguishable"] = self.distinguishable
        return d


def _sps():
    """scipy.stats, imported when an interval is first computed: every run's analysis imports
    this module (through testbed.replicates), and a run without replicates computes none; the
    import is a second of CPU (docs/performance.md)."""
    from scipy import stats     # reason: a second of import that most runs never use
    return stats


def clean(values) -> np.ndarray:
    """The finite values of a sequence (None and nan dropped) as floats."""
    a = np.array([np.nan if v is None else v for v in values], dtype=float).ravel()
    return a[np.isfinite(a)]


def method_for(n: int) -> str:
    """Which interval `interval` gives for n replicates."""
    return "single" if n < 2 else ("t" if n < BOOTSTRAP_MIN else "bootstrap")


def interval(values, confidence=CONFIDENCE) -> Interval:
    """Median and confidence interval of one metric over replicates (module docstring)."""
    a = clean(values)
    n = a.size
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "single")
    center = float(np.median(a))
    method = method_for(n)
    if method == "single":
        return Interval(center, math.nan, math.nan, n, method)
    if np.ptp(a) == 0:
        return Interval(center, center, center, n, method)
    sps = _sps()
    if method == "t":
        lo, hi = sps.t.interval(confidence, n - 1, loc=a.mean(), scale=sps.sem(a))
    else:
        res = sps.bootstrap((a,), np.median, confidence_level=confidence, method="BCa",
                            n_resamples=BOOTSTRAP_RESAMPLES, random_state=SEED)
        lo, hi = res.confidence_interval
        if not (math.isfinite(lo) and math.isfinite(hi)):     # BCa degenerate: percentile
            res = sps.bootstrap((a,), np.median, confidence_level=confidence,
                                method="percentile", n_resamples=BOOTSTRAP_RESAMPLES,
                                random_state=SEED)
            lo, hi = res.confidence_interval
    return Interval(center, float(lo), float(hi), n, method)


def quantile_interval(values, q, confidence=CONFIDENCE):
    """(low, high): the percentile-bootstrap interval of the `q` quantile (0-1) of `values`
    (fixed random state), or None with fewer than `BOOTSTRAP_MIN` finite values. How far a
    small sample can place a tail quantile: of 20 values, the p90 is about the second largest."""
    a = clean(values)
    if a.size < BOOTSTRAP_MIN:
        return None
    res = _sps().bootstrap((a,), lambda x, axis: np.quantile(x, q, axis=axis),
                           confidence_level=confidence, method="percentile",
                           n_resamples=BOOTSTRAP_RESAMPLES, random_state=SEED)
    lo, hi = res.confidence_interval
    return float(lo), float(hi)


def _welch(a, b, confidence):
    """Welch's interval of mean(b) - mean(a)."""
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        d = float(b.mean() - a.mean())
        return d, d, d
    r = _sps().ttest_ind(b, a, equal_var=False)
    ci = r.confidence_interval(confidence)
    return float(b.mean() - a.mean()), float(ci.low), float(ci.high)


def _boot2(a, b, statistic, confidence):
    res = _sps().bootstrap((a, b), statistic, confidence_level=confidence, method="percentile",
                           n_resamples=BOOTSTRAP_RESAMPLES, random_state=SEED, vectorized=False)
    lo, hi = res.confidence_interval
    return float(lo), float(hi)


def _two(a, b):
    a, b = clean(a), clean(b)
    if min(a.size, b.size) < 2:
        return a, b, "single"
    return a, b, ("bootstrap" if min(a.size, b.size) >= BOOTSTRAP_MIN else "t")


def difference(a, b, confidence=CONFIDENCE) -> Contrast:
    """B - A of one metric: t form = difference of means (Welch), bootstrap = of medians."""
    a, b, method = _two(a, b)
    if a.size == 0 or b.size == 0:
        return Contrast(math.nan, math.nan, math.nan, "single", 0.0, a.size, b.size)
    if method == "single":
        est = float(np.median(b) - np.median(a))
        return Contrast(est, math.nan, math.nan, method, 0.0, a.size, b.size)
    if method == "t":
        est, lo, hi = _welch(a, b, confidence)
    else:
        est = float(np.median(b) - np.median(a))
        lo, hi = _boot2(a, b, lambda x, y: np.median(y) - np.median(x), confidence)
    return Contrast(est, lo, hi, method, 0.0, a.size, b.size)


def ratio(a, b, confidence=CONFIDENCE) -> Contrast:
    """B / A of one positive metric: t form = ratio of geometric means (Welch on logs),
    bootstrap = ratio of medians. Non-positive values make it undefined (nan)."""
    a, b, method = _two(a, b)
    if a.size == 0 or b.size == 0 or np.any(a <= 0) or np.any(b <= 0):
        return Contrast(math.nan, math.nan, math.nan, method, 1.0, a.size, b.size)
    if method == "single":
        est = float(np.median(b) / np.median(a))
        return Contrast(est, math.nan, math.nan, method, 1.0, a.size, b.size)
    if method == "t":
        d, lo, hi = _welch(np.log(a), np.log(b), confidence)
        return Contrast(math.exp(d), math.exp(lo), math.exp(hi), method, 1.0, a.size, b.size)
    est = float(np.median(b) / np.median(a))
    lo, hi = _boot2(a, b, lambda x, y: np.median(y) / np.median(x), confidence)
    return Contrast(est, lo, hi, method, 1.0, a.size, b.size)


def method_note(methods) -> str:
    """One line saying what the brackets of a table are, for the methods that occur in it."""
    text = {"t": "t-interval of the mean (fewer than 5 replicates)",
            "bootstrap": "bootstrap (BCa) interval of the median (5 replicates or more)",
            "single": "one replicate: no interval"}
    used = [m for m in ("t", "bootstrap", "single") if m in set(methods)]
    return (f"values: median over replicates; brackets: {int(CONFIDENCE * 100)}% "
            + "; ".join(text[m] for m in used)) if used else ""
