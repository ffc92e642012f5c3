"""Delay-line calibration: the link path's fixed cost, measured at start and subtracted.

Place in the architecture: the builders (`testbed.net.build.Network`, `testbed.net.pair.
routed_pair`) call `calibrate` right after `Wan.start`, before anything else uses the link. With
the userspace backend a packet crossing the WAN costs more than its configured delay: the
NFQUEUE round trip into `tb-delayline` and back, the delay line's wake-up (its releases come tens
of microseconds late), and the end hosts' own stack and wake-up, which a 0 ms link shows alone
(docs/link.md, "Calibration"). netem users calibrate that away; so does this module:

1. with the configured delays installed, it measures the median RTT of 200 UDP echoes between
   the two probe ends (`testbed.net.probe.measure_rtt_ms`, the probe's own timing) on the idle
   link;
2. the excess over the configured RTT, split evenly over the directions that have a delay
   line, is each hop's fixed cost: the delay line holds packets that much less
   (`Wan.subtract_fixed_cost`);
3. a second measurement corrects what the first left (the cost shifts a little with the hold),
   unless it is already within half the probe's warning tolerance; it moves the cost by at most
   half, and no hop's cost is taken above MAX_COST_S (1 ms: a busy machine, not a fixed cost).

A round that falls in a slow spell measures more than the fixed cost: on these shared VMs the
hypervisor takes the cores away for seconds at a time (steal), and every hop of the path wakes
late. A calibration made in one subtracted 0.46-0.81 ms a hop where quiet ones subtract
0.23-0.29, and its link then read 1.57-1.68 ms against 2.00 (docs/link.md, "A calibration in a
slow spell"). The delay lines time their own releases, so each round reads how late they were
(`late_sum_ns` over the packets passed during the round): 60-130 us a packet in quiet rounds,
215-383 us in the spells measured. The end hosts wake late too, which spreads the RTTs: a quiet
round's median is 0.06-0.21 ms above its lower decile, a spell's 0.2-1.6 ms. A round later
than LATE_QUIET_US or spread more than SPREAD_QUIET_MS is measured again after a pause, up to
SPELL_TRIES times, and the least slow round is kept; when even that one is slow, `spell` says
so in one line (the builders print it, metadata.json keeps it).

The run's link probe (`measure_link`) then reports the residual. A configured delay below the
fixed cost cannot be emulated (the delay line holds 0 and the path still costs more):
`shortfall` says so in one line, naming the largest scale.time at which it could be.
"""

import time

from testbed.net.linkmodel import DIRECTIONS, needs_per_frame_packets
from testbed.net.probe import measure_rtt_ms

PROBES = 200            # as many as the link probe's (a median of 100 moved ~0.1 ms under load)
PASSES = 2
SETTLED, SETTLED_MS = 0.025, 0.025    # half of probe.RTT_WARN, RTT_WARN_FLOOR_MS
# The RTT quantile calibrated on: the probe's own (the median). The lower quartile was tried:
# steadier under other jobs' bursts, but it left the probe's median 0.16-0.2 ms above the
# configured RTT (docs/link.md). Other jobs' bursts on these shared cores can move a median by
# milliseconds (10.7 then 19.8 ms a second apart on a 10 ms link): the bounds below keep such a
# round from subtracting more than a fixed cost can be.
QUANTILE = 0.5
MAX_COST_S = 0.001      # idle cost measured here: 0.24-0.34 ms a hop; more is a busy machine
MAX_STEP = 0.5          # the second round moves the first round's cost by at most half
LATE_QUIET_US = 160     # a delay line's mean lateness a packet in a quiet round: 60-130 us
SPREAD_QUIET_MS = 0.3   # a quiet round's median RTT over its lower decile: 0.06-0.21 ms
LOW_Q = 0.1
SPELL_TRIES = 4         # rounds measured again when late (each ~1.2 s, plus the pause)
SPELL_PAUSE_S = 1.0
PROBE_TRIES = 1         # a link probe measured again when slow (~3.5 s, plus the pause)


def lateness_us(before, after):
    """Mean lateness (us a packet) of the delay lines' releases between two
    `Wan.delayline_counters()` reads, or None when none passed a packet."""
    late = passed = 0
    for d, a in after.items():
        b = before.get(d) or {}
        if "late_sum_ns" in a and "late_sum_ns" in b:
            late += a["late_sum_ns"] - b["late_sum_ns"]
            passed += a["passed"] - b["passed"]
    return late / passed / 1e3 if passed > 0 else None


def quiet_round(wan, src, dst, dst_ip, probes, tries=None):
    """(median RTT ms, the delay lines' lateness us a packet) of the least slow of up to
    1 + `tries` (SPELL_TRIES) rounds, measured again while a round is slow (`slowness`);
    whether that one is slow too; and the lateness of every round measured."""
    def measure():
        low, rtt = measure_rtt_ms(src, dst, dst_ip, probes, [LOW_Q, QUANTILE])
        return rtt, rtt - low
    rounds = _rounds(wan, measure, SPELL_TRIES if tries is None else tries)
    _, late, rtt = min(rounds, key=lambda r: (r[0], r[2]))
    return (rtt, late), rounds[-1][0] > 1.0, [_round(r[1]) for r in rounds]


def _rounds(wan, measure, tries, enough=lambda result: False, jitter_ms=None):
    """[(slowness, the delay lines' lateness us a packet, result)] of `measure()` ->
    (result, RTT spread ms) over `wan` (None: no delay lines here, `jitter_ms` the round
    trip's configured jitter), measured again after a pause while a round is slow and not
    `enough(result)`, up to `tries` more times."""
    if jitter_ms is None:
        jitter_ms = 0.0 if wan is None else 1e3 * sum(wan.links[d].jitter_s ** 2
                                                       for d in DIRECTIONS) ** 0.5
    rounds = []
    for i in range(1 + tries):
        if i:
            time.sleep(SPELL_PAUSE_S)
        before = wan.delayline_counters() if wan is not None else {}
        result, spread_ms = measure()
        late = lateness_us(before, wan.delayline_counters()) if wan is not None else None
        rounds.append((slowness(late, spread_ms, jitter_ms), late, result))
        if rounds[-1][0] <= 1.0 or enough(result):
            break
    return rounds


def slowness(late_us, spread_ms, jitter_ms=0.0):
    """How far a round is from quiet: the larger of its delay lines' lateness over
    LATE_QUIET_US and its median RTT's distance from the lower decile over SPREAD_QUIET_MS
    (plus twice the configured jitter of the round trip, `jitter_ms`: 1.28 standard deviations
    of a normal jitter are its own). Above 1 is a slow spell."""
    return max(0.0 if late_us is None else late_us / LATE_QUIET_US,
               spread_ms / (SPREAD_QUIET_MS + 2 * jitter_ms))


def calibrate(wan, src, dst, dst_ip, probes=PROBES, passes=PASSES):
    """Measure and subtract the fixed cost of `wan` (a started `Wan`) between the namespaces
    `src` and `dst` (`dst_ip` in `dst`). Returns None when there is no delay line to calibrate
    (netem, or no delay configured) or a direction starts down, else {"fixed_cost_ms": {dir:
    per hop}, "rtt_ms": [the median RTT of each pass], "late_us": [each pass's rounds' delay-
    line lateness, us a packet], "configured_rtt_ms", "short": [directions whose delay is below
    their fixed cost], "spell": a line when a pass kept a round in a slow spell, else None}."""
    dirs = wan.delaylines() if wan.backend == "userspace" else []
    if not dirs or not all(wan.links[d].up for d in DIRECTIONS):
        return None     # nothing to calibrate, or no echo can come back (a link starts down)
    configured_ms = 1e3 * sum(wan.links[d].delay_s for d in DIRECTIONS)
    cost_s = dict.fromkeys(dirs, 0.0)
    rtts, lates, spell = [], [], None
    for _ in range(passes):
        (rtt, late), slow, tried = quiet_round(wan, src, dst, dst_ip, probes)
        rtts.append(rtt)
        lates.append(tried)
        if slow:
            spell = (f"the link calibration ran in a slow spell in all {len(tried)} rounds it "
                     f"measured (the one kept: delay lines {late or 0:.0f} us late a packet, "
                     f"quiet under {LATE_QUIET_US}, or its RTTs spread), so the fixed cost it "
                     f"subtracts may be too large and the emulated delay short; the link "
                     f"probe reports the residual")
        if len(rtts) > 1 and abs(rtt - configured_ms) <= max(SETTLED_MS, SETTLED * configured_ms):
            short = []
            break       # within half the probe's warning tolerance: do not chase noise
        step = (rtt - configured_ms) / 1e3 / len(dirs)
        if len(rtts) > 1:
            first = max(cost_s.values())
            step = max(-MAX_STEP * first, min(MAX_STEP * first, step))
        cost_s = {d: min(MAX_COST_S, max(0.0, c + step)) for d, c in cost_s.items()}
        short = [d for d in dirs if cost_s[d] > wan.links[d].delay_s]
        wan.subtract_fixed_cost(cost_s)
        if short:
            break       # a delay line already holds 0: nothing left to correct
    return {"fixed_cost_ms": {d: round(c * 1e3, 4) for d, c in cost_s.items()},
            "rtt_ms": [round(r, 4) for r in rtts], "late_us": lates,
            "configured_rtt_ms": round(configured_ms, 4), "probes": probes, "short": short,
            "spell": spell}


def correct(wan, cal, off_ms):
    """Move the fixed cost `calibrate` subtracts (`cal`, its record) by `off_ms`, the RTT p50 a
    later link probe measured over the configured RTT, split evenly over the hops with a delay
    line and within the same bounds (no hop below 0 or above MAX_COST_S); the record, updated
    (`fixed_cost_ms`, `corrections_ms`: each correction asked for). The calibration's two passes
    at the start are a few hundred echoes in one moment: on 2026-12-06 three of them left
    probes on a 0.7-1.5 ms round trip 68 us late to 139 us early."""
    dirs = list(cal["fixed_cost_ms"])
    step_s = off_ms / 1e3 / len(dirs)
    cost_s = {d: min(MAX_COST_S, max(0.0, c / 1e3 + step_s))
              for d, c in cal["fixed_cost_ms"].items()}
    wan.subtract_fixed_cost(cost_s)
    cal["fixed_cost_ms"] = {d: round(c * 1e3, 4) for d, c in cost_s.items()}
    cal["corrections_ms"] = [*cal.get("corrections_ms", []), round(off_ms, 4)]
    return cal


def quiet_probe(wan, measure, tries=PROBE_TRIES, jitter_ms=None):
    """The run's link probe, `measure()` (`probe.measure_link` of the built link), judged as a
    calibration round is: its delay lines' lateness over it (`late_us`, us a packet) and its
    RTTs' spread (median over the lower decile), `slowness`. A probe that warns while slow ran
    in a slow spell and is measured again after a pause, up to `tries` times; the least slow
    is kept, its warnings with it. The result gains `late_us`, `slowness` and `tries` (each
    probe's) and, when the one kept warned in a spell too, `spell`: a line saying so. With the
    delay lines on other machines (`wan` None) the RTTs' spread alone judges, beyond the round
    trip's configured `jitter_ms`."""
    def measure_probe():
        result = measure()
        m = result["measured"]
        spread = m["rtt_p50_ms"] - m["rtt_p10_ms"] if m.get("rtt_p10_ms") is not None else 0.0
        return result, spread
    tried = _rounds(wan, measure_probe, tries, enough=lambda result: not result["warnings"],
                    jitter_ms=jitter_ms)
    slow, late, result = min(tried, key=lambda t: t[0])
    spell = None
    if tries and result["warnings"] and slow > 1.0:
        why = ("its RTTs spread over their lower decile" if late is None else
               f"delay lines {late:.0f} us late a packet, quiet under {LATE_QUIET_US}, or its "
               f"RTTs spread")
        spell = (f"the link probe ran in a slow spell in all {len(tried)} tries (the one kept: "
                 f"{why}), so its warnings may be the machine's, not the link's")
    return {**result, "warnings": result["warnings"] + [spell] if spell else result["warnings"],
            "late_us": _round(late), "slowness": round(slow, 3), "spell": spell,
            "tries": [{"late_us": _round(t[1]), "slowness": round(t[0], 3),
                       "warnings": t[2]["warnings"]} for t in tried]}


def probe_tries(link):
    """quiet_probe's tries for a probe of `link` (a `Link`, both ways): none per frame (with loss
    or a policer), where bulk TCP keeps a delay line ms late on any machine and its lateness
    says nothing of a slow spell (docs/link_fidelity.md)."""
    return 0 if needs_per_frame_packets({"kv": link}) else PROBE_TRIES


def _round(x):
    return None if x is None else round(x, 1)


def shortfall(cal, links, scale):
    """One line when a configured delay of `links` (now: a rescale or a correction moves
    either side) is below the fixed cost (else None): the delay cannot be emulated at this
    scale.time (`scale`: the run's `testbed.scale.Scale`), and the largest scale.time at which
    it can: the real-world delay over the fixed cost."""
    if not cal:
        return None
    short = [d for d, c in cal["fixed_cost_ms"].items() if c > 1e3 * links[d].delay_s]
    if not short:
        return None
    fits = {d: 1e3 * scale.real_s(links[d].delay_s) / cal["fixed_cost_ms"][d] for d in short}
    d = min(fits, key=fits.get)
    return (f"the {d} direction's emulated one-way delay {links[d].delay_s * 1e3:.3f} ms is "
            f"below the delay line's fixed cost here ({cal['fixed_cost_ms'][d]:.3f} ms a hop): "
            f"it cannot be emulated at scale.time {scale.time:g}; the largest scale.time at "
            f"which it can is {fits[d]:.3g}")
