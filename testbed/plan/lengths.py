"""The uncached input length L and the output length L_out, as distributions.

Part of `testbed.plan`. `LengthDistribution` holds L as a probability mass function; p, l_long
and l_short come from its cumulative sums for a whole vector of thresholds at once. Analytic
specs are discretised on every integer token count exactly as the workload generator rounds
them; an empirical distribution is built from an array of lengths, a trace's or a run's own.
"""

import dataclasses
import functools
import types

import numpy as np
from scipy import special

from testbed.errors import ConfigError
from testbed.workload.generate import generate
from testbed.workload.prefix import hit_tokens

@dataclasses.dataclass(frozen=True, eq=False)
class LengthDistribution:
    """A length distribution as a probability mass function over sorted `values` (tokens)."""

    values: np.ndarray
    probs: np.ndarray
    label: str

    def __post_init__(self):
        cum = np.concatenate(([0.0], np.cumsum(self.probs)))
        first = np.concatenate(([0.0], np.cumsum(self.probs * self.values)))
        # Tails as reverse sums, so p and E[L | L > t] stay accurate when p is tiny.
        tail = np.concatenate((np.cumsum(self.probs[::-1])[::-1], [0.0]))
        tail_first = np.concatenate((np.cumsum((self.probs * self.values)[::-1])[::-1], [0.0]))
        cum[-1] = tail[0] = 1.0         # exactly: the empty threshold sides must read 0 and 1
        object.__setattr__(self, "_cum", cum)
        object.__setattr__(self, "_first", first)
        object.__setattr__(self, "_tail", tail)
        object.__setattr__(self, "_tail_first", tail_first)

    @classmethod
    def from_pmf(cls, values, probs, label):
        values = np.asarray(values, dtype=float)
        probs = np.asarray(probs, dtype=float)
        order = np.argsort(values, kind="stable")
        values, probs = values[order], probs[order]
        keep = probs > 0
        values, probs = values[keep], probs[keep]
        if values.size == 0 or not np.all(np.isfinite(values)):
            raise ValueError("a length distribution needs at least one finite length")
        return cls(values, probs / probs.sum(), label)

    @classmethod
    def from_lengths(cls, lengths, label="empirical"):
        """The empirical distribution of an array of (uncached) lengths, e.g. a trace's."""
        lengths = np.asarray(lengths, dtype=float).ravel()
        if lengths.size == 0 or np.any(lengths < 0) or not np.all(np.isfinite(lengths)):
            raise ValueError("expected a non-empty array of non-negative lengths")
        values, counts = np.unique(lengths, return_counts=True)
        return cls.from_pmf(values, counts, f"{label} ({lengths.size} lengths)")

    @property
    def mean(self):
        return float(self._first[-1])

    @property
    def min(self):
        return float(self.values[0])

    @property
    def max(self):
        return float(self.values[-1])

    def split(self, t):
        """(p, l_long, l_short) for threshold(s) t: p = P(L > t); nan where a side is empty."""
        t = np.asarray(t, dtype=float)
        i = np.searchsorted(self.values, t, side="right")   # how many values are <= t
        p = self._tail[i]
        below = self._cum[i]
        with np.errstate(divide="ignore", invalid="ignore"):
            l_long = np.where(p > 0, self._tail_first[i] / p, np.nan)
            l_short = np.where(below > 0, self._first[i] / below, np.nan)
        return p, l_long, l_short

    def expect(self, f, t):
        """(E[f(L) | L > t], E[f(L) | L <= t]) for threshold(s) t; nan where a side is empty.

        f is evaluated once on every length; prefix sums of pmf * f(l) then give every
        threshold in O(1), the same way `split` gives l_long and l_short."""
        w = self.probs * np.asarray(f(self.values), dtype=float)
        head = np.concatenate(([0.0], np.cumsum(w)))
        tail = np.concatenate((np.cumsum(w[::-1])[::-1], [0.0]))
        i = np.searchsorted(self.values, np.asarray(t, dtype=float), side="right")
        p, below = self._tail[i], self._cum[i]
        with np.errstate(divide="ignore", invalid="ignore"):
            above = np.where(p > 0, tail[i] / p, np.nan)
            under = np.where(below > 0, head[i] / below, np.nan)
        return above, under


def _truncated_lognormal(mu, sigma, lo, hi):
    """Mass of every integer in [lo, hi] under the generator's rounding (testbed.workload):
    it draws x from the log-normal truncated to [lo, hi] and sends rint(x)."""
    if lo == hi:
        return np.array([float(lo)]), np.array([1.0])
    k = np.arange(lo, hi + 1, dtype=float)
    z = lambda x: (np.log(x) - mu) / sigma                      # noqa: E731
    cdf = special.ndtr      # the standard normal CDF, as scipy.stats.norm.cdf computes it
    mass = cdf(z(np.minimum(k + 0.5, hi))) - cdf(z(np.maximum(k - 0.5, lo)))
    if not mass.sum() > 0:
        raise ValueError(f"log-normal mu={mu} sigma={sigma} has no mass in [{lo}, {hi}]")
    return k, mass


@functools.lru_cache(maxsize=32)
def _from_spec_cached(spec):
    if spec.dist == "fixed":
        return LengthDistribution.from_pmf([spec.tokens], [1.0], f"fixed {spec.tokens}")
    if spec.dist == "uniform":
        k = np.arange(spec.min, spec.max + 1, dtype=float)
        return LengthDistribution.from_pmf(k, np.ones_like(k),
                                           f"uniform [{spec.min}, {spec.max}]")
    if spec.dist == "lognormal":
        k, mass = _truncated_lognormal(spec.mu, spec.sigma, spec.min, spec.max)
        return LengthDistribution.from_pmf(
            k, mass, f"lognormal mu={spec.mu:g} sigma={spec.sigma:g} in [{spec.min}, {spec.max}]")
    return None


def distribution_from_spec(spec):
    """LengthDistribution of an analytic LengthSpec; None for a kind this module cannot read."""
    try:
        return _from_spec_cached(spec)
    except TypeError:                   # an unhashable spec from a future workload kind
        return None


def _generate(exp, base_dir):
    return generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration,
                    base_dir=base_dir)


@functools.lru_cache(maxsize=8)
def _request_list_cached(workload, seed, requests, duration, base_dir):
    exp = types.SimpleNamespace(workload=workload, seed=seed, requests=requests,
                                duration=duration)
    return _generate(exp, base_dir)


def _request_list(exp, base_dir):
    try:
        return _request_list_cached(exp.workload, exp.seed, exp.requests, exp.duration, base_dir)
    except TypeError:               # an unhashable spec: generate without the cache
        return _generate(exp, base_dir)


def uses_request_list(exp):
    """True when L cannot come from the input spec alone: a trace, shared prefixes, or phases
    (then the planner sees the whole run's mix)."""
    w = exp.workload
    if getattr(w, "phases", ()):
        return True
    prefix = getattr(w, "prefix", None)
    has_prefixes = bool(prefix is not None and prefix.documents > 0) or \
        bool(getattr(w, "trace_prefixes", lambda: False)())
    return has_prefixes or distribution_from_spec(w.input) is None


def _from_request_list(exp, column, base_dir=None):
    """Empirical distribution of the experiment's own request list (traces, shared prefixes).

    The workload module is the one place that knows how a workload turns into requests;
    planning from its output keeps prediction and emulation on the same requests. For the
    input, L is the *uncached* length: the input minus what an unbounded prefix cache would
    hold in arrival order (`testbed.workload.prefix.hit_tokens`), the paper's L, when the
    experiment has a prefix cache (`cache.enabled`); without one every token is prefilled."""
    try:
        df = _request_list(exp, base_dir)
        lengths = df[column].to_numpy()
        label = f"{column} of the request list"
        cache = getattr(exp, "cache", None)
        if column == "input_len" and "prefix_blocks" in df and (cache is None or cache.enabled):
            lengths = lengths - hit_tokens(list(df["prefix_blocks"]), lengths)
            label = "uncached input_len of the request list (unbounded prefix cache)"
    except Exception as e:          # a workload the generator cannot expand here
        raise ConfigError(f"the planner cannot read the {column} distribution of this workload "
                          f"({e}); pass the lengths explicitly", key="workload") from None
    if len(lengths) == 0:
        raise ConfigError("the request list is empty", key="workload")
    return LengthDistribution.from_lengths(lengths, label=label)


def input_distribution(exp, lengths=None, base_dir=None):
    """Distribution of the uncached input length L: explicit lengths, else the workload."""
    if lengths is not None:
        return lengths if isinstance(lengths, LengthDistribution) else \
            LengthDistribution.from_lengths(lengths)
    if uses_request_list(exp):
        return _from_request_list(exp, "input_len", base_dir)
    return distribution_from_spec(exp.workload.input)


def mean_output_length(exp, base_dir=None, output_lengths=None):
    """L_out: the mean output length; of the spec when it is analytic, else of the request list
    (`output_lengths` when given: a run's own, so no request list is generated)."""
    dist = None if getattr(exp.workload, "phases", ()) else \
        distribution_from_spec(exp.workload.output)
    if dist is None and output_lengths is not None and len(output_lengths):
        return float(np.mean(output_lengths))
    if dist is None:
        dist = _from_request_list(exp, "output_len", base_dir)
    return dist.mean
