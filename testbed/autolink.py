"""`scale.time: auto`'s link check: the pilot's steps run no link probe, so after them the kv
link is probed on the pilot's network at the fastest wall-clock rate any run of the experiment
would take; where the machine's path carried less than linktest's tolerance of it, every run's
scale is lowered until its kv link is within what was carried (issue 22, item 2).

Why: the pilot judges its steps by the run's guards on the requests, and a link that this
machine's TCP and shaping cannot carry at a scale shows only in the run's own link probe. On
2026-12-03 (docs/performance.md, occasion 7) homogeneous took 33x from the case study's pilot,
a 3.3 Gbit/s emulated link of which the probe measured 26% less: a warning at the choice that
no pilot step could have seen.

How: probe at the fastest rate of the runs that send KV across the WAN (`fastest`: a run that
sends none, such as the case study's homogeneous, is neither probed for nor capped); a
goodput short by more than
`probe.DEVIATION_WARN` caps the rate at `CARRY_MARGIN` of what it carried (`shortfall_cap`),
and the runs' scales are taken again under the cap (`autoshare.capped`) and probed once more
at the new fastest, up to `CHECKS` probes; the record says whether the last one was within
tolerance (`verified`). The probe is the run's (`backend.probe`: measured again once in a
slow spell, testbed/net/calibrate.py), so a spell that outlasts it lowers the scale: the
careful side. The cap assumes the runs' links alike but for their rate (the case study's
are); a run whose kv link has loss is carried per frame, slower, and its own probe says so.

The round trip: a probe whose goodput was within tolerance but whose RTT p50 was off by more
than the probe's bound (`probe.rtt_limit`: 5% of the configured RTT, at least 0.05 ms), late or
early, first corrects the link's calibration by that error (`backend.correct_round_trip`,
`testbed.net.calibrate.correct`): the calibration's two passes at the network's start are a few
hundred echoes in one moment, and on 2026-12-06 they left many_instances' round trip (5 ms each
way) 68 us late at 8.4x (+6%, a warning at the choice), 101 us early at 6.8x (-7%, a warning)
and 139 us early at 14x (-19%). A probe after the correction off the other way moves it
halfway back (`correction`: each probe reads the offset plus its own noise). Where a probe
after a correction is off the same way again, the error is the machine's now (the delay
line's lateness, wall-clock time, about the same at any scale) and every run's wall-clock
round trip is floored where that error is `RTT_MARGIN` of the bound (`rtt_floor_ms`,
`autoshare.rtt_floored`): a faster run has less round trip to hide it in. The case study's
WAN has no delay: nothing to correct or floor.

Place in the architecture: between `testbed.autoscale` (its Pilot calls `check` on the
network it built) and `testbed.autoshare` (which applies the cap and the floor to every run's
scale).
"""

import time

from testbed import analysis, deploy, fidelity, rundir
from testbed.autoshare import sends_kv, wall_rate_bps
from testbed.errors import ConfigError, RunDirError, TestbedError
from testbed.measure import wan_meta
from testbed.net.probe import DEVIATION_WARN, deviation_warning, rtt_limit
from testbed.net.tcp import congestion_control

CARRY_MARGIN = 0.95     # a cap: this share of the rate the probe's link carried
CHECKS = 4              # probes: at the fastest run's link, then after a cap, a correction
                        # of the calibration (or two) and a floor of the round trip
RTT_MARGIN = 0.9        # a floor: the lateness at this share of the probe's RTT bound


def shortfall_cap(result, rate_bps):
    """The cap (wall-clock bit/s) that a probe of a `rate_bps` link implies: None where its
    goodput was within linktest's tolerance or not measured; else `CARRY_MARGIN` of the rate
    it carried (goodput is compared with the payload share of the rate: `probe.compare`)."""
    dev = (result.get("deviation") or {}).get("goodput")
    if dev is None or dev >= -DEVIATION_WARN:
        return None
    return rate_bps * (1 + dev) * CARRY_MARGIN


def fastest(shared, ceilings):
    """The fastest kv link (wall-clock bit/s) of `shared`'s runs that send KV across it
    (`autoshare.sends_kv`) at the scales it gives them (`ceilings`: each run's, in order);
    None when no run sends any."""
    rates = [wall_rate_bps(exp, shared.scale_for(exp, ceilings[i]))
             for i, (exp, look) in enumerate(zip(shared.runs, shared.looks)) if sends_kv(look)]
    return max(rates, default=None)


def probe_scale(shared, ceilings, rate_bps):
    """The scale.time at which the piloted run's kv link runs at `rate_bps` (linear in the
    scale), at most its ceiling."""
    i, target = shared.index, shared.target
    base = shared.scale_for(target, ceilings[i])
    factor = rate_bps / wall_rate_bps(target, base)
    return base if abs(factor - 1) < 1e-9 else min(ceilings[i], base * factor)


def rtt_off_ms(result):
    """A probe's RTT p50 over the configured RTT (wall ms; below 0: early), or None."""
    measured = (result.get("measured") or {}).get("rtt_p50_ms")
    expected = ((result.get("configured") or {}).get("expected") or {}).get("rtt_ms")
    return None if measured is None or not expected else measured - expected


def rtt_floor_ms(result):
    """The shortest wall-clock RTT (ms) at which the error a probe measured on its round trip
    (`rtt_off_ms`, either way) stays within `RTT_MARGIN` of the probe's bound
    (`probe.rtt_limit`); None where the probe did not warn of its RTT. The error is wall-clock
    time, about the same at any scale (the delay line's lateness, what the calibration
    subtracts off the path's fixed cost now), and the configured RTT is inverse in the scale:
    a faster run has less of it to hide the error in."""
    dev = (result.get("deviation") or {}).get("rtt_p50")
    if not dev or deviation_warning("rtt_p50", dev) not in result["warnings"]:
        return None
    share, _ = rtt_limit(result.get("calibrated", True))
    return abs(rtt_off_ms(result)) / (share * RTT_MARGIN)


def shortfall_bears(step_dir):
    """`check`'s test of a goodput shortfall: would the rate a probe carried (its result) have
    held back any KV transfer of the pilot step in `step_dir` (the largest faithful one), or
    did its kv link ever carry more than that (`fidelity.link_shortfall`: the run's own
    judgement of its probe, in emulated time, so whatever the scale)? The result's
    `link_shortfall` record, or None where it cannot tell (no step, no such warning)."""
    def bears(result):
        if step_dir is None:
            return None
        try:
            run = rundir.load_run(step_dir)
            ts = fidelity.flag_artifacts(rundir.timeseries(step_dir), run.scale)
            return fidelity.link_shortfall(rundir.requests(step_dir), run, ts,
                                           analysis.links(run), {"link_fidelity": result})
        except (OSError, RunDirError, KeyError, ValueError):
            return None
    return bears


def check(backend, shared, ceilings, events, link_probes=None, label="", bears=None):
    """Probe the kv link of `backend` (the pilot's network, `shared.target`'s deployment) at the
    fastest run's rate and act on what it measured (`_act`: cap the runs' rate, correct the
    link's calibration, floor their round trip), then probe again; the record for
    metadata.json's `scale_auto.link_check`. Each probe goes to `link_probes` (the
    experiment's `measure.LinkProbes`): a run on the same WAN at the same scale takes it as
    its own, shared, marked "`label` (the pilot's link check)". The backend is left at the
    last scale probed (the measured run carries it over to its own). `bears`
    (`shortfall_bears`): a goodput shortfall that would not have held back any of the pilot's
    KV transfers caps nothing (the run's own probe is judged the same way: a note, not a
    warning); without it every shortfall caps."""
    target, probes, t0 = shared.target, [], time.monotonic()
    cc = congestion_control(target.network.congestion_control)
    rate_bps, acted = fastest(shared, ceilings), []
    if rate_bps is None:
        return {"skipped": "no run sends KV across the WAN (the planner's egress)"}
    for _ in range(CHECKS):
        scale = probe_scale(shared, ceilings, rate_bps)
        try:
            dep = deploy.compile(target.at_speed(scale))
            at, t1 = time.time(), time.monotonic()
            result = backend.rescale(dep, events).probe(cc)
        except (ConfigError, TestbedError) as e:
            probes.append({"scale": round(scale, 4), "error": f"{type(e).__name__}: {e}"})
            break
        if link_probes is not None:
            link_probes.adopt(wan_meta(target.backend.kind, backend.describe(), cc),
                              f"{label} (the pilot's link check)", at, result)
        probes.append(_probe_record(result, dep.links["kv"].rate_bps, scale, at, t1, bears))
        done = [p["corrected_ms"] for p in probes if p.get("corrected_ms") is not None]
        acted.append(_act(backend, shared.pilot, probes[-1], done))
        if acted[-1] in (None, "kept"):
            break
        rate_bps = fastest(shared, ceilings)        # the fastest run now
    return {"probes": probes, "cap_bps": shared.pilot.get("link_cap_bps"),
            "rtt_floor_ms": shared.pilot.get("rtt_floor_ms"),
            "verified": bool(probes) and "error" not in probes[-1] and acted[-1:] == [None],
            "carry_margin": CARRY_MARGIN, "rtt_margin": RTT_MARGIN,
            "wall_s": round(time.monotonic() - t0, 3)}


def _probe_record(result, rate_bps, scale, at, t1, bears=None):
    """One probe of the check as its record holds it, with the cap and floor it implies (a
    probe short of goodput implies no floor: the machine did not keep up at that rate, its
    round trip with it, so the rate comes down first and the next probe measures it again;
    a shortfall that `bears` says would not have held back the pilot's KV transfers implies
    no cap: `spared`)."""
    cap, spared = shortfall_cap(result, rate_bps), None
    if cap is not None and bears is not None:
        short = bears(result)
        if short is not None and not short["bears"]:
            cap, spared = None, short
    return {"scale": round(scale, 4), "rate_bps": rate_bps, "spared": spared,
            "goodput_bps": result["measured"].get("goodput_bps"),
            "deviation": result.get("deviation"), "warnings": result["warnings"],
            "slowness": result.get("slowness"), "cap_bps": cap,
            "rtt_off_ms": rtt_off_ms(result),
            "rtt_floor_ms": None if cap or spared else rtt_floor_ms(result),
            "measured_at": at, "wall_s": round(time.monotonic() - t1, 3)}


def _act(backend, pilot, probe, corrections):
    """What the check does after `probe` (its record), into `pilot` (the shared outcome):
    take its cap ('capped'); or, its round trip off, correct the link's calibration
    (`correction`, `backend.correct_round_trip`: 'corrected'; the next probe measures what is
    left), and else floor the round trip ('floored'; 'kept' where the floor in force was
    already that high: a probe at it was off again, and another would only repeat it); None:
    nothing to do, the probe was within tolerance. `corrections`: the check's corrections so
    far (ms). A probe in a slow spell corrects too, and the probe after it judges: a spell
    that ends leaves the path early by what was corrected, which that probe measures; one
    that lasts (2026-12-07 02:05: many_instances 197 us late at 8.6x, 184 us at 2.2x) was the
    path's cost for the run, and a floor on it ran many_instances 4x slower than it needed."""
    if probe["cap_bps"] is not None:
        old = pilot.get("link_cap_bps")
        pilot["link_cap_bps"] = probe["cap_bps"] if old is None else min(old, probe["cap_bps"])
        return "capped"
    if probe["rtt_floor_ms"] is None:
        return None
    by = correction(probe["rtt_off_ms"], corrections)
    if by is not None and backend.correct_round_trip(by) is not None:
        probe["corrected_ms"], probe["rtt_floor_ms"] = by, None
        return "corrected"
    old = pilot.get("rtt_floor_ms") or 0.0
    if probe["rtt_floor_ms"] <= old:
        return "kept"
    pilot["rtt_floor_ms"] = probe["rtt_floor_ms"]
    return "floored"


def correction(off_ms, corrections):
    """How much to correct the calibration by after a probe `off_ms` off, the check having
    corrected it by `corrections` so far; None: no more. The first correction is the whole
    error. A probe after it off the other way says the first overshot: each probe read the
    path's offset plus its own noise (2026-12-07 03:06: many_instances' first probe at 13x
    0.30 ms early, the one after the correction 0.15 ms late), so the second moves the
    calibration halfway back, to the mean of the two readings. Off the same way again, the
    error is the delay line's own lateness now, which no calibration removes: floored."""
    if not corrections:
        return off_ms
    if len(corrections) == 1 and off_ms * corrections[0] < 0:
        return off_ms / 2
    return None


def line(record):
    """What the check adds to the choice's line: '' when it lowered and corrected nothing."""
    cap, floor = record.get("cap_bps"), record.get("rtt_floor_ms")
    out = _corrections(record) + _spared(record)
    if cap is not None:
        first = next(p for p in record["probes"] if p.get("cap_bps") is not None)
        out.append(f"kv links capped at {cap / 1e9:.3g} Gbit/s wall clock: the link at "
                   f"{first['scale']:g}x carried "
                   f"{100 * (1 + first['deviation']['goodput']):.0f}% of its payload rate")
    if floor is not None:
        first = next(p for p in record["probes"] if p.get("rtt_floor_ms") is not None)
        out.append(f"round trips kept at {floor:.2g} ms wall clock at least: the link at "
                   f"{first['scale']:g}x measured {100 * first['deviation']['rtt_p50']:+.0f}% off")
    if not out:
        return ""
    how = "" if record["verified"] else ", not verified"
    return f"; {'; '.join(out)}{how} (check {record['wall_s']:.1f} s)"


def _corrections(record):
    """The check's corrections of the link calibration, a phrase each."""
    return [f"the link's calibration corrected by {p['corrected_ms']:+.2f} ms (the link at "
            f"{p['scale']:g}x measured {100 * p['deviation']['rtt_p50']:+.0f}% off)"
            for p in record.get("probes", ()) if p.get("corrected_ms") is not None]


def _spared(record):
    """The check's goodput shortfalls that capped nothing, a phrase each."""
    return [f"the kv link at {p['scale']:g}x carried {100 * p['spared']['carried']:.0f}% of "
            f"its payload rate, which would have held back none of the pilot's "
            f"{p['spared']['transfers']} KV transfers: not capped"
            for p in record.get("probes", ()) if p.get("spared")]
