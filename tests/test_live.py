"""The live exporter's state and metrics on a run directory written here (no root, no network).

The run directory is the tiny experiment's runtime.json (as the runner writes it), client
records, events and kernel-counter rows in the formats their writers use; the metrics are read
back from the exporter's registry and compared with what those files say, converted by hand.
"""

import csv
import json
import os

import pytest

from testbed import config, deploy
from testbed.live.exporter import BUCKET_RATIO, TOKEN_BUCKETS, TTFT_BUCKETS, Metrics, buckets
from testbed.live.state import EGRESS_WINDOW_S, RunState, Tail, Watch
from testbed.measure import CounterSampler

from promserver import prometheus  # noqa: F401  (a fixture)
from test_run_root import ROOT, TINY


def test_buckets_are_at_most_25_percent_wide_over_the_range():
    for b in (TTFT_BUCKETS, TOKEN_BUCKETS, buckets(0.01, 10.0)):
        assert all(1 < hi / lo <= 1.25 for lo, hi in zip(b, b[1:]))
    assert TTFT_BUCKETS[0] <= 0.005 and TTFT_BUCKETS[-1] >= 1800
    assert BUCKET_RATIO <= 1.25


def test_tail_returns_whole_lines_only(tmp_path):
    p = tmp_path / "f"
    t = Tail(p)
    assert t.lines() == []
    p.write_text("a\nb")
    assert t.lines() == ["a"]
    with open(p, "a") as f:
        f.write("c\nd\n")
    assert t.lines() == ["bc", "d"]


def _run_dir(tmp_path):
    exp = config.load_experiment(TINY)[0]
    dep = deploy.compile(exp)
    d = tmp_path / "run"
    d.mkdir()
    dep.runtime.dump(d / "runtime.json")
    return d, dep


def _records(d, t0):
    rows = [{"ev": "sent", "id": 1, "send_time": t0},
            {"ev": "sent", "id": 2, "send_time": t0},
            {"ev": "sent", "id": 3, "send_time": t0},
            {"ev": "done", "id": 1, "send_time": t0, "first_token": t0 + 0.1,
             "last_token": t0 + 0.4, "n_tokens": 4, "status": "ok", "route": "remote",
             "decode_instance": "ld0", "prefill_instance": "rp0",
             "token_times": [t0 + 0.09, t0 + 0.19, t0 + 0.29, t0 + 0.39], "cached_len": 0},
            {"ev": "done", "id": 2, "send_time": t0, "status": "failed", "error": "x",
             "n_tokens": 0, "route": "local"}]
    (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _timeseries(d, t0, scale, rate_bps):
    """Rows as CounterSampler writes them: 20 Hz, the KV direction at `rate_bps` (emulated)."""
    with open(d / "timeseries.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CounterSampler.COLUMNS)
        for k in range(41):
            t = t0 + k * 0.05
            row = {"time": t, "t_s": k * 0.05, "t_real_s": scale.real_s(k * 0.05), "read_s": 0,
                   "kv_tx_bytes": int(rate_bps / 8 * k * 0.05), "request_tx_bytes": 0,
                   "kv_link_gbps": 50.0, "request_link_gbps": 50.0, "kv_up": 1,
                   "request_up": 1, "kv_backlog_bytes": 3000, "kv_drops": 2}
            w.writerow([row.get(c, 0) for c in CounterSampler.COLUMNS])


def test_metrics_of_a_run_directory(tmp_path):
    d, dep = _run_dir(tmp_path)
    scale = dep.scale
    t0 = 1_000_000.0
    _records(d, t0)
    _timeseries(d, t0, scale, rate_bps=8e6)
    with open(d / "events.csv", "w") as f:
        f.write("time,kind,detail\n"
                f"{t0},health,instance=lp0 role=prefill state=down reason=timeout\n"
                f"{t0},fault_inject,fault=0 occurrence=0 fault_kind=pause target=lp0\n")
    m = Metrics()
    for run, done in Watch(d).poll():
        m.update(run, done)
    v = run.variant
    get = lambda name, **lab: m.registry.get_sample_value(name, {  # noqa: E731
        "experiment": "tiny", "variant": v, **lab})
    dec = {"instance": "ld0", "datacenter": "local", "role": "decode"}
    assert get("vllm:time_to_first_token_seconds_sum", **dec) == pytest.approx(
        scale.real_s(0.1))
    assert get("vllm:time_to_first_token_seconds_count", **dec) == 1
    assert get("vllm:e2e_request_latency_seconds_sum", **dec) == pytest.approx(scale.real_s(0.4))
    assert get("vllm:request_time_per_output_token_seconds_sum", **dec) == pytest.approx(
        scale.real_s(0.1))
    assert get("vllm:inter_token_latency_seconds_count", **dec) == 3
    assert get("testbed_first_token_lag_seconds_sum", **dec) == pytest.approx(
        scale.real_s(0.01))
    sched = {"instance": "scheduler", "datacenter": "local", "role": "scheduler"}
    assert get("testbed_requests_in_flight", **sched) == 1
    assert get("testbed_offload_share", **sched) == 0.5
    assert get("testbed_threshold_tokens", **sched) == 4096
    wan = {"instance": "wan", "datacenter": "prfaas", "role": "router", "direction": "kv"}
    # 8 Mbit/s emulated over the last second = 8e6 / (bytes x time) real-world
    assert get("testbed_wan_egress_gbps", **wan) == pytest.approx(
        scale.real_rate(8e6) / 1e9, rel=1e-3)
    assert get("testbed_wan_egress_window_end_seconds", **wan) == pytest.approx(t0 + 2.0)
    assert get("testbed_wan_backlog_bytes", **wan) == pytest.approx(scale.real_bytes(3000))
    assert get("testbed_wan_link_gbps", **wan) == 50.0
    assert get("testbed_instance_up", instance="lp0", datacenter="local",
               role="prefill") == 0
    assert get("testbed_instance_up", instance="ld0", datacenter="local",
               role="decode") == 1
    assert get("testbed_fault_active", instance="lp0", datacenter="", role="fault",
               fault="0", kind="pause", target="lp0") == 1
    assert get("testbed_instances", instance="prefill", datacenter="prfaas",
               role="prefill") == 1
    assert EGRESS_WINDOW_S == 2.0


def test_status_files_become_instance_gauges(tmp_path):
    d, _ = _run_dir(tmp_path)
    (d / "status").mkdir()
    (d / "status" / "ld0.json").write_text(json.dumps(
        {"time": 1.0, "role": "decode", "running": 3, "waiting": 2,
         "kv_reserved_real_bytes": 25.0, "kv_capacity_real_bytes": 100.0}))
    run = RunState(d)
    m = Metrics()
    m.update(run, run.poll())
    lab = {"experiment": "tiny", "variant": run.variant, "instance": "ld0",
           "datacenter": "local", "role": "decode"}
    assert m.registry.get_sample_value("vllm:num_requests_running", lab) == 3
    assert m.registry.get_sample_value("vllm:num_requests_waiting", lab) == 2
    assert m.registry.get_sample_value("vllm:kv_cache_usage_perc", lab) == 0.25


def test_dual_role_status_sample_and_its_gauges_follow_the_role_in_force(tmp_path):
    """A dual-role worker's status (workers/status.py): the role in force, both roles' queues
    summed and apart, its decode memory; the exporter keeps one series per instance, labelled
    with the role in force, across a conversion."""
    from types import SimpleNamespace as NS

    from workers.status import dualrole_sample

    pre = NS(active=True, waiting=2)
    dec = NS(batch=[1, 2, 3], waiting=[4], engine=NS(reserved=30.0, model=NS(kv_capacity=120)))
    worker = NS(role="prefill", pre=pre, dec=dec)
    st = dualrole_sample(worker)
    assert st == {"role": "prefill", "roles": ["prefill", "decode"], "running": 4, "waiting": 3,
                  "prefill": {"running": 1, "waiting": 2}, "decode": {"running": 3, "waiting": 1},
                  "kv_reserved_real_bytes": 30.0, "kv_capacity_real_bytes": 120.0}
    d, _ = _run_dir(tmp_path)
    (d / "status").mkdir()
    run, m = RunState(d), Metrics()
    lab = {"experiment": "tiny", "variant": None, "instance": "lp0", "datacenter": "local"}
    get = m.registry.get_sample_value
    for role, running in (("prefill", 4), ("converting", 0), ("decode", 2)):
        worker.role, pre.active, dec.batch = role, False, [0] * running
        (d / "status" / "lp0.json").write_text(json.dumps(dualrole_sample(worker)))
        m.update(run, run.poll())
        lab["variant"] = run.variant
        assert get("vllm:num_requests_running", {**lab, "role": role}) == running
        assert get("vllm:kv_cache_usage_perc", {**lab, "role": role}) == 0.25
    for gone in ("prefill", "converting"):
        assert get("vllm:num_requests_running", {**lab, "role": gone}) is None
        assert get("vllm:num_requests_waiting", {**lab, "role": gone}) is None


def test_exporter_process_serves_and_stops(tmp_path):
    import socket
    import urllib.request

    from testbed.errors import ConfigError
    from workers.status import STATUS_ENV
    from testbed.live.serve import Exporter

    d, _ = _run_dir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        with pytest.raises(ConfigError, match="in use"):
            Exporter.start(d, port)
    ex = Exporter.start(d, port)
    try:
        assert os.environ[STATUS_ENV] == "1"
        with urllib.request.urlopen(ex.url, timeout=10) as r:
            text = r.read().decode()
        assert 'testbed_emulation_speed{datacenter="local",experiment="tiny"' in text
    finally:
        ex.stop()
    assert STATUS_ENV not in os.environ
    live = json.loads((d / "live.json").read_text())
    assert live["code"] == 0 and live["cpu_s"] > 0


def _dashboard_queries():
    """Every PromQL expression of dashboards/grafana.json, with Grafana's variables put in as
    Grafana would for "All" (`allValue` .*) and a 2 s scrape (`$__rate_interval`: 4 scrapes):
    [(panel title, expr)]. The templating queries' `label_values(SELECTOR, label)` (a Grafana
    function) become their SELECTOR."""
    import re

    dash = json.loads((ROOT / "dashboards" / "grafana.json").read_text())
    fill = lambda e: (e.replace("$experiment", ".*").replace("$variant", ".*")  # noqa: E731
                      .replace("$__rate_interval", "8s"))
    out = [(p["title"], fill(t["expr"])) for p in dash["panels"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"])
        assert m, v["query"]
        out.append((f"variable {v['name']}", fill(m.group(1))))
    return out


def test_prometheus_stores_vllm_names_and_instance_labels(tmp_path, prometheus):
    """A real Prometheus (no run: the run directory written here) keeps vLLM's colons and the
    testbed's `instance` label, as the dashboard's queries expect; and every query of the
    dashboard (dashboards/grafana.json) is one this Prometheus evaluates, over metric names the
    exporter serves (Grafana itself is not packaged for Debian: docs/live.md)."""
    import re
    import time
    import urllib.request

    from promserver import query, scalar
    from testbed.live.serve import Exporter

    api, port = prometheus
    d, dep = _run_dir(tmp_path)
    _records(d, time.time())
    (d / "status").mkdir()
    (d / "status" / "ld0.json").write_text(json.dumps(
        {"time": 1.0, "role": "decode", "running": 1, "waiting": 0,
         "kv_reserved_real_bytes": 25.0, "kv_capacity_real_bytes": 100.0}))
    ex = Exporter.start(d, port)
    try:
        expr = 'vllm:time_to_first_token_seconds_count{instance="ld0", role="decode"}'
        deadline = time.monotonic() + 30
        while True:
            try:
                assert scalar(api, expr) == 1
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        ex.stop()
    with urllib.request.urlopen(f"{api}/label/__name__/values", timeout=30) as r:
        stored = set(json.loads(r.read())["data"])
    declared = {fam.name for fam in Metrics().registry.collect()}     # the exporter's families
    unserved = {"testbed_fault_active", "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_queries_total"}
    for title, expr in _dashboard_queries():
        query(api, expr)                    # it parses and evaluates (status success)
        names = set(re.findall(r"(?:vllm:|testbed_)[a-z_:]+", expr))
        bases = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in names}
        assert names and bases <= declared, (title, bases - declared)
        # served only once there is one: an injected fault, a prefix-cache lookup
        assert names - stored <= unserved, (title, names - stored)
        if "rate(" not in expr and not names & unserved:
            assert query(api, expr), (title, expr)     # a gauge: the dashboard shows a line


def test_a_variant_forgotten_serves_no_series(tmp_path):
    from prometheus_client import generate_latest

    d, dep = _run_dir(tmp_path)
    _records(d, 1_000_000.0)
    run = RunState(d)
    m = Metrics()
    m.update(run, run.poll())
    assert f'variant="{run.variant}"' in generate_latest(m.registry).decode()
    m.forget(run.variant)
    assert f'variant="{run.variant}"' not in generate_latest(m.registry).decode()


def test_a_stopped_exporter_serves_its_last_poll_to_one_more_scrape(tmp_path):
    """The run's last completions, written after the scraper's last look, still reach it: once
    stopped, the exporter polls again and waits (bounded) for one scrape of that state."""
    import re
    import socket
    import threading
    import time
    import urllib.request

    from testbed.live.exporter import FINAL_SCRAPE_S, serve

    d, _ = _run_dir(tmp_path)
    t0 = time.time()
    _records(d, t0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = threading.Event()
    ended = []
    th = threading.Thread(target=lambda: ended.append((serve(d, port, poll_s=60.0, stop=stop),
                                                       time.monotonic())))
    th.start()

    def ttft_count(wait_s=0.0):
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return sum(float(v) for v in re.findall(
            r"^vllm:time_to_first_token_seconds_count\{[^}]*\} (\S+)$", text, re.M))

    try:
        assert ttft_count(wait_s=10) == 1       # request 1 ok, request 2 failed
        with open(d / "requests.jsonl", "a") as f:      # the run's last completion
            f.write(json.dumps({"ev": "done", "id": 3, "send_time": t0, "first_token": t0 + 0.2,
                                "last_token": t0 + 0.3, "n_tokens": 2, "status": "ok",
                                "route": "local", "decode_instance": "ld0"}) + "\n")
        stop.set()          # no poll comes later than the final one
        counts = [ttft_count()]
        while counts[-1] < 2:       # a scraper's interval (shortened): refused if it had ended
            time.sleep(0.3)
            counts.append(ttft_count())
        assert counts[-1] == 2, counts
    finally:
        stop.set()
        th.join(timeout=FINAL_SCRAPE_S + 10)
    assert not th.is_alive() and ended
