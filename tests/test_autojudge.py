"""`scale.time: auto`'s judgement, jump and budget (testbed/autojudge.py) on recorded pilot
steps: the 2026-12-02 pilots of the case study (600 requests offered at 4/s) and of
many_instances (tests/data/pilot_steps.json: each step's summary, wall time and per-request
TTFT excess, and the measured run that followed). No root."""

import dataclasses
import json
import math
import pathlib

import pandas as pd
import pytest

from testbed import autojudge, autoscale
from testbed.config import load_experiment

DATA = pathlib.Path(__file__).parent / "data" / "pilot_steps.json"
RECORDED = json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def outlooks():
    """The planner's outlook of each measured run, as the pilot computes it before any step."""
    out = {}
    for exp in load_experiment("experiments/paper_case_study.yaml", ["workload.arrival.rate=4/s"]):
        out[f"case-{exp.run_label}"] = autojudge.outlook(exp.at_speed(10))
    out["many"] = autojudge.outlook(load_experiment("experiments/many_instances.yaml")[0])
    return out


def _look(outlooks, name):
    return outlooks["many" if name.startswith("many") else name.rstrip("-2")]


def _step(name, scale, outlooks):
    st = RECORDED[name]["steps"][scale]
    return autoscale.step_of(float(scale), st["summary"], st["wall_s"], None,
                             pd.DataFrame(st["requests"]), _look(outlooks, name))


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_planner_expects_the_measured_runs_ttft_p90_within_5_percent(name, outlooks):
    measured = RECORDED[name]["run"]["p90_ttft_ms"]
    assert _look(outlooks, name).ttft_p90_ms == pytest.approx(measured, rel=0.05)


def test_the_steady_excess_leaves_out_the_warm_up():
    """Homogeneous at 28x: the whole pilot's p90 1557 ms, its second half's 247 ms, the full
    run's at 28x 321 ms (es-auto-1/twice-homogeneous)."""
    st = RECORDED["case-homogeneous"]["steps"]["28"]
    steady = autojudge.steady_excess_p90_ms(pd.DataFrame(st["requests"]))
    assert steady == pytest.approx(247, abs=1)
    assert st["summary"]["emulation"]["ttft_excess_ms"]["share_p90"] > autojudge.WARN_SHARE
    assert autojudge.steady_excess_p90_ms(pd.DataFrame({"id": [1]})) is None


@pytest.mark.parametrize("name, scale", [("case-homogeneous", "28"), ("case-homogeneous", "20"),
                                         ("case-naive", "28")])
def test_steps_that_warned_only_for_their_own_short_queue_are_faithful(name, scale, outlooks):
    """These steps warned (TTFT excess 9-11% of the pilot's own p90) and nothing else; full
    runs at 28 (homogeneous) and 40 (naive) had 0.2% and 1.2-1.6%."""
    step = _step(name, scale, outlooks)
    assert _look(outlooks, name).above_capacity
    assert step.excess_share_p90 > autojudge.WARN_SHARE
    assert step.faithful and step.steady_share < autojudge.WARN_SHARE


def test_above_capacity_the_steady_excess_counts_four_times(outlooks):
    """prfaas at 40x: the pilot's steady excess p90 was 479 ms (1.6% of the run's 29 s); the
    full run at 40x (2026-12-02 22:47) measured 1878 ms, 6.5%, and warned. Times 4 the pilot
    says so; many_instances, below capacity, counts its excess once."""
    step = _step("case-prfaas", "40", outlooks)
    assert step.steady_excess_p90_ms == pytest.approx(479, abs=1)
    assert not step.faithful and step.steady_share == pytest.approx(4 * 479 / 29415, rel=0.01)
    assert "TTFT excess 6.5% of p90" in autoscale.why_not(step)
    # the verdict's sampling error, recorded beside it: the p90 of the 20 steady requests
    lo, hi = step.steady_share_interval
    assert lo <= step.steady_share <= hi and hi > 1.1 * lo
    assert f"(90% interval {100 * lo:.2g}-{100 * hi:.2g}%)" in autoscale.why_not(step)
    assert not outlooks["many"].above_capacity and outlooks["many"].length_factor == 1.0


def test_every_other_guard_still_decides(outlooks):
    """naive at 28 and 40 (the second occasion): a KV transfer over the link model."""
    for scale in ("28", "40"):
        step = _step("case-naive-2", scale, outlooks)
        assert not step.faithful and step.steady_share < autojudge.WARN_SHARE
        assert "KV transfers" in autoscale.why_not(step)


def test_many_instances_keeps_its_bound_near_the_full_runs():
    """Below capacity the pilot's p90 is the run's: the guard stays (5.0% at 20x warns)."""
    look = autojudge.Outlook(150, 3495.1, 1.1)
    st = RECORDED["many-1"]["steps"]["20"]
    step = autoscale.step_of(20.0, st["summary"], st["wall_s"], None,
                             pd.DataFrame(st["requests"]), look)
    assert not step.faithful and step.steady_share == pytest.approx(0.0504, abs=1e-3)


def test_the_queue_p90_of_a_run_above_capacity():
    assert autojudge.queue_p90_ms(600, 4.0, 2.0) == pytest.approx(0.9 * 600 * 0.25 * 1e3)
    assert autojudge.queue_p90_ms(600, 2.0, 4.0) is None
    assert autojudge.queue_p90_ms(600, 4.0, None) is None


@pytest.mark.parametrize("share, lag, factor", [
    (0.0025, 2.4, 4.0),              # prfaas at 10x: 20x headroom (the lag): capped at 4
    (0.0325, 3.5, 1.4),              # many_instances at 10x: 1.5x headroom: at least 1.4
    (0.0125, 50 / 9, 2.0),           # 4x headroom on the share, 9x on the lag: sqrt(4)
    (None, None, 4.0),
])
def test_the_jump_is_the_square_root_of_the_headroom_within_its_bounds(share, lag, factor):
    m = autojudge.margin(share, lag)
    assert autojudge.jump(m) == pytest.approx(factor)
    if math.isfinite(m):
        assert factor == pytest.approx(min(4.0, max(1.4, math.sqrt(m))))


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_expected_run_wall_time_from_the_first_step(name, outlooks):
    """From the first step alone, the measured run's wall time within 0.65-1.1x of what it
    took (the run also probes the link, which the pilot does not)."""
    rec = RECORDED[name]
    first = _step(name, next(iter(rec["steps"])), outlooks)
    expected = autojudge.expected_run_s(first, _look(outlooks, name), 40, rec["run"]["scale"])
    assert 0.65 <= expected / rec["run"]["wall_s"] <= 1.1


def test_the_budget_allows_a_measurement_and_its_confirmation_then_20_percent(outlooks):
    look = _look(outlooks, "many-1")
    s10 = _step("many-1", "10", outlooks)
    assert autojudge.within_budget([], 0.0, look, 40, 10)
    assert autojudge.within_budget([s10], 24.0, look, 40, 14)       # MIN_STEPS
    s14 = _step("many-1", "14", outlooks)
    assert not autojudge.within_budget([s10, s14], 46.0, look, 40, 12)
    long_run = autojudge.Outlook(15_000, look.ttft_p90_ms, look.serve_rate)   # ~100x longer
    assert autojudge.within_budget([s10, s14], 46.0, long_run, 40, 12)


def test_the_search_on_recorded_steps_jumps_by_the_headroom(outlooks):
    """prfaas: at 10x the steady excess (x4) is 1% of the run's p90 and the lag 2.4 ms: 5x
    headroom, a jump of sqrt(5) to 22; 40x (recorded unfaithful) after a faithful 10 gives
    the geometric mean 20, unless the budget (two steps here) has ended the pilot."""
    s10, s40 = _step("case-prfaas", "10", outlooks), _step("case-prfaas", "40", outlooks)
    assert s10.faithful and s10.margin == pytest.approx(5, rel=0.02)
    assert autoscale.next_scale([s10], 10) == 22
    assert autoscale.next_scale([s10, s40], 10) == 20
    look = _look(outlooks, "case-prfaas")
    assert autoscale.next_scale([s10, s40], 10, lambda s: autojudge.within_budget(
        [s10, s40], s10.wall_s + s40.wall_s, look, 40, s)) is None


def _auto_run(d, start, end, pilot_s=None, probes=(), measured_at=None, auto=True):
    """A run directory as `cost.pilot_cost` reads it: summary.json and metadata.json."""
    d.mkdir(parents=True)
    (d / "summary.json").write_text("{}")
    meta = {"start_time": start, "end_time": end}
    if auto:
        meta["scale_auto"] = {"link_check": {"probes": [
            {"measured_at": at, "wall_s": w} for at, w in probes]}}
        if pilot_s is not None:         # the run that ran the experiment's pilot
            meta["scale_auto"]["pilot_s"] = pilot_s
    if measured_at is not None:         # its link probe was the check's
        meta["link_fidelity"] = {"measured_at": measured_at}
    (d / "metadata.json").write_text(json.dumps(meta))


def test_the_pilots_cost_against_the_runs_and_why_when_over_its_budget(tmp_path):
    """many_instances on 2026-12-07 15:54 (Intel VM): a pilot of 18.1 s, 4.0 s of it the link
    check's probe that the 10.4 s run took as its own: 14.1 s over 14.4 s, over the budget,
    and the line says what skips it. Three runs sharing a 5 s pilot: within it, no advice."""
    from testbed.profiling import cost
    _auto_run(tmp_path / "many", 100.0, 110.4, 18.1, probes=[(95.0, 4.0)], measured_at=95.0)
    pilot, runs, taken = cost.pilot_cost(tmp_path / "many")
    assert (pilot, runs, taken) == pytest.approx((14.1, 14.4, 4.0))
    line = autojudge.pilot_line(tmp_path / "many")
    assert line.startswith("scale.time auto: the pilot took 14.1 s, 97.9% of the runs' 14.4 s")
    assert "over its 20% budget" in line and "a fixed scale.time" in line
    assert "runs of 70 s or more together would hold it" in line      # 14.1 / 0.2
    for i, label in enumerate("abc"):
        _auto_run(tmp_path / "cs" / label, 10.0 * i, 10.0 * i + 9.0, 5.0 if i == 0 else None)
    assert cost.pilot_cost(tmp_path / "cs") == pytest.approx((5.0, 27.0, 0.0))
    assert autojudge.pilot_line(tmp_path / "cs") == (
        "scale.time auto: the pilot took 5.0 s, 18.5% of the runs' 27.0 s")
    _auto_run(tmp_path / "fixed", 0.0, 9.0, auto=False)
    assert cost.pilot_cost(tmp_path / "fixed") is None
    assert autojudge.pilot_line(tmp_path / "fixed") == ""


def test_the_decode_tail_a_steps_cut_skipped(tmp_path):
    """A pilot step's tail ran fast after its last first token (testbed/run.py): what it
    skipped is the last request's tokens still to come at the cut, each at the median step
    before it, and the measured run's expected wall time counts it (real-world seconds)."""
    from testbed.records import RunDir
    rd = RunDir(tmp_path)
    requests = pd.DataFrame({"id": [0, 1, 2], "first_token": [100.0, 101.0, None],
                             "output_len": [50, 50, 50]})
    assert autojudge.skipped_tail_s(rd, requests) is None          # no cut: nothing skipped
    rd.events.write_text("time,kind,detail\n101.05,pilot_tail,fault=pilot_tail occurrence=0 "
                         "fault_kind=slow target=ld0\n")
    before = [(0, 100.0 + 0.03 * i, 30.0) for i in range(1, 3)] + [(1, 101.0, None),
                                                                   (1, 101.03, 30.0)]
    after = [(i, 101.06 + 1e-4 * k, 0.03) for i in (0, 1) for k in range(10)]
    pd.DataFrame(before + after, columns=["id", "decode_time", "itl_decode_ms"]).to_parquet(
        rd.tokens)
    assert autojudge.skipped_tail_s(rd, requests) == pytest.approx(48 * 0.030)
    look = autojudge.Outlook(600, 3000.0, 3.0)
    cut = autoscale.Step(10.0, True, wall_s=4.0, span_s=1.5)
    whole = dataclasses.replace(cut, tail_s=48 * 0.030)
    assert autojudge.expected_run_s(whole, look, 40, 20) == pytest.approx(
        autojudge.expected_run_s(cut, look, 40, 20) + 48 * 0.030 / 20)
