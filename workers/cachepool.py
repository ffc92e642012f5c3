"""Cache pool worker: the hybrid prefix cache pool of one cluster (docs/cache.md).

One process per datacenter, in its own host on the datacenter's bridge, so every instance of
the cluster reaches it over the intra-DC fabric and the other cluster's pool only over the WAN.
It holds the (scaled) bytes of every cached block in memory (`workers.cache_core.PoolBook`:
a `BlockStore` with LRU, KDA snapshots, transfer-cache reservations from the same capacity, and
the pool's counters; the simulator keeps the same book) and serves:

- `Lookup(blocks)`: how many leading blocks it holds (MLA KV) and how many end at a snapshot;
- `Fetch(blocks, state_at, dest, tag)`: send them to a worker's (or pool's) block socket;
- `Pull(blocks, state_at, source)`: fetch them from another pool into this one (a
  cross-cluster prefix transfer, over the WAN);
- `Transfer(tag, bytes, release)`: reserve / free transfer-cache for a tail being shipped;
- its block socket: workers write new blocks and snapshots into it after prefill.

At exit it writes `cache_<name>.json` (store statistics and byte counters) in the run directory.
"""

import json

from testbed import eventloop
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from testbed.records import RunDir
from workers import cache_wire, common, kvwire
from workers.cache_core import PoolBook


class CachePoolService(pbg.CachePoolServicer):
    def __init__(self, rt, name, inst, log):
        self.rt, self.name, self.inst, self.log = rt, name, inst, log
        self.book = PoolBook(name, inst.dc, inst.cache_capacity_bytes)
        self.store = self.book.store
        self.sender = kvwire.SenderPool()
        self.receiver = cache_wire.BlockReceiver(self.book.received)
        self.pools = cache_wire.PoolClient()
        self.timeout = rt.kv_deadline_s

    async def Lookup(self, req, context):
        kv, state = self.book.lookup(list(req.blocks))
        return pb.LookupReply(kv_blocks=kv, state_blocks=state)

    async def Fetch(self, req, context):
        parts = self.store.parts(list(req.blocks), req.state_at)
        n = await cache_wire.send_parts(self.sender, req.dest, parts, tag=req.tag)
        kv, state = self.book.sent(parts, n)
        return pb.FetchReply(kv_blocks=kv, state=state, bytes=n)

    async def Pull(self, req, context):
        me = cache_wire.block_addr(self.inst)
        reply, got = await self.pools.fetch_into(self.receiver, req.source, me, list(req.blocks),
                                                 req.state_at, self.timeout)
        self.book.pulled(got)
        return pb.FetchReply(kv_blocks=reply.kv_blocks, state=reply.state, bytes=got)

    async def Transfer(self, req, context):
        self.book.transfer(req.tag, req.bytes, req.release)
        return pb.Empty()

    def stats(self):
        return self.book.stats()

    async def Stats(self, request, context):
        return pb.PoolStats(json=json.dumps(self.stats()))

    def write_stats(self):
        path = RunDir(self.rt.dir).cache_pool(self.name)
        path.write_text(json.dumps(self.stats(), indent=1))


async def main():
    args, rt, inst, log = common.startup("PrfaaS testbed prefix cache pool")
    service = CachePoolService(rt, args.name, inst, log)
    kvwire.keep_receive_memory()
    blocks = await service.receiver.serve(inst.ip, inst.cache_port)
    server = await common.start_grpc(inst, pbg.add_CachePoolServicer_to_server, service)
    common.mark_ready(rt, args.name)
    log.info("cache pool up on %s (%s, %.0f bytes)", inst.addr, inst.dc, inst.cache_capacity_bytes)

    def cleanup():
        blocks.close()
        service.sender.close()
        service.write_stats()

    await common.serve_until_signalled(server, cleanup)


if __name__ == "__main__":
    eventloop.run(main())
