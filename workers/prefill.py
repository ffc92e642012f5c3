"""Prefill worker: one prefill instance (PrfaaS or local PD), a `Prefill` service (the
scheduler calls it on the worker's framed port, workers/framedrpc.py; gRPC serves it too).

Requests queue FIFO; one prefill computes at a time (an instance's throughput is 1/T_prefill).
As the engine produces KV pieces they are streamed, in order, to the chosen decode worker's KV
socket while compute goes on (whatever is queued -- a layer's frames -- in one write; with a
profile's `kv_transfer: pull`, all of them after the compute and the pull's round trip:
workers/kvpull.py); the
instance takes the next request as soon as compute ends, and the transfer finishes on its own
(the paper's transfer-cache blocks). The reply reports compute and send times measured here.
"""

import asyncio
import time

from testbed import eventloop
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers import common, control, framedrpc, kvpull, kvwire, status, vllm_engine
from workers.cache_worker import PrefillCache
from workers.engine import PrefillEngine
from workers.engine_profile import ProfilePrefillEngine


# A failed KV connection is retried (emulated seconds): first after 20 ms, doubling up to 0.2 s;
# a new connection gets 0.5 s to connect (a SYN into a blackhole is not waited on for 1 s+).
KV_RETRY_S, KV_RETRY_MAX_S, KV_RETRY_CONNECT_S = 0.02, 0.2, 0.5


class PrefillService(pbg.PrefillServicer):
    def __init__(self, rt, name, engine: PrefillEngine, log):
        self.rt, self.name, self.engine, self.log = rt, name, engine, log
        self.lock = asyncio.Lock()          # FIFO: asyncio.Lock wakes waiters in order
        self.pool = kvwire.SenderPool()
        # State frames carry their own crc32s (per tensor, per header): no frame checksum.
        self.frame_crc = not engine.frames_checksummed
        # None: stream the KV as it is computed; seconds: pull after the prefill (kvpull)
        self.pull_latency_s = getattr(engine, "pull_latency_s", None)
        self.waiting = 0
        self.active = 0
        self.busy_s = 0.0
        self.cache = None           # workers.cache_worker.PrefillCache when the cache is on
        self.kv_retries = 0         # KV transfers sent again on a new connection
        self.events = None          # the run's events.csv (kv_retry rows)

    async def Prefill(self, preq, context):
        req = preq.request
        reply = pb.PrefillReply(instance=self.name, queued=time.time(), status="ok")
        host, port = preq.decode_kv_addr.rsplit(":", 1)
        queue = asyncio.Queue()
        if self.cache is not None:
            await self._cache_fetch(req, reply)
        send = asyncio.create_task(self._send(control.wire_id(req.id, preq.attempt), host,
                                              int(port), queue, reply))
        self.waiting += 1
        arrived = time.monotonic()
        try:
            async with self.lock:
                self.waiting -= 1
                self.active = 1
                reply.start = time.time()
                try:
                    done = await self.engine.prefill(req, lambda seq, data, last:
                                                     queue.put_nowait((seq, data, last)), arrived)
                    reply.start = done.get("start", reply.start)
                    reply.model_s = done.get("model_s", 0.0)
                    if "cached_len" in done:    # the engine's own prefix cache (vLLM) says
                        reply.cached_len = done["cached_len"]
                finally:
                    reply.end = time.time()
                    self.busy_s += reply.end - reply.start
                    self.active = 0
            if self.cache is not None:
                reply.cache_put_bytes = await self.cache.safely(
                    self.cache.put(req, req.cached_len), 0)
            await send
        except asyncio.CancelledError:
            send.cancel()
            queue.put_nowait(None)
            raise
        except Exception as e:  # a failed transfer fails the request, with the reason
            send.cancel()
            reply.status, reply.error = "failed", f"{self.name}: {type(e).__name__}: {e}"
            self.log.warning("request %d failed: %s", req.id, reply.error)
        finally:
            if self.cache is not None:
                self.cache.spawn(self.cache.safely(self.cache.release(req.id), None))
        if reply.send_end:
            reply.overlap_s = max(0.0, min(reply.end, reply.send_end) - reply.send_start)
        return reply

    async def _cache_fetch(self, req, reply):
        """Continue from what the pool really sends (docs/cache.md); reserve the tail."""
        cached, reply.cache_fetch_bytes, reply.cache_fetch_s = await self.cache.safely(
            self.cache.fetch(req), (0, 0, 0.0))     # no prefix: compute it all
        req.cached_len = cached
        reply.cached_len = cached
        # Accounted in the pool off the critical path (the tail is released after shipping).
        self.cache.spawn(self.cache.safely(self.cache.reserve(
            req.id, self.cache.sizes.shipped(req.input_len, req.decode_cached_len)), None))

    async def _send(self, rid, host, port, queue, reply):
        """Stream the frames to the decode worker; a connection that fails (reset, refused,
        aborted by its user timeout, or closed by the receiver on a bad frame) is replaced and
        the transfer sent again from frame 0, until it gets through or the KV deadline has
        passed (then the error fails this prefill attempt: the scheduler may re-prefill)."""
        sent = []           # every frame handed over so far, for a retry on a new connection
        deadline = time.monotonic() + self.rt.kv_deadline_s
        wait_s = KV_RETRY_S
        while True:
            try:
                return await self._send_once(rid, host, port, queue, reply, sent)
            except (OSError, asyncio.TimeoutError) as e:
                if time.monotonic() + wait_s > deadline:
                    raise
                self.kv_retries += 1
                if self.events is not None:
                    self.events("kv_retry", instance=self.name, id=control.split_id(rid)[0],
                                frames=len(sent), error=type(e).__name__)
                await asyncio.sleep(wait_s)
                wait_s = min(2 * wait_s, KV_RETRY_MAX_S)

    async def _send_once(self, rid, host, port, queue, reply, sent):
        async with self.pool.connection(host, port, KV_RETRY_CONNECT_S if sent else None) \
                as conn:
            if sent:            # the transfer so far, again from frame 0
                await conn.send_frames(sent, checksum=self.frame_crc)
            while not (sent and sent[-1][2] & kvwire.FLAG_LAST):
                batch = await self._ready_frames(queue)
                if batch is not None and self.pull_latency_s is not None and not sent:
                    batch = await kvpull.whole(queue, batch)     # the prefill has ended
                    if batch is not None:
                        await kvpull.wait_pull(conn, self.pull_latency_s)
                if batch is None:
                    await conn.send(rid, 0, kvwire.FLAG_ABORT, b"")
                    return
                if not reply.send_start:
                    reply.send_start = time.time()
                # Everything queued so far (a layer's frames) in one write, so the small
                # frames share segments.
                frames = [(rid, seq, kvwire.FLAG_LAST if last else 0, data)
                          for seq, data, last in batch]
                sent.extend(frames)
                await conn.send_frames(frames, checksum=self.frame_crc)
                reply.kv_bytes += sum(memoryview(data).nbytes for _, data, _ in batch)
            reply.send_end = reply.send_end or time.time()
            await conn.drain()      # acknowledged, or the error that makes it a retry

    @staticmethod
    async def _ready_frames(queue):
        """The next frame and every one queued behind it, up to the last; None on abort."""
        batch = [await queue.get()]
        while batch[-1] is not None and not batch[-1][2] and not queue.empty():
            batch.append(queue.get_nowait())
        return None if batch[-1] is None else batch

    async def Health(self, request, context):
        return pb.HealthReply(name=self.name, role="prefill", queue_depth=self.waiting,
                              active=self.active, busy_s=self.busy_s)

    # ---- the worker process (common.run_engine_worker) ----
    async def start(self, inst):
        """Nothing serves beside the gRPC server."""

    async def started(self):
        """KV connections to every decode worker are opened now, not by the first request: a
        serving system keeps its transfer connections up, and a request's TTFT should not
        include the TCP handshake (or an ARP miss) across the WAN."""
        decode = [(i.ip, i.kv_port) for i in self.rt.instances.values() if i.may_decode]
        for host, port in await self.pool.warm(decode, common.WARM_TIMEOUT_S):
            self.log.warning("no KV connection to %s:%s after %.0fs; its first request "
                             "connects", host, port, common.WARM_TIMEOUT_S)

    def status_sample(self):
        return status.prefill_sample(self)

    def up_line(self, inst):
        return f"prefill worker up on {inst.addr} ({inst.accelerator})"

    def close(self):
        self.pool.close()


class TorchPrefill(PrefillEngine):
    """The torch engine behind the profile engine's `prefill(request, emit)` form."""

    frames_checksummed = True      # state_wire frames: crc32 per tensor and per header
    clock_factor = 1.0             # the computation takes its own time: the slow fault cannot

    def __init__(self, rt):
        from workers.engine_torch import TorchPrefillEngine  # reason: torch, heavy
        self.engine = TorchPrefillEngine(rt.torch, rt.device, seed=rt.seed,
                                         scale=rt.scale, threads=1)

    async def prefill(self, request, emit, arrived=None):
        from workers.engine_torch import emit_sender  # reason: torch, heavy (loaded already)
        return await self.engine.prefill(request, emit_sender(emit))


class VllmPrefillService(PrefillService):
    """The prefill worker over a vLLM server (workers/vllm_engine.py), started first."""

    async def start(self, inst):
        await self.engine.vllm.start()

    def close(self):
        super().close()
        return self.engine.vllm.close()


def make_engine(rt, inst) -> PrefillEngine:
    if rt.engine == "torch":
        return TorchPrefill(rt)
    return ProfilePrefillEngine(rt, inst)


def make_service(rt, name, inst, log):
    if rt.engine == "vllm":
        return VllmPrefillService(rt, name, vllm_engine.VllmPrefill(vllm_engine.VllmInstance(
            rt, name, inst, "prefill", log)), log)
    service = PrefillService(rt, name, make_engine(rt, inst), log)
    service.events = control.event_log(rt, name)
    return service


async def main():
    await common.run_engine_worker("PrfaaS testbed prefill worker", make_service,
                                   pbg.add_PrefillServicer_to_server, framedrpc.PREFILL,
                                   PrefillCache)


if __name__ == "__main__":
    eventloop.run(main())
