"""The event loop every testbed process runs: uvloop, with timers that never fire early.

Place in the architecture: a low floor, beside the clocks (it needs only testbed.errors).
Every worker process (prefill, decode, dual-role, cache pool), the scheduler, the built-in
client, the front door, the `testbed up` relay and the vLLM calibration client start their loop
here (`run`, `new_loop`), so the whole control plane runs on one kind of loop, chosen in one
place.

uvloop (libuv) is a dependency: it takes the event loop's own share of the control plane's CPU
(wake-ups, callbacks, socket reads and writes) out of Python. `TESTBED_LOOP=asyncio` in the
environment runs the standard library's loop instead, for comparison (docs/performance.md,
"uvloop"); the runner passes its environment to every process it starts, and metadata.json
records the choice (`event_loop`). Any other value is an error, before anything starts.

Why a subclass of uvloop's loop: libuv keeps time in whole milliseconds, truncated, and uvloop
rounds a timer's delay to the nearest millisecond from that clock, so `asyncio.sleep(d)` and
`call_at(t)` can fire before they are due (measured: a 0.3 ms sleep returned 0.3 ms early every
time, sleeps of 0.2-3 ms up to 1.3 ms early). At `scale.time: 40` that is 50 ms real-world, and
the emulation's premise is that a modelled duration is never cut short: the decode step clock
and the prefill engines sleep until a modelled end and stamp it. `Loop`'s timers (`Timer`) fire
at or after their time, late by as much as asyncio's loop's (epoll rounds its timeout up to the
millisecond; measured with random phases: 0.56-0.64 ms mean under both), and `time()` is
`time.monotonic()`, the clock asyncio's loop uses and the workers compare with
(tests/test_eventloop.py measures both).
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
import time

import uvloop

from testbed.errors import ConfigError

LOOP_ENV = "TESTBED_LOOP"
LOOPS = ("uvloop", "asyncio")       # the first is the default


class Loop(uvloop.Loop):
    """uvloop's loop whose timers never fire before their time (see the module docstring)."""

    def time(self):
        return time.monotonic()

    def call_at(self, when, callback, *args, context=None):
        return Timer(self, when, callback, args, context)

    def call_later(self, delay, callback, *args, context=None):
        return Timer(self, time.monotonic() + delay, callback, args, context)


class Timer:
    """A timer on `Loop`: what asyncio's `TimerHandle` offers (`cancel`, `cancelled`, `when`).

    libuv counts a timeout in whole milliseconds from its clock truncated to the millisecond,
    and sleeps in its poll from there: a timeout of ceil(remaining) ms, armed now, wakes the
    loop at or after `when`, late by under a millisecond as asyncio's epoll timeout is. When
    the loop woke for something else and found the timer due on its truncated clock before
    `when`, the timer arms itself again for the rest instead of running early."""

    __slots__ = ("_loop", "_when", "_callback", "_args", "_context", "_handle")

    def __init__(self, loop, when, callback, args, context):
        self._loop, self._when, self._callback, self._args = loop, when, callback, args
        self._context = contextvars.copy_context() if context is None else context
        self._arm(time.monotonic())

    def _arm(self, now):
        ms = max(0, math.ceil((self._when - now) * 1e3))
        self._handle = uvloop.Loop.call_later(self._loop, ms / 1e3, self._fire,
                                              context=self._context)

    def _fire(self):
        now = time.monotonic()
        if now < self._when:
            self._arm(now)
            return
        self._handle = None
        self._callback(*self._args)

    def when(self):
        return self._when

    def cancel(self):
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._callback = self._args = None

    def cancelled(self):
        return self._callback is None


def kind(environ=None) -> str:
    """The loop this process runs: `TESTBED_LOOP` (`uvloop` when unset); ConfigError otherwise."""
    value = (os.environ if environ is None else environ).get(LOOP_ENV, LOOPS[0]) or LOOPS[0]
    if value not in LOOPS:
        raise ConfigError(f"environment {LOOP_ENV}={value!r}: expected one of {', '.join(LOOPS)}")
    return value


def new_loop(environ=None) -> asyncio.AbstractEventLoop:
    """A new event loop of the kind `kind` names (for a thread that runs its own)."""
    return Loop() if kind(environ) == "uvloop" else asyncio.new_event_loop()


def run(main, environ=None):
    """`asyncio.run(main)` on the loop `kind` names: the entry point of every process's loop."""
    if kind(environ) == "uvloop":
        return uvloop.run(main, loop_factory=Loop)
    return asyncio.run(main)
