"""Tokens straight from the decode workers to the client, off the scheduler.

The client process (workers/client.py, or the front door, workers/frontdoor.py) opens one
`Decode.Tokens` stream to every instance that may decode, under its own name, and sets that name
in each request (`Request.client`). A decode worker then sends the new tokens of every request
of that client in its batch together, one `TokenBatch` per flush, each request's first token at
once (workers/decode.py). The scheduler keeps routing, accounting, failover and health: it holds
each request's `Decode` stream, which carries a `direct` mark at the first token and the last
chunk (with any tokens not sent yet, the prefill report, the route, the re-dispatches), and its
`Submit` stream tells the client which decode instance serves the request, again after each
re-dispatch (workers/recovery.py).

`DirectStub` wraps the scheduler's stub: its `Submit` returns a call that yields one request's
chunks in token order, as the scheduler alone used to, merged from the `Submit` stream and the
token streams:

- direct chunks count only from the decode instance the scheduler announced last (a worker
  that was paused and then replaced may still send a few); those of an instance not announced
  yet wait for its announcement;
- a chunk ahead of a gap (the two paths may overtake each other) is held until the gap fills;
  a last chunk whose earlier tokens do not come within `HELD_FINAL_S` fails the request;
- tokens that overlap tokens already delivered (a worker failed after its first token reached
  the client, before the scheduler learned of it, and the request was re-dispatched) fail the
  request: its output would repeat;
- a failure from the scheduler (a last chunk without tokens, not `ok`) ends the request at once.

A worker without an open stream (not reachable yet, restarted, broken) sends everything through
the scheduler: no token is lost, only the path changes. Every token keeps its decode stamp; the
client stamps each chunk's arrival as before (workers/client.py `Tracker`).
"""

import asyncio

import grpc

from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers import common

# How long the last chunk waits for earlier tokens still on a Tokens stream (real seconds).
HELD_FINAL_S = 5.0
RETRY_S = (0.1, 1.0)        # reopening a broken token stream: first and longest wait
_END = object()


class TokenStreams:
    """One `Tokens` stream per decode-capable instance, read into each request's call."""

    def __init__(self, client, instances, log):
        self.client, self.log = client, log
        opts = common.grpc_options()
        self.channels = {i.name: grpc.aio.insecure_channel(i.addr, options=opts)
                         for i in instances}
        self.stubs = {name: pbg.DecodeStub(ch) for name, ch in self.channels.items()}
        self.calls = {}             # request id -> DirectCall
        self.opened = {name: asyncio.Event() for name in self.channels}
        self.readers = []

    async def start(self, timeout_s=common.WARM_TIMEOUT_S):
        """Open every stream; wait (bounded) until each worker has said it is open."""
        self.readers = [asyncio.create_task(self._read(name)) for name in self.channels]

        async def one(name):
            try:
                await asyncio.wait_for(self.opened[name].wait(), timeout_s)
            except asyncio.TimeoutError:
                self.log.warning("no token stream from %s after %.0fs; its tokens go through "
                                 "the scheduler until it opens", name, timeout_s)
        await asyncio.gather(*(one(n) for n in self.channels))
        return self

    async def _read(self, name):
        """Read `name`'s stream into the calls of its requests; reopen it when it breaks."""
        stub = self.stubs[name]
        wait = RETRY_S[0]
        while True:
            try:
                async for batch in stub.Tokens(pb.TokensRequest(client=self.client)):
                    self.opened[name].set()
                    wait = RETRY_S[0]
                    for chunk in batch.chunks:
                        call = self.calls.get(chunk.id)
                        if call is not None:
                            call.queue.put_nowait((name, chunk))
            except grpc.aio.AioRpcError as e:
                if self.opened[name].is_set():
                    self.log.info("token stream of %s ended: %s", name, e.code().name)
            self.opened[name].clear()
            await asyncio.sleep(wait)
            wait = min(2 * wait, RETRY_S[1])

    async def close(self):
        for t in self.readers:
            t.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        for ch in self.channels.values():
            await ch.close()


class DirectStub:
    """The scheduler's stub with `Submit` taking the tokens from `streams` (a TokenStreams)."""

    def __init__(self, stub, streams):
        self.stub, self.streams = stub, streams

    def Submit(self, req, timeout=None):
        req.client = self.streams.client
        return DirectCall(self.streams, self.stub.Submit(req, timeout=timeout), req.id)

    def __getattr__(self, name):      # Stats, Health: the scheduler's own
        return getattr(self.stub, name)


class DirectCall:
    """One request's chunks in token order, from its `Submit` call and the token streams.
    Iterate it once; `cancel()` ends it (and the request, at the scheduler)."""

    def __init__(self, streams, call, rid):
        self.streams, self.call, self.rid = streams, call, rid
        self.queue = asyncio.Queue()    # (decode instance name or None: the scheduler, chunk)
        streams.calls[rid] = self
        self.reader = None
        self.decode = None              # the decode instance the scheduler announced last
        self.announced = set()          # every decode instance announced so far
        self.early = []                 # (instance, chunk) from an instance not announced yet
        self.next = 0                   # index of the next token to deliver
        self.held = {}                  # first_index -> chunk ahead of a gap

    def cancel(self):
        self.call.cancel()
        self._close()

    def _close(self):
        """No more direct chunks for this call; its `Submit` stream ends on its own."""
        if self.streams.calls.get(self.rid) is self:
            del self.streams.calls[self.rid]

    async def _read_submit(self):
        try:
            async for chunk in self.call:
                self.queue.put_nowait((None, chunk))
            self.queue.put_nowait((_END, None))
        except grpc.aio.AioRpcError as e:
            self.queue.put_nowait((_END, e))

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        self.reader = asyncio.ensure_future(self._read_submit())
        loop = asyncio.get_running_loop()
        deadline = None
        ended = False
        try:
            while True:
                if deadline is None:
                    source, chunk = await self.queue.get()
                else:
                    try:
                        source, chunk = await asyncio.wait_for(
                            self.queue.get(), max(0.0, deadline - loop.time()))
                    except asyncio.TimeoutError:
                        ended = True
                        yield self._missing_tokens()
                        return
                if source is _END:
                    ended = True
                    if chunk is not None:
                        raise chunk
                    return
                for c in self._take(source, chunk):
                    ended = c.done
                    yield c
                    if c.done:
                        return
                if deadline is None and any(c.done for c in self.held.values()):
                    deadline = loop.time() + HELD_FINAL_S
        finally:
            self._close()
            if not ended:           # the consumer stopped before the end: so does the request
                self.call.cancel()
                self.reader.cancel()

    def _take(self, source, chunk):
        """The chunks that `chunk` (from `source`: a decode instance, or None: the scheduler)
        lets through in token order."""
        if source is None and not chunk.times:
            if chunk.done and chunk.status != "ok":     # the request failed: nothing to wait for
                chunk.first_index = self.next
                return [chunk]
            if not chunk.done:      # an announcement: direct tokens come from there from now on
                self.decode = chunk.decode_instance
                self.announced.add(self.decode)
                early = [e for e in self.early if e[0] == self.decode]
                self.early = [e for e in self.early if e[0] not in self.announced]
                return [c for s, e in early for c in self._take(s, e)]
        if source is not None and source != self.decode:
            if source not in self.announced:        # else a replaced instance's: dropped
                self.early.append((source, chunk))
            return []
        if chunk.first_index < self.next and (chunk.times or chunk.done):
            return [self._overlap(chunk)]
        self.held[chunk.first_index] = chunk
        out = []
        while self.next in self.held:
            c = self.held.pop(self.next)
            out.append(c)
            if c.done:
                break
            self.next += len(c.times)
        return out

    def _overlap(self, chunk):
        """Tokens from index `first_index` came twice: the request fails (the scheduler re-sent
        it to another decode worker after the first had sent tokens)."""
        self.call.cancel()
        return pb.TokenChunk(id=self.rid, first_index=self.next, done=True, status="failed",
                             error=f"decode tokens from {chunk.first_index} came again from "
                                   f"{self.decode}, after {self.next} had reached the client "
                                   f"(a decode worker failed after its first token)")

    def _missing_tokens(self):
        """The held last chunk, after the tokens ahead of it never came: the request fails."""
        final = next(c for c in self.held.values() if c.done)
        gap = final.first_index - self.next
        final.status = "failed"
        final.error = (final.error or f"{gap} tokens from {self.decode or 'the decode worker'} "
                       f"did not arrive within {HELD_FINAL_S:g}s")
        final.first_index = self.next
        del final.times[:]
        del final.token_ids[:]
        return final
