"""The decode step clock: when each step of a decode batch runs and what time its tokens carry.

Place in the architecture: beside the engines (workers/engine.py), because the clock follows
what the engine is. The decode worker (`workers.decode.DecodeService`) keeps the batch and the
token streams; the clock runs the batch's steps, asking the service at each step boundary to
admit waiting requests (`admit`) and handing it every step's tokens (`emit`):

- `TimedClock`, for an engine that computes for real (the torch engine): one wake-up per step,
  each `step_s x clock_factor` after the last, stamped when it ends;
- `PacedClock`, for a `PacedDecodeEngine` (the profile engine): steps follow T_step(B, C) back
  to back, and the loop wakes only for a step that changes something outside the batch (a
  first token, a request's last, a flush the service has due: `flush_due`), or when work
  arrives (`kick`). Every step in between is computed at that wake-up and stamped with its
  scheduled end, so each token keeps the time the model gives it. The wake-up hands its steps
  to the service as one run (`emit_run`): the batch's size and context are counted once, and
  the steps before the last, at which nothing but a stamp happens, only append their stamps
  (~7 of ~14 us per step with 20 requests batched; tests/test_stepclock.py checks the result
  is that of one `emit` per step). How late each wake-up came against its schedule is
  recorded (`report`: the `decode_wakeups` row of events.csv). A new clock factor (the `slow`
  fault, a pilot step's fast tail: workers/control.py) is read at the top of a wake-up: the
  steps up to the one it woke for keep the factor they were scheduled with, and the new one
  starts no earlier than it was read, so no step is stamped before the change at its factor.

Idle, either clock waits for work and lets the service reap unclaimed KV every second (`reap`).
"""

import asyncio
import random
import time

from workers.engine import PacedDecodeEngine

LATE_SAMPLES = 100_000      # wake-up lateness samples kept (uniformly over the run)
# The paced loop wakes at least this often (emulated seconds) while it has a batch: the steps one
# wake-up computes hold the event loop, and the KV receiver stamps arrivals from that loop.
MAX_WAKE_S = 0.01


def resolve(fut, value):
    if not fut.done():
        fut.set_result(value)


def for_engine(engine, service):
    """The clock `engine` needs: paced for a `PacedDecodeEngine`, timed otherwise."""
    return (PacedClock if isinstance(engine, PacedDecodeEngine) else TimedClock)(engine, service)


class StepClock:
    """What both clocks share: the wake-up on work (`kick`), the idle wait, the counts."""

    def __init__(self, engine, service):
        """`service`: `batch` (the slots stepped together), `admit()`, `emit(tokens, stamp,
        step_s)`, `flush_due()` (Unix time of the batch's next flush), `reap()`."""
        self.engine, self.service = engine, service
        self.has_work = asyncio.Event()
        self._waiter = None         # the paced loop's sleep, ended early by `kick`
        self.steps = self.wakeups = 0
        self.factor = engine.clock_factor   # the engine's, as the paced loop last read it
        self.last_stamp = 0.0
        self.lateness, self.late_max = [], 0.0

    def kick(self):
        """Work for the step loop: a request waits to join, or one left the batch."""
        self.has_work.set()
        if self._waiter is not None:
            resolve(self._waiter, True)

    async def _idle(self):
        """Wait for work (reaping unclaimed KV every second meanwhile)."""
        self.has_work.clear()
        try:
            await asyncio.wait_for(self.has_work.wait(), 1.0)
        except asyncio.TimeoutError:
            self.service.reap()

    def _late(self, late_s):
        """One wake-up's lateness against its schedule (emulated s), a bounded sample. Not
        under a clock factor below 1: a pilot step's tail, run fast once every first token is
        out (testbed/autoscale.py; the `slow` fault's factor is above 1)."""
        if self.factor < 1:
            return
        self.wakeups += 1
        self.late_max = max(self.late_max, late_s)
        if len(self.lateness) < LATE_SAMPLES:
            self.lateness.append(late_s)
        else:
            i = random.randrange(self.wakeups)
            if i < LATE_SAMPLES:
                self.lateness[i] = late_s

    def report(self, events, name):
        """The `decode_wakeups` row of events.csv: steps, wake-ups, lateness (emulated ms)."""
        if events is None or not self.wakeups:
            return
        late = sorted(self.lateness)
        q = lambda f: round(late[min(len(late) - 1, int(f * len(late)))] * 1e3, 3)  # noqa: E731
        events("decode_wakeups", instance=name, steps=self.steps,
               wakeups=self.wakeups, late_p50_ms=q(0.5), late_p99_ms=q(0.99),
               late_max_ms=round(self.late_max * 1e3, 3))


class TimedClock(StepClock):
    """An engine that computes for real: one wake-up per step, stamped when it ends."""

    async def run(self):
        svc, engine = self.service, self.engine
        assembling = svc.assembling
        next_tick = time.monotonic()
        while True:
            svc.admit()
            if not svc.batch:
                await self._idle()
                next_tick = time.monotonic()
                continue
            next_tick += engine.step_s * engine.clock_factor
            delay = next_tick - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            t_step = time.monotonic()
            ids = [s.rid for s in svc.batch]
            tokens = (await engine.aemit_step(ids) if assembling else engine.step(ids))
            svc.emit(tokens, time.time(), max(engine.step_s, time.monotonic() - t_step))


class PacedClock(StepClock):
    """The modelled engine's clock; see the module docstring."""

    async def run(self):
        """The step the loop woke for is stamped when it runs, as every step was when the loop
        woke for each: its tokens leave then, and a late wake-up (the event loop's timers round
        up to the millisecond) lengthens that step and shortens the next, as it did then."""
        svc = self.service
        next_tick = time.monotonic()        # end of the last step run = start of the next
        while True:
            self.has_work.clear()
            if self.engine.clock_factor != self.factor:     # set since (workers/control.py):
                self.factor = self.engine.clock_factor      # from now on, no step before it
                next_tick = max(next_tick, time.monotonic())
            svc.admit()
            if not svc.batch:
                await self._idle()
                next_tick = time.monotonic()
                continue
            end = self._next_event(next_tick)
            if await self._sleep_until(end):        # work came: stop at the step in progress
                end = self._next_event(next_tick, until=time.monotonic())
                await self._sleep_until(end, wake=False)
            self._late(time.monotonic() - end)
            now = time.time()
            offset = now - time.monotonic()
            steps = self._run if svc.steady() else self._step_each
            next_tick = steps(next_tick, end, now, offset)

    def _step_each(self, next_tick, end, now, offset):
        """The steps up to `end`, one `emit` each, the batch counted again at each (a request
        cancelled leaves it at the next step). Returns the end of the last step."""
        svc, engine = self.service, self.engine
        while svc.batch:
            step_s = engine.step_seconds(
                len(svc.batch), sum(s.input_len + len(s.times) for s in svc.batch))
            t = next_tick + step_s * self.factor
            if t > end + 1e-9:
                break
            next_tick = t
            svc.emit(engine.step([s.rid for s in svc.batch]), self._stamp(t, end, now, offset),
                     step_s)
        return next_tick

    def _stamp(self, t, end, now, offset):
        """Unix stamp of the step ending at monotonic `t`: its scheduled end, or `now` for the
        step the loop woke for; distinct and rising (one stamp is one step)."""
        self.steps += 1
        stamp = max(t + offset, now if t >= end - 1e-9 else 0.0, self.last_stamp + 1e-6)
        self.last_stamp = stamp
        return stamp

    def _run(self, next_tick, end, now, offset):
        """The steps up to `end` of a batch that stays as it is until the last of them (no
        request cancelled: `DecodeService.steady`; one finishing or starting ends the run by
        `_next_event`): the same steps, stamps and step times as one `emit` per step, with the
        batch's size and context counted once. Returns the end of the last step."""
        svc, engine = self.service, self.engine
        n, ids = len(svc.batch), [s.rid for s in svc.batch]
        context = sum(s.input_len + len(s.times) for s in svc.batch)
        run = []
        while True:
            step_s = engine.step_seconds(n, context)
            t = next_tick + step_s * self.factor
            if t > end + 1e-9:
                break
            next_tick = t
            context += n
            run.append((engine.step(ids), self._stamp(t, end, now, offset), step_s))
        if run:
            svc.emit_run(run)
        return next_tick

    def _next_event(self, start, until=None):
        """Monotonic end of the first step from `start` that changes something outside the
        batch (see the module docstring), or of the one in progress at `until`, or of the first
        one `MAX_WAKE_S` after `start`."""
        batch = self.service.batch
        n = len(batch)
        context = sum(s.input_len + len(s.times) for s in batch)
        steps_left = min(s.output_len - len(s.times) for s in batch)
        first = any(not s.times for s in batch)
        flush = self.service.flush_due()
        offset = time.time() - time.monotonic()
        factor = self.factor
        t, j = start, 0
        while True:
            t += self.engine.step_seconds(n, context) * factor
            context += n
            j += 1
            if (first or j >= steps_left or t + offset >= flush or t - start >= MAX_WAKE_S
                    or (until is not None and t >= until)):
                return t

    async def _sleep_until(self, t, wake=True):
        """Sleep until monotonic `t`; True if work arrived first (with `wake`)."""
        if wake and self.has_work.is_set():
            return True
        if t <= time.monotonic():
            return False
        loop = asyncio.get_running_loop()       # its clock is time.monotonic()
        fut = loop.create_future()
        timer = loop.call_at(t, resolve, fut, False)
        if wake:
            self._waiter = fut
        try:
            return await fut
        finally:
            timer.cancel()
            self._waiter = None
