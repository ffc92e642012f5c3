"""Predict: the paper's analytical throughput model, as a planner beside the emulator.

PRFAAS.md ("Analytical model") is the specification; the symbols here are the paper's:

    Phi_kv(l)     = S_kv(l) / T_prefill(l)                       KV throughput of one instance
    B_out         = the egress bandwidth PrfaaS may use          (bytes/s here, Gbps in reports)
    p             = P(L > t);  l_long = E[L | L > t];  l_short = E[L | L <= t]
    Theta_prfaas  = min(N_prfaas / T_prefill_remote(l_long), B_out / S_kv(l_long))
    Theta_pdp     = N_p / T_prefill_local(l_short)
    Theta_pdd     = N_d * BS_max / (T_decode * L_out)
    Lambda_max    = min(Theta_prfaas / p, Theta_pdp / (1 - p), Theta_pdd)

A stage that receives no traffic (p = 0 for PrfaaS, p = 1 for PD prefill) does not bound
Lambda_max. Homogeneous PD is the model with p = 0 and local instances only; naive heterogeneous
is p = 1 with every local instance decoding.

Latency mode (`latency=`, `testbed plan --latency`): what a stage throughput divides by.
- `paper` (default, the formulas above): the latency AT the conditional mean length,
  T_prefill(l_long) and T_prefill(l_short); reproduces the paper's headline numbers.
- `expected`: the conditional mean latency, E[T_prefill(L) | L > t] and E[T_prefill(L) | L <= t]
  (and E[S_kv(L) | L > t] for the egress terms). An instance serving a stream of requests spends
  E[T] per request, so N / E[T] is its capacity; T is convex (quadratic), so by Jensen
  T(E[L]) <= E[T(L)] and the paper form overestimates every prefill stage. S_kv is linear, so
  its two forms agree; Theta_pdd is the same in both (decode time is linear in L_out).
The expectations come from the same probability mass as p and l_long: prefix sums of
pmf * T(l) over the length grid make every threshold O(1) (`LengthDistribution.expect`).

Where this module sits: it reads only validated `Experiment` objects (`testbed.config`) and
profiles (`testbed.profile`, the same fits the workers use), so a prediction and an emulated run of
one file use the same numbers. Everything is real-world: `scale:` does not enter the model.

- `LengthDistribution` holds the uncached input length L as a probability mass function; p,
  l_long and l_short come from its cumulative sums for a whole vector of thresholds at once.
  Analytic specs are discretised on every integer token count exactly as the workload generator
  rounds them, so the moments are those of the lengths the emulator sends (and within 0.1% of the
  continuous truncated distribution); an empirical distribution is built from an array of lengths.
- `predict(exp)` evaluates ONE experiment as configured (its policy, threshold and split).
- `plan_file(path)` builds the three policies of PRFAAS.md from one experiment file and finds each
  one's best threshold and N_p/N_d split by exhaustive grid search, as the paper does.

B_out rule: the paper fixes B_out; here it is the WAN rate of the `kv` direction
(`network.wan.kv.rate`, else `network.wan.rate`), because the WAN is the only path PrfaaS egress
takes, so the link rate is the most the cluster can send. A planner argument (`b_out_bps`,
`testbed plan --b-out`) may set another value (a provisioned share of the link, or a what-if
above it); a warning says when the predicted egress exceeds the WAN rate, and when PrfaaS would
need more than B_out to stay compute-bound (`b_out_min = N_prfaas * Phi_kv(l_long)`, the
paper's minimum egress).
"""

import dataclasses
import functools
import math
import pathlib
import types

import numpy as np
from scipy import stats

from testbed import profile as profiles
from testbed.errors import ConfigError, TestbedError

POLICIES = ("prfaas", "homogeneous", "naive")
LATENCY_MODES = ("paper", "expected")
DEFAULT_LATENCY = "paper"
STAGES = ("prfaas", "pdp", "pdd")
GBPS = 1e9                      # the paper's Gbps: 1e9 bit/s
DEFAULT_STEP_TOKENS = 32        # threshold grid step; the issue asks for <= 100
TIE_RTOL = 1e-9                 # Lambda_max values this close count as equal (decode plateau)

ROW_KEYS = ("policy", "threshold", "n_prfaas", "n_p", "n_d", "lambda_max", "theta_prfaas",
            "theta_pdp", "theta_pdd", "offload_fraction", "l_long", "l_short", "egress_gbps",
            "binding", "bound_prfaas", "bound_pdp", "bound_pdd", "prfaas_limit",
            "b_out_min_gbps", "balance")
# What each latency mode reports of one configuration (the nested `paper` / `expected` dicts).
MODE_KEYS = ("lambda_max", "theta_prfaas", "theta_pdp", "theta_pdd", "bound_prfaas",
             "bound_pdp", "bound_pdd", "binding", "egress_gbps")


# ---------------------------------------------------------------- the equations (array-valued)

def Phi_kv(s_kv_bytes, t_prefill_s):
    """KV throughput of one instance, bytes/s."""
    return np.asarray(s_kv_bytes, dtype=float) / np.asarray(t_prefill_s, dtype=float)


def B_out_min(n_instances, phi_kv_Bps):
    """Minimum egress of a prefill cluster (bytes/s): (N/P) * Phi_kv(L_avg), N/P = instances."""
    return n_instances * np.asarray(phi_kv_Bps, dtype=float)


def Theta_prfaas(n_prfaas, t_prefill_remote_s, s_kv_bytes, b_out_Bps):
    """PrfaaS stage throughput (requests/s): compute limit or egress limit, whichever is lower."""
    compute = np.asarray(n_prfaas, dtype=float) / np.asarray(t_prefill_remote_s, dtype=float)
    bandwidth = b_out_Bps / np.asarray(s_kv_bytes, dtype=float)
    return np.minimum(compute, bandwidth)


def Theta_pdp(n_p, t_prefill_local_s):
    """Local PD prefill stage throughput (requests/s)."""
    return np.asarray(n_p, dtype=float) / np.asarray(t_prefill_local_s, dtype=float)


def Theta_pdd(n_d, bs_max, t_decode_s, l_out):
    """Local PD decode stage throughput (requests/s)."""
    return np.asarray(n_d, dtype=float) * bs_max / (t_decode_s * l_out)


def share_bound(theta, share):
    """Theta / share: the arrival rate a stage sustains when it gets `share` of the requests.

    A stage with no share is no bound (inf), whatever its Theta (0, or undefined)."""
    theta = np.asarray(theta, dtype=float)
    share = np.asarray(share, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(share > 0, theta / np.where(share > 0, share, 1.0), np.inf)


def Lambda_max(theta_prfaas, theta_pdp, theta_pdd, p):
    """System throughput at saturation: min(Theta_prfaas/p, Theta_pdp/(1-p), Theta_pdd)."""
    p = np.asarray(p, dtype=float)
    return np.minimum(np.minimum(share_bound(theta_prfaas, p), share_bound(theta_pdp, 1.0 - p)),
                      np.asarray(theta_pdd, dtype=float))


# ---------------------------------------------------------------- the length distribution

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
    cdf = stats.norm.cdf
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
    from testbed.workload.generate import generate
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
            from testbed.workload.prefix import hit_tokens
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


# ---------------------------------------------------------------- inputs of one evaluation

@functools.lru_cache(maxsize=8)
def _profile(name):
    return profiles.load(name)


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs:
    """Everything the model needs besides instance counts and the threshold."""

    profile: object                 # testbed.profile.Profile
    remote: str                     # PrfaaS accelerator
    local: str                      # local PD accelerator
    lengths: LengthDistribution     # L
    l_out: float                    # L_out
    t_decode_s: float               # T_decode
    bs_max: int                     # BS_max
    b_out_Bps: float                # B_out
    wan_rate_bps: float             # the WAN's kv-direction rate (for the warnings)

    def t_remote(self, l):
        return self.profile.t_prefill(self.remote, l)

    def t_local(self, l):
        return self.profile.t_prefill(self.local, l)

    def s_kv(self, l):
        return self.profile.s_kv(l)


def wan_kv_rate_bps(exp):
    """Rate of the WAN direction that carries KV (PrfaaS -> local), bit/s, real-world."""
    return float(exp.network.wan.direction("kv")["rate"])


def inputs_for(exp, lengths=None, b_out_bps=None, base_dir=None, output_lengths=None):
    """Model inputs of one experiment; B_out defaults to the WAN kv rate (module docstring).

    `lengths` / `output_lengths` (arrays) replace the workload's input / output lengths (a
    run's measured ones: then no request list is generated); `base_dir` (the experiment file's
    folder) resolves a relative trace path."""
    prof = _profile(exp.model.profile)
    wan = wan_kv_rate_bps(exp)
    dist = input_distribution(exp, lengths, base_dir)
    l_out = mean_output_length(exp, base_dir, output_lengths)
    decode = exp.decode_model()
    return Inputs(
        profile=prof,
        remote=exp.clusters.prfaas.accelerator,
        local=exp.clusters.local.accelerator,
        lengths=dist,
        l_out=l_out,
        # A full batch at the mean context a request holds while it decodes (input + half its
        # output): T_decode exactly when that is the profile's reference context.
        t_decode_s=decode.step_time(decode.bs_max, decode.bs_max * (dist.mean + l_out / 2)),
        bs_max=decode.bs_max,
        b_out_Bps=(wan if b_out_bps is None else float(b_out_bps)) / 8.0,
        wan_rate_bps=wan,
    )


# ---------------------------------------------------------------- evaluation on grids

def check_latency(latency):
    """The latency mode, or ConfigError (exit code 2) naming the modes there are."""
    if latency not in LATENCY_MODES:
        raise ConfigError(f"latency mode must be one of {', '.join(LATENCY_MODES)}, got "
                          f"{latency!r}", key="latency")
    return latency


def _paper_costs(inp, l_long, l_short):
    # Undefined lengths (an empty side of the threshold) get a placeholder: that stage has no
    # share, so share_bound makes it no bound; its Theta is reported as null later.
    ll = np.where(np.isfinite(l_long), l_long, inp.lengths.mean)
    ls = np.where(np.isfinite(l_short), l_short, inp.lengths.mean)
    return {"t_remote": inp.t_remote(ll), "t_local": inp.t_local(ls), "s_kv_long": inp.s_kv(ll)}


def _expected_costs(inp, t):
    d = inp.lengths

    def mean_of(f, side):
        v = d.expect(f, t)[side]
        # Same placeholder rule as the paper form: an empty side is no bound.
        return np.where(np.isfinite(v), v, float(np.sum(d.probs * f(d.values))))

    return {"t_remote": mean_of(inp.t_remote, 0), "t_local": mean_of(inp.t_local, 1),
            "s_kv_long": mean_of(inp.s_kv, 0)}


def split(inp, t, latency=DEFAULT_LATENCY):
    """Length statistics and per-request stage costs at threshold(s) t, as a dict.

    p, l_long, l_short as `LengthDistribution.split`; the costs the stage throughputs divide by:
    `t_remote` (one PrfaaS prefill), `t_local` (one PD prefill), `s_kv_long` (the KV bytes one
    offloaded request sends); `paper`: each at the conditional mean length, `expected`: its
    conditional mean. t = -inf offloads everything (naive), t = +inf nothing (homogeneous)."""
    check_latency(latency)
    t = np.asarray(t, dtype=float)
    p, l_long, l_short = inp.lengths.split(t)
    costs = _paper_costs(inp, l_long, l_short) if latency == "paper" else \
        _expected_costs(inp, t)
    return dict(costs, p=p, l_long=l_long, l_short=l_short)


def _row_vector(sp):
    """The arrays of `split` over thresholds, shaped for a (splits x thresholds) grid."""
    return {k: np.asarray(v)[None, :] for k, v in sp.items()}


def evaluate(inp, n_prfaas, n_p, n_d, p, l_long, l_short, costs=None):
    """All stage quantities for (broadcastable arrays of) counts and length statistics.

    `costs` ({t_remote, t_local, s_kv_long}, from `split`) sets what the stage throughputs
    divide by; without it they are the paper's, at l_long and l_short."""
    p = np.asarray(p, dtype=float)
    if costs is None:
        costs = _paper_costs(inp, l_long, l_short)
    t_remote, t_local, s_kv_long = costs["t_remote"], costs["t_local"], costs["s_kv_long"]
    theta_prfaas = Theta_prfaas(n_prfaas, t_remote, s_kv_long, inp.b_out_Bps)
    theta_pdp = Theta_pdp(n_p, t_local)
    theta_pdd = Theta_pdd(n_d, inp.bs_max, inp.t_decode_s, inp.l_out)
    bound_prfaas = share_bound(theta_prfaas, p)
    bound_pdp = share_bound(theta_pdp, 1.0 - p)
    bound_pdd = np.broadcast_to(theta_pdd, np.broadcast(bound_prfaas, bound_pdp).shape)
    lam = np.minimum(np.minimum(bound_prfaas, bound_pdp), bound_pdd)
    egress_Bps = np.where(p > 0, lam * p * s_kv_long, 0.0)
    return {
        "lambda_max": lam, "theta_prfaas": theta_prfaas, "theta_pdp": theta_pdp,
        "theta_pdd": theta_pdd, "bound_prfaas": bound_prfaas, "bound_pdp": bound_pdp,
        "bound_pdd": bound_pdd, "egress_Bps": egress_Bps, "p": p,
        "prfaas_bandwidth_bound": n_prfaas / t_remote > inp.b_out_Bps / s_kv_long,
        "b_out_min_Bps": B_out_min(n_prfaas, Phi_kv(s_kv_long, t_remote)),
    }


def _num(x, digits=None):
    """JSON-safe float: nan and inf become None."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return round(x, digits) if digits is not None else x


def _row(policy, inp, q, idx, threshold, n_prfaas, n_p, n_d, l_long, l_short):
    """The reported dict of one configuration, picked at index `idx` of the arrays in `q`."""
    at = lambda name: np.broadcast_to(q[name], q["lambda_max"].shape)[idx]   # noqa: E731
    p = float(np.broadcast_to(q["p"], q["lambda_max"].shape)[idx])
    bounds = {s: float(at(f"bound_{s}")) for s in STAGES}
    binding = min(STAGES, key=lambda s: bounds[s])
    has_remote = n_prfaas > 0 and p > 0
    has_local = n_p > 0 and p < 1
    theta_prfaas = float(at("theta_prfaas")) if has_remote else (0.0 if n_prfaas == 0 else None)
    theta_pdp = float(at("theta_pdp")) if has_local else (0.0 if n_p == 0 else None)
    theta_pdd = float(at("theta_pdd"))
    producers = (theta_prfaas or 0.0) + (theta_pdp or 0.0)
    return {
        "policy": policy,
        "threshold": None if threshold is None else int(threshold),
        "n_prfaas": int(n_prfaas), "n_p": int(n_p), "n_d": int(n_d),
        "lambda_max": _num(at("lambda_max")),
        "theta_prfaas": _num(theta_prfaas) if theta_prfaas is not None else None,
        "theta_pdp": _num(theta_pdp) if theta_pdp is not None else None,
        "theta_pdd": _num(theta_pdd),
        "offload_fraction": p,
        "l_long": _num(l_long) if p > 0 else None,
        "l_short": _num(l_short) if p < 1 else None,
        "egress_gbps": float(at("egress_Bps")) * 8 / GBPS,
        "binding": binding,
        "bound_prfaas": _num(bounds["prfaas"]), "bound_pdp": _num(bounds["pdp"]),
        "bound_pdd": _num(bounds["pdd"]),
        "prfaas_limit": ("bandwidth" if bool(at("prfaas_bandwidth_bound")) else "compute")
        if has_remote else None,
        "b_out_min_gbps": float(at("b_out_min_Bps")) * 8 / GBPS if has_remote else None,
        # (Theta_prfaas + Theta_pdp) / Theta_pdd: the paper's long-timescale signal
        # (<< 1 prefill-bound, >> 1 decode-bound).
        "balance": _num(producers / theta_pdd) if theta_pdd > 0 else None,
    }


def _pick(lam, egress):
    """Index of the best configuration: highest Lambda_max; among equals, least egress."""
    lam = np.where(np.isfinite(lam), lam, -np.inf)
    best = lam.max()
    tied = lam >= best * (1 - TIE_RTOL) if best > 0 else lam >= best
    cost = np.where(tied, egress, np.inf)
    return np.unravel_index(int(np.argmin(cost)), lam.shape)


def threshold_grid(lengths, step=DEFAULT_STEP_TOKENS):
    """Thresholds t from the shortest length up to the longest, every `step` tokens.

    t = max would offload nothing (that is homogeneous PD), so the grid stops below it."""
    if not 0 < step <= 100:
        raise ConfigError(f"threshold step must be in (0, 100] tokens, got {step}", key="step")
    lo, hi = math.floor(lengths.min), math.ceil(lengths.max)
    ts = np.arange(lo, hi, step, dtype=float)
    return ts if ts.size else np.array([float(lo)])


def best_prfaas(inp, n_prfaas, n_local, step=DEFAULT_STEP_TOKENS, latency=DEFAULT_LATENCY):
    """PrfaaS-PD: exhaustive grid over t x every split N_p + N_d = n_local (both >= 1)."""
    if n_prfaas < 1 or n_local < 2:
        return None
    ts = threshold_grid(inp.lengths, step)
    sp = split(inp, ts, latency)
    g = _row_vector(sp)
    n_p = np.arange(1, n_local, dtype=float)[:, None]         # splits x thresholds
    q = evaluate(inp, n_prfaas, n_p, n_local - n_p, g["p"], g["l_long"], g["l_short"], g)
    s, k = _pick(q["lambda_max"], q["egress_Bps"])
    return _row("prfaas", inp, q, (s, k), ts[k], n_prfaas, int(n_p[s, 0]),
                n_local - int(n_p[s, 0]), sp["l_long"][k], sp["l_short"][k])


def best_homogeneous(inp, n_local, latency=DEFAULT_LATENCY):
    """Homogeneous PD: p = 0, local instances only, best split N_p + N_d = n_local."""
    if n_local < 2:
        return None
    n_p = np.arange(1, n_local, dtype=float)
    sp = split(inp, _policy_threshold("homogeneous", None), latency)
    q = evaluate(inp, 0, n_p, n_local - n_p, sp["p"], sp["l_long"], sp["l_short"], sp)
    (s,) = _pick(q["lambda_max"], q["egress_Bps"])
    return _row("homogeneous", inp, q, (s,), None, 0, int(n_p[s]), n_local - int(n_p[s]),
                sp["l_long"], sp["l_short"])


def naive(inp, n_prfaas, n_local, latency=DEFAULT_LATENCY):
    """Naive heterogeneous: p = 1, every prefill on PrfaaS, every local instance decodes."""
    if n_prfaas < 1 or n_local < 1:
        return None
    return evaluate_config(inp, "naive", None, n_prfaas, 0, n_local, latency)


def _policy_threshold(policy, threshold):
    """The threshold `split` takes for a policy: homogeneous offloads nothing, naive all."""
    return {"homogeneous": np.inf, "naive": -np.inf}.get(policy, threshold)


def evaluate_config(inp, policy, threshold, n_prfaas, n_p, n_d, latency=DEFAULT_LATENCY):
    """The reported row of ONE configuration (no search) in one latency mode."""
    sp = split(inp, _policy_threshold(policy, threshold), latency)
    q = evaluate(inp, n_prfaas, np.full(1, float(n_p)), np.full(1, float(n_d)), sp["p"],
                 sp["l_long"], sp["l_short"], sp)
    return _row(policy, inp, q, (0,), threshold, n_prfaas, n_p, n_d, sp["l_long"],
                sp["l_short"])


def with_both_modes(row, inp, latency):
    """A row (computed in `latency`) plus both modes' evaluation of its configuration:
    `lambda_max_paper`, `lambda_max_expected` and the nested dicts `paper`, `expected`."""
    both = {mode: row if mode == latency else evaluate_config(
        inp, row["policy"], row["threshold"], row["n_prfaas"], row["n_p"], row["n_d"], mode)
        for mode in LATENCY_MODES}
    row["latency"] = latency
    row.update({f"lambda_max_{mode}": r["lambda_max"] for mode, r in both.items()})
    row.update({mode: {k: r[k] for k in MODE_KEYS} for mode, r in both.items()})
    return row


# ---------------------------------------------------------------- one experiment as configured

def _configured(exp, inp, latency=DEFAULT_LATENCY):
    c, pol = exp.clusters, exp.scheduler.policy
    n_prfaas = 0 if pol == "homogeneous" else c.prfaas.instances
    t = exp.scheduler.threshold if pol == "prfaas" else None
    return evaluate_config(inp, pol, t, n_prfaas, c.local.prefill, c.local.decode, latency)


def predict(exp, lengths=None, b_out_bps=None, base_dir=None, latency=DEFAULT_LATENCY,
            output_lengths=None):
    """The model's prediction for ONE experiment as configured (no optimisation).

    Returns the same keys as each policy of `plan_file` (ROW_KEYS) in the `latency` mode (the
    paper's form by default, so `lambda_max` is the paper's prediction), in real-world units
    (lambda_max in requests/s), plus `latency`, both modes side by side (`lambda_max_paper`,
    `lambda_max_expected`, and `paper` / `expected`: dicts of MODE_KEYS), `b_out_gbps` and
    `warnings`. Never raises for a validated experiment: what cannot be predicted comes back
    as None with the reason in `warnings`."""
    check_latency(latency)
    try:
        inp = inputs_for(exp, lengths, b_out_bps, base_dir, output_lengths)
        row = with_both_modes(_configured(exp, inp, latency), inp, latency)
    except (TestbedError, ValueError) as e:
        row = {k: None for k in ROW_KEYS}
        row.update(policy=exp.scheduler.policy, latency=latency, b_out_gbps=None,
                   warnings=[str(e)])
        for mode in LATENCY_MODES:
            row[mode] = {k: None for k in MODE_KEYS}
            row[f"lambda_max_{mode}"] = None
        return row
    row["b_out_gbps"] = inp.b_out_Bps * 8 / GBPS
    row["warnings"] = egress_warnings(row, inp)
    return row


# ---------------------------------------------------------------- the three policies of a file

@dataclasses.dataclass(frozen=True)
class PolicySizing:
    """Cluster sizes the planner gives one policy, and where they came from."""

    policy: str
    exp: object                 # the Experiment whose workload, model and network are used
    n_prfaas: int
    n_local: int
    origin: str


def policy_sizings(runs):
    """One PolicySizing per policy (None where it cannot be derived), and warnings.

    Rule: a run (variant) whose scheduler.policy matches gives that policy's cluster sizes
    (its N_p/N_d split is re-optimised; only the totals are used). A policy without a run is
    derived from the base run (the first prfaas run, else the first run) as in the paper's case
    study: homogeneous gets N_prfaas + N_local local instances of the local accelerator (4 + 8 =
    12 H20), naive keeps the PrfaaS cluster and makes every local instance decode."""
    warnings = []
    by_policy = {}
    for exp in runs:
        pol = exp.scheduler.policy
        if pol in by_policy:
            if by_policy[pol][1] == 1:
                warnings.append(f"several runs with policy {pol}: planning the first "
                                f"({by_policy[pol][0].run_label})")
            by_policy[pol] = (by_policy[pol][0], by_policy[pol][1] + 1)
        else:
            by_policy[pol] = (exp, 1)
    base = by_policy["prfaas"][0] if "prfaas" in by_policy else runs[0]
    bc = base.clusters
    out = {}
    for pol in POLICIES:
        if pol in by_policy:
            exp = by_policy[pol][0]
            c = exp.clusters
            n_prfaas = 0 if pol == "homogeneous" else c.prfaas.instances
            out[pol] = PolicySizing(pol, exp, n_prfaas, c.local.instances,
                                    f"run {exp.run_label!r}")
        elif pol == "homogeneous":
            out[pol] = PolicySizing(pol, base, 0, bc.prfaas.instances + bc.local.instances,
                                    f"derived from run {base.run_label!r}: "
                                    f"{bc.prfaas.instances} + {bc.local.instances} local")
        elif bc.prfaas.instances >= 1:
            out[pol] = PolicySizing(pol, base, bc.prfaas.instances, bc.local.instances,
                                    f"derived from run {base.run_label!r}")
        else:
            out[pol] = None
            warnings.append(f"no {pol} run and the base run has no PrfaaS instances: "
                            f"{pol} is not planned")
    return out, warnings


def egress_warnings(row, inp):
    """The B_out checks of the module docstring, as one-line messages."""
    out = []
    if row is None or not row.get("egress_gbps"):
        return out
    wan = inp.wan_rate_bps / GBPS
    if row["egress_gbps"] > wan * (1 + 1e-9):
        out.append(f"{row['policy']}: predicted PrfaaS egress {row['egress_gbps']:.2f} Gbps "
                   f"exceeds the WAN rate {wan:.3g} Gbps (B_out {inp.b_out_Bps * 8 / GBPS:.3g} "
                   f"Gbps is above the link)")
    need = row.get("b_out_min_gbps")
    b_out = inp.b_out_Bps * 8 / GBPS
    if need is not None and need > b_out * (1 + 1e-9):
        out.append(f"{row['policy']}: PrfaaS needs B_out >= N_prfaas * Phi_kv(l_long) = "
                   f"{need:.2f} Gbps to stay compute-bound; B_out is {b_out:.3g} Gbps (WAN "
                   f"{wan:.3g} Gbps), so it is bandwidth-bound")
    return out


PHI_KV_LENGTHS = (1024, 8192, 32768, 131072)


def phi_kv_table(inp, extra=()):
    """Phi_kv (Gbps) of one instance of each accelerator at the paper's lengths (and extra)."""
    ls = sorted(set(PHI_KV_LENGTHS) | {int(round(x)) for x in extra if x})
    return {acc: {str(l): float(inp.profile.phi_kv(acc, l)) * 8 / GBPS for l in ls}
            for acc in dict.fromkeys((inp.remote, inp.local))}


def _best(policy, inp, sz, step, latency):
    if policy == "prfaas":
        return best_prfaas(inp, sz.n_prfaas, sz.n_local, step, latency)
    if policy == "homogeneous":
        return best_homogeneous(inp, sz.n_local, latency)
    return naive(inp, sz.n_prfaas, sz.n_local, latency)


SUMMARY_KEYS = ("threshold", "n_p", "n_d", "lambda_max", "binding")


def plan_runs(runs, lengths=None, b_out_bps=None, step=DEFAULT_STEP_TOKENS, base_dir=None,
              latency=DEFAULT_LATENCY):
    """The planner's report for the runs of one experiment file (see `plan_file`).

    `policies` and `ratios` are the optima of the `latency` mode; `by_latency` gives every
    mode's own optimum (SUMMARY_KEYS) and ratios, so both predictions sit side by side."""
    check_latency(latency)
    sizings, warnings = policy_sizings(runs)
    by_mode = {mode: {} for mode in LATENCY_MODES}
    inputs = {}
    for pol, sz in sizings.items():
        if sz is None:
            for mode in LATENCY_MODES:
                by_mode[mode][pol] = None
            continue
        inp = inputs_for(sz.exp, lengths, b_out_bps, base_dir)
        inputs[pol] = inp
        for mode in LATENCY_MODES:
            row = _best(pol, inp, sz, step, mode)
            if row is not None:
                row = with_both_modes(row, inp, mode)
                row["origin"] = sz.origin
            by_mode[mode][pol] = row
        row = by_mode[latency][pol]
        if row is None:
            warnings.append(f"{pol}: {sz.n_prfaas} PrfaaS + {sz.n_local} local instances "
                            f"cannot run this policy")
        else:
            warnings.extend(egress_warnings(row, inp))
    policies = by_mode[latency]
    ref = inputs.get("prfaas") or next(iter(inputs.values()))
    l_long = (policies.get("prfaas") or {}).get("l_long")
    return {
        "latency": latency,
        "policies": policies,
        "ratios": _ratios(policies),
        "by_latency": {mode: {
            "policies": {pol: None if row is None else {k: row[k] for k in SUMMARY_KEYS}
                         for pol, row in rows.items()},
            "ratios": _ratios(rows)} for mode, rows in by_mode.items()},
        "phi_kv": {"unit": "Gbps per instance",
                   "by_accelerator": phi_kv_table(ref, [l_long] if l_long else [])},
        "b_out_gbps": ref.b_out_Bps * 8 / GBPS,
        "b_out_rule": "WAN kv-direction rate" if b_out_bps is None else "set by the caller",
        "wan_gbps": ref.wan_rate_bps / GBPS,
        "inputs": {"profile": ref.profile.name, "input": ref.lengths.label,
                   "mean_input": ref.lengths.mean, "l_out": ref.l_out,
                   "t_decode_s": ref.t_decode_s, "bs_max": ref.bs_max,
                   "threshold_step": step},
        "configured": [dict(predict(exp, lengths, b_out_bps, base_dir, latency),
                            label=exp.run_label) for exp in runs],
        "warnings": warnings,
    }


def _ratios(policies):
    lam = {k: (v or {}).get("lambda_max") for k, v in policies.items()}
    out = {}
    for other in ("homogeneous", "naive"):
        if lam.get("prfaas") and lam.get(other):
            out[f"prfaas/{other}"] = lam["prfaas"] / lam[other]
    return out


def plan_file(path, overrides=(), lengths=None, b_out_bps=None, step=DEFAULT_STEP_TOKENS,
              latency=DEFAULT_LATENCY):
    """Plan the three policies of one experiment file (`testbed plan FILE`)."""
    from testbed.config import load_experiment
    return plan_runs(load_experiment(path, overrides), lengths, b_out_bps, step,
                     base_dir=str(pathlib.Path(path).resolve().parent), latency=latency)


# ---------------------------------------------------------------- curves for the figures

def curves_vs_n_p(inp, n_prfaas, n_local, step=DEFAULT_STEP_TOKENS, latency=DEFAULT_LATENCY):
    """Per N_p (prfaas policy, best t for each): Lambda_max, prefill bound and decode bound."""
    g = _row_vector(split(inp, threshold_grid(inp.lengths, step), latency))
    n_p = np.arange(1, n_local, dtype=float)[:, None]
    q = evaluate(inp, n_prfaas, n_p, n_local - n_p, g["p"], g["l_long"], g["l_short"], g)
    prefill = np.minimum(q["bound_prfaas"], q["bound_pdp"]).max(axis=1)
    return {"n_p": n_p[:, 0].astype(int), "lambda_max": q["lambda_max"].max(axis=1),
            "prefill_bound": prefill, "decode_bound": q["theta_pdd"][:, 0]}


def curves_vs_threshold(inp, n_prfaas, n_p, n_d, step=DEFAULT_STEP_TOKENS,
                        latency=DEFAULT_LATENCY):
    """Per threshold t at a fixed split: the PrfaaS bound, PD-prefill bound, decode bound."""
    ts = threshold_grid(inp.lengths, step)
    sp = split(inp, ts, latency)
    q = evaluate(inp, n_prfaas, n_p, n_d, sp["p"], sp["l_long"], sp["l_short"], sp)
    return {"threshold": ts, "lambda_max": q["lambda_max"], "bound_prfaas": q["bound_prfaas"],
            "bound_pdp": q["bound_pdp"], "bound_pdd": q["bound_pdd"]}


__all__ = ["Phi_kv", "B_out_min", "Theta_prfaas", "Theta_pdp", "Theta_pdd", "Lambda_max",
           "LengthDistribution", "Inputs", "inputs_for", "evaluate", "best_prfaas",
           "best_homogeneous", "naive", "predict", "plan_file", "plan_runs", "policy_sizings",
           "split", "evaluate_config", "with_both_modes", "ROW_KEYS", "MODE_KEYS", "POLICIES",
           "LATENCY_MODES", "DEFAULT_LATENCY", "DEFAULT_STEP_TOKENS"]
