"""Token streams from the decode workers to the scheduler, one per worker, demultiplexed.

A decode worker sends the new tokens of every request in its batch together, one `TokenBatch`
per flush (`Decode.Tokens`, workers/decode.py), instead of one message per request. The
scheduler holds one such stream per decode instance, opened when the first request goes there,
and hands each chunk to the request's `Flight` (workers/recovery.py), which relays it to the
client in token order. A request's own `Decode` stream still carries its last chunk, and all of
its chunks when the worker's `Tokens` stream is not open (before it is, or after it broke), so a
broken or late token stream loses no token; every batch is also a sign of life of its worker
(`Health.seen`).
"""

import asyncio

import grpc

from testbed.proto import testbed_pb2 as pb


class TokenStreams:
    def __init__(self, svc, log):
        self.svc, self.log = svc, log
        self.flights = {}           # (decode instance name, request id) -> Flight
        self.readers = {}           # decode instance name -> task reading its Tokens stream

    def attach(self, d, rid, flight):
        """Chunks of request `rid` from decode instance `d` go to `flight` from now on."""
        self.flights[(d.name, rid)] = flight
        if d.name not in self.readers:
            self.readers[d.name] = asyncio.create_task(self._read(d))

    def detach(self, d, rid):
        self.flights.pop((d.name, rid), None)

    async def _read(self, d):
        """Read `d`'s stream until it ends; the next request sent to `d` opens it again."""
        try:
            async for batch in self.svc.decode_stub[d.name].Tokens(pb.Empty()):
                self.svc.health.seen(d)
                for chunk in batch.chunks:
                    flight = self.flights.get((d.name, chunk.id))
                    if flight is not None:
                        flight.inbox.put_nowait((d, chunk))
        except grpc.aio.AioRpcError as e:
            self.log.info("token stream of %s ended: %s", d.name, e.code().name)
        finally:
            self.readers.pop(d.name, None)

    def close(self):
        for task in list(self.readers.values()):
            task.cancel()
