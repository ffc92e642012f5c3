"""The scheduler's framed Prefill and Decode calls (workers/framedrpc.py) against servicers on
loopback: replies and streams arrive; a caller's cancel reaches the handler; a lost or refused
connection is UNAVAILABLE, as gRPC's would be, and the next call connects again; a method the
server does not serve is UNIMPLEMENTED. (The Submit path over the same module:
tests/test_submit.py.)"""

import asyncio
import logging
import socket

import grpc
import pytest

from testbed.proto import testbed_pb2 as pb
from workers import framedrpc

LOG = logging.getLogger("test-framedrpc")


class Prefill:
    def __init__(self, hold_s=0.0):
        self.hold_s, self.cancelled, self.served = hold_s, [], 0

    async def Prefill(self, preq, context):
        try:
            await asyncio.sleep(self.hold_s)
        except asyncio.CancelledError:
            self.cancelled.append(preq.request.id)
            raise
        self.served += 1
        return pb.PrefillReply(instance="lp0", status="ok", kv_bytes=preq.request.input_len)


class Decode:
    async def Decode(self, dreq, context):
        for i in range(3):
            await asyncio.sleep(0.001)
            yield pb.TokenChunk(id=dreq.request.id, first_index=i, done=i == 2)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(body, served, port=None):
    async def main():
        p = port or _port()
        server = await framedrpc.serve(served, "127.0.0.1", p, LOG)
        channel = framedrpc.Channel("127.0.0.1", p)
        stub = framedrpc.Stub(None, channel, [framedrpc.PREFILL, framedrpc.DECODE])
        try:
            return await body(stub, channel, server)
        finally:
            channel.close()
            server.close()
    return asyncio.run(main())


def _preq(rid, n=0):
    return pb.PrefillRequest(request=pb.Request(id=rid, input_len=n), decode="ld0")


def test_unary_replies_and_streams_arrive_on_one_connection():
    async def body(stub, channel, _):
        replies = await asyncio.gather(*(stub.Prefill(_preq(i, 100 + i)) for i in range(5)))
        chunks = [c async for c in stub.Decode(pb.DecodeRequest(request=pb.Request(id=9)))]
        return replies, chunks, channel.link
    served = [(framedrpc.PREFILL, Prefill()), (framedrpc.DECODE, Decode())]
    replies, chunks, link = _run(body, served)
    assert [r.kv_bytes for r in replies] == [100, 101, 102, 103, 104]
    assert [(c.id, c.first_index, c.done) for c in chunks] == [(9, 0, False), (9, 1, False),
                                                               (9, 2, True)]
    assert link.calls == {}         # every call's entry gone once it ended


def test_a_cancelled_caller_cancels_the_handler():
    svc = Prefill(hold_s=5.0)

    async def body(stub, *_):
        task = asyncio.ensure_future(stub.Prefill(_preq(4)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
    _run(body, [(framedrpc.PREFILL, svc)])
    assert svc.cancelled == [4] and svc.served == 0


def test_a_deadline_past_is_deadline_exceeded():
    svc = Prefill(hold_s=5.0)

    async def body(stub, *_):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Prefill(_preq(5), timeout=0.05)
        await asyncio.sleep(0.05)
        return e.value
    assert _run(body, [(framedrpc.PREFILL, svc)]).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert svc.cancelled == [5]


def test_a_lost_connection_is_unavailable_and_the_next_call_connects_again():
    svc = Prefill(hold_s=0.2)

    async def body(stub, channel, _):
        first = asyncio.ensure_future(stub.Prefill(_preq(1)))
        await asyncio.sleep(0.05)
        old = channel.link
        old.transport.abort()               # a reset connection under the call
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await first
        again = await stub.Prefill(_preq(2, 7))
        return e.value, again, channel.link is not old
    err, again, new = _run(body, [(framedrpc.PREFILL, svc)])
    assert err.code() == grpc.StatusCode.UNAVAILABLE and again.kv_bytes == 7 and new


def test_no_server_is_unavailable_for_unary_and_stream_calls():
    async def main():
        channel = framedrpc.Channel("127.0.0.1", _port())
        stub = framedrpc.Stub(None, channel, [framedrpc.PREFILL, framedrpc.DECODE])
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Prefill(_preq(1))
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            _ = [c async for c in stub.Decode(pb.DecodeRequest())]
        return unary.value.code(), stream.value.code()
    assert asyncio.run(main()) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)


def test_a_method_not_served_is_unimplemented_and_a_raising_handler_unknown():
    class Failing:
        async def Prefill(self, preq, context):
            raise LookupError("no KV connection")

    async def body(stub, *_):
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            _ = [c async for c in stub.Decode(pb.DecodeRequest())]
        with pytest.raises(grpc.aio.AioRpcError) as failing:
            await stub.Prefill(_preq(1))
        return missing.value, failing.value
    missing, failing = _run(body, [(framedrpc.PREFILL, Failing())])
    assert missing.code() == grpc.StatusCode.UNIMPLEMENTED
    assert failing.code() == grpc.StatusCode.UNKNOWN
    assert failing.details() == "LookupError: no KV connection"


def test_the_stub_leaves_other_methods_to_the_grpc_stub():
    class GrpcStub:
        def Health(self, req, timeout=None):
            return "grpc health"
    stub = framedrpc.Stub(GrpcStub(), framedrpc.Channel("127.0.0.1", 1), [framedrpc.PREFILL])
    assert stub.Health(pb.Empty()) == "grpc health"
