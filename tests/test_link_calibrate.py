"""Delay-line calibration on paper: the RTT warning's tolerance and the shortfall line."""

from testbed.net.calibrate import shortfall
from testbed.net.linkmodel import check_params
from testbed.net.probe import compare
from testbed.scale import Scale


def _measured(rtt_ms):
    return {"goodput_bps": 0.956e9, "rtt_p50_ms": rtt_ms, "jitter_ms": 0.0, "loss": None,
            "reordered": 0}


def _exp(rtt_ms):
    return {"goodput_bps": 1e9, "rtt_ms": rtt_ms, "jitter_ms": 0.0, "loss": 0.0}


def test_rtt_deviation_is_relative_to_the_configured_rtt_with_a_005_ms_floor():
    dev, warn = compare(_exp(1.0), _measured(1.5))
    assert dev["rtt_p50"] == 0.5 and any("rtt_p50 deviates +50%" in w for w in warn)
    assert not compare(_exp(1.0), _measured(1.04))[1]          # 0.04 ms: under the floor
    assert compare(_exp(1.0), _measured(1.06))[1]              # 0.06 ms: above it
    assert not compare(_exp(10.0), _measured(10.4))[1]         # 4%: under 5%
    assert compare(_exp(10.0), _measured(10.6))[1]             # 6%
    dev, warn = compare(_exp(0.0), _measured(0.2))             # 0 ms: no relative deviation
    assert "rtt_p50" not in dev and not warn


def test_an_uncalibrated_path_warns_at_10_percent_or_03_ms():
    """Ray's host shaping subtracts no fixed cost: its RTT keeps the other keys' 10%."""
    assert not compare(_exp(10.0), _measured(10.9), calibrated=False)[1]
    assert compare(_exp(10.0), _measured(11.1), calibrated=False)[1]
    assert not compare(_exp(1.0), _measured(1.25), calibrated=False)[1]   # under 0.3 ms
    assert compare(_exp(1.0), _measured(1.35), calibrated=False)[1]


def test_shortfall_names_the_largest_scale_time():
    links = {d: check_params({"rate": 1e9, "delay": 0.000125}, d) for d in ("kv", "request")}
    cal = {"fixed_cost_ms": {"kv": 0.25, "request": 0.25}, "short": ["kv", "request"]}
    line = shortfall(cal, links, Scale(time=40.0))
    assert "cannot be emulated at scale.time 40" in line and line.endswith("can is 20")
    assert shortfall({**cal, "short": []}, links, Scale(time=40.0)) is None
    assert shortfall(None, links, Scale()) is None
