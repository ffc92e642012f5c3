"""The token path's demultiplexing, no root: a decode worker's `TokenBatch` reaches each
request's `Flight` (workers/tokens.py), and a request's chunks, which come on two streams that may
overtake each other, are relayed in token order with the last chunk last (workers/recovery.py)."""

import asyncio
import types

from testbed.proto import testbed_pb2 as pb
from workers.policy import Instance
from workers.recovery import Flight
from workers.tokens import TokenStreams


def _chunk(first, n, done=False):
    return pb.TokenChunk(id=7, first_index=first, times=[float(first + i) for i in range(n)],
                         done=done, status="ok" if done else "")


def _flight():
    svc = types.SimpleNamespace(rt=types.SimpleNamespace(
        scheduler=types.SimpleNamespace(failover=True)))
    return Flight(svc, pb.Request(id=7, output_len=6))


def test_chunks_are_relayed_in_token_order_and_the_last_waits_for_the_gap():
    async def go():
        f = _flight()
        got = f._in_order([_chunk(3, 2), _chunk(5, 1, done=True)])   # overtook tokens 0..2
        assert got == [] and f.final_timer is not None
        got = f._in_order([_chunk(0, 3)])
        f.final_timer.cancel()
        return got
    got = asyncio.run(go())
    assert [(c.first_index, c.done) for c in got] == [(0, False), (3, False), (5, True)]
    assert [t for c in got for t in c.times] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_last_chunk_whose_tokens_never_come_fails_the_request():
    async def go():
        f = _flight()
        f.d = types.SimpleNamespace(name="ld0")
        f._in_order([_chunk(0, 2), _chunk(4, 2, done=True)])
        f.final_timer.cancel()
        return f._in_order([f._missing_tokens()])
    (final,) = asyncio.run(go())
    assert final.done and final.status == "failed" and "2 tokens" in final.error
    assert final.first_index == 2 and not final.times


class _Stub:
    def __init__(self, batches):
        self.batches = batches

    async def Tokens(self, request):
        for b in self.batches:
            await asyncio.sleep(0)
            yield b


def test_a_worker_batch_reaches_each_attached_flight_once():
    d = Instance(name="ld0", role="decode", dc="local", accelerator="h20", addr="x:1")
    seen = []
    batch = pb.TokenBatch(chunks=[_chunk(0, 1), pb.TokenChunk(id=8, first_index=0, times=[1.0])])

    async def go():
        svc = types.SimpleNamespace(decode_stub={"ld0": _Stub([batch, batch])},
                                    health=types.SimpleNamespace(seen=seen.append))
        streams = TokenStreams(svc, types.SimpleNamespace(info=lambda *a: None))
        f7, f8 = types.SimpleNamespace(inbox=asyncio.Queue()), types.SimpleNamespace(
            inbox=asyncio.Queue())
        streams.attach(d, 7, f7)
        streams.attach(d, 8, f8)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        streams.detach(d, 8)                  # request 8 moved elsewhere: its chunks stop here
        await asyncio.wait_for(streams.readers["ld0"], 1.0)
        return f7.inbox, f8.inbox, streams
    q7, q8, streams = asyncio.run(go())
    assert q7.qsize() == 2 and q8.qsize() == 1
    inst, chunk = q7.get_nowait()
    assert inst is d and chunk.id == 7
    assert seen == [d, d] and not streams.readers
