"""`scale.time: auto`'s link check (testbed/autolink.py): the pilot's network probed at the
fastest run's kv link, every run's scale lowered where the path carried less. No root: the
backend here is a path that carries at most a given rate."""

import pytest

from testbed import autolink, autoshare
from testbed.config import load_experiment
from testbed.net.probe import deviation_warning, round_trip_ms

CASE = "experiments/paper_case_study.yaml"
MANY = "experiments/many_instances.yaml"        # one run; its WAN has 5 ms each way


class Path:
    """A backend whose kv path carries at most `carry_bps` of a link's rate, or `share` of
    it (a machine that falls short at any rate); records the rates probed."""

    def __init__(self, carry_bps=float("inf"), share=1.0, late_ms=0.0, miscalibrated_ms=0.0,
                 calibrated=True, slowness=0.4):
        self.carry, self.share, self.probed, self.rate = carry_bps, share, [], None
        # its round trip: `late_ms` late (the machine's) plus `miscalibrated_ms` (the start's
        # calibration off, which a correction takes away); `calibrated`: a correction applies
        self.late_ms, self.miscal, self.calibrated, self.rtt_ms = (late_ms, miscalibrated_ms,
                                                                   calibrated, 0.0)
        self.corrected, self.slowness = [], slowness

    def correct_round_trip(self, off_ms):
        if not self.calibrated:
            return None
        self.corrected.append(off_ms)
        self.miscal -= off_ms
        return {"corrections_ms": self.corrected}

    def rescale(self, deployment, events=None):
        self.rate = deployment.links["kv"].rate_bps
        self.rtt_ms = round_trip_ms(deployment.links["kv"].params())
        return self

    def describe(self):
        return {"shaping": {"backend": "userspace", "emulated": {"kv": {"rate": self.rate}}},
                "segmentation_offload": True, "tcp_timers": {"rto_min_ms": 5}}

    def probe(self, congestion_control):
        self.probed.append(self.rate)
        got = min(self.carry, self.share * self.rate)
        dev = got / self.rate - 1
        warn = [deviation_warning("goodput", dev)] if dev < -0.1 else []
        out = {"measured": {"goodput_bps": 0.956 * got}, "deviation": {"goodput": dev},
               "warnings": warn, "slowness": self.slowness, "calibrated": True,
               "configured": {"expected": {"rtt_ms": self.rtt_ms}}}
        if self.rtt_ms > 0:
            late = self.late_ms + self.miscal
            out["measured"]["rtt_p50_ms"] = self.rtt_ms + late
            out["deviation"]["rtt_p50"] = late / self.rtt_ms
            if abs(late) > max(0.05, 0.05 * self.rtt_ms):     # probe.compare's bound
                warn.append(deviation_warning("rtt_p50", late / self.rtt_ms))
        return out


def _case(chosen=20.0):
    """The case study's pilot as recorded on 2026-12-03 04:27: prfaas faithful at 20."""
    sh = autoshare.Shared(load_experiment(CASE, ["workload.arrival.rate=4/s"]))
    sh.record("prfaas", chosen, 10.0, [], 6.0)
    return sh


def _rates(sh, kv_only=False):
    """Each run's kv link rate (wall clock) at its scale; `kv_only`: only the runs that send KV
    across the WAN (the case study's homogeneous sends none)."""
    return {e.run_label: autoshare.wall_rate_bps(e, sh.scale_for(e, 50))
            for e, look in zip(sh.runs, sh.looks) if not kv_only or autoshare.sends_kv(look)}


def test_a_probe_within_tolerance_caps_nothing():
    assert autolink.shortfall_cap({"deviation": {"goodput": -0.09}}, 1e9) is None
    assert autolink.shortfall_cap({"deviation": {}}, 1e9) is None
    assert autolink.shortfall_cap({"deviation": {"goodput": -0.26}}, 3.3e9) == pytest.approx(
        3.3e9 * 0.74 * autolink.CARRY_MARGIN)


def test_the_rate_is_linear_in_the_scale_and_a_cap_lowers_it_to_two_digits():
    exp = _case().runs[0]
    r10 = autoshare.wall_rate_bps(exp, 10)
    assert autoshare.wall_rate_bps(exp, 33) == pytest.approx(3.3 * r10)
    assert autoshare.capped(exp, 33, None) == 33
    assert autoshare.capped(exp, 33, 3.3 * r10) == 33
    assert autoshare.capped(exp, 33, 2.44 * r10) == 24


def test_a_path_that_carries_every_rate_is_probed_once_at_the_fastest_run():
    sh, path = _case(), Path()
    before = _rates(sh)
    rec = autolink.check(path, sh, [50, 50, 50], None)
    assert path.probed == [before["prfaas"]] == [max(_rates(sh, kv_only=True).values())]
    assert before["homogeneous"] > before["prfaas"]      # faster, but nothing on its kv link
    assert rec["cap_bps"] is None and rec["verified"] and len(rec["probes"]) == 1
    assert _rates(sh) == before and autolink.line(rec) == ""
    # when and how long: a run that takes the probe as its own (its measured_at) took that time
    assert rec["probes"][0]["measured_at"] > 0 and rec["probes"][0]["wall_s"] >= 0


def test_without_a_run_that_sends_kv_there_is_nothing_to_check():
    sh = autoshare.Shared(load_experiment(CASE, ["workload.arrival.rate=4/s"])[1:2])
    assert sh.target.run_label == "homogeneous" and not autoshare.sends_kv(sh.target_look)
    sh.record("homogeneous", 40.0, 10.0, [], 6.0)
    path = Path(share=0.5)
    rec = autolink.check(path, sh, [50], None)
    assert path.probed == [] and "no run sends KV" in rec["skipped"]
    assert autolink.line(rec) == ""


def test_a_path_that_falls_short_caps_every_run_and_is_probed_again_under_the_cap():
    """Occasion 7 (2026-12-03): homogeneous at 33 had a 3.3 Gbit/s link, 26% short."""
    sh = _case()
    homogeneous = _rates(sh)["homogeneous"]
    fastest = max(_rates(sh, kv_only=True).values())
    carry = 0.5 * fastest
    path = Path(carry_bps=carry)
    rec = autolink.check(path, sh, [50, 50, 50], None)
    assert path.probed[0] == fastest and len(path.probed) == 2
    assert path.probed[1] <= carry                        # the second link was carried
    assert rec["verified"] and rec["cap_bps"] == pytest.approx(carry * autolink.CARRY_MARGIN)
    rates = _rates(sh, kv_only=True)
    assert max(rates.values()) <= rec["cap_bps"]
    assert min(rates.values()) >= 0.5 * rec["cap_bps"]    # lowered to the cap, not far below
    assert _rates(sh)["homogeneous"] == homogeneous       # no KV: not capped
    assert sh.scale_for(sh.target, 50) <= sh.uncapped(sh.target, 50)
    assert "capped at" in autolink.line(rec) and "50% of its payload rate" in autolink.line(rec)


def test_a_path_short_at_every_rate_says_the_cap_is_not_verified():
    sh, path = _case(), Path(share=0.8)
    rec = autolink.check(path, sh, [50, 50, 50], None)
    assert len(path.probed) == autolink.CHECKS and not rec["verified"]
    assert path.probed[1] < path.probed[0]
    assert rec["cap_bps"] == pytest.approx(path.probed[-1] * 0.8 * autolink.CARRY_MARGIN)
    assert "not verified" in autolink.line(rec)


def test_a_shortfall_that_would_not_have_held_back_the_pilots_transfers_caps_nothing():
    """2026-12-07 04:02: the check's probe at 14x carried 87% of its rate and capped prfaas and
    naive at 11; twice that (22), on networks of their own, their probes carried 99%. The run
    judges its own probe's shortfall by whether it bore on its KV transfers
    (`fidelity.link_shortfall`): so does the check, on the pilot's largest faithful step."""
    asked = []

    def bears(verdict):
        def judge(result):
            asked.append(result["deviation"]["goodput"])
            return {"warning": result["warnings"][0], "carried": 1 + result["deviation"]["goodput"],
                    "transfers": 52, "link_bound": 0, "samples_above": 0, "bears": verdict}
        return judge
    sh, path = _case(), Path(share=0.87)
    rec = autolink.check(path, sh, [50, 50, 50], None, bears=bears(False))
    assert len(path.probed) == 1 and rec["cap_bps"] is None and rec["verified"]
    assert asked == [pytest.approx(-0.13)] and rec["probes"][0]["spared"]["transfers"] == 52
    assert "carried 87% of its payload rate, which would have held back none of the pilot's 52" \
        in autolink.line(rec)
    sh, path = _case(), Path(share=0.87)
    rec = autolink.check(path, sh, [50, 50, 50], None, bears=bears(True))
    assert rec["cap_bps"] is not None and rec["probes"][0]["spared"] is None
    sh, path = _case(), Path(share=0.87)
    rec = autolink.check(path, sh, [50, 50, 50], None, bears=lambda result: None)
    assert rec["cap_bps"] is not None            # cannot tell: the careful side


def test_without_a_faithful_step_the_shortfall_test_cannot_tell(tmp_path):
    assert autolink.shortfall_bears(None)({"warnings": []}) is None
    assert autolink.shortfall_bears(tmp_path / "time10")({"warnings": []}) is None


def test_each_probe_is_the_probe_of_the_runs_on_its_link():
    """The fastest run, uncapped, and every capped run on the link probed at the cap take the
    check's probe as theirs (measure.LinkProbes, shared) instead of measuring again."""
    from testbed.measure import LinkProbes, wan_meta
    from testbed.net.tcp import congestion_control
    sh, path, probes = _case(), Path(carry_bps=2e9), LinkProbes()
    cc = congestion_control(sh.target.network.congestion_control)
    rec = autolink.check(path, sh, [50, 50, 50], None, probes, "prfaas")
    for p, rate in zip(rec["probes"], path.probed):
        path.rate = rate
        fid = probes.fidelity("a run", wan_meta("mininet", path.describe(), cc),
                              lambda: pytest.fail("measured again"))
        assert fid["shared"] and fid["measured_in"] == "prfaas (the pilot's link check)"
        assert fid["deviation"]["goodput"] == pytest.approx(min(2e9, rate) / rate - 1)


def _many(chosen=10.0):
    sh = autoshare.Shared(load_experiment(MANY))
    sh.record(sh.target.run_label, chosen, 5.0, [], 6.0)
    return sh


def test_a_round_trip_off_by_the_calibration_is_corrected_and_keeps_its_scale():
    """2026-12-06: many_instances' probes 68 us late at 8.4x, 101 us early at 6.8x, 139 us
    early at 14x, each after the start's calibration: the check corrects the calibration by
    the error and the probe after it is within its bound; no run slows down."""
    for off in (0.068, -0.101, -0.139):
        sh, path = _many(), Path(miscalibrated_ms=off)
        rec = autolink.check(path, sh, [50], None)
        assert path.corrected == [pytest.approx(off)] and len(path.probed) == 2
        assert rec["verified"] and rec["rtt_floor_ms"] is None and rec["cap_bps"] is None
        assert rec["probes"][0]["corrected_ms"] == pytest.approx(off)
        assert sh.scale_for(sh.target, 50) == 10.0
        assert "the link's calibration corrected by" in autolink.line(rec)


def test_a_round_trip_the_machine_makes_late_is_floored_after_one_correction():
    """The delay line late now (no calibration takes that away): one correction, then the
    floor keeps the lateness at RTT_MARGIN of the 5% bound, and the probe there is within it."""
    sh = _many()
    path = Path(late_ms=0.068)
    path.correct_round_trip = lambda off_ms: {"corrections_ms": [off_ms]}    # changes nothing
    rtt10 = autoshare.wall_rtt_ms(sh.target, 10.0)
    assert rtt10 == pytest.approx(1.0)                   # 10 ms at 10x
    rec = autolink.check(path, sh, [50], None)
    floor = 0.068 / (0.05 * autolink.RTT_MARGIN)
    assert rec["rtt_floor_ms"] == pytest.approx(floor) and rec["cap_bps"] is None
    assert len(path.probed) == 3 and rec["verified"]
    assert [p.get("corrected_ms") is not None for p in rec["probes"]] == [True, False, False]
    scale = sh.scale_for(sh.target, 50)
    assert scale == autoshare.round_down(10.0 * rtt10 / floor) == 6.6
    assert autoshare.wall_rtt_ms(sh.target, scale) >= floor
    assert path.probed[2] == pytest.approx(autoshare.wall_rate_bps(sh.target, scale))
    assert "round trips kept at 1.5 ms" in autolink.line(rec) and "+7% off" in autolink.line(rec)


def test_without_a_calibration_to_correct_the_round_trip_is_floored_at_once():
    sh, path = _many(), Path(late_ms=-0.101, calibrated=False)
    rec = autolink.check(path, sh, [50], None)
    assert rec["rtt_floor_ms"] == pytest.approx(0.101 / (0.05 * autolink.RTT_MARGIN))
    assert rec["verified"] and len(path.probed) == 2 and "-10% off" in autolink.line(rec)


def test_a_probe_in_a_slow_spell_corrects_and_the_probe_after_it_judges():
    """A spell that lasts through the check is the path's cost for the run: corrected, the
    probe after it is within its bound and the run keeps its scale (2026-12-07 02:05: a floor
    on it ran many_instances at 2.2x instead of 8.6x). A spell that ends leaves the path early
    by what was corrected: that probe measures it and the round trip is floored."""
    sh, path = _many(), Path(miscalibrated_ms=0.068, slowness=1.6)
    rec = autolink.check(path, sh, [50], None)
    assert path.corrected == [pytest.approx(0.068)] and rec["verified"]
    assert rec["rtt_floor_ms"] is None and sh.scale_for(sh.target, 50) == 10.0
    sh, path = _many(), Path(slowness=1.6)
    spell = path.probe
    path.probe = lambda cc: (setattr(path, "late_ms", 0.068 if not path.probed else 0.0),
                             spell(cc))[1]
    rec = autolink.check(path, sh, [50], None)
    assert rec["probes"][1]["rtt_off_ms"] == pytest.approx(-0.068)
    assert path.corrected == [pytest.approx(0.068), pytest.approx(-0.034)] and rec["verified"]
    assert rec["rtt_floor_ms"] is None and sh.scale_for(sh.target, 50) == 10.0


def test_a_correction_that_overshot_moves_halfway_back_and_then_floors():
    """2026-12-07 03:06: many_instances' probe at 13x read 0.30 ms early, the one after the
    correction 0.15 ms late: the path's offset is between, each reading carries noise. The
    second correction is half the second error; still off the same way after it, floored."""
    sh, path = _many(), Path(miscalibrated_ms=-0.30)
    noise = iter([0.0, 0.15, 0.0, 0.0])
    spell = path.probe
    path.probe = lambda cc: (setattr(path, "late_ms", next(noise)), spell(cc))[1]
    rec = autolink.check(path, sh, [50], None)
    assert path.corrected == [pytest.approx(-0.30), pytest.approx(0.075)]
    assert rec["probes"][2]["rtt_off_ms"] == pytest.approx(-0.075)
    assert rec["rtt_floor_ms"] == pytest.approx(0.075 / (0.05 * autolink.RTT_MARGIN))
    assert len(path.probed) == 4 and rec["verified"]
    line = autolink.line(rec)
    assert "corrected by -0.30 ms" in line and line.count("calibration corrected by") == 2


def test_a_round_trip_within_its_bound_floors_nothing():
    sh, path = _many(), Path(late_ms=0.045)      # under the 0.05 ms floor of the bound
    rec = autolink.check(path, sh, [50], None)
    assert rec["rtt_floor_ms"] is None and len(path.probed) == 1 and rec["verified"]
    assert path.corrected == [] and sh.scale_for(sh.target, 50) == 10.0
    assert autolink.line(rec) == ""


def test_a_short_goodput_lowers_the_rate_first_and_the_round_trip_is_measured_again():
    """A probe that fell short says the machine did not keep up at that rate, its RTT with it:
    its round trip is neither corrected nor floored; the probe under the cap acts on it."""
    sh = _many()
    fastest = autoshare.wall_rate_bps(sh.target, 10.0)
    path = Path(carry_bps=0.85 * fastest, miscalibrated_ms=0.068)
    rec = autolink.check(path, sh, [50], None)
    first, second = rec["probes"][:2]
    assert first["cap_bps"] is not None and first.get("corrected_ms") is None
    assert second["cap_bps"] is None and second["corrected_ms"] == pytest.approx(0.068)
    assert len(path.probed) == 3 and rec["verified"] and rec["rtt_floor_ms"] is None
    assert "capped at" in autolink.line(rec) and "calibration corrected" in autolink.line(rec)


def test_a_wan_without_delay_has_no_round_trip_to_floor():
    exp = _case().runs[0]
    assert autoshare.wall_rtt_ms(exp, 20.0) == 0.0
    assert autoshare.rtt_floored(exp, 20.0, 5.0) == 20.0
    assert autoshare.rtt_floored(exp, 20.0, None) == 20.0
