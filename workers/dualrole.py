"""Dual-role local worker: one local PD instance that prefills or decodes, and can switch.

Used for every local instance when `scheduler.roles.enabled` (the long timescale, workers/roles.py).
The process serves the Prefill and Decode services (gRPC, and the scheduler's framed calls,
workers/framedrpc.py) and the KV receiver socket of
workers/prefill.py and workers/decode.py, unchanged, on one address, plus `Role.SetRole`: drain
the work of the role in force (the scheduler has already stopped sending it any: no prefill
queued or computing, no request holding a decode slot), wait the conversion cost (emulated; the
instance serves nothing meanwhile), then take the new role. The reply reports the measured drain
and conversion times. Under --metrics it writes `status/<name>.json` as the other workers do
(workers/status.py): the role in force, both roles' queues, its decode memory. Only the profile
engines: the same model and memory serve both roles.
"""

import asyncio
import time

import grpc

from testbed import eventloop
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers import common, control, decode, framedrpc, prefill, status

DRAIN_POLL_S = 0.01


class RoleService(pbg.RoleServicer):
    def __init__(self, name, role, pre, dec, log):
        self.name, self.role, self.pre, self.dec, self.log = name, role, pre, dec, log
        self.lock = asyncio.Lock()

    def busy(self, role):
        if role == "prefill":
            return self.pre.waiting > 0 or self.pre.active > 0
        return bool(self.dec.kv.slots or self.dec.batch or self.dec.waiting)

    async def SetRole(self, req, context):
        async with self.lock:
            t0 = time.time()
            if req.role not in ("prefill", "decode"):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role {req.role!r}")
            old = self.role
            if req.role != old:
                while self.busy(old):
                    await asyncio.sleep(DRAIN_POLL_S)
            t1 = time.time()
            if req.role != old:
                self.role = "converting"
                await asyncio.sleep(max(0.0, req.cost_s))
                self.role = req.role
            t2 = time.time()
            self.log.info("role %s -> %s (drain %.3fs, conversion %.3fs emulated)", old,
                          self.role, t1 - t0, t2 - t1)
            return pb.RoleReply(name=self.name, role=self.role, drain_s=t1 - t0,
                                convert_s=t2 - t1)

    async def Health(self, request, context):
        return pb.HealthReply(name=self.name, role=self.role,
                              queue_depth=self.pre.waiting + len(self.dec.waiting),
                              active=self.pre.active + len(self.dec.batch),
                              busy_s=self.pre.busy_s + self.dec.busy_s)


async def main():
    args, rt, inst, log = common.startup("PrfaaS testbed dual-role local worker")
    pre = prefill.PrefillService(rt, args.name, prefill.make_engine(rt, inst), log)
    dec = decode.DecodeService(rt, args.name, decode.make_engine(rt, inst), log)
    dec.events = control.event_log(rt, args.name)
    role = RoleService(args.name, inst.role, pre, dec, log)
    await dec.start(inst)           # the KV and token sockets
    server = grpc.aio.server(options=common.grpc_options())
    pbg.add_PrefillServicer_to_server(pre, server)
    pbg.add_DecodeServicer_to_server(dec, server)
    pbg.add_RoleServicer_to_server(role, server)
    server.add_insecure_port(inst.addr)
    await server.start()
    framed = await framedrpc.serve([(framedrpc.PREFILL, pre), (framedrpc.DECODE, dec)],
                                   inst.ip, inst.rpc_port, log)
    await dec.started()             # the step loop

    class Both:         # the `slow` fault scales both engines' clocks
        def __setattr__(self, key, value):
            setattr(pre.engine, key, value)
            setattr(dec.engine, key, value)

    control.install(rt, args.name, Both(), log)
    status_task = status.start(rt, args.name, lambda: status.dualrole_sample(role))  # noqa: F841
    kv_peers = [(i.ip, i.kv_port) for i in rt.instances.values()
                if i.name != args.name and i.may_decode]
    for host, port in await pre.pool.warm(kv_peers, common.WARM_TIMEOUT_S):
        log.warning("no KV connection to %s:%s after %.0fs; its first request connects",
                    host, port, common.WARM_TIMEOUT_S)
    common.mark_ready(rt, args.name)
    log.info("dual-role worker up on %s as %s (%s), KV on :%s", inst.addr, inst.role,
             inst.accelerator, inst.kv_port)

    def cleanup():
        framed.close()
        dec.close()
        pre.close()

    await common.serve_until_signalled(server, cleanup)


if __name__ == "__main__":
    eventloop.run(main())
