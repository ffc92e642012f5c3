"""The short-timescale threshold controller's decisions and telemetry reading (no root)."""

from workers.adaptive import decide, read_last_row

CFG = {"step": 0.1, "egress_high": 0.8, "egress_low": 0.3, "queue_ratio": 1.5,
       "min": 1000, "max": 100_000}


def test_saturated_link_or_prfaas_queue_raises_t():
    assert decide(10_000, 0.9, 1.0, 1.0, CFG) == 11_000
    assert decide(10_000, 0.5, 2.0, 1.0, CFG) == 11_000
    assert decide(10_000, None, 0.5, 0.0, CFG) == 11_000   # PrfaaS queued, local idle


def test_idle_link_and_short_prfaas_queue_lowers_t():
    assert decide(11_000, 0.1, 0.2, 1.0, CFG) == 10_000
    assert decide(11_000, 0.1, 1.0, 1.0, CFG) == 11_000    # queues balanced: hold
    assert decide(11_000, 0.5, 0.2, 1.0, CFG) == 11_000    # link half busy: hold


def test_no_load_holds():
    assert decide(11_000, None, 0.0, 0.0, CFG) == 11_000
    assert decide(11_000, 0.0, 0.0, 0.0, CFG) == 11_000


def test_bounds():
    assert decide(99_000, 0.95, 5.0, 1.0, CFG) == 100_000
    assert decide(1_050, 0.0, 0.0, 1.0, CFG) == 1_000


def test_reads_the_last_complete_row(tmp_path):
    p = tmp_path / "timeseries.csv"
    p.write_text("time,kv_rate_bps\n1.0,10\n2.0,20\n3.0,")
    assert read_last_row(p) == {"time": "2.0", "kv_rate_bps": "20"}
    assert read_last_row(tmp_path / "missing.csv") is None
