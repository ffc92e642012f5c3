"""Decode worker: one local decode instance, a gRPC `Decode` service plus a KV receiver socket.

The scheduler opens `Decode(request)` (a stream of token chunks) and, concurrently, tells a
prefill worker to send that request's KV to this worker's KV socket. The request waits (bounded by
the KV deadline) until its KV has fully arrived, then joins the continuous batch at the next step
boundary, up to BS_max. Every step emits one token per batched request, stamped with this
worker's clock; the first token is sent at once, later ones are coalesced into chunks (every
`flush_s`, and always the last one) so the control plane stays cheap while each token keeps its
exact time.

Tokens go straight to the client: while the request's client (`Request.client`) holds its
token stream on this worker (a plain TCP connection to the token port, workers/tokens.py), the
chunks of every batched request of that
client go out together in one `TokenBatch` per flush (first tokens at once, in a batch of their
own), and the request's `Decode` stream, the scheduler's, carries one `direct` mark when the
first token has gone (so the scheduler knows the request has begun: no failover after that) and
the last chunk. Without such a stream each request's chunks go on its `Decode` stream, and the
scheduler relays them.
"""

import asyncio
import collections
import random
import time

from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers import common, control, kvwire, status, tokens
from workers.engine import AssemblingDecodeEngine, DecodeEngine, PacedDecodeEngine


LATE_SAMPLES = 100_000      # wake-up lateness samples kept (uniformly over the run)
# The paced loop wakes at least this often (emulated seconds) while it has a batch: the steps one
# wake-up computes hold the event loop, and the KV receiver stamps arrivals from that loop.
MAX_WAKE_S = 0.01


def _resolve(fut, value):
    if not fut.done():
        fut.set_result(value)


class Slot:
    """One request's state on this worker: KV arrival, then tokens."""

    def __init__(self, rid):
        self.rid = rid
        self.created = time.monotonic()
        self.kv_done = asyncio.Event()
        self.kv_error = ""
        self.kv_bytes = 0
        self.kv_first = 0.0
        self.kv_last = 0.0
        self.claimed = False
        self.output_len = 0
        self.times = []
        self.token_ids = []
        self.emitted = 0
        self.join = 0.0
        self.input_len = 0
        self.kv_need = 0.0          # real-world bytes it holds in decode memory once batched
        self.reserved = 0.0
        self.wake = asyncio.Event()
        self.finished = False
        self.attempt = -1            # the prefill attempt whose KV this slot takes
        self.client = ""             # Request.client: whose token stream takes the tokens
        self.marked = False          # the scheduler was told the first token went direct
        self.cache_bytes = 0
        self.cache_tokens = 0


class DecodeService(pbg.DecodeServicer):
    def __init__(self, rt, name, engine: DecodeEngine, log):
        self.rt, self.name, self.engine, self.log = rt, name, engine, log
        self.slots = {}
        self.waiting = collections.deque()
        self.batch = []
        self.busy_s = 0.0
        # Tokens after the first go out in chunks every `token_flush_s` (emulated): each token
        # keeps its own time stamp; fewer messages keep the control plane off the CPU's limit.
        self.flush_s = rt.token_flush_s
        self.orphan_s = rt.kv_deadline_s
        self.has_work = asyncio.Event()
        self.token_streams = {}     # client -> its open token stream (workers/tokens.py)
        self.last_flush = 0.0       # the last worker-wide flush (Unix time)
        self.slot_flush = {}        # request id -> its last flush, without a token stream
        self._waiter = None         # the paced loop's sleep, ended early by `_kick`
        self.steps = self.wakeups = 0
        self.last_stamp = 0.0
        self.lateness, self.late_max = [], 0.0
        # The torch engine assembles the shipped state from the KV frames, steps in a thread
        # (the loop keeps receiving KV meanwhile) and emits, at each step, the token fed in:
        # the first is the one prefill predicted.
        self.assembling = isinstance(engine, AssemblingDecodeEngine)
        # Step time and decode memory: the profile engine models them (T_step(B, C), KV
        # capacity); an engine that computes for real takes its own time and memory.
        self.paced = isinstance(engine, PacedDecodeEngine)
        # Exactly-once admission: a re-dispatched request's KV may come from several prefill
        # attempts (at-least-once prefill). The slot follows the newest attempt until its KV is
        # complete; frames of any other attempt, or for a request already served, are discarded
        # and counted (`kv_discarded` rows in events.csv; complete ones are duplicates).
        self.served = collections.OrderedDict()     # request id -> admitted attempt
        self.discarded = {}                         # (rid, attempt) -> bytes, last time, complete
        self.duplicates = 0
        self.events = None
        self.cache = None           # workers.cache_worker.DecodeCache when the cache is on

    # ---- KV receiver ----
    def on_frame(self, wire, seq, flags, payload, t_first, t_last):
        rid, attempt = control.split_id(wire)
        slot = self.slots.get(rid)
        if rid in self.served or (slot is not None and (attempt < slot.attempt or (
                slot.kv_done.is_set() and attempt != slot.attempt))):
            self._discard(rid, attempt, flags, len(payload))
            return
        if slot is None:
            slot = self.slots[rid] = Slot(rid)
        if attempt > slot.attempt:
            if slot.kv_bytes:         # a newer attempt supersedes a partial transfer
                self._discard(rid, slot.attempt, 0, slot.kv_bytes)
                slot.kv_bytes, slot.kv_first = 0, 0.0
                if self.assembling:
                    self.engine.release(rid)
            slot.attempt = attempt
        if not slot.kv_first:
            slot.kv_first = t_first
        slot.kv_bytes += len(payload)
        slot.kv_last = t_last
        if self.assembling:
            self.engine.receive(rid, seq, flags, payload)
        if flags & kvwire.FLAG_ABORT:
            slot.kv_error = "KV transfer aborted by the sender"
            slot.kv_done.set()
        elif flags & kvwire.FLAG_LAST:
            slot.kv_done.set()

    def _discard(self, rid, attempt, flags, nbytes):
        e = self.discarded.setdefault((rid, attempt), {"bytes": 0, "complete": False})
        e["bytes"] += nbytes
        e["t"] = time.monotonic()
        if flags & kvwire.FLAG_LAST:
            e["complete"] = True
            self.flush_discarded(0.0)

    def flush_discarded(self, idle_s=1.0):
        """Log discarded KV (per request and attempt) that has seen no frame for `idle_s`."""
        now = time.monotonic()
        for key, e in list(self.discarded.items()):
            if now - e["t"] >= idle_s or e["complete"]:
                del self.discarded[key]
                self.duplicates += e["complete"]
                if self.events is not None:
                    self.events("kv_discarded", instance=self.name, id=key[0], attempt=key[1],
                                bytes=e["bytes"], complete=int(e["complete"]))

    async def discard_loop(self):
        while True:
            await asyncio.sleep(1.0)
            self.flush_discarded()

    def on_kv_error(self, err):
        self.log.warning("KV connection error: %s", err)

    # ---- gRPC ----
    async def Decode(self, dreq, context):
        req = dreq.request
        self.served.pop(req.id, None)     # re-routed back here: this call serves it again
        slot = self.slots.get(req.id)
        if slot is None:
            slot = self.slots[req.id] = Slot(req.id)
        slot.claimed = True
        slot.client = req.client
        slot.output_len = max(1, req.output_len)
        slot.input_len = req.input_len
        slot.kv_need = (self.engine.kv_need(req.input_len, slot.output_len) if self.paced
                        else 0.0)
        prefix = None
        if self.cache is not None and req.decode_cached_len > 0:
            prefix = asyncio.ensure_future(self.cache.safely(
                self.cache.fetch(req, dreq.cache_pool), (0, 0)))
        try:
            try:
                await asyncio.wait_for(slot.kv_done.wait(), dreq.kv_deadline_s)
                if prefix is not None:      # the prefix's MLA KV from the local pool
                    slot.cache_tokens, slot.cache_bytes = await prefix
                if self.cache is not None and dreq.put_to_pool and not slot.kv_error:
                    self.cache.spawn(self.cache.safely(
                        self.cache.put_received(req, slot.cache_tokens), 0))
            except asyncio.TimeoutError:
                got = f"{slot.kv_bytes} bytes" if slot.kv_bytes else "nothing"
                yield self._final(slot, "failed", f"{self.name}: KV not complete after "
                                  f"{dreq.kv_deadline_s:.3g}s (emulated); received {got}")
                return
            error = slot.kv_error or ((self.assembling and self.engine.error(req.id)) or "")
            if not error:
                try:
                    self.engine.admit(req.id, slot)
                except Exception as e:   # a corrupt or incomplete state fails the request
                    error = f"state rejected: {e}"
            if error:
                yield self._final(slot, "failed", f"{self.name}: {error}")
                return
            self.waiting.append(slot)
            self._kick()
            while True:
                await slot.wake.wait()
                slot.wake.clear()
                if slot.finished:
                    yield self._final(slot, "ok", "")
                    return
                if len(slot.times) > slot.emitted:      # no token stream took them
                    yield self._chunk(slot)
                elif slot.emitted and not slot.marked:  # the first token went to the client
                    slot.marked = True
                    yield pb.TokenChunk(id=slot.rid, direct=slot.emitted)
        finally:
            if prefix is not None and not prefix.done():
                prefix.cancel()
            if not slot.finished and slot in self.batch:
                self._kick()            # cancelled while batched: the batch changes now
            slot.finished = True
            if self.slots.get(req.id) is slot:
                self.slots.pop(req.id, None)
            self.served[req.id] = slot.attempt
            while len(self.served) > 100_000:
                self.served.popitem(last=False)
            self.engine.release(req.id)

    def _chunk(self, slot):
        i = slot.emitted
        slot.emitted = len(slot.times)
        return pb.TokenChunk(id=slot.rid, first_index=i, times=slot.times[i:],
                             token_ids=slot.token_ids[i:])

    def _final(self, slot, status, error):
        c = self._chunk(slot)
        c.done, c.status, c.error = True, status, error
        c.kv_recv_start, c.kv_recv_end, c.kv_recv_bytes = slot.kv_first, slot.kv_last, slot.kv_bytes
        c.decode_instance, c.decode_join = self.name, slot.join
        c.kv_attempt = max(0, slot.attempt)
        c.cache_fetch_bytes, c.decode_cached_len = slot.cache_bytes, slot.cache_tokens
        return c

    async def Health(self, request, context):
        return pb.HealthReply(name=self.name, role="decode", queue_depth=len(self.waiting),
                              active=len(self.batch), busy_s=self.busy_s)

    # ---- continuous batching ----
    def _admit(self):
        """At a step boundary: waiting requests join in arrival order, up to BS_max, while their
        KV fits the decode memory (the first in line waits; later ones do not overtake it)."""
        while self.waiting and len(self.batch) < self.engine.bs_max:
            slot = self.waiting[0]
            if slot.finished:
                self.waiting.popleft()
                continue
            if self.paced and not self.engine.fits(slot.kv_need):
                break
            self.waiting.popleft()
            slot.reserved = slot.kv_need
            if slot.reserved:
                self.engine.reserve(slot.reserved)
            slot.join = time.time()
            self.batch.append(slot)

    async def step_loop(self):
        if self.paced:
            await self._paced_loop()
        else:
            await self._timed_loop()

    async def _idle(self):
        """Wait for work (reaping unclaimed KV every second meanwhile)."""
        self.has_work.clear()
        try:
            await asyncio.wait_for(self.has_work.wait(), 1.0)
        except asyncio.TimeoutError:
            self._reap_orphans()

    async def _timed_loop(self):
        """An engine that computes for real: one wake-up per step, stamped when it ends."""
        next_tick = time.monotonic()
        while True:
            self._admit()
            if not self.batch:
                await self._idle()
                next_tick = time.monotonic()
                continue
            next_tick += self.engine.step_s * self.engine.clock_factor
            delay = next_tick - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            t_step = time.monotonic()
            ids = [s.rid for s in self.batch]
            tokens = (await self.engine.aemit_step(ids) if self.assembling
                      else self.engine.step(ids))
            self._emit(tokens, time.time(), max(self.engine.step_s, time.monotonic() - t_step))

    async def _paced_loop(self):
        """The modelled engine: steps follow T_step(B, C) back to back, and the loop wakes only
        for a step that changes something outside it (a first token, a request's last, a
        flush), or when work arrives (admission at the next step boundary) or a request is
        cancelled. Every step in between is computed at that wake-up and stamped with its
        scheduled end, so each token keeps the time the model gives it. The step the loop woke
        for is stamped when it runs, as every step was when the loop woke for each: its tokens
        leave then, and a late wake-up (the event loop's timers round up to the millisecond)
        lengthens that step and shortens the next, as it did then. How late each wake-up came
        against its schedule is recorded (`decode_wakeups` at exit)."""
        next_tick = time.monotonic()        # end of the last step run = start of the next
        while True:
            self.has_work.clear()
            self._admit()
            if not self.batch:
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
            while self.batch:
                step_s = self.engine.step_seconds(
                    len(self.batch), sum(s.input_len + len(s.times) for s in self.batch))
                t = next_tick + step_s * self.engine.clock_factor
                if t > end + 1e-9:
                    break
                next_tick = t
                self.steps += 1
                stamp = max(t + offset, now if t >= end - 1e-9 else 0.0, self.last_stamp + 1e-6)
                self.last_stamp = stamp       # distinct and rising: one stamp is one step
                self._emit(self.engine.step([s.rid for s in self.batch]), stamp, step_s)

    def _next_event(self, start, until=None):
        """Monotonic end of the first step from `start` that changes something outside the
        batch (see `_paced_loop`), or of the one in progress at `until`, or of the first one
        `MAX_WAKE_S` after `start`."""
        batch = self.batch
        n = len(batch)
        context = sum(s.input_len + len(s.times) for s in batch)
        steps_left = min(s.output_len - len(s.times) for s in batch)
        first = any(not s.times for s in batch)
        flush = min((self.last_flush if s.client in self.token_streams else
                     self.slot_flush.get(s.rid, 0.0)) for s in batch) + self.flush_s
        offset = time.time() - time.monotonic()
        factor = self.engine.clock_factor
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
        timer = loop.call_at(t, _resolve, fut, False)
        if wake:
            self._waiter = fut
        try:
            return await fut
        finally:
            timer.cancel()
            self._waiter = None

    def _kick(self):
        """Work for the step loop: a request waits to join, or one left the batch."""
        self.has_work.set()
        if self._waiter is not None:
            _resolve(self._waiter, True)

    def _late(self, late_s):
        """One wake-up's lateness against its schedule (emulated s), a bounded sample."""
        self.wakeups += 1
        self.late_max = max(self.late_max, late_s)
        if len(self.lateness) < LATE_SAMPLES:
            self.lateness.append(late_s)
        else:
            i = random.randrange(self.wakeups)
            if i < LATE_SAMPLES:
                self.lateness[i] = late_s

    def report_wakeups(self):
        """The `decode_wakeups` row of events.csv: steps, wake-ups, lateness (emulated ms)."""
        if self.events is None or not self.wakeups:
            return
        late = sorted(self.lateness)
        q = lambda f: round(late[min(len(late) - 1, int(f * len(late)))] * 1e3, 3)  # noqa: E731
        self.events("decode_wakeups", instance=self.name, steps=self.steps,
                    wakeups=self.wakeups, late_p50_ms=q(0.5), late_p99_ms=q(0.99),
                    late_max_ms=round(self.late_max * 1e3, 3))

    def _emit(self, tokens, now, step_s):
        """One step's tokens, stamped `now` (Unix time): append, send what is due, and let
        finished requests go."""
        self.busy_s += step_s
        keep = []
        for slot in self.batch:
            if slot.finished:        # its stream was cancelled
                continue
            slot.times.append(now)
            if tokens:
                slot.token_ids.append(int(tokens.get(slot.rid, 0)))
            if len(slot.times) >= slot.output_len:
                slot.finished = True
                slot.wake.set()
                continue
            if slot.client not in self.token_streams and (
                    len(slot.times) == 1 or now - self.slot_flush.get(slot.rid, 0.0)
                    >= self.flush_s):
                self.slot_flush[slot.rid] = now
                slot.wake.set()
            keep.append(slot)
        if self.token_streams:
            self._send_batch(keep, now)
        for s in self.batch:
            if s.finished:
                self.slot_flush.pop(s.rid, None)
                if s.reserved:
                    self.engine.free(s.reserved)
                    s.reserved = 0.0
        self.batch = keep

    def _send_batch(self, batch, now):
        """One `TokenBatch` per client on its token stream: every request's pending tokens
        each `flush_s`, and in between the requests whose first token this step made. A first
        token sent wakes the request's `Decode` stream, which marks it for the scheduler."""
        flush = now - self.last_flush >= self.flush_s
        if flush:
            self.last_flush = now
        out = {}
        for s in batch:
            if (len(s.times) > s.emitted if flush else len(s.times) == 1 and not s.emitted) \
                    and s.client in self.token_streams:
                if not s.emitted:
                    s.wake.set()
                out.setdefault(s.client, []).append(self._chunk(s))
        for client, chunks in out.items():
            self.token_streams[client].send_batch(pb.TokenBatch(chunks=chunks))

    def _reap_orphans(self):
        """KV that arrived for a request whose Decode stream never came is freed after a while."""
        now = time.monotonic()
        for rid, slot in list(self.slots.items()):
            if not slot.claimed and now - slot.created > self.orphan_s:
                self.log.warning("dropping KV of unclaimed request %d", rid)
                self.slots.pop(rid, None)
                self.engine.release(rid)


def make_engine(rt, inst) -> DecodeEngine:
    if rt.engine == "torch":
        from workers.engine_torch import TorchDecodeEngine
        return TorchDecodeEngine(rt.torch, rt.device, bs_max=rt.decode.bs_max,
                                 threads=1)
    from workers.engine_profile import ProfileDecodeEngine
    return ProfileDecodeEngine(rt, inst)


async def main():
    args, rt, inst, log = common.startup("PrfaaS testbed decode worker")
    service = DecodeService(rt, args.name, make_engine(rt, inst), log)
    service.events = control.event_log(rt, args.name)
    if rt.cache.enabled:
        from workers.cache_worker import DecodeCache
        service.cache = await DecodeCache(rt, inst, log).start()
    kvwire.keep_receive_memory()   # receive buffers reuse freed heap, not fresh pages
    frame_buffer = service.engine.frame_buffer if service.assembling else None
    kv_server = await kvwire.serve(
        inst.ip, inst.kv_port, service.on_frame, service.on_kv_error,
        payload_buffer=frame_buffer and (lambda wire, *a: frame_buffer(wire & control.RID_MASK, *a)))
    token_server = await tokens.serve(inst.ip, inst.token_port, service.token_streams)
    server = await common.start_grpc(inst, pbg.add_DecodeServicer_to_server, service)
    loop_task = asyncio.create_task(service.step_loop())
    discard_task = asyncio.create_task(service.discard_loop())
    control.install(rt, args.name, service.engine, log)
    # status/<name>.json for the live exporter (--metrics only); the task is held while it runs
    status_task = status.start(rt, args.name, lambda: status.decode_sample(service))  # noqa: F841
    common.mark_ready(rt, args.name)
    log.info("decode worker up on %s, KV on :%s", inst.addr, inst.kv_port)

    def cleanup():
        loop_task.cancel()
        discard_task.cancel()
        kv_server.close()
        token_server.close()
        service.flush_discarded(0.0)
        service.report_wakeups()
        if service.cache is not None:
            service.cache.close()

    await common.serve_until_signalled(server, cleanup)


if __name__ == "__main__":
    asyncio.run(main())
