"""Scheduled link changes during a run: failure injection, degradation, bandwidth traces.

`LinkSchedule(wan, items)` applies each `(t_s, direction, changes)` (emulation units: the
deployment's link changes, `testbed.deploy.LinkChange.item()` -- `network.wan.changes`, every
`network.wan.rate_trace` row and the link faults, whose fourth element is logged as a
`fault_inject`/`fault_end` event) through the shaper's `set` at `t0 + t_s` (a change with an
`event` key -- blackhole, reject, reset, or None to end it -- through its `event`),
in a thread; `Wan.set` logs each change, with how long it took to apply, to the run's
events.csv. A change that fails is reported (a `link_schedule_error` row in events.csv and a
warning line) and kept in `errors`; the later changes are still applied, and the run goes on
measuring.
"""

import sys
import threading
import time


def _stderr(msg):
    print(msg, file=sys.stderr)


class LinkSchedule:
    def __init__(self, wan, items, events=None, warn=_stderr):
        self.wan, self.items, self.events, self.warn = wan, list(items), events, warn
        self._stop = threading.Event()
        self._thread = None
        self.applied = 0
        self.errors = []        # (t_s, direction, changes, error text) of each failed change

    @property
    def error(self):
        """The first failed change's error text, or None."""
        return self.errors[0][3] if self.errors else None

    def start(self, t0):
        """Start applying; `t0` is the Unix time that t_s = 0 refers to (the first arrival)."""
        if self.items:
            self._thread = threading.Thread(target=self._run, args=(t0,), daemon=True,
                                            name="link-schedule")
            self._thread.start()
        return self

    def _run(self, t0):
        for t, direction, changes, *note in self.items:
            if self._stop.wait(max(0.0, t0 + t - time.time())):
                return
            try:
                if note and self.events:     # a link fault (testbed/faultspec.py): on record
                    n = dict(note[0])
                    self.events(f"fault_{n.pop('phase')}", **n)
                if "event" in changes:    # blackhole, reject, reset (testbed.net.linkevents)
                    self.wan.event(direction, changes["event"], changes.get("port", 0))
                else:
                    self.wan.set(direction, **changes)
                self.applied += 1
            except Exception as e:   # keep measuring and keep applying; say what failed
                err = f"{type(e).__name__}: {e}"
                self.errors.append((t, direction, changes, err))
                if self.events:
                    self.events("link_schedule_error", at=t, direction=direction or "both",
                                changes=changes, error=err)
                if self.warn:
                    self.warn(f"warning: scheduled link change at {t:g}s (emulated) "
                              f"{direction or 'both'} {changes} failed: {err}; later changes "
                              "still apply")

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
