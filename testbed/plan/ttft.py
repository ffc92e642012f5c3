"""A TTFT model beside the capacity model: the queueing prediction of TTFT mean, p50 and p90 at
an offered load, per policy (beyond the paper, which predicts throughput only).

Part of `testbed.plan`; real-world seconds and bytes, like the rest of the package. One
request's TTFT is the sum of the legs the emulated system has:

    TTFT(L) = W_stage + T_prefill(L) + [remote only: 2 d + X(L)] + W_decode + T_step

- **Prefill queues, M/G/c.** Each prefill cluster the policy uses (PrfaaS for L > t, local PD
  for L <= t; all local for homogeneous PD, all PrfaaS for naive) is one queue with c = its
  instance count. Routing each request to the instance with the least remaining work is the
  same as one FCFS queue in front of c servers, so the stage is M/G/c as long as the
  predictions are the real service times (they are: the profile engine waits exactly the
  profile). The scheduler routes by least *assigned* work instead (`workers/policy.py`: an
  instance's `outstanding_s` holds the full predicted time of the request in service until it
  ends), which waits longer; docs/planner.md measures by how much.
  Service S = T_prefill(L) over the stage's conditional length mix, with E[S] and the squared
  coefficient of variation C_s^2 from the same probability mass the planner uses.
  The mean wait is the Allen-Cunneen approximation
      W_q = C(c, a) E[S] / (c - a) * (C_a^2 + C_s^2) / 2,    a = lambda_s E[S],
  with C(c, a) the Erlang C probability of waiting (exact for M/M/c) and C_a^2 = 1 for Poisson
  arrivals (the arrival process's own C_a^2 otherwise). For percentiles the wait is taken as
  0 with probability 1 - C and exponential with mean W_q / C otherwise (the M/M/c form).
- **Prefill** T_prefill(L), the profile's fit (the same function the workers wait).
- **KV transfer** (remote requests): the request crosses the WAN (one-way delay d), the KV comes
  back (d again). The KV streams layer by layer in n = `stream_chunks` pieces as prefill runs,
  piece i ready at (i+1)/n of T; it is done at max(T + S/(n B), T/n + S/B) with S = S_kv(L)
  and B the egress rate each transfer gets: B_out (1 - rho_link), the processor-sharing
  slowdown of a link that concurrent transfers share fairly, rho_link = lambda_remote
  E[S_kv] / B_out.
- **Decode admission** W_decode: M/M/c over the N_d * BS_max decode slots, service L_out
  T_step; near zero below decode saturation (decode memory limits are not modelled).
- **First step** T_step: one decode step at the batch Little's law gives per instance
  (lambda L_out T_step / N_d, solved by fixed-point iteration).
- **One finite run** (`finite.Run`, testbed/plan/finite.py; `predict_for` always passes the
  run's): its requests arrive over a horizon T into empty queues, so every wait is the
  time average of the transient from empty (a reflected Brownian motion started at 0) rather
  than the stationary one; and its percentiles are sample percentiles of n requests (the
  medians of the order statistics numpy's percentile interpolates), not F^-1(p).

What it does not model (where a measurement will differ): bursty or correlated arrivals beyond
C_a^2 (a trace's bursts), heavy-tailed M/G/c waits (Allen-Cunneen is a two-moment
approximation, weakest at high C_s^2 and few servers), the run-to-run spread of a run's waits
(they come in busy periods: the model gives the p90 of all runs pooled, above the median
run's), the transient of the probability of waiting, TCP slow start and loss recovery on
the WAN, the prefix cache (L is the uncached length), role conversion and the adaptive
threshold (the configured threshold is used), and the emulation's own timer lateness.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from testbed.plan import finite

APPROXIMATION = ("M/G/c per prefill stage (Allen-Cunneen mean wait, Erlang C probability of "
                 "waiting, exponential conditional wait; over a finite run from empty queues "
                 "the RBM transient's time average, and sample percentiles of n requests), "
                 "layer-wise KV streaming over a processor-sharing WAN, M/M/c decode "
                 "admission over N_d*BS_max slots")
QUANTILES = {"median_ttft_ms": 50, "p90_ttft_ms": 90, "p99_ttft_ms": 99}
QUANTILE_TOL_S = 1e-6           # the bisection stops this close (a microsecond of TTFT)


def erlang_c(c: int, a: float) -> float:
    """P(wait > 0) in M/M/c with c servers and offered load a = lambda E[S] (Erlangs), a < c.

    Erlang B by its stable recursion, then C = B / (1 - (a / c)(1 - B))."""
    if a <= 0:
        return 0.0
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1.0 - rho * (1.0 - b))


@dataclasses.dataclass(frozen=True)
class Queue:
    """One M/G/c stage: c servers, arrivals at `rate` (1/s), service moments (s, s^2)."""

    servers: int
    rate: float
    mean_s: float
    second_s2: float            # E[S^2]
    arrival_scv: float = 1.0    # C_a^2: 1 for Poisson arrivals
    horizon_s: float = math.inf  # arrivals span [0, T] into an empty queue (finite.py); inf:
                                 # the stationary queue

    @property
    def offered(self) -> float:
        return self.rate * self.mean_s

    @property
    def utilisation(self) -> float:
        return self.offered / self.servers if self.servers else math.inf

    @property
    def service_scv(self) -> float:
        if self.mean_s <= 0:
            return 0.0
        return max(self.second_s2 / self.mean_s ** 2 - 1.0, 0.0)

    @property
    def stable(self) -> bool:
        return self.rate <= 0 or self.utilisation < 1.0

    @property
    def p_wait(self) -> float:
        return erlang_c(self.servers, self.offered) if self.rate > 0 else 0.0

    @property
    def stationary_wait_mean(self) -> float:
        """Allen-Cunneen W_q (seconds) of the stationary queue; inf when saturated."""
        if self.rate <= 0:
            return 0.0
        if not self.stable:
            return math.inf
        mmc = self.p_wait * self.mean_s / (self.servers - self.offered)
        return mmc * (self.arrival_scv + self.service_scv) / 2.0

    @property
    def canonical_horizon(self) -> float:
        """The horizon in the canonical time of the stage's RBM (finite.py); inf: stationary."""
        return finite.canonical_horizon(self.horizon_s, self.utilisation, self.mean_s,
                                        self.servers, self.arrival_scv + self.service_scv)

    @property
    def wait_mean(self) -> float:
        """Mean wait (seconds) of the requests arriving over the horizon; inf when saturated."""
        w = self.stationary_wait_mean
        if w <= 0 or not math.isfinite(w):
            return w
        return w * finite.mean_factor(self.canonical_horizon)

    def wait_cdf(self, y):
        """P(W <= y) over the horizon's arrivals, y an array of seconds (0 below 0): no wait
        with probability 1 - C, else 2 theta R, R the time-averaged transient RBM (finite.py;
        exponential with mean theta when stationary)."""
        y = np.asarray(y, dtype=float)
        c, w = self.p_wait, self.stationary_wait_mean
        if c <= 0 or w <= 0:
            return np.where(y >= 0, 1.0, 0.0)
        theta = w / c                   # stationary mean wait of those who wait
        waited = finite.tail(np.maximum(y, 0.0) / (2.0 * theta), self.canonical_horizon)
        return np.where(y >= 0, 1.0 - c * waited, 0.0)


@dataclasses.dataclass(frozen=True)
class Branch:
    """Requests that take one path: their share, lengths (pmf) and fixed legs d(L) (s)."""

    name: str
    share: float
    probs: np.ndarray           # conditional pmf over `fixed`'s lengths
    fixed: np.ndarray           # every leg but the prefill queue's wait, per length
    queue: Queue


def _side(lengths, threshold, above):
    """(values, conditional pmf, share) of L > t (above) or L <= t."""
    v, p = lengths.values, lengths.probs
    mask = v > threshold if above else v <= threshold
    share = float(p[mask].sum())
    if share <= 0:
        return v[:0], p[:0], 0.0
    return v[mask], p[mask] / share, share


def _queue(servers, rate, values, probs, t_fn, arrival_scv, horizon_s):
    s = np.asarray(t_fn(values), dtype=float)
    return Queue(servers, rate, float(probs @ s), float(probs @ s ** 2), arrival_scv,
                 horizon_s), s


def kv_done_s(t_prefill, s_kv, chunks, rate_Bps):
    """When the last KV byte has left: streaming in `chunks` pieces as prefill runs."""
    if rate_Bps <= 0:
        return np.full_like(np.asarray(t_prefill, dtype=float), math.inf)
    n = max(int(chunks), 1)
    return np.maximum(t_prefill + s_kv / (n * rate_Bps), t_prefill / n + s_kv / rate_Bps)


def _decode(n_d, bs_max, rate, l_out, step_fn, horizon_s=math.inf):
    """(admission wait mean, first step seconds): M/M/c over the decode slots, Little's law."""
    step = step_fn(1.0)
    for _ in range(20):             # fixed point: batch = lambda L_out T_step / N_d
        batch = min(max(rate * l_out * step / max(n_d, 1), 1.0), float(bs_max))
        step = step_fn(batch)
    q = Queue(max(int(n_d * bs_max), 1), rate, l_out * step, (l_out * step) ** 2,
              horizon_s=horizon_s)
    return (q.wait_mean if q.stable else math.inf), step, q


def branches(inp, policy, threshold, n_prfaas, n_p, rate, delay_s, arrival_scv=1.0,
             horizon_s=math.inf):
    """The paths requests take under `policy` at arrival rate `rate` (requests/s), arriving
    over `horizon_s` into empty queues (inf: stationary)."""
    lengths = inp.lengths
    if policy == "homogeneous":
        t_cut = math.inf
    elif policy == "naive":
        t_cut = -math.inf
    else:
        t_cut = float(threshold)
    out = []
    lv, lp, lshare = _side(lengths, t_cut, above=False)
    if lshare > 0:
        q, s = _queue(n_p, rate * lshare, lv, lp, inp.t_local, arrival_scv, horizon_s)
        out.append(Branch("local", lshare, lp, s, q))
    rv, rp, rshare = _side(lengths, t_cut, above=True)
    if rshare > 0:
        q, s = _queue(n_prfaas, rate * rshare, rv, rp, inp.t_remote, arrival_scv, horizon_s)
        s_kv = np.asarray(inp.s_kv(rv), dtype=float)
        rho_link = rate * rshare * float(rp @ s_kv) / inp.b_out_Bps if inp.b_out_Bps else math.inf
        per_transfer = inp.b_out_Bps * max(1.0 - rho_link, 0.0)
        done = kv_done_s(s, s_kv, inp.profile.stream_chunks, per_transfer)
        out.append(Branch("prfaas", rshare, rp, 2.0 * delay_s + done, q))
    return out


def _quantile(branch_list, extra_s, level):
    """The TTFT mixture's quantile at probability `level` (0-1), by bisection on its CDF."""
    def cdf(x):
        return sum(b.share * float(b.probs @ b.queue.wait_cdf(x - extra_s - b.fixed))
                   for b in branch_list)
    lo = 0.0
    hi = max(float(b.fixed.max()) + extra_s + 50.0 * max(b.queue.wait_mean, 1e-3)
             for b in branch_list)
    target = level
    while cdf(hi) < target:
        hi *= 2.0
    while hi - lo > QUANTILE_TOL_S:
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if cdf(mid) < target else (lo, mid)
    return hi


def predict_ttft(inp, policy, threshold, n_prfaas, n_p, n_d, rate, delay_s, step_fn=None,
                 arrival_scv=1.0, run=None) -> dict:
    """TTFT mean and percentiles (ms) at arrival rate `rate`, and each stage's load.

    `inp`: `testbed.plan.Inputs`; `delay_s`: the WAN's one-way delay; `step_fn(batch)`: seconds
    of a decode step at that batch (default: the profile's T_decode, batch-independent);
    `run`: a `finite.Run` (n requests over a horizon, from empty queues) to predict what that
    run measures, else the stationary population's TTFT.
    Saturated stages give None for the TTFT numbers and name the stage in `saturated`."""
    step_fn = step_fn or (lambda batch: inp.t_decode_s)
    run = run or finite.Run()
    paths = branches(inp, policy, threshold, n_prfaas, n_p, rate, delay_s, arrival_scv,
                     run.horizon_s)
    w_dec, step, dq = _decode(n_d, inp.bs_max, rate, inp.l_out, step_fn, run.horizon_s)
    stages = {b.name: {"servers": b.queue.servers, "utilisation": b.queue.utilisation,
                       "share": b.share, "wait_mean_ms": b.queue.wait_mean * 1e3,
                       "service_scv": b.queue.service_scv} for b in paths}
    stages["decode"] = {"servers": dq.servers, "utilisation": dq.utilisation,
                        "wait_mean_ms": w_dec * 1e3, "step_ms": step * 1e3}
    saturated = [name for name, st in stages.items() if st["utilisation"] >= 1.0]
    out = {"rate": rate, "approximation": APPROXIMATION, "arrival_scv": arrival_scv,
           "requests": run.requests, "horizon_s": run.horizon_s if math.isfinite(
               run.horizon_s) else None, "stages": stages, "saturated": saturated}
    if saturated or not paths:
        out.update({"mean_ttft_ms": None, **{key: None for key in QUANTILES}})
        return out
    extra = w_dec + step
    mean = sum(b.share * (b.queue.wait_mean + float(b.probs @ b.fixed)) for b in paths) + extra
    out["mean_ttft_ms"] = mean * 1e3
    for key, q in QUANTILES.items():
        out[key] = sum(w * _quantile(paths, extra, level)
                       for level, w in finite.order_levels(q, run.requests)) * 1e3
    return out


def arrival_moments(times) -> tuple[float, float]:
    """(rate, C_a^2) of arrival times (seconds): n-1 gaps over the span, and the gaps' squared
    coefficient of variation (1 for Poisson arrivals, more for bursty ones)."""
    t = np.sort(np.asarray(times, dtype=float))
    if t.size < 3 or t[-1] <= t[0]:
        return math.nan, 1.0
    gaps = np.diff(t)
    return float(gaps.size / (t[-1] - t[0])), float(gaps.var() / gaps.mean() ** 2)


def run_of(exp, arrival_times, rate=None) -> finite.Run:
    """The run a request list makes: its n requests over its arrival span. At another `rate`,
    a run bounded by `duration` keeps that horizon (n = rate x duration, capped by
    `requests`), one bounded by its request count keeps n (horizon n / rate)."""
    t = np.asarray(arrival_times, dtype=float)
    if rate is None:
        span = float(t.max() - t.min()) if t.size >= 2 else math.inf
        return finite.Run(int(t.size), span if span > 0 else math.inf)
    if rate <= 0:
        return finite.Run()
    if exp.duration is not None:
        n = rate * float(exp.duration)
        n = min(n, exp.requests) if exp.requests else n
        return finite.Run(max(int(round(n)), 1), n / rate)
    return finite.Run(int(t.size), t.size / rate)


def predict_for(exp, inp, arrival_times, rate=None) -> dict:
    """`predict_ttft` for one experiment as configured: its policy, threshold and cluster
    sizes, the WAN's kv-direction delay, the decode step model at the mean context, the
    arrival rate and C_a^2 of `arrival_times` (the request list it sends; `rate` overrides
    the rate, keeping the burstiness), and that run's size and horizon (`run_of`): the
    prediction is of what the run measures, its transient and its sample percentiles."""
    measured, scv = arrival_moments(arrival_times)
    run = run_of(exp, arrival_times, rate)
    rate = measured if rate is None else float(rate)
    c, pol = exp.clusters, exp.scheduler.policy
    decode = exp.decode_model()
    context = inp.lengths.mean + inp.l_out / 2

    def step_fn(batch):
        return decode.step_time(batch, batch * context)

    out = predict_ttft(inp, pol, exp.scheduler.threshold,
                       0 if pol == "homogeneous" else c.prfaas.instances, c.local.prefill,
                       c.local.decode, rate, float(exp.network.wan.direction("kv")["delay"]),
                       step_fn, scv, run)
    return out
