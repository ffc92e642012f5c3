"""Scheduler: the global router. A gRPC `Submit(request)` returns the request's token stream.

For each request it picks a prefill and a decode instance (`workers.policy.Router`), opens the
decode worker's `Decode` stream, asks the prefill worker to prefill and ship the KV to that decode
worker (both calls on one framed connection per worker, workers/framedrpc.py), and relays the last chunk to the client (`workers.recovery.Flight`). The tokens go from
the decode worker to the client directly, batched per worker on one stream per client
(workers/tokens.py), when the client holds such streams (`Request.client`); otherwise the
scheduler relays them too. The last chunk carries the route, the prefill worker's report and any
re-dispatches. With failover on, a failed
instance's requests are re-dispatched or fail fast (workers/recovery.py); any failure that cannot
be recovered ends the request `failed` with the reason; no request vanishes.

Each request's first routing is a line of the run's decisions.jsonl (`Router.route_recorded`:
the book the router read and what it chose), written as the simulator writes it, so the two
backends' decisions can be replayed against each other (testbed/sim/replay.py). With the
prefix cache the placement decides instead (workers/placement.py) and records its line, with
what the pools answered, the same way (`CachePlacer.plan` and `.settle`). With vLLM instances
the scheduler's cache view is fed by their own KV events (workers/kvfeed.py, a subscriber it
owns) and placement reads it (workers/kvplace.py); with the profile and torch engines the view
is the pools' answers (above) or there is none.
"""

import asyncio
import time

import grpc

from testbed import eventloop
from testbed import profile as profiles
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from testbed.records import RecordLog, RunDir
from workers import common, control, framedrpc, submit
from workers.adaptive import ThresholdController
from workers.kvfeed import KvEventFeed, endpoints
from workers.kvplace import KvPlacer
from workers.placement import CachePlacer, profile_prefill_s
from workers.policy import Router
from workers.recovery import Flight, Health


class SchedulerService(pbg.SchedulerServicer):
    def __init__(self, rt, log):
        self.rt, self.log = rt, log
        scale = rt.scale
        prof = profiles.load(rt.profile)
        self.router = Router.of_runtime(rt, prof)
        instances = self.router.remote + self.router.local + self.router.decode
        opts = common.grpc_options(scale)
        self.channels = {i.name: grpc.aio.insecure_channel(i.addr, options=opts) for i in instances}
        # Prefill and Decode on a framed connection per worker (workers/framedrpc.py); Health on
        # gRPC, through the same stubs
        where = {i.name: rt.instance(i.name) for i in instances}
        self.framed = {n: framedrpc.Channel(w.ip, w.rpc_port) for n, w in where.items()}
        self.prefill_stub, self.decode_stub = {}, {}
        for i in instances:
            self.add_stub(i, i.role)
        self.stats = pb.SchedulerStats(threshold=rt.scheduler.threshold)
        self.health = Health(self, rt, log)     # instance states, failover (workers/recovery.py)
        self.placer = None          # workers.placement.CachePlacer when the cache is on
        self.on_request = []        # callables(request): workers/adaptive.py, workers/roles.py
        # One buffered line per request; closed (flushed) at shutdown.
        self.decisions = RecordLog(RunDir(rt.dir).decisions, buffering=1 << 16)
        if rt.cache.enabled:
            self.placer = CachePlacer(rt, self.router, profile_prefill_s(scale, prof), log,
                                      write=self.decisions.write)
        self.kv_feed = self.kv_placer = None    # vLLM: the instances' KV events feed the view
        if rt.vllm is not None:
            self._kv_events(rt, log)

    def _kv_events(self, rt, log):
        """The subscriber this scheduler owns (workers/kvfeed.py) and the placement it feeds."""
        rd = RunDir(rt.dir)
        self.kv_feed = KvEventFeed(endpoints(rt), rt.vllm.python, rows_path=rd / rd.KV_EVENTS,
                                   events=control.event_log(rt, "scheduler"), log=log)
        self.kv_placer = KvPlacer(self.router, self.kv_feed.view, rt.seed, rt.vllm.model_dir,
                                  rt.cache.block, self.decisions.write)

    def route(self, req, kind=""):
        """(kind, prefill Instance, decode Instance) for a request; LookupError if none is up.
        With the cache, a request already placed (`kind`, on a re-dispatch) stays in the cluster
        it was placed in, whose pool holds the prefix it counted on, while an instance is up there."""
        uncached = req.input_len - req.cached_len
        if self.placer is not None and kind:
            return self.router.route_to(kind == "remote", uncached)
        return self.router.route(uncached)

    async def place(self, req):
        """A request's first routing: (kind, prefill, decode, its Route's cache fields). With the
        cache, the placement policy (workers/placement.py) looks up both pools, may move a prefix
        and fills the request's cached_len / decode_cached_len."""
        if self.kv_placer is not None:
            return self.kv_placer.place(req, time.time())
        if self.placer is None:
            return (*self.router.route_recorded(req.id, req.input_len - req.cached_len,
                                                time.time(), self.decisions.write), {})
        return await self.placer.place(req)

    def add_stub(self, inst, role):
        """The stub of `inst` in `role` (prefill | decode); a dual-role worker has both."""
        if role == "prefill":
            self.prefill_stub.setdefault(inst.name, framedrpc.Stub(
                pbg.PrefillStub(self.channels[inst.name]), self.framed[inst.name],
                [framedrpc.PREFILL]))
        elif role == "decode":
            self.decode_stub.setdefault(inst.name, framedrpc.Stub(
                pbg.DecodeStub(self.channels[inst.name]), self.framed[inst.name],
                [framedrpc.DECODE]))

    async def close(self):
        for channel in self.framed.values():
            channel.close()
        if self.kv_feed is not None:
            rd = RunDir(self.rt.dir)
            await self.kv_feed.close(rd / rd.KV_EVENTS_SUMMARY, self.kv_placer.placed)
        self.decisions.close()

    def predict_s(self, p, req):
        """Estimated prefill seconds of `req` on `p` (added to its outstanding work)."""
        if self.placer is not None:
            return self.placer.prefill_s(p, req.input_len, req.cached_len)
        return self.router.predict_s(p, req.input_len - req.cached_len)

    def decode_fields(self, kind):
        """DecodeRequest fields for the cache: the local pool, whether to store the WAN's blocks."""
        return self.placer.decode_fields(kind) if self.placer is not None else {}

    def observe(self, reply):
        """A prefill worker's report: the placement learns the measured pool fetch time."""
        if self.placer is not None:
            self.placer.observe(reply)

    async def Submit(self, req, context):
        received = time.time()
        for hook in self.on_request:        # the controllers see every request before it is routed
            hook(req)
        async for chunk in Flight(self, req, received).run():
            yield chunk

    async def Stats(self, request, context):
        return self.stats

    async def Health(self, request, context):
        return pb.HealthReply(name="scheduler", role="scheduler",
                              active=sum(i.inflight for i in self.router.decode))


async def main():
    args, rt, inst, log = common.startup("PrfaaS testbed scheduler")
    service = SchedulerService(rt, log)
    server = await common.start_grpc(inst, pbg.add_SchedulerServicer_to_server, service)
    framed = await submit.serve(service, inst.ip, inst.rpc_port)   # the built-in client's
    # before the first request; a vLLM worker serves gRPC once its server is healthy
    if service.kv_feed is not None:     # subscribed before the workers' warm-up requests
        await service.kv_feed.start()
    warm_s = common.WARM_TIMEOUT_S if rt.vllm is None else rt.vllm.start_timeout_s
    await common.connect_all(service.channels, log, warm_s)
    await common.connect_framed(service.framed, log, warm_s)
    tasks = []
    if rt.scheduler.failover:
        tasks.append(asyncio.create_task(service.health.loop()))
    if rt.scheduler.adaptive is not None:
        ctl = ThresholdController(service.router, rt.scheduler.adaptive, rt.dir, log)
        service.on_request.append(lambda req: ctl.on_request())
        tasks.append(asyncio.create_task(ctl.run()))
    if rt.scheduler.roles is not None:
        from workers.roles import RoleManager   # numpy and the planner: only when roles run
        roles = RoleManager(service, rt, log)
        service.on_request.append(roles.on_request)
        tasks.append(asyncio.create_task(roles.run()))
    common.mark_ready(rt, args.name)
    log.info("scheduler up on %s, policy %s", inst.addr, rt.scheduler.policy)

    async def cleanup():
        framed.close()
        for t in tasks:
            t.cancel()
        await service.close()
    await common.serve_until_signalled(server, cleanup)


if __name__ == "__main__":
    eventloop.run(main())
