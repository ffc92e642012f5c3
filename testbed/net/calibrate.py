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

The run's link probe (`measure_link`) then reports the residual. A configured delay below the
fixed cost cannot be emulated (the delay line holds 0 and the path still costs more):
`shortfall` says so in one line, naming the largest scale.time at which it could be.
"""

from testbed.net.linkmodel import DIRECTIONS
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


def calibrate(wan, src, dst, dst_ip, probes=PROBES, passes=PASSES):
    """Measure and subtract the fixed cost of `wan` (a started `Wan`) between the namespaces
    `src` and `dst` (`dst_ip` in `dst`). Returns None when there is no delay line to calibrate
    (netem, or no delay configured) or a direction starts down, else {"fixed_cost_ms": {dir:
    per hop}, "rtt_ms": [the median RTT of each round], "configured_rtt_ms", "short":
    [directions whose delay is below their fixed cost]}."""
    dirs = wan.delaylines() if wan.backend == "userspace" else []
    if not dirs or not all(wan.links[d].up for d in DIRECTIONS):
        return None     # nothing to calibrate, or no echo can come back (a link starts down)
    configured_ms = 1e3 * sum(wan.links[d].delay_s for d in DIRECTIONS)
    cost_s = dict.fromkeys(dirs, 0.0)
    rtts = []
    for _ in range(passes):
        rtts.append(measure_rtt_ms(src, dst, dst_ip, probes, QUANTILE))
        if len(rtts) > 1 and abs(rtts[-1] - configured_ms) <= max(SETTLED_MS,
                                                                  SETTLED * configured_ms):
            short = []
            break       # within half the probe's warning tolerance: do not chase noise
        step = (rtts[-1] - configured_ms) / 1e3 / len(dirs)
        if len(rtts) > 1:
            first = max(cost_s.values())
            step = max(-MAX_STEP * first, min(MAX_STEP * first, step))
        cost_s = {d: min(MAX_COST_S, max(0.0, c + step)) for d, c in cost_s.items()}
        short = [d for d in dirs if cost_s[d] > wan.links[d].delay_s]
        wan.subtract_fixed_cost(cost_s)
        if short:
            break       # a delay line already holds 0: nothing left to correct
    return {"fixed_cost_ms": {d: round(c * 1e3, 4) for d, c in cost_s.items()},
            "rtt_ms": [round(r, 4) for r in rtts], "configured_rtt_ms": round(configured_ms, 4),
            "probes": probes, "short": short}


def shortfall(cal, links, scale):
    """One line when a configured delay is below the fixed cost (else None): the delay cannot
    be emulated at this scale.time (`scale`: the run's `testbed.scale.Scale`), and the largest
    scale.time at which it can: the real-world delay over the fixed cost."""
    if not cal or not cal["short"]:
        return None
    fits = {d: 1e3 * scale.real_s(links[d].delay_s) / cal["fixed_cost_ms"][d]
            for d in cal["short"]}
    d = min(fits, key=fits.get)
    return (f"the {d} direction's emulated one-way delay {links[d].delay_s * 1e3:.3f} ms is "
            f"below the delay line's fixed cost here ({cal['fixed_cost_ms'][d]:.3f} ms a hop): "
            f"it cannot be emulated at scale.time {scale.time:g}; the largest scale.time at "
            f"which it can is {fits[d]:.3g}")
