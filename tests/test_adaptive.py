"""The short-timescale threshold controller's law on synthetic inputs, and its telemetry reading
(no root)."""

from testbed.runtime import AdaptiveRuntime
from workers.adaptive import Control, read_last_row

CFG = AdaptiveRuntime(step=0.1, egress_high=0.8, egress_low=0.3, queue_ratio=1.5, min=1000,
                      max=100_000, window_s=1.0, dwell_s=0.5, interval_s=1.0)
LINK = 1e9        # bit/s


def drive(law, seconds, util, remote, local, dt=0.1, t0=0.0):
    """Feed `seconds` of samples every `dt`: egress at `util` x LINK, backlogs from callables
    of time (or constants); returns [(time, threshold, reason)]."""
    out = []
    n = round(seconds / dt)
    for k in range(n + 1):
        now = t0 + k * dt
        law.bytes = getattr(law, "bytes", 0) + (util * LINK * dt / 8 if k else 0)
        r = remote(now) if callable(remote) else remote
        lo = local(now) if callable(local) else local
        t, _, _, reason = law.observe(now, int(law.bytes), LINK, r, lo)
        out.append((now, t, reason))
    return out


def test_saturated_link_alone_does_not_raise_t():
    """Utilisation above egress_high with a steady PrfaaS queue: hold (the link copes)."""
    law = Control(10_000, CFG)
    rows = drive(law, 3.0, 0.95, 1.0, 1.0)
    assert law.t == 10_000
    assert {r for _, _, r in rows[12:]} == {"hold"}


def test_saturated_link_and_growing_queue_raises_t_after_dwell():
    law = Control(10_000, CFG)
    rows = drive(law, 3.0, 0.95, lambda t: 0.5 + t, 1.0)
    changes = [(now, t, r) for (now, t, r), (_, prev, _) in zip(rows[1:], rows) if t != prev]
    assert changes[0][2] == "raise:link" and changes[0][1] == 11_000
    assert changes[0][0] >= CFG.dwell_s             # not before the signal held for dwell
    gaps = [b[0] - a[0] for a, b in zip(changes, changes[1:])]
    assert all(g >= CFG.interval_s - 1e-9 for g in gaps)   # at most one change per interval
    assert any(r.startswith("dwell:raise") for _, _, r in rows)


def test_prfaas_compute_queue_surge_raises_t_with_an_idle_link():
    law = Control(10_000, CFG)
    drive(law, 1.0, 0.1, lambda t: 1.0 + 2 * t, 0.5)
    assert law.t == 11_000


def test_idle_link_and_short_prfaas_queue_lowers_t():
    law = Control(11_000, CFG)
    drive(law, 1.0, 0.1, 0.2, 1.0)
    assert law.t == 10_000
    law = Control(11_000, CFG)
    drive(law, 2.0, 0.1, 1.0, 1.0)        # queues balanced: hold
    assert law.t == 11_000
    law = Control(11_000, CFG)
    drive(law, 2.0, 0.5, 0.2, 1.0)        # link half busy (inside the band): hold
    assert law.t == 11_000
    law = Control(11_000, CFG)
    drive(law, 2.0, 0.1, 0.0, 0.0)        # no load anywhere: hold
    assert law.t == 11_000


def test_a_short_burst_does_not_move_t():
    """Hysteresis: a raise signal shorter than dwell, then calm, leaves t alone."""
    law = Control(10_000, CFG)
    burst = lambda t: 0.5 + 2 * t if t < 0.3 else 0.5    # noqa: E731
    rows = drive(law, 3.0, 0.95, burst, 1.0)
    assert law.t == 10_000
    assert any(r == "dwell:raise" for _, _, r in rows)


def test_alternating_signals_do_not_oscillate():
    """Raise and lower signals that flip faster than dwell never move t."""
    law = Control(10_000, CFG)
    out = []
    for k in range(60):
        now = k * 0.1
        up = (k // 3) % 2 == 0          # 0.3 s of each
        law.bytes = getattr(law, "bytes", 0) + (0.95 if up else 0.05) * LINK * 0.1 / 8
        t, *_ = law.observe(now, int(law.bytes), LINK, 1.0 + (k if up else -k) * 0.1, 1.0)
        out.append(t)
    assert set(out) == {10_000}


def test_bounds():
    law = Control(99_000, CFG)
    rows = drive(law, 5.0, 0.95, lambda t: 1.0 + t, 1.0)
    assert law.t == 100_000 and rows[-1][2] in ("bound:raise", "wait:raise", "dwell:raise")
    law = Control(1_050, CFG)
    drive(law, 5.0, 0.0, 0.0, 1.0)
    assert law.t == 1_000


def test_utilisation_is_measured_over_the_window():
    law = Control(10_000, CFG)
    assert law.utilisation(0.0, 0, LINK) is None
    assert law.utilisation(0.5, int(0.4 * LINK * 0.5 / 8), LINK) == 0.4 * 1.0
    assert law.utilisation(1.0, int(0.4 * LINK / 8), None) is None      # link rate unknown


def test_reads_the_last_complete_row(tmp_path):
    p = tmp_path / "timeseries.csv"
    p.write_text("time,kv_rate_bps\n1.0,10\n2.0,20\n3.0,")
    assert read_last_row(p) == {"time": "2.0", "kv_rate_bps": "20"}
    assert read_last_row(tmp_path / "missing.csv") is None


def test_controller_reads_the_link_rate_emulated_from_the_sampler(tmp_path):
    """The sampler writes the link rate in force both ways: `kv_link_bps` emulated (what the
    controller compares with byte counts, unconverted) and `kv_link_gbps` real-world."""
    from testbed.measure import CounterSampler
    from testbed.scale import Scale
    from workers.adaptive import ThresholdController

    class StubWan:
        def stats(self):
            return {d: {"tx_bytes": 1000, "tx_packets": 1, "backlog_bytes": 0, "drops": 0,
                        "up": True, "rate_bps": 2e8} for d in ("kv", "request")}

    path = tmp_path / "timeseries.csv"
    sampler = CounterSampler(StubWan(), path, Scale(time=10, bytes=1e-3))
    sampler.start()
    sampler.stop()
    row = read_last_row(path)
    assert float(row["kv_link_bps"]) == 2e8
    assert float(row["kv_link_gbps"]) == 2e8 / (10 * 1e-3) / 1e9     # 20 Gbit/s real-world

    class Router:
        threshold = 10_000
    ctl = ThresholdController(Router(), CFG, tmp_path, None)
    try:
        assert ctl.link() == (1000, 2e8)
    finally:
        ctl.out.close()
