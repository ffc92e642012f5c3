"""What a scheduler-to-worker call costs in CPU: gRPC aio against the framed calls of
workers/framedrpc.py, side by side, the server in a process of its own.

Each trial makes `--calls` calls, `--concurrency` at a time, of one kind on one transport:

- `prefill`: the scheduler's unary `Prefill` (a PrefillRequest out, a PrefillReply back);
- `decode`: the scheduler's `Decode`, a server stream of three TokenChunks (the worker's marker
  that the first token went to the client, the last chunk, its end), as a request's is.

Per call it reports the caller's and the server's CPU (rusage of each process over the trial)
and their sum, for both transports, and the framed / gRPC ratio of the sum. Trials alternate
the transports; a row gives the median of `--trials`. Both sides run the testbed's event loop
(uvloop, testbed/eventloop.py) and the servicers are stand-ins that answer at once, so the
figure is the transport's own cost, which is what moved off the request path.

    .venv/bin/python benchmarks/rpc_cost.py            # 3000 calls, 20 at a time, 5 trials
    .venv/bin/python benchmarks/rpc_cost.py --smoke    # the same path in a second
"""

import argparse
import asyncio
import logging
import multiprocessing
import pathlib
import resource
import socket
import statistics
import sys
import time

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import eventloop  # noqa: E402
from testbed.proto import testbed_pb2 as pb  # noqa: E402
from testbed.proto import testbed_pb2_grpc as pbg  # noqa: E402
from workers import common, framedrpc  # noqa: E402


class Prefill(pbg.PrefillServicer):
    async def Prefill(self, preq, context):
        return pb.PrefillReply(instance="lp0", status="ok", queued=time.time(),
                               start=time.time(), end=time.time(), kv_bytes=1 << 20)


class Decode(pbg.DecodeServicer):
    async def Decode(self, dreq, context):
        rid = dreq.request.id
        yield pb.TokenChunk(id=rid, direct=1)
        yield pb.TokenChunk(id=rid, done=True, status="ok", decode_instance="ld0",
                            kv_recv_start=time.time(), kv_recv_end=time.time())


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _server(grpc_port, framed_port, conn):
    """The worker side: both transports, both services; answers `conn` with its CPU seconds."""
    async def main():
        server = grpc.aio.server(options=common.grpc_options())
        pbg.add_PrefillServicer_to_server(Prefill(), server)
        pbg.add_DecodeServicer_to_server(Decode(), server)
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        await framedrpc.serve([(framedrpc.PREFILL, Prefill()), (framedrpc.DECODE, Decode())],
                              "127.0.0.1", framed_port, logging.getLogger("rpc_cost"))
        conn.send("up")
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg == "stop":
                return
            conn.send(_cpu())
    eventloop.run(main())


def _request(i):
    req = pb.Request(id=i, input_len=8192, output_len=512, client="client")
    return (pb.PrefillRequest(request=req, decode="ld0", decode_kv_addr="10.0.0.1:50052"),
            pb.DecodeRequest(request=req, kv_deadline_s=30.0))


async def _trial(stubs, transport, kind, calls, concurrency):
    stub = stubs[transport][kind]

    async def one(i):
        preq, dreq = _request(i)
        if kind == "prefill":
            await stub.Prefill(preq)
        else:
            _ = [c async for c in stub.Decode(dreq)]
    for b in range(0, calls, concurrency):
        await asyncio.gather(*(one(b + k) for k in range(min(concurrency, calls - b))))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _measure(args, conn, grpc_port, framed_port):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=common.grpc_options())
    await channel.channel_ready()
    framed = framedrpc.Channel("127.0.0.1", framed_port)
    await framed.connect()
    stubs = {"grpc": {"prefill": pbg.PrefillStub(channel), "decode": pbg.DecodeStub(channel)},
             "framed": {"prefill": framedrpc.Stub(None, framed, [framedrpc.PREFILL]),
                        "decode": framedrpc.Stub(None, framed, [framedrpc.DECODE])}}
    loop = asyncio.get_running_loop()

    async def server_cpu():
        conn.send("cpu")
        return await loop.run_in_executor(None, conn.recv)
    out = {}                # (kind, transport) -> [(caller us, server us), ...]
    for kind in ("prefill", "decode"):
        for transport in ("grpc", "framed"):     # warm-up
            await _trial(stubs, transport, kind, min(200, args.calls), args.concurrency)
        for _ in range(args.trials):
            for transport in ("grpc", "framed"):
                s0, c0 = await server_cpu(), _cpu()
                await _trial(stubs, transport, kind, args.calls, args.concurrency)
                c1, s1 = _cpu(), await server_cpu()
                out.setdefault((kind, transport), []).append(
                    ((c1 - c0) / args.calls * 1e6, (s1 - s0) / args.calls * 1e6))
    framed.close()
    await channel.close()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="200 calls, 1 trial")
    args = p.parse_args()
    if args.smoke:
        args.calls, args.trials = 200, 1
    grpc_port, framed_port = _free_port(), _free_port()
    ours, theirs = multiprocessing.Pipe()
    server = multiprocessing.get_context("spawn").Process(
        target=_server, args=(grpc_port, framed_port, theirs), daemon=True)
    server.start()
    try:
        if not ours.poll(30):
            sys.exit("rpc_cost: the server process did not start in 30 s")
        ours.recv()
        out = eventloop.run(_measure(args, ours, grpc_port, framed_port))
        ours.send("stop")
    finally:
        server.join(5)
        if server.is_alive():
            server.kill()
    print(f"{args.calls} calls a trial, {args.concurrency} at a time, median of {args.trials} "
          f"alternated trials; CPU us per call")
    print("| call | gRPC caller | gRPC server | gRPC both | framed caller | framed server "
          "| framed both | framed / gRPC |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in ("prefill", "decode"):
        g, f = out[(kind, "grpc")], out[(kind, "framed")]
        med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
        both = lambda rows: statistics.median(r[0] + r[1] for r in rows)  # noqa: E731
        print(f"| {kind} | {med(g, 0):.0f} | {med(g, 1):.0f} | {both(g):.0f} | {med(f, 0):.0f} "
              f"| {med(f, 1):.0f} | {both(f):.0f} | {both(f) / both(g):.2f} |")


if __name__ == "__main__":
    main()
