"""The Prometheus endpoint of a run: vLLM's metric names where the concept is the same.

A process of its own (`python -m testbed.live.exporter --dir TOP --port PORT`), started beside the
orchestrator by `testbed run --metrics PORT` / `testbed up --metrics PORT` (testbed/live/serve.py).
It tails the run directory (`testbed.live.state.Watch`, every `--poll` seconds) and serves what
it read with prometheus_client on 127.0.0.1:PORT of the root namespace. No forwarding is needed:
the orchestrator runs in the root namespace and the run directory is on its file system (the Ray
backend mirrors the remote hosts' files there every 50 ms), so the exporter reaches nothing
inside the emulated network, and nothing inside it reaches the exporter. A process, not a thread
of the orchestrator: its JSON parsing never holds the GIL that the 20 Hz counter sampler needs.

Values are real-world: the run's `Scale` converts emulated times, rates and bytes back, and every
help text says so. Prometheus's `rate()` divides by the machine's seconds, which are emulated
ones, so rates are published as gauges already in real-world units (`testbed_wan_egress_gbps`).
Every sample has the labels experiment, variant, instance, datacenter and role (a request's
instance is the decode instance that streamed it; the WAN's is `wan`, its datacenter the sending
one). The histograms' buckets are 24% wide (`BUCKET_RATIO`): vLLM's jump from 1 s to 2.5 s.
"""

from __future__ import annotations

import argparse
import http.server
import math
import signal
import sys
import threading
import time

import numpy as np
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Gauge
from prometheus_client import generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from testbed.live.state import DIRECTION_DC, DIRECTIONS, EGRESS_WINDOW_S, Watch

LABELS = ("experiment", "variant", "instance", "datacenter", "role")
BUCKET_RATIO = 1.24        # each bucket < 25% wide; fewer samples per scrape than 1.2
REAL = "Real-world (the emulation's scale converted back)."
# A variant that ended is served this long (wall seconds), then dropped: Prometheus keeps what
# it scraped, and rendering every earlier variant at each scrape was most of the exporter's CPU.
RETAIN_S = 30.0
# At the end, one more scrape is awaited this long (dashboards/prometheus.yml scrapes every 2 s).
FINAL_SCRAPE_S = 5.0


def buckets(lo_s, hi_s, ratio=BUCKET_RATIO):
    """Geometric bucket bounds from `lo_s` to at least `hi_s`, each `ratio` times the last
    (rounded to 4 significant digits, so each bucket stays within `ratio` of its lower bound)."""
    out, b = [], lo_s
    while b < hi_s * ratio:
        out.append(float(f"{b:.4g}"))
        b *= ratio
    return out


TTFT_BUCKETS = buckets(0.005, 1800.0)
TOKEN_BUCKETS = buckets(0.0002, 30.0)


class Histogram:
    """A labelled histogram family kept as numpy bucket counts and served through
    prometheus_client's `HistogramMetricFamily`: a request's thousand token gaps are one
    `searchsorted`, not a thousand `Histogram.observe` calls (each a lock and a linear scan of
    the bounds: most of the exporter's CPU before). Same exposition, same `le` strings."""

    def __init__(self, name, doc, bounds, labels, registry):
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self.bounds = np.asarray(bounds, dtype=float)
        self.le = [floatToGoString(b) for b in bounds] + ["+Inf"]
        self.series = {}            # label values -> [counts per bucket (not cumulative), sum]
        self.lock = threading.Lock()
        registry.register(self)

    def observe(self, labels: dict, values):
        v = np.asarray(values, dtype=float)
        if not v.size:
            return
        counts = np.bincount(np.searchsorted(self.bounds, v, side="left"),
                             minlength=len(self.le))
        key = tuple(labels[k] for k in self.labels)
        with self.lock:
            s = self.series.setdefault(key, [np.zeros(len(self.le), dtype=np.int64), 0.0])
            s[0] += counts
            s[1] += float(v.sum())

    def forget(self, variant):
        i = self.labels.index("variant")
        with self.lock:
            self.series = {k: v for k, v in self.series.items() if k[i] != variant}

    def collect(self):
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        with self.lock:
            series = [(k, np.cumsum(c).tolist(), total) for k, (c, total) in self.series.items()]
        for key, cum, total in series:
            fam.add_metric(list(key), list(zip(self.le, cum)), total)
        yield fam


class Metrics:
    """The metric families of one exporter, in their own registry."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.seen = {}              # variant -> {(family, label values)}
        self.status_labels = {}     # (variant, instance) -> label values of its status series
        self.histograms = []
        self._vllm_families(self._hist, self._gauge, self._counter)
        self._testbed_families(self._hist, self._gauge, self._counter)

    def _hist(self, name, doc, b, labels=LABELS):
        h = Histogram(name, f"{doc} {REAL}", b, labels, self.registry)
        self.histograms.append(h)
        return h

    def _gauge(self, name, doc, labels=LABELS):
        return Gauge(name, f"{doc} {REAL}", labels, registry=self.registry)

    def _counter(self, name, doc, labels=LABELS):
        return Counter(name, f"{doc} {REAL}", labels, registry=self.registry)

    def _vllm_families(self, hist, gauge, counter):
        """vLLM's names (vllm/v1/metrics/loggers.py) where the concept is the same."""
        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Time to first token: first token at the client - send, seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Inter-token latency: gaps between the decode worker's token stamps, "
                        "seconds.", TOKEN_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Time per output token of each request: (E2EL - TTFT) / (tokens - 1), "
                         "seconds.", TOKEN_BUCKETS)
        self.e2el = hist("vllm:e2e_request_latency_seconds",
                         "End-to-end request latency: last token at the client - send, seconds.",
                         TTFT_BUCKETS)
        self.success = counter("vllm:request_success", "Requests completed (status ok).")
        self.running = gauge("vllm:num_requests_running",
                             "Requests the instance computes now (prefill: 0 or 1; decode: in "
                             "the batch).")
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Requests waiting at the instance (prefill queue; decode: KV "
                             "arrived or arriving, not yet batched).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "Decode memory reserved by the batch over its KV capacity (1 = "
                              "full), from real-world bytes.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prompt tokens of the requests prefilled (queried against "
                                      "the prefix cache).")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (not prefilled).")

    def _testbed_families(self, hist, gauge, counter):
        """The testbed's own: requests, the WAN, the control plane, faults, fidelity guards."""
        self.failed = counter("testbed_requests_failed", "Requests that ended failed.")
        self.in_flight = gauge("testbed_requests_in_flight", "Requests sent, not yet done.")
        self.egress = gauge("testbed_wan_egress_gbps",
                            "WAN egress per direction from the router's kernel byte counters, "
                            f"Gbit/s, mean over the last {EGRESS_WINDOW_S:g} s of the machine's "
                            "clock (scale.time real-world seconds).", LABELS + ("direction",))
        self.egress_end = gauge("testbed_wan_egress_window_end_seconds",
                                "Unix time (the machine's clock) of the newest kernel counter "
                                "sample testbed_wan_egress_gbps covers.", LABELS + ("direction",))
        self.link_rate = gauge("testbed_wan_link_gbps",
                               "Link rate in force per direction, Gbit/s.", LABELS + ("direction",))
        self.link_up = gauge("testbed_wan_link_up", "1 while the WAN direction is up.",
                             LABELS + ("direction",))
        self.backlog = gauge("testbed_wan_backlog_bytes",
                             "Bottleneck queue backlog per direction, bytes.",
                             LABELS + ("direction",))
        self.drops = gauge("testbed_wan_drops", "Packets dropped at the bottleneck queue since the "
                           "link was built (cumulative).", LABELS + ("direction",))
        self.threshold = gauge("testbed_threshold_tokens",
                               "Routing threshold in force (uncached prompt tokens above it go "
                               "to PrfaaS prefill).")
        self.roles = gauge("testbed_instances", "Prefill and decode instances per role in force.")
        self.healthy = gauge("testbed_instance_up",
                             "1 while the instance is up (no health check failed, not exited).")
        self.offload = gauge("testbed_offload_share",
                             "Share of routed requests prefilled remotely (PrfaaS).")
        self.fault = gauge("testbed_fault_active", "Injected faults: 1 while injected, 0 after "
                           "its end.", LABELS + ("fault", "kind", "target"))
        self.lag = hist("testbed_first_token_lag_seconds",
                        "Fidelity guard: first token's decode stamp -> its arrival at the "
                        "client, seconds (the control plane's lag, in every TTFT).",
                        TOKEN_BUCKETS)
        self.speed = gauge("testbed_emulation_speed", "The emulation's time scale: real-world "
                                "seconds per second of the machine's clock.")

    def at(self, family, labels, **more):
        """`family.labels(...)`, remembered per variant so that `forget` can remove it."""
        lab = {**labels, **more}
        # the dicts are built in each family's label order (LABELS, then its own)
        self.seen.setdefault(lab["variant"], set()).add((family, tuple(lab.values())))
        return family.labels(**lab)

    def forget(self, variant):
        """Serve a variant's series no longer (it ended; Prometheus keeps what it scraped)."""
        for family, values in self.seen.pop(variant, ()):
            family.remove(*values)
        self.status_labels = {k: v for k, v in self.status_labels.items() if k[0] != variant}
        for h in self.histograms:
            h.forget(variant)

    def update(self, run, done):
        """Observe the requests `done` since the last poll and set the gauges of `run`."""
        if not run.started:
            return
        base = {"experiment": run.experiment, "variant": run.variant}

        def lab(instance, role="", dc=None):
            return {**base, "instance": instance,
                    "datacenter": run.dc(instance) if dc is None else dc, "role": role}

        for f in done:
            self._request(run, f, lab(f.decode, "decode"), lab(f.prefill, "prefill"))
        sched = lab("scheduler", "scheduler")
        self.at(self.in_flight, sched).set(run.in_flight)
        self.at(self.speed, sched).set(run.scale.time)
        if run.threshold is not None:
            self.at(self.threshold, sched).set(run.threshold)
        if (share := run.offload_share()) is not None:
            self.at(self.offload, sched).set(share)
        for d in DIRECTIONS:
            self._link(run, d, lab("wan", "router", DIRECTION_DC[d]))
        for (role, dc), n in run.role_counts().items():
            self.at(self.roles, lab(role, role, dc)).set(n)
        for name, inst in run.rt.instances.items():
            if inst.role in ("prefill", "decode", "cachepool", "scheduler"):
                self.at(self.healthy, lab(name, run.roles.get(name, inst.role))).set(
                    0 if name in run.down else 1)
        for name, st in run.status.items():
            self._status(lab(name, st.get("role", "")), st)
        for fault in run.faults.values():
            self.at(self.fault, lab(fault.target, "fault", ""), fault=fault.fault,
                    kind=fault.kind, target=fault.target).set(int(fault.active))

    def _request(self, run, f, dec, pre):
        if not f.ok:
            self.at(self.failed, dec).inc()
            return
        self.at(self.success, dec).inc()
        self.ttft.observe(dec, [f.ttft_s])
        self.e2el.observe(dec, [f.e2el_s])
        if f.tpot_s is not None:
            self.tpot.observe(dec, [f.tpot_s])
        self.itl.observe(dec, f.itl_s)
        if f.first_token_lag_s is not None:
            self.lag.observe(dec, [f.first_token_lag_s])
        n = run.input_tokens(f.id)
        if n is not None and f.prefill:
            self.at(self.prefix_queries, pre).inc(n)
            self.at(self.prefix_hits, pre).inc(f.cached_tokens)

    def _link(self, run, d, lab):
        link = run.link[d]
        self.at(self.egress, lab, direction=d).set(link.egress_gbps)
        self.at(self.egress_end, lab, direction=d).set(link.window_end)
        self.at(self.link_rate, lab, direction=d).set(link.link_gbps)
        self.at(self.link_up, lab, direction=d).set(int(link.up))
        self.at(self.backlog, lab, direction=d).set(link.backlog_real_bytes)
        self.at(self.drops, lab, direction=d).set(link.drops)

    def _status(self, lab, st):
        self._relabel(lab)
        self.at(self.running, lab).set(st.get("running", 0))
        self.at(self.waiting, lab).set(st.get("waiting", 0))
        cap = st.get("kv_capacity_real_bytes")
        if cap and math.isfinite(cap):
            self.at(self.kv_usage, lab).set(st.get("kv_reserved_real_bytes", 0.0) / cap)


    def _relabel(self, lab):
        """A dual-role instance's role changed: drop its status series under the old role, so
        that each instance has one running/waiting/KV series, labelled with the role in force."""
        key, values = (lab["variant"], lab["instance"]), tuple(lab.values())
        old = self.status_labels.get(key)
        self.status_labels[key] = values
        if old is None or old == values:
            return
        seen = self.seen.get(lab["variant"], set())
        for family in (self.running, self.waiting, self.kv_usage):
            if (family, old) in seen:
                seen.discard((family, old))
                family.remove(*old)


def http_server(registry, host, port):
    """/metrics in Prometheus's text format (0.0.4), whatever the scraper accepts.

    prometheus_client's own server answers a Prometheus scrape (which prefers OpenMetrics)
    with names escaped to underscores (0.26: `vllm_time_to_first_token_seconds_count`), and
    vLLM's names are the point; the text format keeps their colons."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            final = server.final            # read before rendering: was the last poll in it?
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            with server.scraped:
                server.scrapes += 1
                server.final_scrapes += final
                server.scraped.notify_all()

        def log_message(self, *args):      # a line per scrape is noise in live.log
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.scrapes, server.final_scrapes, server.final = 0, 0, False
    server.scraped = threading.Condition()
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread


def _await_scrape(server, timeout_s=FINAL_SCRAPE_S):
    """After the last poll, wait (bounded) for one scrape rendered from it, so the scraper holds
    the final counts; not when nobody scraped at all. A scrape under way while the last poll ran
    may hold the earlier state, so only one that began after it counts."""
    with server.scraped:
        server.final = True
        if server.scrapes:
            server.scraped.wait_for(lambda: server.final_scrapes > 0, timeout=timeout_s)


def serve(top, port, host="127.0.0.1", poll_s=1.0, stop=None):
    """Tail `top` and serve its metrics on host:port until `stop` (a threading.Event) is set;
    returns the number of polls. The first poll runs before the port opens."""
    stop = stop or threading.Event()
    metrics, watch = Metrics(), Watch(top)
    polls = 0

    ended = {}                  # variant -> when its end was seen (time.monotonic)

    def once():
        nonlocal polls
        for run, done in watch.poll():
            if run.variant in ended:
                if time.monotonic() - ended[run.variant] > RETAIN_S and run.variant in metrics.seen:
                    metrics.forget(run.variant)
                continue
            metrics.update(run, done)
            if run.ended:
                ended[run.variant] = time.monotonic()
        polls += 1

    once()
    server, thread = http_server(metrics.registry, host, port)
    try:
        while not stop.wait(poll_s):
            once()
        once()          # what the run wrote last
        _await_scrape(server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    return polls


def main(argv=None):
    p = argparse.ArgumentParser(description="Prometheus metrics of a testbed run directory")
    p.add_argument("--dir", required=True, help="the run directory (an experiment's top)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between reads")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Ctrl-C reaches the whole process group: the orchestrator stops this one after its teardown
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(args.dir, args.port, args.host, args.poll, stop)
    except OSError as e:
        print(f"metrics: cannot serve on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
