"""The simulation's event loop: virtual time, a binary heap of timed callbacks.

    deploy (Deployment) -> sim backend: loop (this) <- cluster, wan, engine models -> run dir

`Loop.at(t, fn, *args)` runs `fn(*args)` at virtual time `t` (emulated seconds after arrival
0); events at the same instant run in the order they were scheduled (a sequence number breaks
ties), so a run is deterministic for a seed. `Loop.now()` is the clock the decision code is
handed (`workers.clock.Clock`). Cancelling is by generation: a model that reschedules keeps a
counter and ignores callbacks of an older generation, cheaper than removing heap entries.
`series` schedules a long series of callbacks (a million arrivals) one heap entry at a time,
in the order they would run in had each been scheduled at once: every heap operation stays as
cheap as the events in flight make it.

Why not simpy: `benchmarks/sim_vs_emulation.py --loop-cost` times both on one chain of timed
callbacks; they cost the same per event (simpy 4.1.2 is a heap too: 0.43 us/event as a process,
0.35 as bare callbacks, against 0.41 here; docs/sim.md). The models here are callbacks, not
processes, and need nothing else simpy offers, so the simulator adds no dependency for it.
"""

import heapq
import itertools


class Loop:
    def __init__(self, start_s=0.0):
        self._now = float(start_s)
        self._heap = []
        self._seq = itertools.count()
        self.events = 0             # callbacks run (the cost measure of a run)

    def now(self):
        return self._now

    def at(self, t, fn, *args):
        """Run `fn(*args)` at virtual time `t` (never before now)."""
        now = self._now
        heapq.heappush(self._heap, (now if now > t else t, next(self._seq), fn, args))

    def series(self, n, items):
        """Run each of `n` callbacks `items` yields, (t, i, fn, args) in the order of (t, i),
        as if `at(t, fn, *args)` had been called now for all of them in the order of `i`
        (0 .. n-1), with one of them in the heap at a time."""
        first, items = next(self._seq), iter(items)
        self._seq = itertools.count(first + n)     # theirs: the order at equal times

        def schedule_next():
            for t, i, fn, args in itertools.islice(items, 1):
                now = self._now
                heapq.heappush(self._heap, (now if now > t else t, first + i, run, (fn, args)))

        def run(fn, args):
            schedule_next()
            fn(*args)
        schedule_next()

    def after(self, dt, fn, *args):
        self.at(self._now + dt, fn, *args)

    def run(self, until=float("inf")):
        """Run events in time order until none is left or the next is after `until`."""
        heap, pop = self._heap, heapq.heappop
        n = 0
        try:
            while heap and heap[0][0] <= until:
                t, _, fn, args = pop(heap)
                self._now = t
                n += 1
                fn(*args)
        finally:
            self.events += n
        if until != float("inf"):
            self._now = max(self._now, until)

    def pending(self):
        return len(self._heap)
