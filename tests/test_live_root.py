"""The live exporter scraped by a real Prometheus server (root; Debian's `prometheus` package).

The test starts Prometheus itself (loopback only, its own temporary directory, the repository's
dashboards/prometheus.yml with the exporter's port put in) and `testbed run --metrics PORT` of a
small experiment driven by the built-in client, lets Prometheus scrape it while it runs, then
queries Prometheus's HTTP API and compares with what the run's own analysis wrote afterwards:

- the TTFT histogram's _sum / _count against summary.json's mean_ttft_ms (within 1%);
- histogram_quantile(0.5) against median_ttft_ms: in the same bucket, at most 25% wide;
- the dashboard's egress query (dashboards/grafana.json, as written) against timeseries.csv's
  real-world egress over the window each sample covers (within 5%).

A second test does the same for a live `testbed up --load --metrics PORT` (the long-lived
deployment), driven by the built-in client (`--load`: the same 61 requests) and, at the same
time, through its forwarded OpenAI front door from the root namespace: the TTFT histogram and
the dashboard's egress query as above, the E2EL histogram's _sum / _count, and the
offload-share gauge against the records, then Ctrl-C and nothing left (the run, the forward,
the exporter and its port).

Prometheus is stopped by the test (SIGTERM to the PID it started, SIGKILL if it lingers).
"""

import bisect
import json
import pathlib
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest

from promserver import prometheus, query, scalar  # noqa: F401  (prometheus: a fixture)
from test_run_root import ROOT, TINY, leftovers, tb_cmd
from test_up_root import UP_TIMEOUT_S, _stream_completion, _wait_for_line, end_up, held_up
from testbed.live.state import EGRESS_WINDOW_S, RunState
from testbed.records import read_records

pytestmark = [pytest.mark.root, pytest.mark.slow]

# 61 requests (an odd number: the median is one request's TTFT) over ~15 s of the machine's clock
# (several 2 s scrapes while KV crosses the WAN).
OVERRIDES = ["requests=61", "scale.time=2"]
LOOKBACK = "10m"


def _samples(api, expr):
    """Raw samples of one series over the lookback: {unix time: value}."""
    res = query(api, f"{expr}[{LOOKBACK}]")     # raw samples, not a subquery
    assert len(res) == 1, f"{expr}: {len(res)} series"
    return {round(float(t), 3): float(v) for t, v in res[0]["values"]}


def _dashboard_expr(title):
    dash = json.loads((ROOT / "dashboards" / "grafana.json").read_text())
    panel = next(p for p in dash["panels"] if p["title"] == title)
    return panel["targets"][0]["expr"]


def _csv_egress(ts, end, window_s):
    """timeseries.csv's real-world KV egress (kv_egress_gbps, per 50 ms row), time-weighted over
    (the last row at or before end - window_s, end]: the window one exporter sample covers."""
    t = ts.time.tolist()
    j = bisect.bisect_right(t, end + 1e-6) - 1
    i = max(0, bisect.bisect_right(t, end - window_s + 1e-6) - 1)
    if j <= i:
        return None
    rows = ts.iloc[i + 1:j + 1]
    dt = ts.time.diff().iloc[i + 1:j + 1]
    return float((rows.kv_egress_gbps * dt).sum() / dt.sum())


def _last(metric, variant):
    return f'sum(last_over_time({metric}{{variant="{variant}"}}[{LOOKBACK}]))'


def _assert_ttft_histogram(api, variant, summary):
    """What Prometheus stored of the TTFT histogram against the run's analysis (summary.json):
    every completion counted, _sum / _count = mean TTFT within 1%, histogram_quantile(0.5) in
    the bucket (at most 25% wide) that holds the median. (mean s, q50 s, (lo, median s, hi))."""
    count = scalar(api, _last("vllm:time_to_first_token_seconds_count", variant))
    assert count == summary["completed"] > 0, "Prometheus's last scrape saw every completion"
    # TTFT mean: _sum / _count against the analysis (real-world ms there, seconds here)
    mean_s = scalar(api, _last("vllm:time_to_first_token_seconds_sum", variant)) / count
    assert mean_s * 1e3 == pytest.approx(summary["mean_ttft_ms"], rel=0.01)
    # the median: histogram_quantile lands in the bucket holding the run's median
    sel = f'vllm:time_to_first_token_seconds_bucket{{variant="{variant}"}}[{LOOKBACK}]'
    q50 = scalar(api, f"histogram_quantile(0.5, sum by (le) (last_over_time({sel})))")
    bounds = sorted(float(s["metric"]["le"]) for s in query(api, f"last_over_time({sel})")
                    if s["metric"]["le"] != "+Inf")
    median_s = summary["median_ttft_ms"] / 1e3
    k = bisect.bisect_left(bounds, median_s)
    lo, hi = bounds[k - 1], bounds[k]
    assert lo < median_s <= hi and lo <= q50 <= hi, (lo, median_s, q50, hi)
    assert hi / lo <= 1.25
    return mean_s, q50, (lo, median_s, hi)


def test_prometheus_scrapes_a_live_run(tmp_path, prometheus):
    api, port = prometheus
    out = tmp_path / "run"
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    r = subprocess.run(tb_cmd("run", str(TINY), "--out", str(out), "--no-probe", "--no-progress",
                              "--metrics", str(port), *sets),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not leftovers(out)
    summary = json.loads((out / "summary.json").read_text())
    live = json.loads((out / "live.json").read_text())
    assert live["code"] == 0, (out / "live.log").read_text()[-2000:]

    variant = summary["label"]
    mean_s, q50, (lo, median_s, hi) = _assert_ttft_histogram(api, variant, summary)
    compared, n = _assert_dashboard_egress(api, out, variant, summary)
    print(f"egress samples compared: {compared} of {n}; TTFT mean {mean_s * 1e3:.1f} ms"
          f" vs {summary['mean_ttft_ms']:.1f}; median {median_s * 1e3:.1f} ms in ({lo}, {hi}] s,"
          f" histogram_quantile {q50 * 1e3:.1f} ms; exporter CPU {live['cpu_s']} s")


def _assert_dashboard_egress(api, out, variant, summary):
    """The dashboard's egress query, sample by sample, against timeseries.csv's real-world
    egress over the window each sample covers (within 5%), on at least 3 samples taken while KV
    crossed the WAN. (samples compared, samples stored)."""
    ts = pd.read_csv(out / "timeseries.csv")
    expr = _dashboard_expr("WAN egress vs link rate (real-world)").replace(
        '=~"$experiment"', '="tiny"').replace('=~"$variant"', f'="{variant}"')
    assert "testbed_wan_egress_gbps" in expr
    values = _samples(api, expr.replace("}", ', direction="kv"}'))
    ends = _samples(api, f'testbed_wan_egress_window_end_seconds{{variant="{variant}", '
                         'direction="kv"}')
    compared = 0
    for t, v in values.items():
        want = _csv_egress(ts, ends[t], EGRESS_WINDOW_S) if t in ends else None
        if want is None or want < 0.01 * max(summary["egress_peak_gbps"], 1e-9):
            continue
        assert v == pytest.approx(want, rel=0.05), (t, ends[t], v, want)
        compared += 1
    assert compared >= 3, f"only {compared} egress samples while KV crossed the WAN"
    return compared, len(values)


# `testbed up --load`: the built-in client's 60 requests and, beside them, requests through the
# front door (local and, over tiny's 4Ki threshold, remote prefill), three at a time; 69 in all,
# an odd number, so the median is one request's TTFT.
UP_OVERRIDES = ["requests=60", "scale.time=2"]
UP_PROMPTS = [600, 900, 1500, 2500, 3500, 5000, 7000, 9000, 12000]
SCRAPED_TIMEOUT_S = 60       # Prometheus scrapes every 2 s; the exporter polls every 1 s


def _wait_scraped(api, variant, n):
    """Until Prometheus has stored a scrape that counts `n` completions (bounded)."""
    deadline = time.monotonic() + SCRAPED_TIMEOUT_S
    expr = _last("vllm:request_success_total", variant)
    while True:
        res = query(api, expr)
        if res and float(res[0]["value"][1]) >= n:
            return
        assert time.monotonic() < deadline, f"Prometheus saw {res} of {n} completions"
        time.sleep(0.5)


def test_prometheus_scrapes_a_live_up_driven_by_the_builtin_client(tmp_path, prometheus):
    """`testbed up --load --metrics`, driven by the built-in client and through the forwarded
    front door from this namespace while Prometheus scrapes; then Ctrl-C, and what Prometheus
    stored against the run's analysis."""
    api, port = prometheus
    out = tmp_path / "run"
    sets = [a for o in UP_OVERRIDES for a in ("--set", o)]
    with held_up(out, "--load", "--metrics", str(port), *sets) as (proc, q):
        url = _wait_for_line(q, r"forwarded:\s+(http://127\.0\.0\.1:\d+)/v1", UP_TIMEOUT_S)[1]
        model = _wait_for_line(q, r"model:\s+(\S+)", 5)[1]
        _wait_for_line(q, r"^up: ", 5)
        run = RunState(out)
        run.poll()
        variant = run.variant           # the label the exporter gives the deployment
        with ThreadPoolExecutor(3) as pool:
            streams = list(pool.map(lambda a: _stream_completion(url, model, *a),
                                    [(n, f"u{i}") for i, n in enumerate(UP_PROMPTS)]))
        assert all(s[-1] == "[DONE]" for s in streams)
        _wait_for_line(q, r"^load: the built-in client replayed 60 requests \(exit 0\)",
                       UP_TIMEOUT_S)
        n = 60 + len(UP_PROMPTS)
        _wait_scraped(api, variant, n)
        end_up(proc)
    # Torn down: the run, the forward, the exporter and its port.
    assert leftovers(out) == []
    live = json.loads((out / "live.json").read_text())
    assert live["code"] == 0, (out / "live.log").read_text()[-2000:]
    assert not pathlib.Path(f"/proc/{live['pid']}").exists()
    for p in (port, int(url.rsplit(":", 1)[1])):
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", p), timeout=2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["label"] == variant
    assert summary["completed"] == summary["requests"] == n
    sent, _ = read_records(out / "requests.jsonl")
    assert len(sent) == n       # the front door's ids follow the workload's: none overwritten
    mean_s, q50, (lo, median_s, hi) = _assert_ttft_histogram(api, variant, summary)
    compared, stored = _assert_dashboard_egress(api, out, variant, summary)
    # E2EL: _sum / _count against the analysis too.
    e2el_s = (scalar(api, _last("vllm:e2e_request_latency_seconds_sum", variant))
              / scalar(api, _last("vllm:e2e_request_latency_seconds_count", variant)))
    assert e2el_s * 1e3 == pytest.approx(summary["mean_e2el_ms"], rel=0.01)
    # A gauge: the offload share Prometheus stored last, against the routes the records hold.
    share = scalar(api, _last("testbed_offload_share", variant))
    assert 0 < summary["offload_fraction"] < 1
    assert share == pytest.approx(summary["offload_fraction"])
    print(f"up: TTFT mean {mean_s * 1e3:.1f} ms vs {summary['mean_ttft_ms']:.1f}; median "
          f"{median_s * 1e3:.1f} ms in ({lo}, {hi}] s, histogram_quantile {q50 * 1e3:.1f} ms; "
          f"E2EL {e2el_s * 1e3:.1f} vs {summary['mean_e2el_ms']:.1f} ms; offload share {share}; "
          f"egress samples compared {compared} of {stored}; exporter CPU {live['cpu_s']} s")
