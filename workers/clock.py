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
