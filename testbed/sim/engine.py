"""Engine models in virtual time: the profile engines' own timing, driven by the event loop.

    deploy (WorkerRuntime) -> engine (this): workers.engine_profile's engines -> cluster

The numbers come from the engines the emulation runs (`workers.engine_profile`), instantiated
from the same `WorkerRuntime`, so nothing about the profile is re-derived here:

- prefill (`PrefillInstance`): `ProfilePrefillEngine.compute_s` = T(L | P cached) / scale.time
  and `kv_bytes`; FIFO, one compute at a time, a request starting when the one before was due
  to end; its KV in `stream_chunks` pieces, piece i ready at (i+1)/n of the compute (layer-wise
  pipelining), as the worker hands them to the sender.
- decode (`DecodeInstance`): continuous batching as workers/decode.py's paced loop does it:
  `ProfileDecodeEngine.step_seconds(B, C)` back to back while the batch has work; a request
  whose KV is complete joins at the next step boundary (the end of the step in progress, or at
  once when idle), up to BS_max and while `fits` its KV (the head of the queue waits, later
  ones do not overtake it); a request leaves at the step of its last token; every step emits
  one token per request, stamped with the step's end. Tokens after the first reach the client
  at the worker-wide flushes (every `token_flush_s`), the first one and the last at once.

Steps are kept once per instance (their end times, an array), and a request holds only the
index of its first step, so a step costs O(1) whatever the batch, and the per-token times of a
request are a slice (`tokens_of`).
"""

from __future__ import annotations

import array
import bisect
import collections
import math

import numpy as np

from workers.engine_profile import ProfileDecodeEngine, ProfilePrefillEngine


_EMPTY = np.empty(0)


class PrefillInstance:
    """One prefill instance's compute schedule (virtual, emulated seconds)."""

    def __init__(self, rt, inst):
        self.engine = ProfilePrefillEngine(rt, inst)
        self.free_at = -math.inf
        self.busy_s = 0.0

    def schedule(self, arrived, input_len, cached=0, decode_cached=0):
        """(start, end, [(ready_at, nbytes, last)]) of a prefill that reached the instance at
        `arrived` (requests are scheduled in arrival order: FIFO)."""
        e = self.engine
        t_compute = e.compute_s(input_len, cached)
        size = e.kv_bytes(input_len, decode_cached)
        n = min(e.chunks, size)
        start = max(arrived, self.free_at)
        ready, pieces = start, []
        for i in range(n):
            ready += t_compute / n * e.clock_factor
            pieces.append((ready, size // n + (1 if i < size % n else 0), i == n - 1))
        self.free_at = ready
        self.busy_s += ready - start
        return start, ready, pieces


class Slot:
    """A request on a decode instance (`req`: the caller's own record of it)."""

    __slots__ = ("req", "input_len", "output_len", "need", "reserved", "join", "last",
                 "join_time", "kv_done", "on_finish")

    def __init__(self, req, input_len, output_len, need, on_finish):
        self.req, self.input_len, self.output_len = req, input_len, output_len
        self.need, self.reserved = need, 0.0
        self.join = -1              # index of its first step on the instance
        self.last = self.join + output_len - 1      # of its last step (an attribute: read
        self.join_time = None                       # at every boundary of its batch)
        self.kv_done = None
        self.on_finish = on_finish


class DecodeInstance:
    """One decode instance's continuous batch in virtual time."""

    def __init__(self, loop, rt, inst):
        self.loop, self.name = loop, inst.name
        self.engine = ProfileDecodeEngine(rt, inst)
        self.flush_s = rt.token_flush_s
        self.steps = array.array("d")       # end time of every step run, in order
        self.flushes = array.array("q")     # indices of the steps that flushed tokens
        self.last_flush = -math.inf
        self.waiting = collections.deque()
        self.batch = []
        self.sum_input = 0                  # of the batch
        self.sum_join = 0                   # of the batch's first-step indices
        self.next_tick = None               # end of the last step run (None: idle)
        self.pending = _EMPTY               # planned step ends beyond the last one run
        self.busy_s = 0.0
        self._gen = 0
        self.frozen_at = None               # a pause began (None: running)
        self._rest = None                   # what was left of the step a pause froze

    # ---- requests ----
    def arrive(self, slot):
        """`slot`'s KV is complete now: it waits for the next step boundary."""
        now = self.loop.now()
        slot.kv_done = now
        self.waiting.append(slot)
        if self.frozen_at is not None:      # a frozen worker takes it at the resume
            return
        if self.next_tick is None:          # idle: the loop starts a step at once
            self.next_tick = now
            self._boundary_now()
            return
        # The step in progress ends first; the batch changes at its end.
        j = int(np.searchsorted(self.pending, now, "left"))
        if j < len(self.pending):
            self._commit(j + 1)
            self._gen += 1
            self.loop.at(self.next_tick, self._boundary, self._gen)
        # else: the planned boundary is now (an event at this instant is already queued)

    def first_last(self, slot):
        """(first token's stamp, last token's stamp) of a finished slot: `tokens_of`'s first
        and last, without the per-token list."""
        return self.steps[slot.join], self.steps[slot.last]

    def tokens_of(self, slot):
        """(token stamps, client chunks [(first index, arrival, count)]) of a finished slot."""
        times = self.steps[slot.join:slot.last + 1].tolist()
        chunks = [(0, times[0], 1)] if slot.output_len > 1 else []
        emitted = len(chunks)
        lo = bisect.bisect_right(self.flushes, slot.join)
        hi = bisect.bisect_left(self.flushes, slot.last)
        for f in self.flushes[lo:hi]:
            n = f - slot.join + 1
            if n > emitted:
                chunks.append((emitted, times[f - slot.join], n - emitted))
                emitted = n
        chunks.append((emitted, times[-1], slot.output_len - emitted))   # the last chunk
        return times, chunks

    # ---- faults (testbed/sim/faults.py) ----
    def tokens(self, slot):
        """Tokens `slot` has made by now (its steps that ended)."""
        if slot.join < 0:
            return 0
        made = len(self.steps) - slot.join + int(np.searchsorted(self.pending, self.loop.now(),
                                                                 "right"))
        return max(0, min(slot.output_len, made))

    def _stop(self):
        """Keep the steps that ended by now, drop the planned rest: (the step in progress's
        remaining seconds or None)."""
        now = self.loop.now()
        j = int(np.searchsorted(self.pending, now, "right"))
        rest = float(self.pending[j]) - now if j < len(self.pending) else None
        self._commit(j)
        self._gen += 1
        return rest

    def freeze(self):
        """SIGSTOP: no step ends until `thaw`; the step in progress resumes where it was."""
        if self.frozen_at is None:
            self._rest = self._stop() if self.next_tick is not None else None
            self.frozen_at = self.loop.now()

    def thaw(self):
        if self.frozen_at is None:
            return
        now = self.loop.now()
        frozen, self.frozen_at = now - self.frozen_at, None
        if self._rest is not None and self.batch:
            self.busy_s -= frozen               # the resumed step's end counts the pause
            self.pending = np.array([now + self._rest])
            self._gen += 1
            self.loop.at(float(self.pending[0]), self._boundary, self._gen)
        elif self.batch or self.waiting:
            self.next_tick = now
            self._boundary_now()
        else:
            self.next_tick = None
        self._rest = None

    def kill(self):
        """SIGKILL: every request on it is lost; [(slot, tokens made)] of those it held (one
        whose last token was made before is finished first)."""
        if self.next_tick is not None and self.frozen_at is None:
            self._stop()
        done = [s for s in self.batch if s.last < len(self.steps)]
        lost = [(s, self.tokens(s)) for s in self.batch if s.last >= len(self.steps)]
        lost += [(s, 0) for s in self.waiting]
        for s in self.batch:
            if s.reserved:
                self.engine.free(s.reserved)
        self.batch, self.waiting = [], collections.deque()
        self.sum_input = self.sum_join = 0
        self.next_tick = self.frozen_at = self._rest = None
        self.pending = _EMPTY
        self._gen += 1
        for s in done:
            s.on_finish(s)
        return lost

    def remove(self, slot):
        """A request moved off this (frozen) instance: its stream was cancelled."""
        if slot in self.waiting:
            self.waiting.remove(slot)
        elif slot in self.batch:
            self.batch.remove(slot)
            self.sum_input -= slot.input_len
            self.sum_join -= slot.join
            if slot.reserved:
                self.engine.free(slot.reserved)

    def rebound(self):
        """The step time changed (`slow`): re-plan from the end of the step in progress."""
        if self.next_tick is None or self.frozen_at is not None:
            return
        j = int(np.searchsorted(self.pending, self.loop.now(), "left"))
        if j < len(self.pending):
            self._commit(j + 1)
            self._gen += 1
            self.loop.at(self.next_tick, self._boundary, self._gen)

    # ---- the step loop ----
    def _step_s(self, k, n):
        context = self.sum_input + n * k - self.sum_join
        return self.engine.step_seconds(n, context) * self.engine.clock_factor

    def _durations(self, k, m, n):
        """Durations of steps k .. k+m-1 of a batch of `n`. T_step(B, C) is affine in the
        context C (`testbed.profile.DecodeModel`), and C grows by B a step, so the durations
        are an arithmetic progression: two evaluations give it, a third checks it."""
        t0 = self._step_s(k, n)
        if m == 1:
            return np.array([t0])
        d = self._step_s(k + 1, n) - t0
        if m > 2 and not math.isclose(self._step_s(k + m - 1, n), t0 + d * (m - 1),
                                      rel_tol=1e-9, abs_tol=1e-12):
            return np.array([self._step_s(k + i, n) for i in range(m)])
        return t0 + d * np.arange(m)

    def _commit(self, j):
        """Run the first `j` planned steps; a worker-wide flush at every step that ends
        `token_flush_s` or more after the last one (workers/decode.py `_send_batch`)."""
        seg = self.pending[:j]
        if j:
            base = len(self.steps)
            while True:
                f = int(np.searchsorted(seg, self.last_flush + self.flush_s, "left"))
                if f >= j:
                    break
                self.flushes.append(base + f)
                self.last_flush = float(seg[f])
            self.steps.frombytes(seg.tobytes())
            self.busy_s += float(seg[-1]) - self.next_tick
            self.next_tick = float(seg[-1])
        self.pending = _EMPTY

    def _boundary_now(self):
        self._gen += 1
        self._boundary(self._gen)

    def _boundary(self, gen):
        if gen != self._gen:
            return
        if len(self.pending):
            self._commit(len(self.pending))
        k = len(self.steps)             # the next step's index
        done = [s for s in self.batch if s.last < k]
        if done:
            self.batch = [s for s in self.batch if s.last >= k]
            for s in done:
                self.sum_input -= s.input_len
                self.sum_join -= s.join
                if s.reserved:
                    self.engine.free(s.reserved)
        self._admit(k)
        self._plan(k)
        for s in done:
            s.on_finish(s)

    def _admit(self, k):
        e = self.engine
        while self.waiting and len(self.batch) < e.bs_max:
            s = self.waiting[0]
            if not e.fits(s.need):
                break
            self.waiting.popleft()
            s.reserved = s.need
            if s.reserved:
                e.reserve(s.reserved)
            s.join, s.join_time = k, self.next_tick
            s.last = k + s.output_len - 1
            self.sum_input += s.input_len
            self.sum_join += k
            self.batch.append(s)

    def _plan(self, k):
        """Plan the steps up to the first one that ends a request; an event at its end."""
        if not self.batch:
            self.next_tick = None
            return
        n = len(self.batch)
        last = min(s.last for s in self.batch)
        self.pending = self.next_tick + np.cumsum(self._durations(k, last - k + 1, n))
        self._gen += 1
        self.loop.at(float(self.pending[-1]), self._boundary, self._gen)
