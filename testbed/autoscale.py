"""`scale.time: auto`: a short pilot of the same deployment picks the largest faithful
scale.time on this machine now, then the measured run uses it (issue 22, item 2).

Place in the architecture: beside the runner. `testbed.run` hands its `Run` class in (this
module never imports it: layers point down), and `AutoRun` drives one expanded run:

1. the experiment's pilot, when no run before this one ran it (`Pilot`; one per experiment,
   on the run with the least room: testbed/autoshare.py). It builds the backend once at the
   first scale tried, then runs steps, each a short `Run` (the first `PILOT_REQUESTS` requests
   of the same workload, no link probe, the decode tail after the last first token run fast:
   `Run(tail=True)`) on that network, carried over to the step's scale (`rescale`: the WAN's
   links, the hosts' TCP timers; the workers start afresh: runtime.json is in emulated units).
   A step is judged as testbed/autojudge.py says: every guard of the run as the run has it
   but the TTFT excess, judged on the requests after the warm-up against the TTFT p90 the
   planner expects of the measured run, not the pilot's. Then the link check
   (testbed/autolink.py): the kv link probed on that network at the fastest run's rate, and
   every run's scale lowered where the machine's path carried less;
2. the measured run at the scale `autoshare.Shared.scale_for` gives it (the pilot's choice,
   faster by the run's room over the piloted run's), on the pilot's network when the pilot
   ran on this run's deployment; its metadata.json records the pilot (`scale_auto`) and
   `testbed run` prints the scale in one line.

The search (`next_scale`, pure): start at `AUTO_START` (10); from a faithful step jump up by
its guards' headroom (`autojudge.jump`: 1.4-4x; 2x when a step measured none), halve while not
faithful, and between a faithful scale a and an unfaithful b > 1.5 a try their geometric mean
once. The choice is the largest faithful scale tried, moved where the budget stopped the
search: between a and that mean where b failed on the TTFT excess alone (`interpolate`;
`interpolated`), above the largest faithful step where none above it failed (`extrapolate`;
`extrapolated`: at most the next jump, the piloted run's own scale; the other runs derive
theirs from the largest faithful step), each where the excess, ~ scale ** k through two steps
(k at least 1 above), is predicted at 80% of its bound; below that step where it kept less
headroom (`pull_back`; `pulled_back`). The search plans with a step's 90% interval where it
reaches further (`Step.planned`). The pilot stops before a step past `autojudge.PILOT_SHARE` of
the runs' expected wall time, after `autojudge.MIN_STEPS`; the record says what the scale above
did (`faithful_hint`). Steps, not a CPU-cost model: guards decide.
"""

import dataclasses
import math
import os
import pathlib
import secrets
import sys
import time

import pandas as pd

from testbed import autojudge, autolink, autoshare, deploy, lifecycle
from testbed.backend import open_backend
from testbed.errors import ConfigError, RunInterrupted, TestbedError
from testbed.experiment import AUTO, AUTO_START
from testbed.measure import LinkProbes
from testbed.profiling import cost
from testbed.records import EventLog, RunDir

PILOT_REQUESTS = 40        # per step: a few seconds of wall time at the scales tried
MIN_SCALE = 1.0            # below real time the pilot does not go
MAX_SCALE = 1000.0         # the key's own limit
PILOT_DIR = "pilot"        # run_dir/pilot/time<scale>/: each step a run directory
INTERPOLATE_AIM = autojudge.AIM  # a moved choice: the TTFT excess at 80% of its bound


@dataclasses.dataclass(frozen=True)
class Step:
    """One pilot step: the scale tried and what its guards said (real-world ms)."""
    scale: float
    faithful: bool
    excess_share_p90: float | None = None     # p90 excess / its own TTFT p90 (the run's guard)
    first_token_lag_ms: float | None = None   # median
    warnings: tuple = ()
    wall_s: float = 0.0
    cpu_s: float | None = None                # its processes' (workers, scheduler, client)
    cpu_ms_per_request: float | None = None   # cpu_s over the requests it completed
    steady_share_interval: tuple | None = None  # steady_share's 90% bootstrap interval
    error: str | None = None                  # the scale could not be run (link, workers)
    steady_excess_p90_ms: float | None = None  # after the warm-up (testbed/autojudge.py)
    steady_share: float | None = None         # judged: x length factor / the run's p90
    span_s: float | None = None               # the requests' span, wall seconds
    load: float | None = None                 # the machine's 1-minute load when it started
    tail_s: float | None = None               # real-world decode its cut skipped (autojudge)

    def as_dict(self):
        return {**dataclasses.asdict(self), "warnings": list(self.warnings),
                "planned_share": self.planned}

    @property
    def planned(self):
        """The judged share the search plans with (`autojudge.planned_share`)."""
        return autojudge.planned_share(self.steady_share, self.steady_share_interval)

    @property
    def margin(self):
        """The guards' headroom at this step, on its planned share (None: not measured)."""
        measured = self.steady_share is not None or self.first_token_lag_ms is not None
        return autojudge.margin(self.planned, self.first_token_lag_ms) if measured else None


def step_of(scale, summary, wall_s, cpu_s=None, requests=None, look=None, load=None,
            tail_s=None):
    """The `Step` of a pilot run from its summary.json (`testbed.analysis.analyse`) and, when
    given, its requests table: judged on the steady excess against the measured run's
    `autojudge.Outlook` `look` (testbed/autojudge.py); without them, on every warning."""
    emu = summary.get("emulation") or {}
    warnings = tuple(summary.get("warnings") or ())
    share = (emu.get("ttft_excess_ms") or {}).get("share_p90")
    steady_share = interval = None
    steady = None if requests is None else autojudge.steady_excess_p90_ms(requests)
    if requests is None:
        faithful = not warnings and summary.get("completed", 0) > 0
    else:
        faithful, steady_share = autojudge.judge(summary, steady, look)
        ms = autojudge.steady_interval_ms(requests) if steady_share and steady else None
        interval = ms and tuple(round(x * steady_share / steady, 4) for x in ms)
    span = summary.get("duration_s")
    return Step(scale, faithful=faithful, excess_share_p90=share,
                first_token_lag_ms=emu.get("first_token_lag_ms"), warnings=warnings,
                wall_s=round(wall_s, 3), cpu_s=None if cpu_s is None else round(cpu_s, 3),
                cpu_ms_per_request=(round(1e3 * cpu_s / summary["completed"], 2)
                                    if cpu_s is not None and summary.get("completed") else None),
                steady_excess_p90_ms=steady, steady_share=steady_share,
                steady_share_interval=interval,
                span_s=None if span is None else round(span / scale, 3), load=load,
                tail_s=tail_s)


def _round(x):
    """Two significant digits (14, 28, 5.7): scales a reader can repeat."""
    return float(f"{x:.2g}")


def next_scale(steps, start=AUTO_START, fits=None, ceiling=MAX_SCALE):
    """The next scale.time to try after `steps` (the pilot so far), or None when done.
    Upward from the largest faithful scale by its measured headroom (`autojudge.jump`; x2
    when the step measured none), downward from the smallest unfaithful one by half, and
    between the two once by their geometric mean. `fits(scale)`: whether the pilot's budget
    allows a step there (default: always); `ceiling`: the largest scale the links allow."""
    if not steps:
        return min(start, ceiling)
    ok = [s for s in steps if s.faithful]
    bad = [s for s in steps if not s.faithful]
    tried = {s.scale for s in steps}
    lo = max(ok, key=lambda s: s.scale, default=None)
    hi = min((s.scale for s in bad), default=None)
    if hi is None:
        factor = 2.0 if lo.margin is None else autojudge.jump(lo.margin)
        nxt = min(_round(factor * lo.scale), ceiling)
    elif lo is None:
        nxt = _round(hi / 2)
        nxt = nxt if nxt >= MIN_SCALE else None
    elif hi > 1.5 * lo.scale:
        nxt = _round(math.sqrt(lo.scale * hi))
    else:
        nxt = None
    if nxt is None or nxt in tried or (fits is not None and not fits(nxt)):
        return None
    return nxt


def ceiling(exp):
    """The largest scale.time (two significant digits, rounded down) at which `exp` compiles:
    its emulated WAN within what this machine can shape (`deploy.compile`)."""
    def compiles(scale):
        try:
            deploy.compile(exp.at_speed(scale))
            return True
        except ConfigError:
            return False
    if compiles(MAX_SCALE):
        return MAX_SCALE
    lo, hi = MIN_SCALE, MAX_SCALE
    for _ in range(40):         # log-space bisection: well below 1% apart
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if compiles(mid) else (lo, mid)
    digit = 10 ** (math.floor(math.log10(lo)) - 1)
    top = math.floor(lo / digit + 1e-9) * digit
    return top if compiles(top) else top - digit


def choose(steps):
    """The largest faithful scale tried, or None when none was."""
    return max((s.scale for s in steps if s.faithful), default=None)


def interpolate(steps):
    """(scale, exponent) where the budget stopped the search between a faithful step a and an
    unfaithful one b > 1.5 a that failed on the TTFT excess alone: the excess's share taken
    as ~ scale ** k through the two steps, the scale at which it reaches `INTERPOLATE_AIM` of
    its bound, at most their geometric mean (the step the search would have taken next) and
    above a; None otherwise (then the choice is a)."""
    ok = [s for s in steps if s.faithful]
    if not ok:
        return None
    lo = max(ok, key=lambda s: s.scale)
    above = [s for s in steps if not s.faithful and s.scale > lo.scale]
    hi = min(above, key=lambda s: s.scale, default=None)
    if (hi is None or hi.scale <= 1.5 * lo.scale or hi.error or not lo.steady_share
            or not hi.steady_share or hi.steady_share <= autojudge.WARN_SHARE
            or any(not w.startswith(autojudge.WARN_PREFIX) for w in hi.warnings)):
        return None
    k = math.log(hi.steady_share / lo.steady_share) / math.log(hi.scale / lo.scale)
    if k <= 0:
        return None
    aim = lo.scale * (INTERPOLATE_AIM * autojudge.WARN_SHARE / lo.planned) ** (1 / k)
    scale = _round(min(aim, math.sqrt(lo.scale * hi.scale)))
    return (scale, round(k, 3)) if scale > lo.scale else None


def extrapolate(steps, top=MAX_SCALE):
    """(scale, exponent) where the budget stopped the search with no unfaithful step above
    its largest faithful one b: the excess's share through the two largest faithful steps a
    < b as ~ scale ** k (k at least 1: the excess grows no slower than the scale; it grew
    about as the scale, 4.0-4.2% at twice choices measured at 2.0-2.8% on 2026-12-03), the
    scale at which b's headroom (`Step.margin`, the lag's too) shrinks to `INTERPOLATE_AIM`,
    at most the next step the search would have taken (`autojudge.jump`) and `top`; None
    when that is not above b (then the choice is b)."""
    ok = sorted((s for s in steps if s.faithful and s.steady_share), key=lambda s: s.scale)
    if len(ok) < 2 or any(not s.faithful and s.scale > ok[-1].scale for s in steps):
        return None
    a, b = ok[-2], ok[-1]
    k = _growth(a, b)
    aim = b.scale * (INTERPOLATE_AIM * b.margin) ** (1 / k)
    scale = autoshare.round_down(min(aim, b.scale * autojudge.jump(b.margin), top))
    return (scale, round(k, 3)) if scale > b.scale else None


def pull_back(steps):
    """(scale, exponent) where the largest faithful step b kept less headroom than the pilot
    aims at (`Step.margin` under 1 / `INTERPOLATE_AIM`: its planned share above 4% of the
    p90, or its lag above 40 ms): the scale below b at which it is predicted at the aim,
    the excess ~ scale ** k through the faithful step a below b (k at least 1, and 1 without
    a: the larger cut), not below a where a is within the aim, nor below `MIN_SCALE`; None
    when b is within the aim. It comes before `interpolate` and `extrapolate`, which look up
    from b by its TTFT excess alone. A step is one short sample: on 2026-12-06
    many_instances' step at 14 measured 4.6% of the p90 and its run at 14 5.2%."""
    ok = sorted((s for s in steps if s.faithful), key=lambda s: s.scale)
    if not ok or ok[-1].margin is None or ok[-1].margin * INTERPOLATE_AIM >= 1:
        return None
    b, a = ok[-1], (ok[-2] if len(ok) > 1 else None)
    k = _growth(a, b) if a is not None else 1.0
    scale = autoshare.round_down(b.scale * (INTERPOLATE_AIM * b.margin) ** (1 / k))
    if a is not None and a.margin is not None and a.margin * INTERPOLATE_AIM >= 1:
        scale = max(scale, a.scale)         # a step within the aim: never below it
    scale = max(scale, MIN_SCALE)
    return (scale, round(k, 3)) if scale < b.scale else None


def _growth(a, b):
    """k of the judged share ~ scale ** k through faithful steps a < b, at least 1 (the
    excess grows no slower than the scale); 1 where either measured no share."""
    if not a.steady_share or not b.steady_share:
        return 1.0
    return max(1.0, math.log(b.steady_share / a.steady_share) / math.log(b.scale / a.scale))


def faithful_hint(steps, chosen, top=MAX_SCALE):
    """What a scale above the choice did: the basis of 'a run at twice it would warn'
    (`top`: the pilot's ceiling)."""
    above = [s for s in steps if s.scale > chosen and not s.faithful]
    if not above and chosen >= top:
        return (f"{chosen:g} is the most the links allow (a faster run needs a lower "
                f"scale.bytes)")
    if not above:
        return "no unfaithful scale was reached (the budget or the limit stopped the search)"
    s = min(above, key=lambda s: s.scale)
    return f"{s.scale:g} was not faithful ({why_not(s)})"


def why_not(step):
    """Why a step was not faithful, in a few words."""
    if step.error:
        return step.error
    share = step.steady_share if step.steady_share is not None else step.excess_share_p90
    if share is not None and share > autojudge.WARN_SHARE:
        lo_hi = step.steady_share_interval         # set only beside a steady share
        return f"TTFT excess {100 * share:.2g}% of p90" + (
            f" (90% interval {100 * lo_hi[0]:.2g}-{100 * lo_hi[1]:.2g}%)" if lo_hi else "")
    others = [w for w in step.warnings if not w.startswith(autojudge.WARN_PREFIX)]
    return f"{len(others)} warning(s): {others[0][:60]}" if others else "no request completed"


def choice_line(label, steps, chosen, pilot_s, between=False, beyond=False, back=False):
    """The one line `testbed run` prints (`between`: the choice was interpolated; `beyond`:
    extrapolated; `back`: pulled back below the largest faithful step)."""
    tried = ", ".join(f"{s.scale:g}{'' if s.faithful else '!'}" for s in steps)
    if chosen is None:
        return (f"scale.time auto ({label}): no scale tried was faithful ({tried}; ! warned); "
                f"running at {min(s.scale for s in steps):g}, which will warn "
                f"(pilot {pilot_s:.1f} s)")
    if between:
        return (f"scale.time auto ({label}): {chosen:g}, between the faithful and the unfaithful "
                f"of {tried} where the TTFT excess is predicted at "
                f"{100 * INTERPOLATE_AIM * autojudge.WARN_SHARE:g}% (! warned; pilot "
                f"{pilot_s:.1f} s)")
    if back:
        return (f"scale.time auto ({label}): {chosen:g}, below the largest faithful of {tried} "
                f"where its TTFT excess and lag are predicted at "
                f"{100 * INTERPOLATE_AIM:g}% of their bounds (! warned; pilot {pilot_s:.1f} s)")
    if beyond:
        return (f"scale.time auto ({label}): {chosen:g}, above the faithful {tried} where the "
                f"TTFT excess through them is predicted at "
                f"{100 * INTERPOLATE_AIM * autojudge.WARN_SHARE:g}% (the budget ended the "
                f"search; ! warned; pilot {pilot_s:.1f} s)")
    return (f"scale.time auto ({label}): {chosen:g}, the largest faithful of {tried} "
            f"(! warned; pilot {pilot_s:.1f} s)")


class AutoRun:
    """One expanded run with `scale.time: auto`: the experiment's pilot (when no run before it
    ran it: testbed/autoshare.py), then the measured run at the scale it gives this run.

    `make_run(exp, run_dir, deployment=, backend=, meta=, **kw)` is the runner's `Run` (passed
    in); `shared`: the experiment's `autoshare.Shared` (default: this run alone); `execute()`
    returns the measured run's summary."""

    def __init__(self, exp, run_dir, make_run, shared=None, **kw):
        if exp.scale.time != AUTO:
            raise ValueError("AutoRun runs experiments with scale.time auto")
        if "probes" not in kw:       # the experiment's, or this run's own
            kw["probes"] = LinkProbes(kw.pop("probe", True))
        self.exp, self.dir, self.make_run, self.kw = exp, pathlib.Path(run_dir), make_run, kw
        # the experiment's, unless none or not made for this run
        self.shared = (shared if shared is not None and shared.position(exp) is not None
                       else autoshare.Shared([exp]))
        self.ceiling = ceiling(exp)
        self.backend = None

    def execute(self):
        registry = lifecycle.Registry(secrets.token_hex(2))
        try:
            pilot = None
            if self.shared.pilot is None:
                own = self.shared.target is self.exp
                pilot = Pilot(self.shared, self.dir / PILOT_DIR, self.make_run,
                              link_probes=self.kw["probes"])
                self.backend = pilot.execute(registry if own else None)
            scale = self.shared.scale_for(self.exp, self.ceiling)
            print(self._line(scale), flush=True)
            exp = self.exp.at_speed(scale)
            meta = {"scale_auto": self._meta(scale, pilot)}
            run = self.make_run(exp, self.dir, deployment=deploy.compile(exp),
                                backend=self.backend, meta=meta, **self.kw)
            return run.execute()
        finally:
            registry.close()

    def _line(self, scale):
        p = self.shared.pilot
        before = self.shared.uncapped(self.exp, self.ceiling)
        limits = " and ".join(k for k, v in (("the link's cap", p.get("link_cap_bps")),
                                             ("the round trip's floor", p.get("rtt_floor_ms")))
                              if v is not None) or "the link check"
        capped = f"; runs at {scale:g}, within {limits}" if scale != before else ""
        if p["label"] == self.exp.run_label and p.get("line"):
            return p["line"] + capped
        fac, bound = self.shared.bound(self.exp)
        how = (f"{p['label']}'s {self.shared.base_for(self.exp):g} x {fac:.2g} ({bound})"
               if p["chosen"] is not None else "no faithful scale in the pilot")
        return (f"scale.time auto ({self.exp.run_label}): {before:g}, from the pilot of "
                f"{how}{capped}")

    def _meta(self, scale, pilot):
        p, sh = self.shared.pilot, self.shared
        look, (fac, bound) = sh.look_of(self.exp), sh.bound(self.exp)
        rec = {"chosen": scale, "faithful": p["chosen"] is not None, "ceiling": self.ceiling,
               "piloted": p["label"], "pilot_chosen": p["chosen"],
               "pilot_base": sh.base_for(self.exp) if p["chosen"] is not None else None,
               "factor": round(fac, 4), "factor_bound": bound,
               "room_ms": autoshare.room_ms(look),
               "outlook": {**dataclasses.asdict(look), "length_factor": look.length_factor},
               "budget_share": autojudge.PILOT_SHARE,
               "uncapped": sh.uncapped(self.exp, self.ceiling),
               "link_cap_bps": p.get("link_cap_bps"), "rtt_floor_ms": p.get("rtt_floor_ms")}
        if pilot is not None:        # this run ran the experiment's pilot
            rec.update(pilot.record, pilot_s=p["pilot_s"], steps=p["steps"])
            if p["label"] == self.exp.run_label:
                rec["above"] = faithful_hint(pilot.steps, p["chosen"] or scale, pilot.ceiling)
        return rec


class Pilot:
    """The pilot of an experiment: steps on `shared.target`'s deployment in `pilot_dir`, until
    `next_scale` says done or the budget (the experiment's runs together) is spent."""

    def __init__(self, shared, pilot_dir, make_run, link_probes=None):
        """`link_probes`: the experiment's `measure.LinkProbes`; the link check after the steps
        (testbed/autolink.py) hands its probes to them (none: no check, as with --no-probe)."""
        self.shared, self.dir, self.make_run = shared, pathlib.Path(pilot_dir), make_run
        self.link_probes = link_probes
        self.exp, self.look = shared.target, shared.target_look
        self.ceiling = ceiling(self.exp)
        self.steps, self.backend, self.spent_s = [], None, 0.0
        self.record = {"pilot_ceiling": self.ceiling, "start": AUTO_START,
                       "pilot_requests": self._requests(),
                       "pilot_outlook": {**dataclasses.asdict(self.look),
                                         "length_factor": self.look.length_factor}}

    def execute(self, registry):
        """Run the pilot; `registry`: the measured run's, whose network the pilot builds and
        hands over (returned), or None (another run's deployment: built and torn down here).
        Records the outcome in `shared`."""
        self.dir.mkdir(parents=True, exist_ok=True)
        own = registry is not None
        registry = registry or lifecycle.Registry(secrets.token_hex(2))
        events = EventLog(RunDir(self.dir).events)
        self.record["network_run_id"] = registry.run_id     # its interfaces' prefix
        t0 = time.monotonic()
        try:
            while (s := next_scale(self.steps, AUTO_START, self._fits, self.ceiling)) is not None:
                t1 = time.monotonic()
                self.steps.append(self._step(s, registry, events))
                self.spent_s += time.monotonic() - t1
            built = self.record.get("network_build_s", 0.0) if own else 0.0
            self._conclude(time.monotonic() - t0 - built)
            if self.link_probes is None or not self.link_probes.enabled:
                self.record["link_check"] = {"skipped": "--no-probe"}
            elif self.backend is not None:
                best = choose(self.steps)
                self.record["link_check"] = autolink.check(
                    self.backend, self.shared, [ceiling(exp) for exp in self.shared.runs],
                    events, self.link_probes, self.exp.run_label, autolink.shortfall_bears(
                        None if best is None else self.dir / f"time{best:g}"))
                self.shared.pilot["line"] += autolink.line(self.record["link_check"])
        finally:
            events.close()
            if not own:
                registry.close()
        # its cost: what a run at a fixed scale does not do (when its own, it builds the
        # network too)
        self.shared.pilot["pilot_s"] = round(time.monotonic() - t0 - built, 3)
        return self.backend if own else None

    def _conclude(self, pilot_s):
        """The choice from the steps, recorded in `shared` (the link check comes after);
        `pilot_s`: the steps' wall time."""
        best = choose(self.steps)
        back = pull_back(self.steps)
        between = interpolate(self.steps) if back is None else None
        beyond = (extrapolate(self.steps, self.ceiling) if back is None and between is None
                  else None)
        chosen = best
        for key, moved in (("pulled_back", back), ("interpolated", between),
                           ("extrapolated", beyond)):       # at most one of them
            if moved is not None:
                chosen = moved[0]
                self.record[key] = {"scale": moved[0], "exponent": moved[1],
                                    "aim_share": INTERPOLATE_AIM * autojudge.WARN_SHARE,
                                    **({} if key == "interpolated" else {"from": best})}
        fallback = min((s.scale for s in self.steps), default=AUTO_START)
        self.shared.record(self.exp.run_label, chosen, fallback,
                           [s.as_dict() for s in self.steps], pilot_s,
                           base=best if beyond is not None else None)
        self.shared.pilot["line"] = choice_line(self.exp.run_label, self.steps, chosen, pilot_s,
                                                between is not None, beyond is not None,
                                                back is not None)
        self.record["expected_run_s"] = self._expected(chosen or fallback)

    def _requests(self):
        return min(self.exp.requests or PILOT_REQUESTS, PILOT_REQUESTS)

    def _expected(self, scale):
        """The experiment's runs' expected wall time together at `scale` (the piloted run's)."""
        first = next((s for s in self.steps if s.span_s is not None), None)
        if first is None:
            return None
        runs = [(self.look, 1.0), *self.shared.others()]
        return round(sum(autojudge.expected_run_s(first, look, self._requests(), scale * f)
                         for look, f in runs), 3)

    def _fits(self, scale):
        return autojudge.within_budget(self.steps, self.spent_s, self.look, self._requests(),
                                       scale, self.shared.others())

    def _step(self, scale, registry, events):
        exp = dataclasses.replace(self.exp.at_speed(scale), requests=self._requests(),
                                  duration=None)
        try:
            dep = deploy.compile(exp)
        except ConfigError as e:      # the link cannot be shaped at this scale: a ceiling
            return Step(scale, faithful=False, error=f"cannot be emulated: {e}")
        if self.backend is None:     # built once: what a run without the pilot builds too
            t0 = time.monotonic()
            self.backend = open_backend(exp.backend.kind, dep, registry, events, exp.backend,
                                        run_dir=self.dir).start()
            self.record["network_build_s"] = round(time.monotonic() - t0, 3)
        t0, load = time.monotonic(), os.getloadavg()[0]
        run = self.make_run(exp, self.dir / f"time{scale:g}", deployment=dep,
                            backend=self.backend, probe=False, progress=False, tail=True)
        try:
            summary = run.execute()
        except RunInterrupted:
            raise
        except TestbedError as e:     # e.g. workers not ready in time at this scale
            print(f"scale.time auto: the pilot at {scale:g} failed: {e}", file=sys.stderr)
            return Step(scale, faithful=False, wall_s=round(time.monotonic() - t0, 3),
                        error=f"{type(e).__name__}: {e}")
        rd = RunDir(run.dir)
        requests = pd.read_parquet(rd.requests) if rd.requests.exists() else None
        return step_of(scale, summary, time.monotonic() - t0,
                       cost.measured_cpu_s(getattr(run, "meta", {})), requests, self.look, load,
                       autojudge.skipped_tail_s(rd, requests))
