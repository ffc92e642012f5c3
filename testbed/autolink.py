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

Place in the architecture: between `testbed.autoscale` (its Pilot calls `check` on the
network it built) and `testbed.autoshare` (which applies the cap to every run's scale).
"""

import time

from testbed import deploy
from testbed.autoshare import sends_kv, wall_rate_bps
from testbed.errors import ConfigError, TestbedError
from testbed.measure import wan_meta
from testbed.net.probe import DEVIATION_WARN
from testbed.net.tcp import congestion_control

CARRY_MARGIN = 0.95     # a cap: this share of the rate the probe's link carried
CHECKS = 2              # probes: at the fastest run's link, then once more under the cap


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


def check(backend, shared, ceilings, events, link_probes=None, label=""):
    """Probe the kv link of `backend` (the pilot's network, `shared.target`'s deployment) at the
    fastest run's rate, cap `shared`'s runs where it fell short, and probe again under the cap;
    the record for metadata.json's `scale_auto.link_check`. Each probe goes to `link_probes`
    (the experiment's `measure.LinkProbes`): a run on the same WAN at the same scale takes it
    as its own, shared, marked "`label` (the pilot's link check)". The backend is left at the
    last scale probed (the measured run carries it over to its own)."""
    target, probes, cap, t0 = shared.target, [], None, time.monotonic()
    cc = congestion_control(target.network.congestion_control)
    rate_bps = fastest(shared, ceilings)
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
        rate = dep.links["kv"].rate_bps
        cap = shortfall_cap(result, rate)
        probes.append({"scale": round(scale, 4), "rate_bps": rate,
                       "goodput_bps": result["measured"].get("goodput_bps"),
                       "deviation": result.get("deviation"), "warnings": result["warnings"],
                       "slowness": result.get("slowness"), "cap_bps": cap,
                       "measured_at": at, "wall_s": round(time.monotonic() - t1, 3)})
        if cap is None:
            break
        old = shared.pilot.get("link_cap_bps")
        shared.pilot["link_cap_bps"] = cap if old is None else min(old, cap)
        rate_bps = fastest(shared, ceilings)        # the fastest run under the cap
    return {"probes": probes, "cap_bps": shared.pilot.get("link_cap_bps"),
            "verified": bool(probes) and "error" not in probes[-1] and cap is None,
            "carry_margin": CARRY_MARGIN, "wall_s": round(time.monotonic() - t0, 3)}


def line(record):
    """What the check adds to the choice's line: '' when nothing was capped."""
    cap = record.get("cap_bps")
    if cap is None:
        return ""
    first = record["probes"][0]
    how = "" if record["verified"] else ", not verified"
    return (f"; kv links capped at {cap / 1e9:.3g} Gbit/s wall clock: the link at "
            f"{first['scale']:g}x carried {100 * (1 + first['deviation']['goodput']):.0f}% of "
            f"its payload rate{how} (check {record['wall_s']:.1f} s)")
