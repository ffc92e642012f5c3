"""Decode worker: one local decode instance, a `Decode` service plus a KV receiver socket.

The scheduler opens `Decode(request)` (a stream of token chunks, on the worker's framed port,
workers/framedrpc.py; the same service answers on gRPC) and, concurrently, tells a
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

Where the parts live: the KV socket's frames gather in `workers.kvintake` (one `Slot` per
request), the steps' timing is `workers.stepclock` (paced by the engine's model, or timed by
its computation), and this module holds the service: the `Decode` call, admission to the batch
and the tokens each step emits, on the token streams or the `Decode` streams.
"""

import asyncio
import collections
import time

from testbed import eventloop
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers import (common, control, framedrpc, kvwire, status, stepclock, tokens, vllm_api,
                     vllm_engine)
from workers.cache_worker import DecodeCache
from workers.engine import AssemblingDecodeEngine, DecodeEngine, PacedDecodeEngine
from workers.engine_profile import ProfileDecodeEngine
from workers.kvintake import KvIntake


class DecodeService(pbg.DecodeServicer):
    def __init__(self, rt, name, engine: DecodeEngine, log):
        self.rt, self.name, self.engine, self.log = rt, name, engine, log
        self.waiting = collections.deque()
        self.batch = []
        self.busy_s = 0.0
        # Tokens after the first go out in chunks every `token_flush_s` (emulated): each token
        # keeps its own time stamp; fewer messages keep the control plane off the CPU's limit.
        self.flush_s = rt.token_flush_s
        self.token_streams = {}     # client -> its open token stream (workers/tokens.py)
        self.last_flush = 0.0       # the last worker-wide flush (Unix time)
        self.slot_flush = {}        # request id -> its last flush, without a token stream
        # The torch engine assembles the shipped state from the KV frames, steps in a thread
        # (the loop keeps receiving KV meanwhile) and emits, at each step, the token fed in:
        # the first is the one prefill predicted.
        self.assembling = isinstance(engine, AssemblingDecodeEngine)
        # Step time and decode memory: the profile engine models them (T_step(B, C), KV
        # capacity); an engine that computes for real takes its own time and memory.
        self.paced = isinstance(engine, PacedDecodeEngine)
        self.kv = KvIntake(name, engine, self.assembling, rt.kv_deadline_s, log)
        self.clock = stepclock.for_engine(engine, self)
        self.cache = None           # workers.cache_worker.DecodeCache when the cache is on
        self._tasks = []
        self._servers = []

    @property
    def events(self):
        """The run's event log (None: not logged); the KV intake logs through it too."""
        return self.kv.events

    @events.setter
    def events(self, log):
        self.kv.events = log

    # ---- gRPC ----
    async def Decode(self, dreq, context):
        req = dreq.request
        slot = self.kv.claim(req.id)
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
            error = await self._kv_ready(req, dreq, slot, prefix)
            if not error and self.paced:    # larger than the decode memory: never batched
                error = self.engine.refusal(slot.kv_need)
            if error:
                yield self._final(slot, "failed", f"{self.name}: {error}")
                return
            self.waiting.append(slot)
            self.clock.kick()
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
                self.clock.kick()       # cancelled while batched: the batch changes now
            slot.finished = True
            self._end_call(req.id, slot)

    def _end_call(self, rid, slot):
        """A `Decode` call ended: its slot and engine state go, except at the KV deadline with
        failover on, where what arrived is kept for the scheduler's next call
        (`KvIntake.keep`)."""
        if slot.kv_late and self.rt.scheduler.failover:
            self.kv.keep(rid, slot)
        else:
            self.kv.done(rid, slot)
            self.engine.release(rid)

    async def _kv_ready(self, req, dreq, slot, prefix):
        """Wait (bounded by the KV deadline) for the request's KV and its cached prefix, then
        admit it to the engine; why it cannot join the batch, or ''."""
        try:
            await asyncio.wait_for(slot.kv_done.wait(), dreq.kv_deadline_s)
            if prefix is not None:      # the prefix's MLA KV from the local pool
                slot.cache_tokens, slot.cache_bytes = await prefix
            if self.cache is not None and dreq.put_to_pool and not slot.kv_error:
                self.cache.spawn(self.cache.safely(
                    self.cache.put_received(req, slot.cache_tokens), 0))
        except asyncio.TimeoutError:
            slot.kv_late = True
            got = f"{slot.kv_bytes} bytes" if slot.kv_bytes else "nothing"
            return (f"KV not complete after {dreq.kv_deadline_s:.3g}s (emulated); "
                    f"received {got}")
        error = slot.kv_error or ((self.assembling and self.engine.error(req.id)) or "")
        if not error:
            try:
                self.engine.admit(req.id, slot)
            except Exception as e:   # a corrupt or incomplete state fails the request
                error = f"state rejected: {e}"
        return error

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
        c.first_step_s, c.decode_held = slot.first_step_s, slot.held
        c.cache_fetch_bytes, c.decode_cached_len = slot.cache_bytes, slot.cache_tokens
        c.kv_late = slot.kv_late and status != "ok"
        return c

    async def Health(self, request, context):
        return pb.HealthReply(name=self.name, role="decode", queue_depth=len(self.waiting),
                              active=len(self.batch), busy_s=self.busy_s)

    # ---- continuous batching: what the step clock (workers/stepclock.py) calls ----
    def admit(self):
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
        if self.waiting:        # the rest wait for capacity: stamp those seen here first
            now = time.time()
            for slot in reversed(self.waiting):
                if slot.held:
                    break
                slot.held = now

    def flush_due(self):
        """Unix time of the batch's next flush: the worker-wide one for requests on a token
        stream, each request's own otherwise."""
        return min((self.last_flush if s.client in self.token_streams else
                    self.slot_flush.get(s.rid, 0.0)) for s in self.batch) + self.flush_s

    def reap(self):
        self.kv.reap_orphans()

    def steady(self):
        """No request of the batch was cancelled: it stays as it is until a step ends one."""
        return not any(s.finished for s in self.batch)

    def emit_run(self, run):
        """The steps [(tokens, stamp, step_s)] of an unchanged batch (`PacedClock._run`): the
        same as one `emit` each. Every step before the last only appends its stamp when
        nothing else would happen at it (no token ids, no request's first or last token, no
        flush due); otherwise each goes through `emit`."""
        head, k = 0, len(run) - 1
        if k and self._quiet(run, k):
            stamps = [stamp for _, stamp, _ in run[:k]]
            for _, _, step_s in run[:k]:
                self.busy_s += step_s
            for slot in self.batch:
                slot.times.extend(stamps)
            head = k
        for tokens, stamp, step_s in run[head:]:
            self.emit(tokens, stamp, step_s)

    def _quiet(self, run, k):
        """Nothing but a stamp happens at the first `k` steps of `run` (see `emit`)."""
        last = run[k - 1][1]
        if any(tokens for tokens, _, _ in run[:k]) or (
                self.token_streams and last - self.last_flush >= self.flush_s):
            return False
        return all(s.times and len(s.times) + k < s.output_len and not s.finished and (
            s.client in self.token_streams or last - self.slot_flush.get(s.rid, 0.0)
            < self.flush_s) for s in self.batch)

    def emit(self, tokens, now, step_s):
        """One step's tokens, stamped `now` (Unix time): append, send what is due, and let
        finished requests go."""
        self.busy_s += step_s
        factor = self.engine.clock_factor if self.paced else 1.0
        keep = []
        for slot in self.batch:
            if slot.finished:        # its stream was cancelled
                continue
            slot.times.append(now)
            if len(slot.times) == 1:
                slot.first_step_s = step_s * factor
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

    # ---- the worker process (common.run_engine_worker) ----
    async def start(self, inst):
        """The KV and token sockets, before the gRPC server."""
        kvwire.keep_receive_memory()   # receive buffers reuse freed heap, not fresh pages
        frame_buffer = self.engine.frame_buffer if self.assembling else None
        self._servers = [
            await kvwire.serve(inst.ip, inst.kv_port, self.kv.on_frame, self.kv.on_kv_error,
                               payload_buffer=frame_buffer and (
                                   lambda wire, *a: frame_buffer(wire & control.RID_MASK, *a))),
            await tokens.serve(inst.ip, inst.token_port, self.token_streams)]

    async def started(self):
        """Once it serves: the step loop and the discarded-KV log run."""
        self._tasks = [asyncio.create_task(self.clock.run()),
                       asyncio.create_task(self.kv.discard_loop())]

    def status_sample(self):
        return status.decode_sample(self)

    def up_line(self, inst):
        return f"decode worker up on {inst.addr}, KV on :{inst.kv_port}"

    def close(self):
        for t in self._tasks:
            t.cancel()
        for s in self._servers:
            s.close()
        self.kv.flush_discarded(0.0)
        self.clock.report(self.events, self.name)


class VllmDecodeService(DecodeService):
    """The decode worker over a vLLM server (workers/vllm_engine.py): the KV handle arrives
    on the KV socket as before, vLLM pulls the KV and streams the tokens, which are stamped on
    arrival and sent as the step loop would (first at once, then every `flush_s`)."""

    def __init__(self, rt, name, engine, log):
        super().__init__(rt, name, engine, log)
        self.kv = KvIntake(name, engine, True, rt.kv_deadline_s, log)   # keeps the handle
        self.reprefills = 0

    async def Decode(self, dreq, context):
        req = dreq.request
        slot = self.kv.claim(req.id)
        slot.client, slot.input_len = req.client, req.input_len
        slot.output_len = max(1, req.output_len)
        pump = None
        try:
            error = await self._kv_ready(req, dreq, slot, None)
            if error:
                yield self._final(slot, "failed", f"{self.name}: {error}")
                return
            slot.join = time.time()
            self.batch.append(slot)
            pump = asyncio.create_task(self._pump(req, slot, *self.engine.take(req.id)))
            while True:
                await slot.wake.wait()
                slot.wake.clear()
                if slot.finished:
                    why = slot.kv_error
                    yield self._final(slot, "failed" if why else "ok", why and f"{self.name}: {why}")
                    return
                if len(slot.times) > slot.emitted:
                    yield self._chunk(slot)
                elif slot.emitted and not slot.marked:
                    slot.marked = True
                    yield pb.TokenChunk(id=slot.rid, direct=slot.emitted)
        finally:
            if pump is not None:
                pump.cancel()
            slot.finished = True
            if slot in self.batch:
                self.batch.remove(slot)
            self._end_call(req.id, slot)

    async def _pump(self, req, slot, params, ids):
        """Stream the tokens from vLLM; a failed KV pull is prefilled here instead (counted)."""
        v = self.engine.vllm
        try:
            try:
                await self._stream(slot, v.decode_stream(ids, slot.output_len, params))
            except vllm_api.VllmRequestError as e:
                if slot.times:
                    raise
                self.reprefills += 1
                self.log.warning("request %d: KV pull failed (%s); prefilled here", req.id, e)
                if self.events is not None:
                    self.events("vllm_reprefill", instance=self.name, id=req.id, error=str(e))
                await self._stream(slot, v.decode_stream(ids, slot.output_len, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the request fails with the reason
            slot.kv_error = f"vLLM: {type(e).__name__}: {e}"
        slot.finished = True
        slot.wake.set()

    async def _stream(self, slot, chunks):
        async for token_ids in chunks:
            now = time.time()
            for t in token_ids:
                slot.times.append(now)
                slot.token_ids.append(int(t))
            if slot.client in self.token_streams:
                self._send_batch([s for s in self.batch if not s.finished], now)
            elif len(slot.times) == len(token_ids) or now - self.slot_flush.get(
                    slot.rid, 0.0) >= self.flush_s:
                self.slot_flush[slot.rid] = now
                slot.wake.set()
        self.slot_flush.pop(slot.rid, None)

    async def start(self, inst):
        await self.engine.vllm.start()
        await super().start(inst)

    async def started(self):
        """The KV connector's handshake with every prefill instance, before ready."""
        prefill = [f"http://{i.ip}:{self.rt.vllm.http_port}" for i in self.rt.instances.values()
                   if i.role == "prefill"]
        deadline = time.monotonic() + self.rt.vllm.start_timeout_s
        failed = await vllm_engine.warm_pairs(self.engine.vllm, prefill, deadline, self.log)
        await self.engine.vllm.mark_ready(warm_failed=failed)
        self._tasks = [asyncio.create_task(self.kv.discard_loop())]

    def close(self):
        for t in self._tasks:
            t.cancel()
        for s in self._servers:
            s.close()
        return self.engine.vllm.close()


def make_engine(rt, inst) -> DecodeEngine:
    if rt.engine == "torch":
        from workers.engine_torch import TorchDecodeEngine  # reason: torch, heavy
        return TorchDecodeEngine(rt.torch, rt.device, bs_max=rt.decode.bs_max,
                                 threads=1)
    return ProfileDecodeEngine(rt, inst)


def make_service(rt, name, inst, log):
    if rt.engine == "vllm":
        engine = vllm_engine.VllmDecodeEngine(vllm_engine.VllmInstance(rt, name, inst, "decode",
                                                                       log))
        service = VllmDecodeService(rt, name, engine, log)
    else:
        service = DecodeService(rt, name, make_engine(rt, inst), log)
    service.events = control.event_log(rt, name)
    return service


async def main():
    await common.run_engine_worker("PrfaaS testbed decode worker", make_service,
                                   pbg.add_DecodeServicer_to_server, framedrpc.DECODE,
                                   DecodeCache)


if __name__ == "__main__":
    eventloop.run(main())
