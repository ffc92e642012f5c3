"""The request path's calls on one framed TCP connection per peer, off gRPC.

Which calls: the built-in client's `Submit` to the scheduler (workers/submit.py), and the
scheduler's `Prefill` and `Decode` to the prefill, decode and dual-role workers. Each request
makes one of each, so they are the control plane's hot path. Everything else stays on gRPC:
`Health`, `Stats`, `SetRole` and the cache pool's calls (rare, or off the request's path), and
the front door's `Submit`, which outside tools may call.

Why: a gRPC aio call costs the caller and the server together about 0.5 ms of CPU on this
kind of machine, where a call here costs under 0.1 ms (`benchmarks/rpc_cost.py`; numbers in
docs/performance.md, "The request path off gRPC"); a profiled case study at 40x spent a fifth
of the scheduler's CPU in gRPC's event-engine threads. Here a call is a frame out and its
messages a frame each back, read in each side's event loop.

The wire is workers/tokens.py's: frames of a 4-byte big-endian length and that many bytes. A
payload's first byte says what it is; a call id is 8 bytes, big-endian, chosen by the caller
(unique on its connection):

- caller -> server: `R` + call id + method (1 byte, `Method.index`) + the serialized request;
  `C` + call id: the caller gave the call up (cancelled, or its deadline passed);
- server -> caller: `K` + call id + a serialized response (a stream's message, or the unary
  call's reply); `Z` + call id: the call ended; `E` + call id + a gRPC status code (1 byte) +
  UTF-8 text: the handler raised (UNKNOWN, as gRPC ends such a call), was cancelled from within,
  or the method is not served here (UNIMPLEMENTED).

The server calls the servicer's own method (`handler(request, None)`: no handler here uses
gRPC's context), so a call has one code path whichever transport brought it. A call whose
connection breaks, or that the caller cancels, is cancelled at the server, as gRPC cancels a
handler. Failures reach the caller as gRPC's (`RpcError` is a `grpc.aio.AioRpcError`), so
failover (workers/recovery.py) reads them as before: UNAVAILABLE when the connection is lost
or cannot be made, DEADLINE_EXCEEDED past a call's timeout. A `Channel` connects on first use
and, with `reconnect`, again on the first call after its connection was lost (a restarted
worker, a reset connection), as a gRPC channel does.
"""

import asyncio
import dataclasses
import struct

import grpc

from testbed.proto import testbed_pb2 as pb
LENGTH = struct.Struct("!I")
MAX_FRAME = 64 << 20
ID = struct.Struct("!Q")
HEAD = struct.Struct("!QB")         # call id, method
_END = object()
_CODES = {c.value[0]: c for c in grpc.StatusCode}


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    index: int
    request: type
    response: type
    streaming: bool         # a server stream (else unary)


SUBMIT = Method("Submit", 1, pb.Request, pb.TokenChunk, True)
PREFILL = Method("Prefill", 2, pb.PrefillRequest, pb.PrefillReply, False)
DECODE = Method("Decode", 3, pb.DecodeRequest, pb.TokenChunk, True)


class RpcError(grpc.aio.AioRpcError):
    """A framed call's failure, with gRPC's `code()` and `details()`."""

    def __init__(self, code, details):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Framed(asyncio.Protocol):
    """Length-prefixed frames in, `on_frame(bytes)` per frame, from the read callback."""

    def __init__(self):
        self.transport = None
        self.buf = bytearray()

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        buf, pos = self.buf, 0
        while len(buf) - pos >= 4:
            (n,) = LENGTH.unpack_from(buf, pos)
            if n > MAX_FRAME:
                self.transport.abort()
                return
            if len(buf) - pos - 4 < n:
                break
            self.on_frame(bytes(buf[pos + 4:pos + 4 + n]))
            pos += 4 + n
        del buf[:pos]

    def send(self, payload):
        self.transport.write(LENGTH.pack(len(payload)) + payload)


def _frame(payload):
    return LENGTH.pack(len(payload)) + payload


# ---- the server ----
class _Server(Framed):
    """The server's end of one caller's connection: each call a task of its own."""

    def __init__(self, handlers, log):
        super().__init__()
        self.handlers, self.log, self.tasks = handlers, log, {}

    def on_frame(self, payload):
        kind = payload[:1]
        if kind == b"R" and len(payload) >= 1 + HEAD.size:
            cid, index = HEAD.unpack_from(payload, 1)
            handler = self.handlers.get(index)
            if handler is None:
                self._error(ID.pack(cid), grpc.StatusCode.UNIMPLEMENTED,
                            f"method {index} is not served here")
                return
            method, fn = handler
            try:
                req = method.request.FromString(payload[1 + HEAD.size:])
            except Exception:           # noqa: BLE001 (protobuf's DecodeError and kin)
                self.transport.abort()
                return
            self.tasks[cid] = asyncio.ensure_future(self._serve(cid, method, fn, req))
        elif kind == b"C" and len(payload) == 1 + ID.size:
            task = self.tasks.get(ID.unpack_from(payload, 1)[0])
            if task is not None:
                task.cancel()
        else:
            self.transport.abort()          # not this protocol

    async def _serve(self, cid, method, fn, req):
        me, key = asyncio.current_task(), ID.pack(cid)
        try:
            if method.streaming:
                async for msg in fn(req, None):
                    self._write(_frame(b"K" + key + msg.SerializeToString()))
                self._write(_frame(b"Z" + key))
            else:
                reply = await fn(req, None)
                self._write(_frame(b"K" + key + reply.SerializeToString()) + _frame(b"Z" + key))
        except asyncio.CancelledError:
            if me.cancelling():             # the caller's cancel, or its connection's end
                raise
            self._error(key, grpc.StatusCode.CANCELLED,
                        "CancelledError: the call's handler was cancelled")
        except Exception as e:     # gRPC ends such a call UNKNOWN: so does this
            self.log.exception("%s call failed", method.name)
            self._error(key, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}")
        finally:
            if self.tasks.get(cid) is me:
                del self.tasks[cid]

    def _error(self, key, code, text):
        self._write(_frame(b"E" + key + bytes([code.value[0]]) + text.encode()))

    def _write(self, data):
        if not self.transport.is_closing():
            self.transport.write(data)

    def connection_lost(self, exc):
        for task in list(self.tasks.values()):
            task.cancel()


async def serve(served, host, port, log):
    """A started server on host:port for `served`: (Method, servicer) pairs, each method
    answered by the servicer's own handler of that name."""
    handlers = {m.index: (m, getattr(service, m.name)) for m, service in served}
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Server(handlers, log), host, port,
                                    reuse_address=True)


# ---- the caller ----
class _Link(Framed):
    """The caller's end of one connection: each frame to the queue of its call."""

    def __init__(self):
        super().__init__()
        self.calls = {}             # call id -> its queue
        self.next_id = 0

    def on_frame(self, payload):
        if len(payload) < 1 + ID.size:
            return
        kind, cid = payload[:1], ID.unpack_from(payload, 1)[0]
        if kind == b"K":
            queue = self.calls.get(cid)
            if queue is not None:
                queue.put_nowait(payload[1 + ID.size:])
        elif kind == b"Z" or kind == b"E":
            queue = self.calls.pop(cid, None)
            if queue is not None:
                queue.put_nowait(_END if kind == b"Z" else RpcError(
                    _CODES.get(payload[1 + ID.size], grpc.StatusCode.UNKNOWN),
                    payload[2 + ID.size:].decode("utf-8", "replace")))

    def connection_lost(self, exc):
        error = RpcError(grpc.StatusCode.UNAVAILABLE, f"the connection ended: {exc or 'closed'}")
        for queue in self.calls.values():
            queue.put_nowait(error)
        self.calls.clear()

    def start(self, method, req):
        """Send a call; (its id, the queue its messages and end arrive on)."""
        self.next_id += 1
        cid, queue = self.next_id, asyncio.Queue()
        self.calls[cid] = queue
        self.send(b"R" + HEAD.pack(cid, method.index) + req.SerializeToString())
        return cid, queue

    def cancel(self, cid):
        if self.calls.pop(cid, None) is not None and not self.transport.is_closing():
            self.send(b"C" + ID.pack(cid))

    @property
    def up(self):
        return not self.transport.is_closing()


class Channel:
    """Framed calls to one server (host, port). The connection is made on first use (or by
    `connect`); once lost, the next call makes a new one (`reconnect`) or fails UNAVAILABLE."""

    def __init__(self, host, port, reconnect=True):
        self.host, self.port, self.reconnect = host, int(port), reconnect
        self.link = None
        self._connecting = None

    async def connect(self):
        """The connection, made (or made again) if need be; UNAVAILABLE when it cannot be."""
        if self.link is not None and self.link.up:
            return self.link
        if self.link is not None and not self.reconnect:
            raise RpcError(grpc.StatusCode.UNAVAILABLE,
                           f"the connection to {self.host}:{self.port} ended")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        return await asyncio.shield(self._connecting)

    async def _connect(self):
        loop = asyncio.get_running_loop()
        try:
            _, self.link = await loop.create_connection(_Link, self.host, self.port)
        except OSError as e:
            raise RpcError(grpc.StatusCode.UNAVAILABLE,
                           f"cannot connect to {self.host}:{self.port}: {e}") from None
        finally:
            self._connecting = None
        return self.link

    def close(self):
        if self.link is not None:
            self.link.transport.close()

    def unary(self, method, req, timeout=None):
        return self._unary(method, req, timeout)

    async def _unary(self, method, req, timeout):
        link = self.link if self.link is not None and self.link.up else await self.connect()
        cid, queue = link.start(method, req)
        try:
            item = await (queue.get() if timeout is None
                          else asyncio.wait_for(queue.get(), timeout))
        except asyncio.TimeoutError:
            link.cancel(cid)
            raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            link.cancel(cid)
            raise
        if isinstance(item, RpcError):
            raise item
        if item is _END:
            raise RpcError(grpc.StatusCode.UNKNOWN, f"{method.name} ended without a reply")
        link.calls.pop(cid, None)       # the reply; its end follows
        return method.response.FromString(item)

    def stream(self, method, req, timeout=None):
        return StreamCall(self, method, req, timeout)


class StreamCall:
    """A server stream's messages, as a gRPC call yields them; `cancel()` gives it up. Sent at
    once when the connection is up, else at the first read (after connecting)."""

    def __init__(self, channel, method, req, timeout):
        self.channel, self.method, self.req = channel, method, req
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout is None else loop.time() + timeout
        self.link = self.cid = self.queue = None
        self.cancelled = False
        link = channel.link
        if link is not None and link.up:
            self._start(link)

    def _start(self, link):
        self.link = link
        self.cid, self.queue = link.start(self.method, self.req)

    def cancel(self):
        if self.cancelled:
            return
        self.cancelled = True
        if self.link is not None:
            self.link.cancel(self.cid)
            self.queue.put_nowait(_END)

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        if self.link is None:
            link = await self.channel.connect()
            if self.cancelled:
                return
            self._start(link)
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
                raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            if item is _END:
                return
            if isinstance(item, RpcError):
                raise item
            yield self.method.response.FromString(item)


class Stub:
    """A gRPC stub whose `methods` go over a framed `Channel`; its other methods (Health,
    Stats, SetRole) are the gRPC stub's."""

    def __init__(self, grpc_stub, channel, methods):
        self.grpc_stub, self.channel = grpc_stub, channel
        self.methods = {m.name: m for m in methods}

    def __getattr__(self, name):
        method = self.__dict__.get("methods", {}).get(name)
        if method is None:
            return getattr(self.grpc_stub, name)
        if method.streaming:
            return lambda req, timeout=None: self.channel.stream(method, req, timeout)
        return lambda req, timeout=None: self.channel.unary(method, req, timeout)
