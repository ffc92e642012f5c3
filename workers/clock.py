"""The clock a decision is made by: a Protocol, so the same decision code runs on the wall clock
(the emulation's scheduler) and on virtual time (the simulator, testbed/sim/loop.py).

A decision class (`workers.adaptive.ThresholdDecider`, `workers.roles.RolePlanner`) takes `now`
as an argument or a `Clock`; the asyncio adapters around them pass `WALL`.
"""

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock's timeline (Unix time on the wall; virtual in the sim)."""
        ...


class WallClock:
    def now(self):
        return time.time()


WALL = WallClock()


def wall_of(mono):
    """The Unix time of monotonic time `mono`. The offset between the clocks is read with the
    wall clock bracketed by two monotonic reads, the tightest of three tries: a reader
    descheduled between two plain reads (half a ms on shared cores, 2026-12-03) would shift
    every time it converts by that much."""
    best = None
    for _ in range(3):
        m0 = time.monotonic()
        w = time.time()
        m1 = time.monotonic()
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, w - (m0 + m1) / 2)
        if m1 - m0 < 20e-6:
            break
    return mono + best[1]
