"""`scale.time: auto`: a short pilot of the same deployment picks the largest faithful
scale.time on this machine now, then the measured run uses it (issue 22, item 2).

Place in the architecture: beside the runner. `testbed.run` hands its `Run` class in (this
module never imports it: layers point down), and `AutoRun` drives one expanded run:

1. build the backend once (the network, the WAN), at the first scale tried;
2. pilot steps, each a short `Run` (the first `PILOT_REQUESTS` requests of the same workload,
   no link probe) on that same network, carried over to the step's scale (`rescale`: the WAN's
   links and the hosts' TCP timers; the workers start afresh, since runtime.json is in
   emulated units). A step is faithful when its analysis has no warning at all: the TTFT
   excess (`emulation.ttft_excess_ms`, p90 under 5% of the TTFT p90), the first-token lag,
   decode wake-ups, step and prefill ratios, KV transfers, TCP timeouts, start-up;
3. the measured run at the chosen scale, on the same network again; its metadata.json
   records the pilot (`scale_auto`) and `testbed run` prints the choice in one line.

The search (`next_scale`, pure): start at `AUTO_START` (10; a later run of the same experiment
at the previous run's choice: `Starts`), double while faithful, halve while not, and once
there is a faithful scale a below an unfaithful one b = 2a, try their geometric mean once; the
largest faithful scale tried is the choice. So a scale twice the choice was
tried and warned, unless the link (`deploy.compile`: the emulated rate this machine can
shape) or the 1000 limit capped the search first, which the record says. Four steps on a
machine where 10 and 20 are faithful and 40 is not (10, 20, 40, 28). Stepping, rather than a
CPU-cost model, because the guards are what defines faithful: a model of CPU per request
would need calibrating per machine, load and deployment, and would still have to be checked
by a run.
"""

import dataclasses
import math
import pathlib
import secrets
import sys
import time

from testbed import deploy, lifecycle
from testbed.backend import open_backend
from testbed.errors import ConfigError, RunInterrupted, TestbedError
from testbed.experiment import AUTO, AUTO_START
from testbed.profiling.cost import children_cpu_s
from testbed.records import EventLog, RunDir

PILOT_REQUESTS = 40        # per step: a few seconds of wall time at the scales tried
MIN_SCALE = 1.0            # below real time the pilot does not go
MAX_SCALE = 1000.0         # the key's own limit
PILOT_DIR = "pilot"        # run_dir/pilot/time<scale>/: each step a run directory


@dataclasses.dataclass(frozen=True)
class Step:
    """One pilot step: the scale tried and what its guards said (real-world ms)."""
    scale: float
    faithful: bool
    excess_share_p90: float | None = None     # p90 excess / TTFT p90
    first_token_lag_ms: float | None = None   # median
    warnings: tuple = ()
    wall_s: float = 0.0
    cpu_s: float | None = None                # the step's processes (workers, client), reaped
    error: str | None = None                  # the scale could not be run (link, workers)

    def as_dict(self):
        return {**dataclasses.asdict(self), "warnings": list(self.warnings)}


def step_of(scale, summary, wall_s, cpu_s=None):
    """The `Step` of a pilot run from its summary.json (`testbed.analysis.analyse`)."""
    emu = summary.get("emulation") or {}
    warnings = tuple(summary.get("warnings") or ())
    share = (emu.get("ttft_excess_ms") or {}).get("share_p90")
    return Step(scale, faithful=not warnings and summary.get("completed", 0) > 0,
                excess_share_p90=share, first_token_lag_ms=emu.get("first_token_lag_ms"),
                warnings=warnings, wall_s=round(wall_s, 3),
                cpu_s=None if cpu_s is None else round(cpu_s, 3))


def _round(x):
    """Two significant digits (14, 28, 5.7): scales a reader can repeat."""
    return float(f"{x:.2g}")


def next_scale(steps, start=AUTO_START):
    """The next scale.time to try after `steps` (the pilot so far), or None when done."""
    if not steps:
        return start
    ok = [s.scale for s in steps if s.faithful]
    bad = [s.scale for s in steps if not s.faithful]
    tried = {s.scale for s in steps}
    lo, hi = max(ok, default=None), min(bad, default=None)
    if hi is None:
        nxt = _round(min(2 * lo, MAX_SCALE))
    elif lo is None:
        nxt = _round(hi / 2)
        nxt = nxt if nxt >= MIN_SCALE else None
    elif hi > 1.5 * lo:
        nxt = _round(math.sqrt(lo * hi))
    else:
        nxt = None
    return nxt if nxt is not None and nxt not in tried else None


def choose(steps):
    """The largest faithful scale tried, or None when none was."""
    return max((s.scale for s in steps if s.faithful), default=None)


def faithful_hint(steps, chosen):
    """What a scale twice the choice did: the basis of 'a run at twice it would warn'."""
    above = [s for s in steps if s.scale > chosen and not s.faithful]
    if not above:
        return "no unfaithful scale was reached (the search stopped at its limit)"
    s = min(above, key=lambda s: s.scale)
    why = s.error or (f"TTFT excess {100 * s.excess_share_p90:.0f}% of p90"
                      if s.excess_share_p90 is not None else f"{len(s.warnings)} warning(s)")
    return f"{s.scale:g} was not faithful ({why})"


def choice_line(label, steps, chosen, pilot_s):
    """The one line `testbed run` prints."""
    tried = ", ".join(f"{s.scale:g}{'' if s.faithful else '!'}" for s in steps)
    if chosen is None:
        return (f"scale.time auto ({label}): no scale tried was faithful ({tried}; ! warned); "
                f"running at {min(s.scale for s in steps):g}, which will warn "
                f"(pilot {pilot_s:.1f} s)")
    return (f"scale.time auto ({label}): {chosen:g}, the largest faithful of {tried} "
            f"(! warned; pilot {pilot_s:.1f} s)")


class Starts:
    """Where the next pilot of one experiment starts: the last choice (the same machine,
    minutes later, a deployment of the same kind), else `AUTO_START`. Only the cost depends on
    it: the search brackets the largest faithful scale from any start."""

    def __init__(self):
        self.next = AUTO_START

    def chose(self, scale):
        if scale is not None:
            self.next = scale


class AutoRun:
    """One expanded run with `scale.time: auto`: pilot, then the measured run, on one network.

    `make_run(exp, run_dir, deployment=, backend=, meta=, **kw)` is the runner's `Run` (passed
    in); `execute()` returns the measured run's summary."""

    def __init__(self, exp, run_dir, make_run, starts=None, **kw):
        if exp.scale.time != AUTO:
            raise ValueError("AutoRun runs experiments with scale.time auto")
        self.exp, self.dir, self.make_run, self.kw = exp, pathlib.Path(run_dir), make_run, kw
        self.starts = starts if starts is not None else Starts()
        self.start = self.starts.next
        self.backend, self.steps, self.record = None, [], {}

    def execute(self):
        pilot_dir = self.dir / PILOT_DIR
        pilot_dir.mkdir(parents=True, exist_ok=True)
        registry = lifecycle.Registry(secrets.token_hex(2))
        events = EventLog(RunDir(pilot_dir).events)
        self.record["network_run_id"] = registry.run_id     # its interfaces' prefix
        try:
            t0 = time.monotonic()
            chosen = self._pilot(registry, events, pilot_dir)
            # its cost: what a run at a fixed scale does not do (it builds the network too)
            pilot_s = time.monotonic() - t0 - self.record.get("network_build_s", 0.0)
            print(choice_line(self.exp.run_label, self.steps, chosen, pilot_s), flush=True)
            scale = chosen if chosen is not None else min(s.scale for s in self.steps)
            exp = self.exp.at_speed(scale)
            meta = {"scale_auto": {
                **self.record, "chosen": scale, "faithful": chosen is not None,
                "pilot_s": round(pilot_s, 3),
                "pilot_requests": self._pilot_requests(), "start": self.start,
                "above": faithful_hint(self.steps, scale),
                "steps": [s.as_dict() for s in self.steps]}}
            run = self.make_run(exp, self.dir, deployment=deploy.compile(exp),
                                backend=self.backend, meta=meta, **self.kw)
            return run.execute()
        finally:
            registry.close()
            events.close()

    def _pilot_requests(self):
        n = self.exp.requests
        return min(n, PILOT_REQUESTS) if n is not None else PILOT_REQUESTS

    def _pilot(self, registry, events, pilot_dir):
        """Step until `next_scale` says done; returns the choice (None: none faithful)."""
        while (s := next_scale(self.steps, self.start)) is not None:
            self.steps.append(self._step(s, registry, events, pilot_dir))
        self.starts.chose(choose(self.steps))
        return choose(self.steps)

    def _step(self, scale, registry, events, pilot_dir):
        exp = dataclasses.replace(self.exp.at_speed(scale),
                                  requests=self._pilot_requests(), duration=None)
        try:
            dep = deploy.compile(exp)
        except ConfigError as e:      # the link cannot be shaped at this scale: a ceiling
            return Step(scale, faithful=False, error=f"cannot be emulated: {e}")
        if self.backend is None:     # built once: what a run without the pilot builds too
            t0 = time.monotonic()
            self.backend = open_backend(exp.backend.kind, dep, registry, events, exp.backend,
                                        run_dir=pilot_dir).start()
            self.record["network_build_s"] = round(time.monotonic() - t0, 3)
        t0, cpu0 = time.monotonic(), children_cpu_s()
        run = self.make_run(exp, pilot_dir / f"time{scale:g}", deployment=dep,
                            backend=self.backend, probe=False, progress=False)
        try:
            summary = run.execute()
        except RunInterrupted:
            raise
        except TestbedError as e:     # e.g. workers not ready in time at this scale
            print(f"scale.time auto: the pilot at {scale:g} failed: {e}", file=sys.stderr)
            return Step(scale, faithful=False, wall_s=round(time.monotonic() - t0, 3),
                        error=f"{type(e).__name__}: {e}")
        return step_of(scale, summary, time.monotonic() - t0, children_cpu_s() - cpu0)
