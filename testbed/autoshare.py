"""`scale.time: auto` across the runs of one experiment: one pilot, on the run with the least
room, and a scale for every run from it (issue 22, item 2).

Place in the architecture: beside `testbed.autoscale` (which runs the pilot and asks this
module which run to pilot and what scale each run gets), above `testbed.autojudge`. Pure: no
run, no root, so the unit tests feed it experiments and recorded outlooks.

Why one pilot, not one per run: a pilot step costs a fixed part (the network carried over to
the step's scale, the workers' start, the client's, the teardown and the analysis: 1.6-2.2 s
for the case study's 12 instances on 2026-12-03, with the workers forked from the launcher)
plus its requests' span, and the pilot needs two steps at least (a measurement and the jump it
predicts). Three pilots of two steps cost 48% of the case study's three runs (04:27 UTC); one
pilot of two or three steps is within 20% of them.

- **The run piloted** is the one with the least room (`room_ms`): the TTFT excess (real-world
  ms, p90) its guard allows, `autojudge.WARN_SHARE` of the TTFT p90 the planner expects of it
  (`autojudge.outlook`), over its length factor (4 above capacity: the excess grows over a
  long run). The case study at 4 req/s: prfaas 368 ms, naive 1041, homogeneous 2073.
- **Every other run's scale** is the pilot's choice times the square root of its room over
  the piloted run's (`GROWTH`, as the jump: the excess grows about as the scale squared near
  the bound), at most `autojudge.JUMP_MAX` times it and at most the run's own ceiling. It
  assumes the runs' excess in ms is alike at one scale on one machine (2026-12-03 04:27, 12
  instances each: homogeneous 883 ms and naive 1202 ms at 50x, prfaas 175 ms at 20x, about
  1100 at 50x by the square): the runs' own guards say when it is not.
- **No more KV cache per wall-clock second** than the piloted run sent at its choice
  (`kv_factor`; the planner's egress at each run's serve rate, `Outlook.kv_bps`, times its
  scale.bytes): the pilot measured the KV path faithful up to that much and no further. The
  room says nothing of the KV-transfer guard: naive at 1.68 times prfaas's scale (28-35x)
  sent 1.6 times its KV bytes a wall second and warned for 1-12 of 600 KV transfers in 5 of 8
  runs (2026-12-03, docs/performance.md). A piloted run that sends no KV bounds nothing. A run
  this bounds to no more than the piloted run's speed derives from the piloted run's choice,
  extrapolated or not; a faster one from the largest step the pilot measured (the scale a
  run derives from is its metadata's `pilot_base`, and `testbed run` prints it):
  on four occasions in a row (2026-12-07) naive, derived from the step below an extrapolated
  choice, ran faithful at twice its scale.
- **The budget** is `autojudge.PILOT_SHARE` of all the runs' expected wall time together.
- **The link's cap** (`link_cap_bps`, from testbed/autolink.py): the most kv link rate, wall
  clock, the machine's path carried when the pilot probed it; the scale of every run that
  sends KV across the WAN (`sends_kv`) is lowered until its kv link is within it (`capped`).
- **The round trip's floor** (`rtt_floor_ms`, testbed/autolink.py): the shortest wall-clock
  RTT at which the delay line's lateness the check measured stays within the probe's bound;
  every run's scale is lowered until its WAN's round trip is at least that (`rtt_floored`).
"""

import math

from testbed import autojudge, deploy
from testbed.experiment import AUTO, AUTO_START
from testbed.net.probe import round_trip_ms

GROWTH = autojudge.GROWTH


def room_ms(look):
    """The TTFT excess p90 (real-world ms) a run with `Outlook` `look` may show before its
    guard warns, as the pilot judges it; None when the planner predicts no TTFT."""
    if look is None or not look.ttft_p90_ms:
        return None
    return autojudge.WARN_SHARE * look.ttft_p90_ms / look.length_factor


def round_down(x):
    """Two significant digits, rounded down (34.7 -> 34): a scale no higher than derived."""
    digit = 10 ** (math.floor(math.log10(x)) - 1)
    return float(f"{math.floor(x / digit + 1e-9) * digit:.2g}")


def factor(room, base_room):
    """How much faster than the piloted run (room `base_room`) a run with `room` may go."""
    if not room or not base_room or room <= base_room:
        return 1.0
    return min(autojudge.JUMP_MAX, (room / base_room) ** (1 / GROWTH))


def sends_kv(look):
    """Whether a run with Outlook `look` sends KV across the WAN's kv link: the planner's
    egress says so, or the planner predicts nothing for it (then it may)."""
    return look is None or look.serve_rate is None or bool(look.kv_bps)


def kv_wall(exp, look):
    """The KV bit/s `exp` (`look`: its Outlook) sends across the WAN, emulated, per unit of
    scale.time; None when it sends none."""
    return look.kv_bps * exp.scale.bytes if look is not None and look.kv_bps else None


def kv_factor(kv, base_kv):
    """How much faster than the piloted run (KV `base_kv`, `kv_wall`) a run sending `kv` may
    go for its KV bytes a wall second to stay within the piloted run's (inf: no bound)."""
    return base_kv / kv if kv and base_kv else math.inf


def wall_rate_bps(exp, scale):
    """`exp`'s kv link rate, emulated (wall clock), at scale.time `scale`."""
    return deploy.compile(exp.at_speed(scale)).links["kv"].rate_bps


def wall_rtt_ms(exp, scale):
    """`exp`'s kv link round trip (both directions' delay), emulated (wall ms), at scale.time
    `scale`; 0 for a WAN without delay."""
    return round_trip_ms(deploy.compile(exp.at_speed(scale)).links["kv"].params())


def capped(exp, scale, cap_bps):
    """`scale`, lowered (two significant digits, down) until `exp`'s kv link is within
    `cap_bps` wall clock (None: no cap); the rate is linear in the scale."""
    if cap_bps is None:
        return scale
    rate = wall_rate_bps(exp, scale)
    return scale if rate <= cap_bps else round_down(scale * cap_bps / rate)


def rtt_floored(exp, scale, floor_ms):
    """`scale`, lowered (two significant digits, down) until `exp`'s kv link's round trip is
    at least `floor_ms` wall clock (None: no floor; a WAN without delay has none to keep); the
    round trip is inverse in the scale."""
    rtt = wall_rtt_ms(exp, scale) if floor_ms else 0.0
    return scale if rtt <= 0 or rtt >= floor_ms else round_down(scale * rtt / floor_ms)


class Shared:
    """The pilot of one experiment, shared by its runs with `scale.time: auto`.

    `looks`: the planner's `Outlook` of each of `runs` (computed here when not given: the
    tests pass recorded ones); `target`: the run to pilot; `pilot`: the pilot's outcome once it
    ran (`record(...)`), which `scale_for` turns into each run's scale."""

    def __init__(self, runs, looks=None):
        self.runs = [exp for exp in runs if exp.scale.time == AUTO]
        self.looks = looks if looks is not None else [
            autojudge.outlook(exp.at_speed(AUTO_START)) for exp in self.runs]
        rooms = [room_ms(look) for look in self.looks]
        known = [i for i, r in enumerate(rooms) if r is not None]
        self.index = min(known, key=lambda i: rooms[i]) if known else 0
        self.pilot = None

    @property
    def target(self):
        return self.runs[self.index] if self.runs else None

    @property
    def target_look(self):
        return self.looks[self.index] if self.looks else None

    def position(self, exp):
        """The index of `exp` among the runs (by identity: the runner's own objects)."""
        return next((i for i, e in enumerate(self.runs) if e is exp), None)

    def look_of(self, exp):
        i = self.position(exp)
        return self.looks[i] if i is not None else autojudge.outlook(exp.at_speed(AUTO_START))

    def factors(self, exp, look):
        """(room's factor, KV's factor) of `exp` with Outlook `look` against the piloted run."""
        return (factor(room_ms(look), room_ms(self.target_look)),
                kv_factor(kv_wall(exp, look), kv_wall(self.target, self.target_look)))

    def factor_of(self, exp):
        """How much faster than the piloted run `exp` may go: the least of `factors`."""
        return self.bound(exp)[0]

    def bound_of(self, exp):
        """What sets `factor_of(exp)`: 'its room' or 'its KV egress'."""
        return self.bound(exp)[1]

    def bound(self, exp):
        """(`factor_of(exp)`, `bound_of(exp)`) from one evaluation of `factors`."""
        room, kv = self.factors(exp, self.look_of(exp))
        return (kv, "its KV egress") if kv < room else (room, "its room")

    def others(self):
        """(Outlook, factor) of every run but the piloted one: the pilot's budget covers them."""
        return [(look, min(self.factors(exp, look)))
                for i, (exp, look) in enumerate(zip(self.runs, self.looks)) if i != self.index]

    def record(self, label, chosen, fallback, steps_record, pilot_s, base=None):
        """Keep the pilot's outcome: its choice (None: nothing faithful, the runs use
        `fallback`, the least scale tried), its steps (as metadata holds them) and cost.
        `base`: what the faster runs' scales derive from when not the choice (an extrapolated
        choice is the piloted run's own: a run faster than it derives from a measured step;
        one no faster, from the choice: `uncapped`)."""
        self.pilot = {"label": label, "chosen": chosen, "fallback": fallback,
                      "steps": steps_record, "pilot_s": pilot_s,
                      "base": chosen if base is None else base}

    def scale_for(self, exp, ceiling):
        """The scale.time `exp` runs at after the pilot, at most `ceiling` (its links'), with
        a round trip no shorter than the link check's floor (`rtt_floored`) and, where it
        sends KV across the WAN (`sends_kv`), within the link's cap once the pilot measured
        one: a run that sends none has nothing on that link to slow."""
        scale = rtt_floored(exp, self.uncapped(exp, ceiling), self.pilot.get("rtt_floor_ms"))
        if not sends_kv(self.look_of(exp)):
            return scale
        return capped(exp, scale, self.pilot.get("link_cap_bps"))

    def uncapped(self, exp, ceiling):
        """`scale_for` before the round trip's floor and the link's cap."""
        if self.pilot["chosen"] is None:
            return min(self.pilot["fallback"], ceiling)
        if self.position(exp) == self.index:
            return min(self.pilot["chosen"], ceiling)
        f = self.factor_of(exp)
        base = self.base_for(exp)
        derived = base * f
        return min(round_down(derived) if derived != base else derived, ceiling)

    def base_for(self, exp):
        """The scale `exp`'s derives from (the pilot chose one): a run no faster than the
        piloted one (its KV egress bounds it) from the choice, at which it sends no more KV a
        wall second than the piloted run will, with more room; a faster one from the largest
        step measured (`base`, where the choice was extrapolated beyond it)."""
        if self.factor_of(exp) <= 1:
            return self.pilot["chosen"]
        return self.pilot.get("base") or self.pilot["chosen"]
