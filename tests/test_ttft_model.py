"""The TTFT queueing model (testbed/plan/ttft.py) against closed forms and a simulated queue."""

import heapq
import math

import numpy as np
import pytest

from testbed import plan
from testbed.config import load_experiment
from testbed.plan import ttft


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


def test_quickstart_prediction_grows_with_load_and_saturates():
    exp = next(r for r in load_experiment("experiments/quickstart.yaml")
               if r.scheduler.policy == "prfaas")
    inp = plan.inputs_for(exp)
    lam = plan.predict(exp, latency="expected")["lambda_max"]
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
