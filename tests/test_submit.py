"""The client's framed Submit (workers/submit.py) against a scheduler service on loopback: the
chunks arrive in order and end the call; a cancel, a deadline or a lost connection ends the
request at the scheduler too; errors come back as gRPC's would."""

import asyncio
import logging

import grpc
import pytest

from testbed.proto import testbed_pb2 as pb
from workers import submit


class Service:
    """A scheduler's `Submit`: `n` chunks `gap_s` apart, the last one done; records what
    ended how."""

    def __init__(self, n=3, gap_s=0.0, fail=None):
        self.n, self.gap_s, self.fail = n, gap_s, fail
        self.log = logging.getLogger("test-submit")
        self.ended, self.cancelled = [], []

    async def Submit(self, req, context):
        try:
            for i in range(self.n):
                if self.fail is not None and i == 1:
                    raise self.fail
                await asyncio.sleep(self.gap_s)
                last = i == self.n - 1          # a last chunk carries no id (a failure's)
                yield pb.TokenChunk(id=0 if last else req.id, first_index=i, times=[float(i)],
                                    done=last, status="ok" if last else "")
            self.ended.append(req.id)
        except asyncio.CancelledError:
            self.cancelled.append(req.id)
            raise


def _run(body, service):
    async def main():
        server = await submit.serve(service, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stub = await submit.SubmitStub.open(None, "127.0.0.1", port, 5.0)
        try:
            return await body(stub, server)
        finally:
            stub.close()
            server.close()
    return asyncio.run(main())


async def _collect(call):
    return [c async for c in call]


def test_each_request_gets_its_chunks_in_order_and_the_call_ends():
    svc = Service(n=4, gap_s=0.005)

    async def body(stub, _):
        calls = [stub.Submit(pb.Request(id=i), timeout=5.0) for i in (7, 8, 9)]
        return await asyncio.gather(*(_collect(c) for c in calls))
    got = _run(body, svc)
    assert [[(c.id, c.first_index) for c in chunks] for chunks in got] == [
        [(r, 0), (r, 1), (r, 2), (0, 3)] for r in (7, 8, 9)]
    assert all(chunks[-1].done for chunks in got) and sorted(svc.ended) == [7, 8, 9]


def test_a_cancelled_call_is_cancelled_at_the_scheduler():
    svc = Service(n=50, gap_s=0.01)

    async def body(stub, _):
        call = stub.Submit(pb.Request(id=3), timeout=5.0)
        it = call.__aiter__()
        first = await it.__anext__()
        call.cancel()
        rest = [c async for c in it]
        await asyncio.sleep(0.1)
        return first, rest
    first, rest = _run(body, svc)
    assert first.first_index == 0 and rest == [] and svc.cancelled == [3] and svc.ended == []


def test_a_deadline_past_is_deadline_exceeded_and_cancels_the_request():
    svc = Service(n=50, gap_s=0.02)

    async def body(stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _collect(stub.Submit(pb.Request(id=5), timeout=0.1))
        await asyncio.sleep(0.1)
        return e.value
    err = _run(body, svc)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and svc.cancelled == [5]


def test_a_failing_submit_ends_the_call_unknown_with_its_reason():
    svc = Service(n=3, fail=LookupError("no decode instance is up"))

    async def body(stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _collect(stub.Submit(pb.Request(id=1), timeout=5.0))
        return e.value
    err = _run(body, svc)
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details() == "LookupError: no decode instance is up"


def test_a_handler_cancelled_from_within_ends_the_call_with_its_reason():
    """gRPC ends a call whose handler raised CancelledError itself (not the client's cancel)
    CANCELLED; here it ends with the reason rather than leaving the client to its deadline."""
    svc = Service(n=3, fail=asyncio.CancelledError())

    async def body(stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _collect(stub.Submit(pb.Request(id=6), timeout=5.0))
        return e.value
    err = _run(body, svc)
    assert "cancelled" in err.details()


def test_a_lost_connection_fails_the_calls_in_flight_and_the_next_unavailable():
    svc = Service(n=50, gap_s=0.02)

    async def body(stub, server):
        call = stub.Submit(pb.Request(id=2), timeout=5.0)
        it = call.__aiter__()
        await it.__anext__()
        stub.link.transport.abort()             # the connection breaks under the call
        with pytest.raises(grpc.aio.AioRpcError) as during:
            await it.__anext__()
        with pytest.raises(grpc.aio.AioRpcError) as after:
            await _collect(stub.Submit(pb.Request(id=4), timeout=5.0))
        await asyncio.sleep(0.1)
        return during.value, after.value
    during, after = _run(body, svc)
    assert during.code() == after.code() == grpc.StatusCode.UNAVAILABLE
    assert svc.cancelled == [2]


def test_a_frame_of_another_protocol_closes_the_connection():
    async def body(stub, _):
        stub.link.send(b"Xnot a submit frame")
        await asyncio.sleep(0.1)
        return stub.link.transport.is_closing()
    assert _run(body, Service())
