"""The built-in client's requests to the scheduler on one framed TCP connection, off gRPC.

Why: each request was one gRPC `Submit` call, a server stream that carries a handful of
messages (the decode instance's announcement, the last chunk: the tokens themselves come from
the decode workers, workers/tokens.py). On 2026-12-07 a profiled case study at 40x
(docs/performance.md) spent 11-12% of the client's CPU in gRPC's `_send_unary_request` alone,
and the scheduler a fifth of its own in gRPC's event-engine threads.

The call is workers/framedrpc.py's `SUBMIT`: the scheduler serves it on its `rpc_port` beside
its gRPC `Submit` (the front door and outside tools keep gRPC), with the same
`SchedulerService.Submit`, so routing, recovery and records are one code path. A request whose
connection breaks, or that the client cancels, is cancelled at the scheduler as a gRPC call
would be (`Flight.run`'s cleanup stops its prefill and decode). Errors reach the client as
gRPC's would (`SubmitError` is a `grpc.aio.AioRpcError`): UNAVAILABLE when the connection is
lost (the client does not connect again: the scheduler is the run), DEADLINE_EXCEEDED past the
call's timeout, UNKNOWN when `Submit` raised.
"""

import asyncio

from workers import framedrpc

SubmitError = framedrpc.RpcError


async def serve(service, host, port):
    """The scheduler's framed port for the client's `Submit` (`service.Submit`)."""
    return await framedrpc.serve([(framedrpc.SUBMIT, service)], host, port, service.log)


class SubmitStub(framedrpc.Stub):
    """The scheduler's gRPC stub with `Submit` on a framed connection (`open`); its other
    methods (Stats, Health) are the gRPC stub's."""

    @classmethod
    async def open(cls, stub, host, port, timeout_s):
        channel = framedrpc.Channel(host, port, reconnect=False)
        await asyncio.wait_for(channel.connect(), timeout_s)
        return cls(stub, channel, [framedrpc.SUBMIT])

    @property
    def link(self):
        return self.channel.link

    def close(self):
        self.channel.close()
