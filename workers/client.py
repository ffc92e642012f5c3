"""Client: the open-loop load generator. Sends each request of `workload.parquet` on schedule.

A request is sent at `start + arrival_s / scale.time` whether or not earlier ones finished (open
loop); how late each send was is recorded. For every request the client appends to
`requests.jsonl` a `sent` line when it sends and a `done` line when the stream ends, flushed at
once, so a crash keeps everything measured so far. Times are the client's own clock: TTFT is the
first token's arrival here minus the send time (vLLM `bench serve` definition); the decode
worker's per-token stamps come along for ITL (written compactly: testbed/tokentimes.py). The
tokens come straight from the decode workers, one stream per worker (workers/tokens.py); the
scheduler's `Submit` stream, on one framed connection (workers/submit.py), brings the route and
the last chunk. With `--first-tokens-file` (a pilot step, testbed/autoscale.py) it writes that
file once every request has its first token or has ended.
"""

import argparse
import asyncio
import collections
import pathlib
import time

import grpc

from testbed import eventloop
from testbed.records import RecordLog, RequestRecord, SentRecord
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers import common, submit, tokens


def _prefill_fields(p):
    return {"prefill_instance": p.instance, "prefill_queued": p.queued or None,
            "prefill_start": p.start or None, "prefill_end": p.end or None,
            "kv_bytes_sent": p.kv_bytes, "send_start": p.send_start or None,
            "send_end": p.send_end or None, "overlap_s": p.overlap_s,
            "prefill_error": p.error, "cached_len": p.cached_len,
            "cache_fetch_bytes": p.cache_fetch_bytes, "cache_put_bytes": p.cache_put_bytes,
            "cache_fetch_s": p.cache_fetch_s, "prefill_model_s": p.model_s or None}


def _done_fields(chunk):
    """The last chunk's route, KV and cache fields of the request's record."""
    r = chunk.route
    return dict(route=r.kind, decode_instance=r.decode or chunk.decode_instance,
                threshold=r.threshold, kv_recv_start=chunk.kv_recv_start or None,
                kv_recv_end=chunk.kv_recv_end or None, kv_bytes=chunk.kv_recv_bytes,
                decode_join=chunk.decode_join or None, kv_attempt=chunk.kv_attempt,
                attempts=chunk.attempts,
                redispatches=[{"time": x.time, "role": x.role, "from": x.from_instance,
                               "to": x.to_instance, "reason": x.reason}
                              for x in chunk.redispatches],
                planned_cached_len=r.cached_len, cache_source=r.cache_source,
                prefix_transfer_bytes=r.prefix_transfer_bytes, lookup_local=r.lookup_local,
                lookup_prfaas=r.lookup_prfaas, decode_cached_len=chunk.decode_cached_len,
                decode_cache_bytes=chunk.cache_fetch_bytes,
                sched_received=r.received or None, sched_routed=r.routed or None,
                first_step_s=chunk.first_step_s or None, decode_held=chunk.decode_held or None)


class Tracker:
    """One request's `RequestRecord`, built from the scheduler's token chunks as they arrive:
    the first and last token's arrival here, every token's decode stamp and arrival, and from
    the last chunk the route, the prefill worker's report and any re-dispatches. The built-in
    client and the front door (workers/frontdoor.py) both record through it."""

    def __init__(self, req, send):
        self.req = req
        self.out = RequestRecord(id=req.id, send_time=send, token_times=[])
        self.chunks = []        # [first token index, arrival]

    def add(self, chunk, now):
        """Take one chunk received at `now`; returns its number of tokens."""
        out = self.out
        if chunk.times:
            if out.first_token is None:
                out.first_token = now
            out.last_token = now
            self.chunks.append([out.n_tokens, now])
            out.n_tokens += len(chunk.times)
            out.token_times.extend(chunk.times)
        if chunk.done:
            out.status, out.error = chunk.status or "failed", chunk.error
            for k, v in {**_done_fields(chunk), **_prefill_fields(chunk.prefill)}.items():
                setattr(out, k, v)
            if not out.prefill_instance:
                out.prefill_instance = chunk.route.prefill
        return len(chunk.times)

    def record(self, error=None, end=True):
        """The `done` line: `error` is the reason of a request that did not end `ok` (a stream
        broken or cut short); one that ended `ok` with fewer tokens than asked for fails too."""
        return self.finish(error, end).line(self.chunks)

    def finish(self, error=None, end=True):
        """The typed `RequestRecord` of `record` (the simulator stamps `end_time` itself)."""
        out = self.out
        if error is not None and out.status != "ok":
            out.status, out.error = "failed", error
        if out.status == "ok" and out.n_tokens < self.req.output_len:
            out.status, out.error = "failed", (f"only {out.n_tokens} of "
                                               f"{self.req.output_len} tokens")
        if end:
            out.end_time = time.time()      # when the stream ended here (a failure's time)
        return out


class FirstTokens:
    """Writes `path` (the time, atomically) once each request of `ids` has had its first
    token or ended: what a pilot step judges has all happened by then (testbed/autoscale.py)."""

    def __init__(self, path, ids):
        self.path, self.left = pathlib.Path(path), set(ids)

    def seen(self, i):
        if i in self.left:
            self.left.discard(i)
            if not self.left:
                tmp = self.path.with_name(f".{self.path.name}")
                tmp.write_text(f"{time.time():.6f}")
                tmp.replace(self.path)


async def one_request(stub, row, scheduled, rec, timeout_s, first=None):
    req = pb.Request(id=int(row.id), input_len=int(row.input_len),
                     output_len=int(row.output_len), cached_len=int(getattr(row, "cached_len", 0)))
    prefix = getattr(row, "prefix_blocks", None)
    if prefix is not None and len(prefix):
        req.prefix_blocks.extend(int(b) for b in prefix)
    send = time.time()
    req.send_time = send
    rec.write(SentRecord(id=req.id, send_time=send, scheduled=scheduled,
                         lateness_s=send - scheduled))
    track = Tracker(req, send)
    error = None
    try:
        call = stub.Submit(req, timeout=timeout_s)
        async for chunk in call:
            if track.add(chunk, tokens.received(call)) and first is not None:
                first.seen(req.id)
    except grpc.aio.AioRpcError as e:
        error = f"scheduler: {e.code().name}: {e.details()}"
    except asyncio.CancelledError:
        rec.write(track.record("run ended before the request finished", end=False))
        raise
    rec.write(track.record(error))
    if first is not None:
        first.seen(req.id)


async def _read_start(path, timeout_s=60.0):
    """Unix time of arrival 0, once the runner has written it to `path`."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"client: no start time in {path} after {timeout_s:.0f}s")
        await asyncio.sleep(0.002)
    return float(path.read_text())


def read_workload(path):
    """The rows of workload.parquet in order, each a namedtuple of its columns (plain ints,
    floats and lists). pyarrow's file reader alone: `pq.read_table` imports pyarrow.dataset,
    which imports pandas, ~0.3 s of CPU more at every client's start."""
    import pyarrow.parquet as pq  # reason: pyarrow starts a thread at import; the worker
    # launcher (testbed/net/zygote.py) imports this module and must stay one thread to fork
    table = pq.ParquetFile(path).read()
    Row = collections.namedtuple("Row", table.column_names)
    return [Row(**r) for r in table.to_pylist()]


async def run(args):
    rt = common.load_runtime(args.runtime)
    sched = rt.instance("scheduler")
    workload = read_workload(args.workload)
    rec = RecordLog(args.out)
    channel = grpc.aio.insecure_channel(sched.addr,
                                        options=common.grpc_options())
    await asyncio.wait_for(channel.channel_ready(), 10.0)
    streams = await tokens.TokenStreams(
        args.name, [i for i in rt.instances.values() if i.may_decode],
        common.setup_logging(args.name)).start()
    framed = await submit.SubmitStub.open(pbg.SchedulerStub(channel), sched.ip,
                                          sched.rpc_port, common.WARM_TIMEOUT_S)
    stub = tokens.DirectStub(framed, streams)
    start_at = args.start_at
    if args.start_file:
        # Ready (workload loaded, scheduler connected); the runner then picks arrival 0, the
        # same instant its link schedule and faults count from, however long this start took.
        common.mark_ready(rt, args.name)
        start_at = await _read_start(pathlib.Path(args.start_file))
    start = max(start_at, time.time())
    first = (FirstTokens(args.first_tokens_file, [int(r.id) for r in workload])
             if args.first_tokens_file else None)
    tasks = []
    for row in workload:
        at = start + rt.scale.emulated_s(row.arrival_s)
        delay = at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(
            one_request(stub, row, at, rec, rt.request_timeout_s, first)))
    rec.write({"ev": "all_sent", "time": time.time()})
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=rt.drain_timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    rec.write({"ev": "finished", "time": time.time()})
    rec.close()
    await streams.close()
    framed.close()
    await channel.close()


def main():
    p = argparse.ArgumentParser(description="PrfaaS testbed open-loop client")
    p.add_argument("--runtime", required=True)
    p.add_argument("--name", default="client")
    p.add_argument("--workload", required=True, help="the request list (workload.parquet)")
    p.add_argument("--out", required=True, help="requests.jsonl to append to")
    p.add_argument("--start-at", type=float, default=0.0, help="Unix time of arrival 0")
    p.add_argument("--start-file", default="",
                   help="say ready, then read the Unix time of arrival 0 from this file")
    p.add_argument("--first-tokens-file", default="",
                   help="write this file once every request has its first token or has ended")
    args = p.parse_args()
    common.die_with_orchestrator()
    eventloop.run(run(args))


if __name__ == "__main__":
    main()
