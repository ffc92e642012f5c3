"""The TTFT queueing model (testbed/plan/ttft.py) against closed forms and a simulated queue."""

import heapq
import math

import numpy as np
import pytest

from testbed import plan
from testbed.config import load_experiment
from testbed.plan import finite, ttft


def test_erlang_c_closed_forms():
    # M/M/2 at rho 0.5: C = 2 rho^2 / (1 + rho) = 1/3; M/M/1: C = rho.
    assert ttft.erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert ttft.erlang_c(1, 0.7) == pytest.approx(0.7)
    assert ttft.erlang_c(500, 400.0) < 1e-6


def test_single_server_is_pollaczek_khinchine():
    s = np.array([0.5, 1.0, 3.0])
    p = np.array([0.5, 0.3, 0.2])
    es, es2 = float(p @ s), float(p @ s ** 2)
    q = ttft.Queue(1, 0.4, es, es2)
    rho = 0.4 * es
    assert q.wait_mean == pytest.approx(0.4 * es2 / (2 * (1 - rho)))


def _simulate_fcfs(c, rate, service, n, rng):
    """Waits of n Poisson arrivals at one FCFS queue with c servers (the routing of the
    scheduler: each request to the server with the least remaining work)."""
    free = [0.0] * c
    t = 0.0
    waits = np.empty(n)
    for i in range(n):
        t += rng.exponential(1 / rate)
        start = max(t, heapq.heappop(free))
        waits[i] = start - t
        heapq.heappush(free, start + service(rng))
    return waits[n // 10:]


@pytest.mark.parametrize("c,rho", [(3, 0.7), (4, 0.85)])
def test_mmc_wait_against_simulation(c, rho):
    rng = np.random.default_rng(11)
    mean_s = 1.0
    rate = rho * c / mean_s
    waits = _simulate_fcfs(c, rate, lambda r: r.exponential(mean_s), 200_000, rng)
    q = ttft.Queue(c, rate, mean_s, 2 * mean_s ** 2)
    assert q.wait_mean == pytest.approx(waits.mean(), rel=0.06)
    for x in (0.5, 2.0):
        assert float(q.wait_cdf(x)) == pytest.approx((waits <= x).mean(), abs=0.02)


def _quickstart(policy):
    """(experiment, model inputs, Lambda_max in the E[T] form) of the quickstart's `policy`."""
    exp = next(r for r in load_experiment("experiments/quickstart.yaml")
               if r.scheduler.policy == policy)
    return exp, plan.inputs_for(exp), plan.predict(exp, latency="expected")["lambda_max"]


def test_quickstart_prediction_grows_with_load_and_saturates():
    exp, inp, lam = _quickstart("prfaas")
    c = exp.clusters
    rows = [ttft.predict_ttft(inp, "prfaas", exp.scheduler.threshold, c.prfaas.instances,
                              c.local.prefill, c.local.decode, f * lam,
                              exp.network.wan.direction("kv")["delay"])
            for f in (0.2, 0.5, 0.8)]
    p90 = [r["p90_ttft_ms"] for r in rows]
    assert p90 == sorted(p90) and p90[0] < p90[-1]
    for r in rows:
        assert r["median_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"]
        assert not r["saturated"]
    over = ttft.predict_ttft(inp, "prfaas", exp.scheduler.threshold, c.prfaas.instances,
                             c.local.prefill, c.local.decode, 1.3 * lam, 0.005)
    assert over["saturated"] and over["mean_ttft_ms"] is None


def test_kv_streaming_overlaps_prefill():
    # Transfer shorter than compute: the last piece after compute; longer: bandwidth-bound.
    assert ttft.kv_done_s(1.0, 10.0, 10, 100.0) == pytest.approx(1.0 + 0.01)
    assert ttft.kv_done_s(1.0, 1000.0, 10, 100.0) == pytest.approx(0.1 + 10.0)
    assert math.isinf(float(ttft.kv_done_s(np.array(1.0), 1.0, 1, 0.0)))


def test_plan_ttft_json(capsys):
    from testbed import cli
    import json
    assert cli.main(["plan", "experiments/quickstart.yaml", "--ttft", "--loads", "0.3,0.6",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ttft"]
    assert {r["policy"] for r in rows} == {"homogeneous", "naive", "prfaas"}
    for pol in ("homogeneous", "naive", "prfaas"):
        a, b = [r for r in rows if r["policy"] == pol]
        assert a["load"] == 0.3 and b["load"] == 0.6
        assert a["p90_ttft_ms"] < b["p90_ttft_ms"] and a["rate"] < b["rate"]
    with pytest.raises(SystemExit) as e:         # argparse: usage error, exit 2
        cli.main(["plan", "experiments/quickstart.yaml", "--ttft", "--loads", "x"])
    assert e.value.code == 2


# ---------------------------------------------------------------- finite-run corrections

def test_rbm_mean_ratio_is_the_integral_of_its_tail():
    # E[R(t)] = int_0^inf P(R(t) > z) dz, and E[R(inf)] = 1/2 (Abate and Whitt 1987).
    from scipy import integrate
    for t in (0.05, 0.5, 2.0, 8.0):
        mean, _ = integrate.quad(lambda z: float(finite.rbm_sf(z, t)), 0, np.inf)
        assert 2 * mean == pytest.approx(float(finite.rbm_mean_ratio(t)), rel=1e-6)
    assert float(finite.rbm_mean_ratio(1e-8)) == pytest.approx(0.0, abs=1e-3)
    assert float(finite.rbm_mean_ratio(50.0)) == pytest.approx(1.0, abs=1e-9)


def test_time_averaged_tail_and_mean_agree_and_tend_to_stationary():
    from scipy import integrate
    factors = [finite.mean_factor(t) for t in (0.3, 1.0, 3.0, 30.0)]
    assert factors == sorted(factors) and 0 < factors[0] and factors[-1] < 1
    assert finite.mean_factor(math.inf) == 1.0
    for t_c in (0.3, 3.0):      # the tail the percentiles use has the mean the mean uses
        z = np.linspace(0, 20, 20_001)
        area = integrate.trapezoid(finite.tail(z, t_c), z)
        assert 2 * area == pytest.approx(finite.mean_factor(t_c), rel=2e-3)
    z = np.linspace(0, 5, 11)
    assert np.allclose(finite.tail(z, 5e3), np.exp(-2 * z), atol=2e-3)
    assert np.allclose(finite.tail(z, math.inf), np.exp(-2 * z))


def _finite_waits(c, rate, service, horizon, runs, rng):
    """Waits of every request of `runs` runs: Poisson arrivals over [0, horizon] into an empty
    FCFS queue with c servers."""
    out = []
    for _ in range(runs):
        t = np.sort(rng.uniform(0, horizon, rng.poisson(rate * horizon)))
        free, waits = [0.0] * c, np.empty(t.size)
        for i, a in enumerate(t):
            start = max(a, heapq.heappop(free))
            waits[i] = start - a
            heapq.heappush(free, start + service(rng))
        out.append(waits)
    return np.concatenate(out)


@pytest.mark.parametrize("c,rho,horizon", [(1, 0.7, 50.0), (2, 0.8, 100.0), (4, 0.9, 100.0)])
def test_transient_mean_wait_against_simulated_finite_runs(c, rho, horizon):
    rng = np.random.default_rng(5)
    rate = rho * c
    waits = _finite_waits(c, rate, lambda r: r.exponential(1.0), horizon, 1500, rng)
    run = ttft.Queue(c, rate, 1.0, 2.0, horizon_s=horizon)
    stationary = ttft.Queue(c, rate, 1.0, 2.0)
    assert run.wait_mean == pytest.approx(waits.mean(), rel=0.08)
    assert abs(stationary.wait_mean / waits.mean() - 1) > 0.1     # the correction matters
    # The probability of waiting keeps its stationary value, while a run from empty waits
    # less often (0.35 against 0.30 no-wait at c=1, 0.26 against 0.21 at c=4): within 0.05,
    # and closer than the stationary CDF.
    for x in (0.5, 2.0, 5.0):
        sim = (waits <= x).mean()
        assert float(run.wait_cdf(x)) == pytest.approx(sim, abs=0.05)
        assert abs(float(run.wait_cdf(x)) - sim) < abs(float(stationary.wait_cdf(x)) - sim)


@pytest.mark.parametrize("n", [5, 17, 19, 24, 61, 200])
@pytest.mark.parametrize("q", [50, 90, 99])
def test_order_levels_reproduce_numpy_percentile_of_the_values(n, q):
    # F = the n values themselves (no queueing): the run's own percentile, exactly.
    x = np.sort(np.random.default_rng(n).lognormal(0, 1, n))
    inv = lambda p: x[min(max(math.ceil(p * n - 1e-12), 1), n) - 1]     # noqa: E731
    model = sum(w * inv(level) for level, w in finite.order_levels(q, n))
    assert model == pytest.approx(float(np.percentile(x, q)))


def test_order_levels_are_the_median_of_the_sample_percentile():
    rng = np.random.default_rng(2)
    n = 20
    p90 = np.percentile(rng.exponential(1.0, (40_000, n)), 90, axis=1)
    model = sum(w * -math.log(1 - level) for level, w in finite.order_levels(90, n))
    assert model == pytest.approx(float(np.median(p90)), rel=0.02)
    assert finite.order_levels(90, None) == [(0.9, 1.0)]
    (level, _), *_ = finite.order_levels(90, 100_001)
    assert level == pytest.approx(0.9, abs=1e-4)


def test_finite_run_prediction_below_stationary_and_tends_to_it():
    exp, inp, lam = _quickstart("naive")
    c = exp.clusters

    def at(run):
        return ttft.predict_ttft(inp, "naive", 0, c.prfaas.instances, 0, c.local.decode,
                                 0.85 * lam, 0.005, run=run)
    stationary, short = at(None), at(finite.Run(None, 120.0))
    long = at(finite.Run(None, 1e7))
    assert short["mean_ttft_ms"] < stationary["mean_ttft_ms"]
    assert short["p90_ttft_ms"] < stationary["p90_ttft_ms"]
    for key in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms"):
        assert long[key] == pytest.approx(stationary[key], rel=0.01)
