"""Finite-run corrections of the TTFT model: what one measured run of n requests, arriving over
a horizon of T seconds into empty queues, shows that a stationary queue does not.

Part of `testbed.plan`, used by `testbed.plan.ttft`; pure mathematics, no run data. Neither
correction has a constant fitted to measurements; both vanish as T and n grow.

- **Transient from empty queues.** A run starts with every queue empty, and its arrivals
  stop at T. The stationary wait is the limit t -> inf; a request arriving at t < inf waits
  less on average. We take the heavy-traffic (diffusion) picture of the stage: its waiting
  time is a reflected Brownian motion (RBM) with drift -(1 - rho) and variance
  rho E[S] (C_a^2 + C_s^2) / c per second (the c servers pooled into one of rate c, in
  seconds of that pooled server's work), which has the stationary mean of Kingman's formula.
  In canonical units (drift -1, variance 1) time is t_c = t (1 - rho)^2 c /
  (rho E[S] (C_a^2 + C_s^2)), and for an RBM R started at 0 (Abate and Whitt, "Transient
  behavior of regulated Brownian motion, I: starting at the origin", Adv. Appl. Prob. 19, 1987)

      P(R(t) > z)        = Phi_c((z + t) / sqrt t) + exp(-2 z) Phi_c((z - t) / sqrt t)
      E[R(t)] / E[R(inf)] = H1(t) = 1 - 2 [(1 + t) Phi_c(sqrt t) - sqrt t phi(sqrt t)]

  (E[R(inf)] = 1/2, R(inf) exponential). Poisson arrivals of a run are uniform over [0, T],
  so the requests of the run see the time average over [0, T_c] of the transient: the mean
  wait is W_inf * (1/T_c) int_0^T_c H1, and the conditional wait of those who wait is
  2 theta R(U), U uniform on [0, T_c], theta their stationary mean wait (exponential in the
  limit, the M/M/c form the model takes). The probability of waiting is left at its
  stationary value: whether all c servers are busy relaxes within a few service times,
  the queue behind them over the much longer RBM time scale.
  Assumptions: a queue that starts empty (the testbed starts every run so) and heavy-traffic
  scaling; the diffusion approaches its limit faster than a queue whose service times are
  heavy-tailed (C_s^2 >> 1), so there it corrects too little.
- **Sample quantiles.** A run's p-th percentile is numpy's: the order statistics j and j + 1
  (h = (n - 1) p / 100, j = floor(h)) interpolated with weight g = h - j. The k-th order
  statistic of n draws from F is F^-1 of a Beta(k, n + 1 - k) variable, so its median is
  exactly F^-1(median of Beta(k, n + 1 - k)); the model interpolates those two medians the
  same way. For a small run this is not F^-1(p): with n = 19 the p90 sits between the 17th and
  18th of 19 values, where F^-1(0.9) is the 18th. With F the run's own lengths (no queueing)
  it reproduces the measured percentile exactly; as n grows it tends to F^-1(p).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from scipy import special

@dataclasses.dataclass(frozen=True)
class Run:
    """What one run measures over: `requests` (n, None: the population's quantiles) arriving
    over `horizon_s` seconds into empty queues (inf: the stationary queue)."""

    requests: int | None = None
    horizon_s: float = math.inf


STATIONARY_TC = 1e4         # canonical horizons beyond this are the stationary limit (1e-4)
TAIL_Z_MAX = 20.0           # canonical waits tabulated up to here: P(R > 20) <= e^-40
TAIL_POINTS = 801


def _norm_pdf(x):
    """The standard normal density, as scipy.stats.norm.pdf computes it. This module uses
    scipy.special's ndtr (the CDF; sf(x) = ndtr(-x)) and betaincinv (Beta quantiles), the
    functions scipy.stats' norm and beta call, bit for bit, without importing scipy.stats: a
    second of CPU in every run's orchestrator (docs/performance.md)."""
    return np.exp(-x**2 / 2.0) / np.sqrt(2 * np.pi)


def rbm_sf(z, t):
    """P(R(t) > z) for canonical RBM (drift -1, variance 1) started at 0, z >= 0, t > 0."""
    z = np.asarray(z, dtype=float)
    r = np.sqrt(t)
    return special.ndtr(-(z + t) / r) + np.exp(-2.0 * z) * special.ndtr(-(z - t) / r)


def rbm_mean_ratio(t):
    """H1(t) = E[R(t)] / E[R(inf)] for canonical RBM started at 0 (Abate and Whitt 1987)."""
    t = np.asarray(t, dtype=float)
    r = np.sqrt(t)
    return 1.0 - 2.0 * ((1.0 + t) * special.ndtr(-r) - r * _norm_pdf(r))


def canonical_horizon(horizon_s, rho, mean_s, servers, scv_sum):
    """T in the canonical time of the stage's RBM (module docstring); inf for an infinite
    horizon or a stage with no variability."""
    if not math.isfinite(horizon_s) or rho <= 0 or mean_s <= 0 or scv_sum <= 0:
        return math.inf
    return horizon_s * (1.0 - rho) ** 2 * servers / (rho * mean_s * scv_sum)


@functools.lru_cache(maxsize=256)
def mean_factor(t_c):
    """(1/T_c) int_0^T_c H1: the run's mean wait over the stationary one (1 at inf)."""
    if t_c >= STATIONARY_TC:
        return 1.0
    if t_c <= 0:
        return 0.0
    from scipy import integrate     # reason: only a finite horizon integrates; 0.2 s of import
    # t = s^2 takes the sqrt(t) start of H1 out of the integrand.
    val, _ = integrate.quad(lambda s: 2.0 * s * float(rbm_mean_ratio(s * s)), 0.0,
                            math.sqrt(t_c))
    return val / t_c


@functools.lru_cache(maxsize=256)
def _tail_table(t_c):
    """(z grid, log of (1/T_c) int_0^T_c P(R(t) > z) dt) for canonical waits z."""
    from scipy import integrate     # reason: only a finite horizon integrates; 0.2 s of import
    z = np.linspace(0.0, TAIL_Z_MAX, TAIL_POINTS)
    avg, _ = integrate.quad_vec(lambda s: 2.0 * s * rbm_sf(z, max(s * s, 1e-300)), 0.0,
                                math.sqrt(t_c))
    avg = np.clip(avg / t_c, 1e-300, 1.0)
    avg[0] = 1.0                # every R(t), t > 0, is positive
    return z, np.log(avg)


def tail(z, t_c):
    """The time-averaged P(R > z) over a canonical horizon t_c (e^-2z at inf), z an array."""
    z = np.maximum(np.asarray(z, dtype=float), 0.0)
    if t_c >= STATIONARY_TC:
        return np.exp(-2.0 * z)
    if t_c <= 0:
        return np.where(z > 0, 0.0, 1.0)
    grid, log_avg = _tail_table(float(t_c))
    # Beyond the table the average falls at least as fast as the stationary e^-2z.
    slope = -2.0
    return np.exp(np.where(z <= grid[-1], np.interp(z, grid, log_avg),
                           log_avg[-1] + slope * (z - grid[-1])))


def order_levels(q, n):
    """[(probability level, weight)] of the run's q-th percentile (0-100) of n requests: the
    medians of the order statistics numpy's percentile interpolates; [(q/100, 1)] without n."""
    if n is None or n < 2:
        return [(q / 100.0, 1.0)]
    h = (n - 1) * q / 100.0
    j = min(int(math.floor(h)), n - 1)
    g = h - j
    levels = [(float(special.betaincinv(j + 1, n - j, 0.5)), 1.0 - g)]   # Beta's median
    if g > 0 and j + 2 <= n:
        levels.append((float(special.betaincinv(j + 2, n - j - 1, 0.5)), g))
    return levels
