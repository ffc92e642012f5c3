"""The WAN link as built: measured values against configured ones, on real namespaces (root).

Each test builds its own tb<hex>{s,r,d} namespaces through `testbed.net.pair.routed_pair` with a registry in
tmp_path and removes them in `finally`. Tolerances are wider than the fidelity targets of
benchmarks/link_fidelity.py because these two cores are shared with other jobs.
"""

import os
import signal
import statistics
import subprocess
import threading
import time

import pytest

from testbed import lifecycle
from testbed.net import probe, timers
from testbed.net.pair import routed_pair
from testbed.net.linkmodel import check_params
from testbed.net.wan import probe_backend
from testbed.scale import Scale

pytestmark = pytest.mark.root


def _params(**kw):
    d = check_params({"rate": 50e6, **kw}, "test")
    return {"kv": d, "request": d}


@pytest.fixture
def link_factory(tmp_path):
    """build(**params) -> RoutedPair; everything built is removed at the end, also on failure."""
    stack = []

    def build(backend="userspace", **kw):
        reg = lifecycle.Registry(f"t{os.getpid()}-{len(stack)}", kind="test", state_dir=tmp_path)
        # uncalibrated: these tests check the delay line itself (held for the delay exactly)
        cm = routed_pair(_params(**kw), backend=backend, registry=reg, calibrate=False)
        stack.append((cm, reg))
        return cm.__enter__()

    try:
        yield build
    finally:
        for cm, reg in reversed(stack):
            try:
                cm.__exit__(None, None, None)
            finally:
                reg.close()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for cm, reg in stack:
            assert not any(n in left for n in reg.state["netns"]), left


def test_rate_measured_at_the_receiver(link_factory):
    link = link_factory(rate=50e6)
    # TCP payload share of a 1514-byte frame is 0.956. The link's capacity is what the best of
    # up to three 1.5 s transfers reaches: a busy CPU on this shared machine can only lower a
    # transfer's goodput (seen: 0.77 of the rate once), never raise it above the shaped rate.
    runs = []
    for _ in range(3):
        runs.append(probe.measure_goodput(link.src, link.dst, link.dst_ip, duration_s=1.5))
        assert runs[-1] <= 1.0 * 50e6, runs
        if runs[-1] >= 0.88 * 50e6:
            break
    assert max(runs) >= 0.88 * 50e6, runs
    st = link.wan.stats()["kv"]
    assert st["tx_bytes"] >= 0.9 * 50e6 / 8 * 1.5


def test_goodput_never_exceeds_the_payload_share_of_the_rate(link_factory):
    """A 40 ms RTT flow leaves slow start with losses; a window opened during the recovery used
    to count out-of-order data that crossed the link before it (0.97-0.98 of the rate)."""
    link = link_factory(rate=20e6, delay=0.020)
    runs = []
    for _ in range(3):      # a busy CPU can lower a transfer's goodput (0.84 seen in CI), not raise it
        a = link.wan.stats()["kv"]
        t0 = time.monotonic()
        goodput = probe.measure_goodput(link.src, link.dst, link.dst_ip, duration_s=1.5)
        b = link.wan.stats()["kv"]
        carried = 8 * (b["tx_bytes"] - a["tx_bytes"]) / (time.monotonic() - t0)
        assert carried <= 1.01 * 20e6, carried          # the shaper holds the layer-2 rate
        # payload share 1448/1514 = 0.9564; 0.3% for the ACK granularity of the two samples
        assert goodput <= 0.959 * 20e6, goodput / 20e6
        runs.append(goodput / 20e6)
        if runs[-1] >= 0.85:
            break
    assert max(runs) >= 0.85, runs


def test_burst_loss_rate_and_burst_length(link_factory):
    link = link_factory(rate=50e6, loss=0.05, loss_burst=4)
    n = 40000
    c, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=10, train=n,
                             train_pps=15000)
    loss = 1 - s["got"]["t"] / n
    burst = probe._mean_burst(n, s["got"]["t"], s["loss_runs"])
    # ~500 bursts: the lost count's relative sd is ~6%, the mean burst's ~4%
    assert 0.0375 <= loss <= 0.0625, loss
    assert 3.0 <= burst <= 5.0, burst
    assert link.wan.delayline_counters()["kv"]["lost"] >= 0.8 * loss * n
    # the same loss without bursts: runs of about 1 / (1 - loss) packets
    link.wan.set(loss_burst=None)
    c, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=10, train=n,
                             train_pps=15000)
    assert 0.0375 <= 1 - s["got"]["t"] / n <= 0.0625
    assert probe._mean_burst(n, s["got"]["t"], s["loss_runs"]) <= 1.2


def _udp_rtt_owd(link):
    """(sorted RTTs ms, one-way delays ms, server stats) of the standard UDP probe."""
    c, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=150)
    return sorted(x / 1e6 for x in c["rtt_ns"]), [x / 1e6 for x in s["owd_ns"]], s


def _sd(xs):
    m = sum(xs) / len(xs)
    return (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5


def test_rtt_jitter_and_order(link_factory):
    """The delay and jitter the delay line adds, measured side by side with the same link at no
    delay: what this machine adds on its own (the probe's wake-ups, the NFQUEUE round trip; seen
    from 0.2 to 1.8 ms a round trip, varying by the minute) is common to both and cancels. The
    median is robust to it; the jitter is the one-way spread beyond the baseline's, in
    quadrature. A busy CPU only adds delay, so the best of up to five pairs is taken (a
    clean-clone run's three pairs all fell in one spell: 12.1, 11.4, 10.8 ms added)."""
    link = link_factory(rate=50e6, delay=0.005, jitter=0.001)
    pairs = []
    for _ in range(5):
        link.wan.set(delay=0.0, jitter=0.0)
        base_rtt, base_owd, _ = _udp_rtt_owd(link)
        link.wan.set(delay=0.005, jitter=0.001)
        rtt, owd, s = _udp_rtt_owd(link)
        assert len(rtt) >= 145 and len(base_rtt) >= 145
        assert s["reordered"]["p"] == 0            # jitter never reorders (FIFO release)
        added = probe._percentile(rtt, 0.5) - probe._percentile(base_rtt, 0.5)
        jitter = max(0.0, _sd(owd) ** 2 - _sd(base_owd) ** 2) ** 0.5
        pairs.append((added, jitter))
        if abs(added - 10.0) <= 1.0 and 0.65 <= jitter <= 1.35:
            break
    assert any(abs(a - 10.0) <= 1.0 and 0.65 <= j <= 1.35 for a, j in pairs), pairs
    assert min(a for a, _ in pairs) >= 9.0, pairs      # never less delay than configured


def _during_bulk_transfer(link, duration_s, measure):
    """Run measure() while a bulk TCP flow src -> dst fills the link (after its warm-up)."""
    done = {}
    bulk = threading.Thread(target=lambda: done.setdefault("goodput", probe.measure_goodput(
        link.src, link.dst, link.dst_ip, duration_s=duration_s)))
    bulk.start()
    try:
        time.sleep(probe.WARMUP_S)
        return measure()
    finally:
        bulk.join()
        assert "goodput" in done, "the bulk transfer failed (traceback above)"


def test_delay_line_above_2_gbit_keeps_order_and_delay(link_factory):
    """At 4 Gbit/s (above the old 2 Gbit/s cap) with bulk TCP filling the link: forward packets
    (through the loaded line and the bottleneck queue) arrive in order and none before the 5 ms
    delay; reverse probes (through the ACK direction's line, whose queue stays empty) arrive
    5 ms later plus little; the line dropped nothing and the kernel refused no verdict."""
    link = link_factory(rate=4e9, delay=0.005)

    def both_directions():
        fwd = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=100, train=5000,
                                train_pps=10000)
        rev = probe.measure_udp(link.dst, link.src, link.src_ip, probes=100)
        return fwd, rev

    medians = []
    for _ in range(2):  # the 4 Gbit/s flow saturates the 2 cores; a busy moment can add 1.9 ms
        (_, fwd), (_, rev) = _during_bulk_transfer(link, 4.0, both_directions)
        fwd_ms = [x / 1e6 for x in fwd["owd_ns"]]
        assert len(fwd_ms) >= 95 and fwd["got"]["t"] >= 4900
        assert min(fwd_ms) >= 4.99, min(fwd_ms)        # held for the delay, queueing on top
        assert fwd["reordered"]["p"] + fwd["reordered"]["t"] == 0, fwd.get("reorder_examples")
        rev_ms = sorted(x / 1e6 for x in rev["owd_ns"])
        assert len(rev_ms) >= 95 and rev["reordered"]["p"] == 0
        assert 4.99 <= rev_ms[0], rev_ms                # every try: never early
        medians.append(probe._percentile(rev_ms, 0.5))
        if medians[-1] <= 6.0:
            break
    assert min(medians) <= 6.0, medians
    counters = link.wan.delayline_counters()
    for d in ("kv", "request"):
        assert counters[d]["dropped"] == 0 and counters[d]["errors"] == 0, counters


def test_loss_measured_one_way(link_factory):
    link = link_factory(rate=50e6, loss=0.05)
    c, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=10, train=4000,
                             train_pps=8000)
    loss = 1 - s["got"]["t"] / 4000
    assert 0.0375 <= loss <= 0.0625, loss   # 25% relative; 3.6 sigma at 4000 packets


def test_down_stops_traffic_and_up_restores(link_factory):
    link = link_factory(rate=50e6)
    link.wan.set(up=False)
    c, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=20)
    assert s["got"]["p"] == 0 and not c["rtt_ns"]
    assert link.wan.stats()["kv"]["up"] is False
    link.wan.set(up=True)
    c, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=20)
    assert len(c["rtt_ns"]) >= 19


def test_rate_change_shows_in_kernel_counters_within_100ms(link_factory):
    """A flow that fills 100 Mbit/s is held to 20 Mbit/s within 100 ms of the change. The flow
    must fill the link first to show it; a busy CPU can keep a 1 s flow below that (seen in a
    clean-clone run), so up to three flows are tried, the rate set back to 100 Mbit/s between."""
    link = link_factory(rate=100e6, delay=0.002)
    tries = []
    for _ in range(3):
        link.wan.set("kv", rate=100e6)
        sink = probe._spawn(link.dst, "tcp-sink", probe.TCP_PORT, 2.0)
        try:
            sink.ready("tcp sink")
            source = probe._spawn(link.src, "tcp-source", link.dst_ip, probe.TCP_PORT, 1.5)
            time.sleep(1.0)   # through slow start at 4 ms RTT (probe.WARMUP_S is 0.5 s)
            before = _rate_over(link.wan, 0.1)
            t_set = time.monotonic()
            link.wan.set("kv", rate=20e6)      # its apply time is benchmarks' business
            while time.monotonic() < t_set + 0.05:
                time.sleep(0.005)
            after = _rate_over(link.wan, 0.05)   # the window ends 100 ms after the change
            source.result("tcp source", 10)
            sink.result("tcp sink", 10)
        finally:
            sink.close()
        tries.append((before, after))
        assert after <= 1.3 * 20e6, tries                # every try: the new rate holds
        if before >= 0.8 * 100e6:
            break
    assert max(b for b, _ in tries) >= 0.8 * 100e6, tries


def _rate_over(wan, window_s):
    a = wan.stats()["kv"]["tx_bytes"]
    t0 = time.monotonic()
    time.sleep(window_s)
    b = wan.stats()["kv"]["tx_bytes"]
    return 8 * (b - a) / (time.monotonic() - t0)


def test_stop_removes_delay_line_and_rules(link_factory):
    link = link_factory(rate=10e6, delay=0.002, loss=0.01)
    pids = [dl.proc.pid for dl in link.wan._delaylines.values()]
    assert pids
    link.wan.stop()
    link.wan.stop()   # idempotent
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or lifecycle.proc_start_time(pid) is None
    rules = subprocess.run(["nsenter", f"--net={link.router}", "iptables-save"],
                           capture_output=True, text=True).stdout
    assert "TBWAN" not in rules and "NFQUEUE" not in rules
    qdiscs = subprocess.run(["tc", "-n", link.names[1], "qdisc", "show"], capture_output=True,
                            text=True).stdout
    assert "htb" not in qdiscs


def test_delay_line_refuses_bad_control_lines_and_stops_on_sigterm(link_factory):
    """Bad `set` lines are answered with an error and change nothing; the link still delays
    by the configured 5 ms afterwards; SIGTERM ends the delay line cleanly (exit 0)."""
    link = link_factory(rate=50e6, delay=0.005)
    dl = link.wan._delaylines["kv"]
    before, _, _ = _udp_rtt_owd(link)
    for line in ["set 1 2", "set 3600000001 0 normal 0 0 1 0 1",
                 "set 99999999999999999999999 0 normal 0 0 1 0 1", "set 5000 0 normal 0 nan 1 0 1",
                 "x" * 600, "bogus"]:
        dl.proc.stdin.write(line + "\n")
        dl.proc.stdin.flush()
        assert (dl._read_line(2.0) or "").startswith("error"), line
    assert dl.alive() and dl.counters()["errors"] == 0
    # the same delay as before the bad lines, side by side (this machine adds its own 0.2-1.8
    # ms to both), and never less than configured
    after, _, _ = _udp_rtt_owd(link)
    p50 = (probe._percentile(before, 0.5), probe._percentile(after, 0.5))
    assert abs(p50[1] - p50[0]) <= 1.0 and min(p50) >= 9.5, p50
    dl.proc.send_signal(signal.SIGTERM)
    assert dl.proc.wait(timeout=2.0) == 0


def _netem_skip():
    backend, reason = probe_backend()
    if backend != "netem":
        pytest.skip(f"netem backend unavailable: {reason}")


def test_netem_rtt_and_rate(link_factory):
    _netem_skip()
    link = link_factory(backend="netem", rate=50e6, delay=0.005)
    c, _ = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=100)
    assert abs(probe._percentile([x / 1e6 for x in c["rtt_ns"]], 0.5) - 10.0) <= 1.0
    goodput = probe.measure_goodput(link.src, link.dst, link.dst_ip, duration_s=1.5)
    assert goodput >= 0.88 * 50e6


def test_netem_loss_and_down(link_factory):
    _netem_skip()
    link = link_factory(backend="netem", rate=50e6, loss=0.05)
    _, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=10, train=4000,
                             train_pps=8000)
    assert 0.0375 <= 1 - s["got"]["t"] / 4000 <= 0.0625
    link.wan.set(up=False)
    _, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=20)
    assert s["got"]["p"] == 0


def _recovery_cost_real_s(link_factory, time_scale, scaled=True, drops=None, trials=11):
    """{scenario: real-world s} that losing segments of a 20-segment message adds to its
    completion (median with the drop minus median without), on a 100 Mbit/s, 5 ms link emulated
    at `time_scale` with the hosts' TCP timers as a run sets them (`net.timers`), or the
    kernel's (`scaled=False`). tail: the last segment, recovered by its RTO (or the loss probe
    with one packet out, 2 srtt + the RTO floor); twice: the last segment and its retransmission,
    the RTO and then the RTO backed off."""
    drops = drops or {"tail": (20,), "twice": (20, 21)}
    s = Scale(time=time_scale)
    link = link_factory(rate=s.emulated_rate(100e6), delay=s.emulated_s(0.005))
    tcp = timers.TcpTimers.for_scale(s if scaled else Scale())
    for ns in (link.src, link.dst):
        timers.apply(ns, tcp)
    runs = {name: probe.measure_requests(link, 20, drop, trials, settle_s=s.emulated_s(0.02))
            for name, drop in {"none": (), **drops}.items()}
    for name, r in runs.items():     # every trial lost what it should, and nothing else
        assert statistics.median(r["retrans"]) == len(drops.get(name, ())), (name, r)
    clean = statistics.median(runs["none"]["times"])
    return {name: s.real_s(statistics.median(runs[name]["times"]) - clean) for name in drops}


def test_loss_recovery_costs_the_same_real_time_at_1x_and_10x(link_factory):
    """Deterministic drops (benchmarks/loss_recovery.py, docs/link.md "TCP timers"): at 1x a
    lost last segment costs ~226 ms (the RTO, 212 ms, and a round trip), lost twice ~442 ms.
    At 10x with the scaled floor (16 ms: the jiffy the timer overshoots by is counted) it
    measured 1.06x and 1.08x of that; with the kernel's 200 ms floor ~9x. Medians of 11 at 1x
    and of 31 at 10x: a 10x trial is ten times shorter, and a millisecond of CPU contention in it
    ten times larger in real-world time, so its median needs (and cheaply gets) more trials."""
    one = _recovery_cost_real_s(link_factory, 1.0)
    ten = _recovery_cost_real_s(link_factory, 10.0, trials=31)
    if not all(0.8 <= ten[n] / one[n] <= 1.2 for n in one):
        # CPU contention only adds to a 10x trial, ten times over in real-world time (1.24x
        # once in a clean-clone run): a second set of 31, the lower median per scenario kept
        again = _recovery_cost_real_s(link_factory, 10.0, trials=31)
        ten = {n: min(ten[n], again[n]) for n in ten}
    print("loss recovery, real-world s: 1x", one, "10x", ten,
          {name: round(ten[name] / one[name], 3) for name in one})
    assert one["tail"] >= 0.2, one                # the kernel's 200 ms floor, at 1x
    for name in ("tail", "twice"):
        assert 0.8 <= ten[name] / one[name] <= 1.2, (name, one, ten)
    kernel = _recovery_cost_real_s(link_factory, 10.0, scaled=False, drops={"tail": (20,)})
    assert kernel["tail"] >= 5 * one["tail"], (one, kernel)
