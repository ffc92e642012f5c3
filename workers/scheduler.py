"""Scheduler: the global router. A gRPC `Submit(request)` returns the request's token stream.

For each request it picks a prefill and a decode instance (`workers.policy.Router`), opens the
decode worker's token stream, asks the prefill worker to prefill and ship the KV to that decode
worker, and relays token chunks to the client. The last chunk carries the route and the prefill
worker's report. Any failure (a worker unreachable or dead, a KV deadline, a timeout) ends the
request `failed` with the reason; no request vanishes.
"""

import asyncio

import grpc

from testbed import profile as profiles
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers import common
from workers.policy import Instance, Router

UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class SchedulerService(pbg.SchedulerServicer):
    def __init__(self, rt, log):
        self.rt, self.log = rt, log
        self.time_scale = rt["scale"]["time"]
        prof = profiles.load(rt["profile"])
        instances = [Instance(name=n, role=i["role"], dc=i["dc"], accelerator=i["accelerator"],
                              addr=f"{i['ip']}:{i['grpc_port']}",
                              kv_addr=f"{i['ip']}:{i.get('kv_port', 0)}")
                     for n, i in rt["instances"].items() if i["role"] in ("prefill", "decode")]
        self.router = Router(rt["scheduler"]["policy"], rt["scheduler"]["threshold"], instances,
                             lambda inst, l: prof.t_prefill(inst.accelerator, max(l, 1))
                             / self.time_scale,
                             max_local=rt["scheduler"].get("failover_max_local"))
        opts = common.grpc_options()
        self.prefill_stub = {i.name: pbg.PrefillStub(grpc.aio.insecure_channel(i.addr, options=opts))
                             for i in instances if i.role == "prefill"}
        self.decode_stub = {i.name: pbg.DecodeStub(grpc.aio.insecure_channel(i.addr, options=opts))
                            for i in instances if i.role == "decode"}
        self.stats = pb.SchedulerStats(threshold=rt["scheduler"]["threshold"])
        self.placer = None          # workers.placement.CachePlacer when the cache is on
        if rt.get("cache", {}).get("enabled"):
            from workers.placement import CachePlacer
            self.placer = CachePlacer(rt, self.router, lambda inst, l, cached: prof.t_prefill_cached(
                inst.accelerator, max(l, 1), cached) / self.time_scale, log)

    def _mark(self, inst, err):
        if isinstance(err, grpc.aio.AioRpcError) and err.code() in UNREACHABLE and not inst.down:
            inst.down = True
            self.log.warning("marking %s down: %s", inst.name, err.code().name)

    async def Submit(self, req, context):
        uncached = req.input_len - req.cached_len
        cache = {}
        try:
            if self.placer is not None:
                kind, p, d, cache = await self.placer.place(req)
            else:
                kind, p, d = self.router.route(uncached)
        except LookupError as e:
            self.stats.failed += 1
            yield pb.TokenChunk(id=req.id, done=True, status="failed", error=f"scheduler: {e}")
            return
        route = pb.Route(kind=kind, prefill=p.name, decode=d.name,
                         threshold=self.router.threshold, **cache)
        if kind == "remote":
            self.stats.routed_remote += 1
        else:
            self.stats.routed_local += 1
        predicted = (self.placer.prefill_s(p, req.input_len, req.cached_len) if self.placer
                     else self.router.predict_s(p, uncached))
        p.outstanding_s += predicted
        d.inflight += 1
        deadline_s = self.rt["kv_deadline_s"]
        decode_call = self.decode_stub[d.name].Decode(
            pb.DecodeRequest(request=req, prefill=p.name, kv_deadline_s=deadline_s,
                             **(self.placer.decode_fields(kind) if self.placer else {})))
        prefill_task = asyncio.create_task(self._prefill(p, d, req))
        try:
            async for chunk in self._relay(decode_call, prefill_task, d):
                if chunk.done:
                    chunk.route.CopyFrom(route)
                    if prefill_task.done() and not prefill_task.cancelled():
                        chunk.prefill.CopyFrom(prefill_task.result())
                    if chunk.status != "ok":
                        self.stats.failed += 1
                yield chunk
        finally:
            if not prefill_task.done():
                prefill_task.cancel()
            decode_call.cancel()
            p.outstanding_s -= predicted
            d.inflight -= 1

    async def _prefill(self, p, d, req):
        try:
            reply = await self.prefill_stub[p.name].Prefill(
                pb.PrefillRequest(request=req, decode=d.name, decode_kv_addr=d.kv_addr))
        except grpc.aio.AioRpcError as e:
            self._mark(p, e)
            return pb.PrefillReply(instance=p.name, status="failed",
                                   error=f"prefill {p.name} unreachable: {e.code().name}")
        if self.placer is not None:
            self.placer.observe(reply)
        return reply

    async def _relay(self, decode_call, prefill_task, d):
        """Token chunks of the decode stream; a failed prefill ends it with that reason."""
        stream = decode_call.__aiter__()
        next_chunk = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                waits = {next_chunk} | ({prefill_task} if not prefill_task.done() else set())
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.result().status != "ok":
                    r = prefill_task.result()
                    yield pb.TokenChunk(done=True, status="failed", error=r.error)
                    return
                if next_chunk in done:
                    try:
                        chunk = next_chunk.result()
                    except StopAsyncIteration:
                        yield pb.TokenChunk(done=True, status="failed",
                                            error=f"decode {d.name} closed the stream early")
                        return
                    except grpc.aio.AioRpcError as e:
                        self._mark(d, e)
                        yield pb.TokenChunk(done=True, status="failed",
                                            error=f"decode {d.name} failed: {e.code().name}")
                        return
                    if chunk.done:
                        if prefill_task.done() or chunk.status != "ok":
                            yield chunk
                            return
                        # Tokens done before the prefill RPC returned: wait for its report.
                        try:
                            await asyncio.wait_for(asyncio.shield(prefill_task), 5.0)
                        except asyncio.TimeoutError:
                            pass
                        yield chunk
                        return
                    yield chunk
                    next_chunk = asyncio.ensure_future(stream.__anext__())
        finally:
            if not next_chunk.done():
                next_chunk.cancel()

    async def health_loop(self, misses_down=2):
        """Failover: ask every prefill instance for its health; mark down one that has missed
        `misses_down` checks in a row (one slow reply on a busy machine is not an outage), up
        again at its first answer. Routing skips down instances and falls back to the other
        cluster (the local path when PrfaaS or the WAN fails)."""
        sched = self.rt["scheduler"]
        interval, timeout = sched["health_interval_s"], sched["health_timeout_s"]
        insts = self.router.remote + self.router.local
        misses = dict.fromkeys((i.name for i in insts), 0)

        async def check(inst):
            try:
                await self.prefill_stub[inst.name].Health(pb.Empty(), timeout=timeout)
                misses[inst.name] = 0
            except grpc.aio.AioRpcError:
                misses[inst.name] += 1
            down = misses[inst.name] >= misses_down
            if down != inst.down:
                inst.down = down
                self.stats.failovers += 1
                self.log.warning("health: %s is %s", inst.name, "DOWN" if down else "up")

        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(check(i) for i in insts))

    async def Stats(self, request, context):
        return self.stats

    async def Health(self, request, context):
        return pb.HealthReply(name="scheduler", role="scheduler",
                              active=sum(i.inflight for i in self.router.decode))


async def main():
    args, rt, inst, log = common.startup("PrfaaS testbed scheduler")
    service = SchedulerService(rt, log)
    server = await common.start_grpc(inst, pbg.add_SchedulerServicer_to_server, service)
    tasks = []
    if rt["scheduler"]["failover"]:
        tasks.append(asyncio.create_task(service.health_loop()))
    if rt["scheduler"].get("adaptive"):
        from workers.adaptive import ThresholdController
        ctl = ThresholdController(service.router, rt["scheduler"]["adaptive"], rt["_dir"], log)
        tasks.append(asyncio.create_task(ctl.run()))
    common.mark_ready(rt, args.name)
    log.info("scheduler up on %s:%s, policy %s", inst["ip"], inst["grpc_port"],
             rt["scheduler"]["policy"])
    await common.serve_until_signalled(server, lambda: [t.cancel() for t in tasks])


if __name__ == "__main__":
    asyncio.run(main())
