"""`scale.time: auto`'s link check (testbed/autolink.py): the pilot's network probed at the
fastest run's kv link, every run's scale lowered where the path carried less. No root: the
backend here is a path that carries at most a given rate."""

import pytest

from testbed import autolink, autoshare
from testbed.config import load_experiment

CASE = "experiments/paper_case_study.yaml"


class Path:
    """A backend whose kv path carries at most `carry_bps` of a link's rate, or `share` of
    it (a machine that falls short at any rate); records the rates probed."""

    def __init__(self, carry_bps=float("inf"), share=1.0):
        self.carry, self.share, self.probed, self.rate = carry_bps, share, [], None

    def rescale(self, deployment, events=None):
        self.rate = deployment.links["kv"].rate_bps
        return self

    def describe(self):
        return {"shaping": {"backend": "userspace", "emulated": {"kv": {"rate": self.rate}}},
                "segmentation_offload": True, "tcp_timers": {"rto_min_ms": 5}}

    def probe(self, congestion_control):
        self.probed.append(self.rate)
        got = min(self.carry, self.share * self.rate)
        dev = got / self.rate - 1
        warn = [f"goodput deviates {100 * dev:+.0f}% from configured"] if dev < -0.1 else []
        return {"measured": {"goodput_bps": 0.956 * got}, "deviation": {"goodput": dev},
                "warnings": warn, "slowness": 0.4}


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
    assert rec["cap_bps"] == pytest.approx(path.probed[1] * 0.8 * autolink.CARRY_MARGIN)
    assert "not verified" in autolink.line(rec)


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
