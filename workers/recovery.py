"""Recovery: what the scheduler does when an instance fails, request by request.

`Health` keeps every prefill and decode instance's state. With failover on it health-checks them
all (`health_interval_s`, `health_timeout_s`; down after two missed checks in a row, up again at
the first answer, so a restarted worker rejoins; a late answer does not count as a miss while the
instance's chunks keep arriving, so an overloaded decode worker is not taken for a dead one); an
RPC that finds an instance unreachable marks it down at once. Every transition is a `health` row
in the run's events.csv.

`Flight` serves one request (the scheduler's `Submit`): it places it (`SchedulerService.place`:
with the prefix cache, the placement policy of workers/placement.py, so that under `cache_aware`
it prefills where its prefix lives), opens the decode worker's `Decode` stream, asks a prefill
worker for the KV and relays what that stream carries. A request whose client holds token
streams (`Request.client`, workers/tokens.py) gets its tokens from the decode worker directly:
the scheduler announces each decode instance it chooses to the client, learns from the worker's
`direct` mark that the first token has gone, and relays only the last chunk. Re-dispatches
route with `SchedulerService.route`; with the cache they stay in the cluster the request was
placed in while an instance there is up. With failover on it recovers:

- prefill instance down (health check) or unreachable (RPC error), or its prefill failed: the
  request's prefill is re-dispatched to an instance that is up (at-least-once prefill). Each
  attempt's KV frames carry the attempt number; the decode worker admits exactly one attempt and
  discards, and counts, the others. If no instance is up for it (e.g. `max_local` keeps a long
  request on PrfaaS), a paused instance keeps it and a dead one is retried when an instance
  comes back up.
- decode instance down or its stream broken: a request that has no token yet (none relayed, no
  `direct` mark) is re-prefilled for another decode instance; one that has tokens (or has
  nowhere to go) fails at once with the reason, so nothing waits for the request timeout.
- the decode instance's KV deadline passed (`kv_late` on its last chunk): while the prefill
  attempt still runs on an up instance (queued, or its KV still crossing) the decode stream is
  opened again on the same instance and the transfer goes on into it (a `kv_wait` row in
  events.csv); otherwise the request is prefilled again (a new attempt) where the policy routes
  it. Waits and attempts together are bounded (`redispatch.MAX_ATTEMPTS`).

Every decision (a health check's verdict, where a request moves, when it fails) is
workers/redispatch.py's, asyncio- and gRPC-free, which the simulator runs too; this module is
the RPCs and the waits around it. Every move is a `redispatch` row in events.csv and a
`Redispatch` in the request's last chunk (the client's record). Without failover a failure fails the request with its reason, as before.
"""

import asyncio
import time

import grpc

from testbed.proto import testbed_pb2 as pb
from testbed.records import RunDir
from workers import control, redispatch

UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Health:
    """The asyncio and gRPC side of the instances' health: the checks' RPCs, the waits; every
    decision is `workers.redispatch.HealthBook`'s (the simulator runs the same one)."""

    def __init__(self, svc, rt, log):
        self.svc, self.log = svc, log
        self.events = control.event_log(rt, "scheduler")
        self.flights = set()
        self._up = asyncio.Event()
        r = svc.router
        self.book = redispatch.HealthBook(
            [i.name for i in r.remote + r.local + r.decode], self.events, time.monotonic,
            on_down=self._tell, on_up=self._wake, stats=svc.stats)

    def seen(self, inst):
        self.book.seen(inst)

    def set(self, inst, down, reason):
        """Mark `inst` down or up; logs the transition and tells the requests on it."""
        self.book.set(inst, down, reason, self.log)

    def _tell(self, inst, reason):
        for f in list(self.flights):
            f.notify(inst, reason)

    def _wake(self, inst):
        self._up.set()
        self._up = asyncio.Event()

    async def any_up(self, timeout):
        """Wait until some instance comes back up, or `timeout`."""
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def rpc_error(self, inst, err):
        if isinstance(err, grpc.aio.AioRpcError) and err.code() in UNREACHABLE:
            self.set(inst, True, f"{err.code().name} on an RPC")

    async def loop(self):
        """Ask every instance for its health every `health_interval_s`; `HealthBook.checked`
        judges each answer (down after two missed checks in a row, up at the first answer)."""
        sched = self.svc.rt.scheduler
        interval, timeout = sched.health_interval_s, sched.health_timeout_s
        router = self.svc.router
        insts = router.remote + router.local + router.decode
        stubs = {**self.svc.prefill_stub, **self.svc.decode_stub}

        async def check(inst):
            asked = time.monotonic()
            try:
                await stubs[inst.name].Health(pb.Empty(), timeout=timeout)
                out = self.book.checked(inst, True, asked, timeout)
            except grpc.aio.AioRpcError as e:
                out = self.book.checked(inst, False, asked, timeout, e.code().name)
            if out is not None:
                self.set(inst, *out)

        # Start once every worker has said it is ready (the runner waits for the same files):
        # a worker still importing is not an outage.
        ready = RunDir(self.svc.rt.dir).ready
        for _ in range(600):
            if all((ready / i.name).exists() for i in insts):
                break
            await asyncio.sleep(0.05)
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(check(i) for i in insts))


class Flight:
    """One request through the system, with recovery; `run()` yields its token chunks."""

    def __init__(self, svc, req, received=0.0):
        self.svc, self.req = svc, req
        self.received = received    # the scheduler got it; `routed`: it dispatched it
        self.routed = 0.0
        self.failover = svc.rt.scheduler.failover
        self.inbox = asyncio.Queue()
        self.p = self.d = None
        self.kind = ""
        self.cache_route = {}       # the placement's Route fields (prefix cache)
        self.attempt = -1
        self.kv_waits = 0           # KV deadlines waited out again (redispatch.after_kv_timeout)
        self.ptask = None
        self.replies = {}
        self.moves = []
        self.tokens = 0             # tokens known to have left the decode worker
        self.decode_call = None
        self.next_chunk = None
        self.announce = False       # the client has not been told the decode instance yet

    def notify(self, inst, reason):
        if inst is self.p or inst is self.d:
            self.inbox.put_nowait((inst, reason))

    async def run(self):
        self.svc.health.flights.add(self)
        try:
            async for chunk in self._serve():
                yield chunk
        finally:
            self.svc.health.flights.discard(self)
            self._stop_prefill()
            self._stop_decode()

    # ---- the two calls ----
    def _start_decode(self, d):
        self.d = d
        d.inflight += 1
        self.announce = bool(self.req.client)
        self.decode_call = self.svc.decode_stub[d.name].Decode(pb.DecodeRequest(
            request=self.req, prefill="", kv_deadline_s=self.svc.rt.kv_deadline_s,
            **self.svc.decode_fields(self.kind)))
        self.stream = self.decode_call.__aiter__()
        self.next_chunk = asyncio.ensure_future(self.stream.__anext__())

    def _stop_decode(self):
        if self.decode_call is not None:
            if self.next_chunk is not None and not self.next_chunk.done():
                self.next_chunk.cancel()
            self.decode_call.cancel()
            self.decode_call = None
            self.d.inflight -= 1

    def _start_prefill(self, p):
        self.p = p
        self.attempt += 1
        self.ptask = asyncio.create_task(self._prefill(p, self.d, self.attempt))

    def _stop_prefill(self):
        if self.ptask is not None and not self.ptask.done():
            self.ptask.cancel()

    async def _prefill(self, p, d, attempt):
        svc = self.svc
        predicted = svc.predict_s(p, self.req)
        p.outstanding_s += predicted
        try:
            reply = await svc.prefill_stub[p.name].Prefill(pb.PrefillRequest(
                request=self.req, decode=d.name, decode_kv_addr=d.kv_addr, attempt=attempt))
        except grpc.aio.AioRpcError as e:
            svc.health.rpc_error(p, e)
            reply = pb.PrefillReply(instance=p.name, status="failed",
                                    error=f"prefill {p.name} unreachable: {e.code().name}")
        finally:
            p.outstanding_s -= predicted
        svc.observe(reply)
        self.replies[attempt] = reply
        return reply

    async def _prefill_when_up(self, d, reason):
        """A failed prefill with nowhere to go: retry once an instance is up for it."""
        interval = self.svc.rt.scheduler.health_interval_s
        while True:
            await self.svc.health.any_up(interval)
            p = self._place()
            if p is not None:
                break
        self._moved("prefill", self.p, p, reason)
        self.p = p
        self.attempt += 1
        return await self._prefill(p, d, self.attempt)

    def _route(self):
        return self.svc.route(self.req, self.kind)

    def _place(self):
        """An up prefill instance for this request (the routing policy's choice), or None."""
        return redispatch.place_prefill(self._route)

    def _moved(self, role, old, new, reason):
        t = time.time()
        self.moves.append(pb.Redispatch(time=t, role=role, from_instance=old.name if old else "",
                                        to_instance=new.name, reason=reason))
        self.svc.health.events("redispatch", id=self.req.id, role=role,
                               **{"from": old.name if old else "", "to": new.name},
                               attempt=self.attempt + 1, reason=reason.replace(" ", "_"))

    # ---- recovery ----
    def _redispatch_prefill(self, reason):
        """Move the prefill elsewhere; False when no instance is up for it."""
        p = redispatch.move_prefill(self, self._route)
        if p is None:
            return False
        self._stop_prefill()
        self._moved("prefill", self.p, p, reason)
        self._start_prefill(p)
        return True

    def _reroute_decode(self, reason):
        """Re-prefill for another decode instance; an error string when that is not possible."""
        d_old = self.d
        error, to = redispatch.reroute_decode(self, self._route, reason)
        if error is not None:
            return error
        p, d = to
        self._stop_prefill()
        self._stop_decode()
        self._moved("decode", d_old, p, f"{reason}; decode now on {d.name}")
        self._start_decode(d)
        self._start_prefill(p)
        return None

    # ---- the request ----
    async def _serve(self):
        svc = self.svc
        try:
            self.kind, p, d, self.cache_route = await svc.place(self.req)
        except LookupError as e:
            svc.stats.failed += 1
            yield self._final(pb.TokenChunk(done=True, status="failed", error=f"scheduler: {e}"))
            return
        self.routed = time.time()
        if self.kind == "remote":
            svc.stats.routed_remote += 1
        else:
            svc.stats.routed_local += 1
        self._start_decode(d)
        self._start_prefill(p)
        inbox = asyncio.ensure_future(self.inbox.get())
        try:
            while True:
                if self.announce:       # the client takes this instance's direct tokens
                    self.announce = False
                    yield pb.TokenChunk(id=self.req.id, decode_instance=self.d.name)
                waits = {inbox}
                if self.next_chunk is not None:
                    waits.add(self.next_chunk)
                ptask = self.ptask
                if not ptask.done():
                    waits.add(ptask)
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                error = None
                chunk = None
                if inbox in done:
                    inst, reason = inbox.result()
                    inbox = asyncio.ensure_future(self.inbox.get())
                    error = self._on_down(inst, reason)
                if error is None and ptask in done and ptask is self.ptask:
                    error = self._on_prefill(ptask.result())
                if error is None and self.next_chunk is not None and self.next_chunk in done:
                    chunk, error = self._on_chunk()
                if error is None and chunk is not None and chunk.kv_late and chunk.done \
                        and self._on_kv_late(chunk):
                    chunk = None        # served again: waits on, or prefilled again
                if error is None and chunk is not None:
                    if chunk.done:
                        yield await self._finish(chunk)
                        return
                    if chunk.times:     # not a `direct` mark: tokens the client gets from here
                        yield chunk
                if error is not None:
                    svc.stats.failed += 1
                    yield self._final(pb.TokenChunk(done=True, status="failed", error=error))
                    return
        finally:
            inbox.cancel()

    def _on_down(self, inst, reason):
        """`inst` went down (health): with failover, the request moves off it; the error when
        it cannot (decode), else None."""
        what = redispatch.on_instance_down(self, inst, self.ptask.done())
        if what == "decode":
            return self._reroute_decode(f"{inst.name} down: {reason}")
        if what == "prefill":
            # A paused instance keeps the request when there is nowhere else to go.
            self._redispatch_prefill(f"{inst.name} down: {reason}")
        return None

    def _on_prefill(self, r):
        """The prefill attempt's reply `r`: on a failure another attempt (now, or once an
        instance is up), or the error that fails the request."""
        if r.status == "ok":
            return None
        what, arg = redispatch.after_prefill_failure(self, self._route, r.error)
        if what == "fail":
            return arg
        if what == "decode":
            return self._reroute_decode(r.error)
        if what == "move":
            self._stop_prefill()
            self._moved("prefill", self.p, arg, r.error)
            self._start_prefill(arg)
            return None
        self.ptask = asyncio.create_task(self._prefill_when_up(self.d, r.error))
        return None

    def _on_kv_late(self, chunk):
        """The decode instance's KV deadline passed (`chunk`: its last, no token yet): wait
        again on it while the prefill runs, or prefill again (True); or the request fails with
        that chunk, its error saying why (False)."""
        error = chunk.error
        what, arg = redispatch.after_kv_timeout(self, self._route, error, not self.ptask.done())
        if what == "fail":
            chunk.error = arg
            return False
        d_old = self.d
        self._stop_decode()
        if what == "wait":
            self.kv_waits += 1
            self.svc.health.events("kv_wait", id=self.req.id, instance=d_old.name,
                                   attempt=self.attempt, waits=self.kv_waits)
            self._start_decode(d_old)
            return True
        p, d = arg
        self._stop_prefill()
        self._moved("decode", d_old, p, f"{error}; prefill again for {d.name}")
        self._start_decode(d)
        self._start_prefill(p)
        return True

    def _on_chunk(self):
        """(the decode stream's next chunk, None) and the stream read on; (None, the error)
        when the stream broke and the request cannot move (None: it moved)."""
        try:
            chunk = self.next_chunk.result()
        except StopAsyncIteration:
            return None, self._reroute_decode("closed the stream early")
        except grpc.aio.AioRpcError as e:
            self.svc.health.rpc_error(self.d, e)
            return None, self._reroute_decode(e.code().name)
        self.svc.health.seen(self.d)
        self.next_chunk = (None if chunk.done else
                           asyncio.ensure_future(self.stream.__anext__()))
        self.tokens = max(self.tokens, chunk.direct, chunk.first_index + len(chunk.times))
        return chunk, None

    async def _finish(self, chunk):
        """The decode worker's last chunk, with the route and the admitted attempt's report."""
        want = chunk.kv_attempt
        if chunk.status == "ok" and want not in self.replies and self.ptask is not None \
                and want == self.attempt:
            # Tokens done before the prefill RPC returned: wait (bounded) for its report.
            try:
                await asyncio.wait_for(asyncio.shield(self.ptask), 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        if chunk.status != "ok":
            self.svc.stats.failed += 1
        return self._final(chunk, self.replies.get(want))

    def _final(self, chunk, reply=None):
        if self.p is not None and self.d is not None:
            router = self.svc.router
            name = reply.instance if reply is not None and reply.instance else self.p.name
            p = next((i for i in router.remote + router.local if i.name == name), self.p)
            chunk.route.CopyFrom(pb.Route(kind="remote" if p.dc == "prfaas" else "local",
                                          prefill=p.name,
                                          decode=self.d.name,
                                          threshold=self.svc.router.threshold,
                                          received=self.received, routed=self.routed,
                                          **self.cache_route))
        if reply is not None:
            chunk.prefill.CopyFrom(reply)
        chunk.attempts = self.attempt + 1
        chunk.redispatches.extend(self.moves)
        return chunk
