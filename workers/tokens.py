"""Tokens straight from the decode workers to the client, off the scheduler and off gRPC.

The client process (workers/client.py, or the front door, workers/frontdoor.py) opens one token
stream to every instance that may decode, a plain TCP connection to its token port, under its
own name, and sets that name in each request (`Request.client`). A decode worker then sends the
new tokens of every request of that client in its batch together, one `TokenBatch` per flush,
each request's first token at once (workers/decode.py). The scheduler keeps routing, accounting,
failover and health: it holds each request's `Decode` stream, which carries a `direct` mark at
the first token and the last chunk (with any tokens not sent yet, the prefill report, the
route, the re-dispatches), and its `Submit` stream tells the client which decode instance serves
the request, again after each re-dispatch (workers/recovery.py).

The wire, like workers/kvwire.py for KV: frames of a 4-byte big-endian length and that many
bytes. The client's first frame is its name (UTF-8); every frame after that, from the worker,
is a serialized `TokenBatch`, the first one empty (the stream is open). No gRPC on this path:
each batch is one `write` at the worker and is read in the client's event loop itself, with no
hand-off between gRPC's threads and the loop on either side. The client stamps each batch's
arrival as it reads it.

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

`received` is when the chunk just yielded could be delivered (the arrival of the frame that
brought it, or filled the gap before it). A worker without an open stream (not reachable yet,
restarted, broken) sends everything through the scheduler: no token is lost, only the path
changes. Every token keeps its decode stamp.
"""

import asyncio
import time

import grpc

from testbed.proto import testbed_pb2 as pb
from workers import common
from workers.framedrpc import LENGTH, Framed

# How long the last chunk waits for earlier tokens still on a token stream (emulated s).
HELD_FINAL_S = 5.0
RETRY_S = (0.1, 1.0)        # reopening a broken token stream: first and longest wait
CONNECT_S = 2.0             # one attempt to open it (a dead host's SYNs go unanswered)
_END = object()


class _Sink(Framed):
    """A decode worker's end of one client's stream: `send_batch` writes a TokenBatch."""

    def __init__(self, streams):
        super().__init__()
        self.streams, self.client = streams, None

    def on_frame(self, payload):
        if self.client is not None:
            return                          # the client sends nothing after its name
        self.client = payload.decode("utf-8", "replace")
        if not self.client:
            self.transport.abort()
            return
        old = self.streams.get(self.client)
        self.streams[self.client] = self    # a newer stream of the same client replaces it
        if old is not None:
            old.transport.abort()
        self.send(b"")                      # open

    def send_batch(self, batch):
        self.send(batch.SerializeToString())

    def connection_lost(self, exc):
        if self.client is not None and self.streams.get(self.client) is self:
            del self.streams[self.client]


async def serve(host, port, streams):
    """A decode worker's token port: each client's stream lands in `streams[client]`."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Sink(streams), host, port, reuse_address=True)


class _Source(Framed):
    """The client's end of one decode worker's stream."""

    def __init__(self, streams, name):
        super().__init__()
        self.streams, self.name = streams, name
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        super().connection_made(transport)
        self.send(self.streams.client.encode())

    def on_frame(self, payload):
        if not payload:
            self.streams.opened[self.name].set()
            return
        now = time.time()
        calls = self.streams.calls
        for chunk in pb.TokenBatch.FromString(payload).chunks:
            call = calls.get(chunk.id)
            if call is not None:
                call.queue.put_nowait((self.name, chunk, now))

    def connection_lost(self, exc):
        if not self.lost.done():
            self.lost.set_result(exc)


class TokenStreams:
    """One token stream per decode-capable instance, read into each request's call."""

    def __init__(self, client, instances, log):
        self.client, self.log = client, log
        self.addrs = {i.name: (i.ip, i.token_port) for i in instances}
        self.calls = {}             # request id -> DirectCall
        self.opened = {name: asyncio.Event() for name in self.addrs}
        self.readers = []

    async def start(self, timeout_s=common.WARM_TIMEOUT_S):
        """Open every stream; wait (bounded) until each worker has said it is open."""
        self.readers = [asyncio.create_task(self._read(name)) for name in self.addrs]

        async def one(name):
            try:
                await asyncio.wait_for(self.opened[name].wait(), timeout_s)
            except asyncio.TimeoutError:
                self.log.warning("no token stream from %s after %.0fs; its tokens go through "
                                 "the scheduler until it opens", name, timeout_s)
        await asyncio.gather(*(one(n) for n in self.addrs))
        return self

    async def _read(self, name):
        """Keep `name`'s stream open: reopen it when it breaks or cannot be opened."""
        loop = asyncio.get_running_loop()
        host, port = self.addrs[name]
        wait = RETRY_S[0]
        while True:
            try:
                transport, source = await asyncio.wait_for(loop.create_connection(
                    lambda: _Source(self, name), host, port), CONNECT_S)
            except (OSError, asyncio.TimeoutError):
                pass
            else:
                try:
                    exc = await source.lost
                finally:
                    transport.close()
                if self.opened[name].is_set():
                    self.log.info("token stream of %s ended: %s", name, exc or "closed")
                    wait = RETRY_S[0]
            self.opened[name].clear()
            await asyncio.sleep(wait)
            wait = min(2 * wait, RETRY_S[1])

    async def close(self):
        for t in self.readers:
            t.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)


def received(call):
    """When the chunk `call` just yielded reached this process (now, for a plain call)."""
    return getattr(call, "received", None) or time.time()


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
        self.queue = asyncio.Queue()    # (decode instance or None: the scheduler, chunk, arrival)
        self.received = None            # when the chunk just yielded could be delivered
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
                self.queue.put_nowait((None, chunk, time.time()))
            self.queue.put_nowait((_END, None, None))
        except grpc.aio.AioRpcError as e:
            self.queue.put_nowait((_END, e, None))

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
                    source, chunk, self.received = await self.queue.get()
                else:
                    try:
                        source, chunk, self.received = await asyncio.wait_for(
                            self.queue.get(), max(0.0, deadline - loop.time()))
                    except asyncio.TimeoutError:
                        ended = True
                        self.received = time.time()
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
                self.held = {}      # ahead of a gap from an instance replaced since: never due
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
