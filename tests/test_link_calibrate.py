"""Delay-line calibration on paper: the RTT warning's tolerance and the shortfall line."""

import pytest

from testbed.net import calibrate
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
    # judged on the links now (a rescale or a correction), not the calibration's own list
    assert shortfall({**cal, "short": []}, links, Scale(time=40.0)) == line
    slower = {d: check_params({"rate": 1e9, "delay": 0.0005}, d) for d in ("kv", "request")}
    assert shortfall(cal, slower, Scale(time=10.0)) is None
    assert shortfall({"fixed_cost_ms": {"kv": 0.0, "request": 0.0}, "short": []}, links,
                     Scale(time=40.0)) is None                  # a cost corrected to 0
    assert shortfall(None, links, Scale()) is None


class _SpellWan:
    """A userspace WAN whose delay lines report `late_us` (us a packet) for each round in
    turn, and whose path measures `rtt_ms` for it: the calibration's side of a slow spell."""
    backend = "userspace"

    def __init__(self, late_us, rtt_ms, jitter=0.0):
        self.late_us, self.rtt_ms = list(late_us), list(rtt_ms)
        self.links = {d: check_params({"rate": 50e6, "delay": 0.001, "jitter": jitter}, d)
                      for d in ("kv", "request")}
        self.passed = self.late = 0
        self.subtracted, self.spread_ms = [], []

    def delaylines(self):
        return ["kv", "request"]

    def delayline_counters(self):
        return {d: {"passed": self.passed, "late_sum_ns": self.late} for d in ("kv", "request")}

    def measure(self, src, dst, dst_ip, probes, qs):
        self.passed += 200
        self.late += int(200 * self.late_us.pop(0) * 1e3)
        rtt = self.rtt_ms.pop(0)
        return [rtt - self.spread_ms.pop(0) if self.spread_ms else rtt - 0.1, rtt]

    def subtract_fixed_cost(self, cost_s):
        self.subtracted.append(dict(cost_s))


def _calibrate(monkeypatch, wan):
    from testbed.net import calibrate as cal
    monkeypatch.setattr(cal, "measure_rtt_ms", wan.measure)
    monkeypatch.setattr(cal, "SPELL_PAUSE_S", 0.0)
    return cal.calibrate(wan, "src", "dst", "10.0.0.2")


def test_a_round_in_a_slow_spell_is_measured_again_and_the_quiet_one_kept(monkeypatch):
    """The spell measured on 2026-12-03: 383 us a packet late and 3.36 ms on a 2 ms link (0.68
    ms a hop subtracted); quiet rounds 60-108 us and ~2.5 ms."""
    wan = _SpellWan(late_us=[383, 317, 90, 80], rtt_ms=[3.36, 3.2, 2.52, 2.01])
    got = _calibrate(monkeypatch, wan)
    assert got["late_us"] == [[383.0, 317.0, 90.0], [80.0]]
    assert got["rtt_ms"] == [2.52, 2.01] and got["spell"] is None
    assert got["fixed_cost_ms"] == {"kv": 0.26, "request": 0.26}


def test_a_calibration_that_never_leaves_the_spell_says_so(monkeypatch):
    wan = _SpellWan(late_us=[383, 317, 250, 300, 260, 240, 250, 230, 260, 270],
                    rtt_ms=[3.36, 3.2, 3.0, 3.1, 3.05, 2.4, 2.5, 2.45, 2.3, 2.6])
    got = _calibrate(monkeypatch, wan)
    assert [len(r) for r in got["late_us"]] == [5, 5]
    assert got["rtt_ms"][0] == 3.0      # the least slow of the first pass's rounds (250 us)
    assert "slow spell in all 5 rounds" in got["spell"] and "kept: delay lines 230 us late" in got["spell"]


def test_a_link_without_lateness_counters_is_measured_once_a_pass(monkeypatch):
    wan = _SpellWan(late_us=[0, 0], rtt_ms=[2.5, 2.0])
    wan.delayline_counters = lambda: {}
    got = _calibrate(monkeypatch, wan)
    assert got["late_us"] == [[None], [None]] and got["spell"] is None


def test_rtts_spread_by_a_spell_are_measured_again_even_when_the_delay_lines_were_on_time(
        monkeypatch):
    """An induced spell (a SCHED_FIFO hog on both cores) once left the delay lines 127-133 us
    late a packet while the RTT median rose 0.8 ms: the end hosts woke late. Its RTTs spread."""
    wan = _SpellWan(late_us=[127, 80, 70], rtt_ms=[3.3, 2.5, 2.0])
    wan.spread_ms = [0.6, 0.1, 0.1]
    got = _calibrate(monkeypatch, wan)
    assert got["late_us"] == [[127.0, 80.0], [70.0]] and got["rtt_ms"] == [2.5, 2.0]


def test_a_jittered_links_own_spread_is_not_a_spell(monkeypatch):
    wan = _SpellWan(late_us=[80, 80], rtt_ms=[2.5, 2.0], jitter=0.001)  # round trip's sd 1.41
    wan.spread_ms = [1.8, 1.8]                  # 1.28 of it
    got = _calibrate(monkeypatch, wan)
    assert got["late_us"] == [[80.0], [80.0]] and got["spell"] is None


def _probe(wan, late_us, warnings, monkeypatch, tries=2, spread_ms=None, jitter_ms=None):
    """`quiet_probe` over probes that each pass 1000 packets `late_us` late, spread their RTTs
    by `spread_ms` (0.1 each by default) and warn `warnings`, in turn."""
    from testbed.net import calibrate as cal
    monkeypatch.setattr(cal, "SPELL_PAUSE_S", 0.0)
    late, warns, calls = list(late_us), list(warnings), []
    spread = list(spread_ms or [0.1] * len(late))

    def measure():
        if wan is not None:
            wan.passed += 1000
            wan.late += int(1000 * late.pop(0) * 1e3)
        calls.append(1)
        m = {"n": len(calls), "rtt_p10_ms": 1.0, "rtt_p50_ms": 1.0 + spread.pop(0)}
        return {"measured": m, "warnings": warns.pop(0)}
    out = cal.quiet_probe(wan, measure, tries, jitter_ms=jitter_ms)
    out["measured"] = out["measured"]["n"]
    return out, len(calls)


def test_a_link_probe_that_warns_in_a_slow_spell_is_measured_again(monkeypatch):
    wan = _SpellWan([], [])
    out, n = _probe(wan, [400, 90], [["goodput deviates -27% from configured"], []], monkeypatch)
    assert n == 2 and out["warnings"] == [] and out["measured"] == 2
    assert out["late_us"] == 90 and out["spell"] is None
    assert [t["late_us"] for t in out["tries"]] == [400, 90]


def test_rtts_that_spread_mark_a_spell_too(monkeypatch):
    """End hosts that wake late spread the RTTs while the delay lines keep time."""
    out, n = _probe(_SpellWan([], []), [90, 90], [["rtt_p50 deviates +22% from configured"], []],
                    monkeypatch, spread_ms=[0.9, 0.1])
    assert n == 2 and out["warnings"] == [] and out["measured"] == 2
    assert out["tries"][0]["slowness"] == 3.0 and out["slowness"] < 1


def test_a_quiet_probe_keeps_its_warnings_and_is_not_measured_again(monkeypatch):
    out, n = _probe(_SpellWan([], []), [100], [["rtt_p50 deviates +16% from configured"]],
                    monkeypatch)
    assert n == 1 and out["warnings"] == ["rtt_p50 deviates +16% from configured"]
    assert out["spell"] is None


def test_a_probe_late_in_every_try_keeps_the_least_late_and_says_so(monkeypatch):
    out, n = _probe(_SpellWan([], []), [500, 300, 450], [["a"], ["b"], ["c"]], monkeypatch)
    assert n == 3 and out["late_us"] == 300 and out["warnings"][0] == "b"
    assert "slow spell in all 3 tries" in out["spell"] and out["warnings"][-1] == out["spell"]


def test_a_probe_without_delay_lines_is_measured_once(monkeypatch):
    out, n = _probe(None, [0], [["x"]], monkeypatch)
    assert n == 1 and out["late_us"] is None and out["warnings"] == ["x"]


def test_a_probe_without_delay_lines_is_judged_by_its_rtts_spread(monkeypatch):
    """Between Ray hosts the delay lines are the agents': the RTTs' spread alone tells a spell,
    beyond the round trip's configured jitter."""
    out, n = _probe(None, [0, 0], [["rtt_p50 deviates +28% from configured"]] * 2, monkeypatch,
                    tries=1, spread_ms=[0.9, 0.8])
    assert n == 2 and out["late_us"] is None and out["slowness"] == round(0.8 / 0.3, 3)
    assert "its RTTs spread over their lower decile" in out["spell"]
    assert "us late" not in out["spell"] and out["warnings"][-1] == out["spell"]
    out, n = _probe(None, [0], [["jitter deviates +12% from configured"]], monkeypatch,
                    tries=1, spread_ms=[0.9], jitter_ms=1.414)
    assert n == 1 and out["spell"] is None


def test_a_probe_with_no_tries_is_measured_once_and_claims_no_spell(monkeypatch):
    """Per frame (loss configured) a delay line is late under bulk TCP on any machine."""
    out, n = _probe(_SpellWan([], []), [2000], [["loss deviates +30% from configured"]],
                    monkeypatch, tries=0)
    assert n == 1 and out["late_us"] == 2000 and out["spell"] is None
    assert out["warnings"] == ["loss deviates +30% from configured"]


class _CostWan:
    """A WAN that records the fixed cost its delay lines subtract."""

    def __init__(self):
        self.cost_s = None

    def subtract_fixed_cost(self, cost_s):
        self.cost_s = dict(cost_s)


def test_a_correction_moves_each_hops_cost_by_its_share_of_the_probes_error():
    """The link check (testbed/autolink.py) corrects the start's calibration by what a later
    probe measured off: early takes cost away, late adds it, within the calibration's bounds."""
    cal = {"fixed_cost_ms": {"kv": 0.2987, "request": 0.2987}}
    wan = _CostWan()
    calibrate.correct(wan, cal, -0.101)                       # 101 us early: hold 50.5 us more
    assert wan.cost_s == pytest.approx({"kv": 0.2482e-3, "request": 0.2482e-3})
    assert cal["fixed_cost_ms"] == pytest.approx({"kv": 0.2482, "request": 0.2482})
    calibrate.correct(wan, cal, -1.0)                         # never below 0
    assert wan.cost_s == {"kv": 0.0, "request": 0.0} and cal["corrections_ms"] == [-0.101, -1.0]
    calibrate.correct(wan, cal, 5.0)                          # never above MAX_COST_S
    assert wan.cost_s == {"kv": calibrate.MAX_COST_S, "request": calibrate.MAX_COST_S}
