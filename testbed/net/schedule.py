"""Scheduled link changes during a run: failure injection, degradation, bandwidth traces.

`LinkSchedule(wan, items)` applies each `(t_s, direction, changes)` (emulation units, from
`Experiment.emulated_changes`, and link faults from `testbed.faults.link_items`, whose fourth
element is logged as a `fault_inject`/`fault_end` event) through `Wan.set` at `t0 + t_s`, in a thread; `Wan.set` logs each
change, with how long it took to apply, to the run's events.csv. An error in a change stops the
schedule, is logged, and the run goes on measuring.
"""

import threading
import time


class LinkSchedule:
    def __init__(self, wan, items, events=None):
        self.wan, self.items, self.events = wan, list(items), events
        self._stop = threading.Event()
        self._thread = None
        self.applied = 0
        self.error = None

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
                if note and self.events:     # a link fault (testbed/faults.py): on record
                    n = dict(note[0])
                    self.events(f"fault_{n.pop('phase')}", **n)
                self.wan.set(direction, **changes)
                self.applied += 1
            except Exception as e:   # keep measuring; say what failed
                self.error = e
                if self.events:
                    self.events("link_schedule_error", at=t, error=e)
                return

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
