"""The built-in client's requests to the scheduler on one framed TCP connection, off gRPC.

Why: each request was one gRPC `Submit` call, a server stream that carries a handful of
messages (the decode instance's announcement, the last chunk: the tokens themselves come from
the decode workers, workers/tokens.py). On 2026-12-07 a profiled case study at 40x
(docs/performance.md) spent 11-12% of the client's CPU in gRPC's `_send_unary_request` alone,
and the scheduler a fifth of its own in gRPC's event-engine threads. Here a request is one
frame out and its chunks a frame each back, read in each side's event loop.

The wire is workers/tokens.py's: frames of a 4-byte big-endian length and that many bytes. A
payload's first byte says what it is:

- client -> scheduler: `R` + a serialized `Request` (its chunks follow); `C` + the request id
  (8 bytes, big-endian): the client gave it up (its consumer stopped, or its deadline passed);
- scheduler -> client: `K` + id + a serialized `TokenChunk` of that request (a chunk need not
  carry its request's id: a gRPC stream is the request's own, and a failure's last chunk has
  none); `Z` + id: that request's stream ended; `E` + id + UTF-8 text: the scheduler's `Submit`
  raised, or was cancelled from within.

The scheduler serves this beside its gRPC `Submit` (the front door and outside tools keep
gRPC), with the same `SchedulerService.Submit`: routing, recovery and records are one code path.
A request whose connection breaks, or that the client cancels, is cancelled at the scheduler as
a gRPC call would be (`Flight.run`'s cleanup stops its prefill and decode). Errors reach the
client as gRPC's would (`SubmitError` is a `grpc.aio.AioRpcError`): UNAVAILABLE when the
connection is lost, DEADLINE_EXCEEDED past the call's timeout, UNKNOWN when `Submit` raised.
"""

import asyncio
import struct

import grpc

from testbed.proto import testbed_pb2 as pb
from workers.tokens import Framed

ID = struct.Struct("!Q")
_CANCELLED = object()


class SubmitError(grpc.aio.AioRpcError):
    """A framed call's failure, with gRPC's `code()` and `details()`."""

    def __init__(self, code, details):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Server(Framed):
    """The scheduler's end of one client's connection: each request a task of its own."""

    def __init__(self, service):
        super().__init__()
        self.service, self.tasks = service, {}

    def on_frame(self, payload):
        kind, body = payload[:1], payload[1:]
        if kind == b"R":
            req = pb.Request.FromString(body)
            self.tasks[req.id] = asyncio.ensure_future(self._serve(req))
        elif kind == b"C" and len(body) == ID.size:
            task = self.tasks.get(ID.unpack(body)[0])
            if task is not None:
                task.cancel()
        else:
            self.transport.abort()          # not this protocol

    async def _serve(self, req):
        me, rid = asyncio.current_task(), ID.pack(req.id)
        try:
            async for chunk in self.service.Submit(req, None):
                self._send(b"K" + rid + chunk.SerializeToString())
            self._send(b"Z" + rid)
        except asyncio.CancelledError:
            if me.cancelling():             # the client's cancel, or its connection's end
                raise
            self._send(b"E" + rid + b"CancelledError: the request's handler was cancelled")
        except Exception as e:     # gRPC ends such a call UNKNOWN: so does this
            self.service.log.exception("request %d: Submit failed", req.id)
            self._send(b"E" + rid + f"{type(e).__name__}: {e}".encode())
        finally:
            if self.tasks.get(req.id) is me:
                del self.tasks[req.id]

    def _send(self, payload):
        if not self.transport.is_closing():
            self.send(payload)

    def connection_lost(self, exc):
        for task in list(self.tasks.values()):
            task.cancel()


async def serve(service, host, port):
    """The scheduler's submit port: each connection's requests go to `service.Submit`."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Server(service), host, port, reuse_address=True)


class _Link(Framed):
    """The client's end: each frame to the call of its request."""

    def __init__(self):
        super().__init__()
        self.calls = {}             # request id -> SubmitCall

    def on_frame(self, payload):
        kind = payload[:1]
        if len(payload) < 1 + ID.size:
            return
        rid, body = ID.unpack_from(payload, 1)[0], payload[1 + ID.size:]
        if kind == b"K":
            call = self.calls.get(rid)
            if call is not None:
                call.queue.put_nowait(pb.TokenChunk.FromString(body))
        elif kind in (b"Z", b"E"):
            call = self.calls.pop(rid, None)
            if call is not None:
                call.queue.put_nowait(None if kind == b"Z" else SubmitError(
                    grpc.StatusCode.UNKNOWN, body.decode("utf-8", "replace")))

    def connection_lost(self, exc):
        error = SubmitError(grpc.StatusCode.UNAVAILABLE,
                            f"the connection to the scheduler ended: {exc or 'closed'}")
        for call in self.calls.values():
            call.queue.put_nowait(error)
        self.calls.clear()


class SubmitStub:
    """The scheduler's gRPC stub with `Submit` on a framed connection (`open`); its other
    methods (Stats, Health) are the gRPC stub's."""

    def __init__(self, stub, link):
        self.stub, self.link = stub, link

    @classmethod
    async def open(cls, stub, host, port, timeout_s):
        loop = asyncio.get_running_loop()
        _, link = await asyncio.wait_for(loop.create_connection(_Link, host, port), timeout_s)
        return cls(stub, link)

    def Submit(self, req, timeout=None):
        return SubmitCall(self.link, req, timeout)

    def close(self):
        self.link.transport.close()

    def __getattr__(self, name):
        return getattr(self.stub, name)


class SubmitCall:
    """One request's chunks, as a gRPC `Submit` call yields them; `cancel()` gives it up."""

    def __init__(self, link, req, timeout):
        self.link, self.id, self.queue = link, req.id, asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout is None else loop.time() + timeout
        if link.transport.is_closing():
            self.queue.put_nowait(SubmitError(grpc.StatusCode.UNAVAILABLE,
                                              "the connection to the scheduler is closed"))
        else:
            link.calls[req.id] = self
            link.send(b"R" + req.SerializeToString())

    def cancel(self):
        if self.link.calls.get(self.id) is self:
            del self.link.calls[self.id]
            if not self.link.transport.is_closing():
                self.link.send(b"C" + ID.pack(self.id))
        self.queue.put_nowait(_CANCELLED)

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        loop = asyncio.get_running_loop()
        while True:
            try:
                if self.deadline is None:
                    item = await self.queue.get()
                else:
                    item = await asyncio.wait_for(self.queue.get(),
                                                  max(0.0, self.deadline - loop.time()))
            except asyncio.TimeoutError:
                self.cancel()
                raise SubmitError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            if item is None or item is _CANCELLED:
                return
            if isinstance(item, SubmitError):
                raise item
            yield item
