"""The prefix cache as the prefill and decode workers use it (docs/cache.md).

`PrefillCache`: before compute, fetch the cached prefix (the MLA KV of its blocks and the KDA
snapshot after the last one) from the instance's own cluster pool over the intra-DC link; the
request continues from what really arrived. While the tail ships, account it as transfer-cache
in the pool. After compute, write the new whole blocks and their snapshots
(`cache_core.computed_parts`) into the pool. Which blocks and what a fetch continues from are
`workers.cache_core`'s, which the simulator's model of these workers calls too.

`DecodeCache`: fetch the MLA KV of the prefix the local pool holds (the scheduler counted on
it, so the prefill shipped only the rest) and, for a request prefilled in the other cluster,
write the whole blocks that came over the WAN into the local pool (KV only: no snapshot crossed).
"""

import asyncio
import time

from workers import cache_wire, kvwire
from workers.cache_core import (BlockSizes, computed_parts, continued_from, fetch_blocks,
                                received_parts)
from workers.engine_profile import _payload


def _pool_block_addr(rt, dc):
    pool = rt.pool(dc)
    return cache_wire.block_addr(pool) if pool is not None else None


class _Cache:
    def __init__(self, rt, inst, log):
        c = rt.cache
        self.log = log
        self.block = c.block
        self.every = c.snapshot_every
        self.sizes = BlockSizes(c.s_kv_real, self.block, rt.scale)
        self.pool = cache_wire.pool_addr(rt, inst.dc)
        self.pool_blocks = _pool_block_addr(rt, inst.dc)
        self.local_pool = cache_wire.pool_addr(rt, "local")
        self.local_pool_blocks = _pool_block_addr(rt, "local")
        self.me = cache_wire.block_addr(inst)
        self.inst = inst
        self.timeout = rt.kv_deadline_s
        self.receiver = cache_wire.BlockReceiver(lambda bid, kind, data: None)
        self.sender = kvwire.SenderPool()
        self.pools = cache_wire.PoolClient()
        self.server = None
        self.tasks = set()

    async def start(self):
        self.server = await self.receiver.serve(self.inst.ip, self.inst.cache_port)
        return self

    def close(self):
        if self.server is not None:
            self.server.close()
        self.sender.close()

    def spawn(self, coro):
        """Run a cache operation in the background, in order of spawning per connection."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def safely(self, coro, fallback):
        """Await a cache operation; a pool that fails costs the hit, never the request."""
        try:
            return await coro
        except Exception as e:      # noqa: BLE001  (grpc, socket and timeout errors alike)
            self.log.warning("prefix cache: %s: %s", type(e).__name__, e)
            return fallback

    async def _fetch(self, pool, blocks, state_at):
        return await self.pools.fetch_into(self.receiver, pool, self.me, blocks, state_at,
                                           self.timeout)

    def whole_blocks(self, req):
        return min(req.input_len // self.block, len(req.prefix_blocks))


class PrefillCache(_Cache):
    async def fetch(self, req):
        """(tokens continued from, bytes fetched, seconds) for the request's planned hit."""
        k = fetch_blocks(req.cached_len, req.input_len, self.whole_blocks(req), self.block)
        if k <= 0:
            return 0, 0, 0.0
        t0 = time.time()
        blocks = list(req.prefix_blocks[:k])
        reply, got = await self._fetch(self.pool, blocks, k)
        return continued_from(k, self.block, reply.kv_blocks, reply.state), got, time.time() - t0

    async def reserve(self, rid, nbytes):
        await self.pools.stub(self.pool).Transfer(
            cache_wire.pb.TransferRequest(tag=rid, bytes=nbytes), timeout=self.timeout)

    async def release(self, rid):
        await self.pools.stub(self.pool).Transfer(
            cache_wire.pb.TransferRequest(tag=rid, release=True), timeout=self.timeout)

    async def put(self, req, cached_len):
        """Write the blocks this prefill computed (and their snapshots) into the pool."""
        ids = list(req.prefix_blocks[:self.whole_blocks(req)])
        parts = [(bid, kind, _payload(self.sizes.of(kind)))
                 for bid, kind in computed_parts(ids, cached_len // self.block, self.every)]
        return await cache_wire.send_parts(self.sender, self.pool_blocks, parts)


class DecodeCache(_Cache):
    async def fetch(self, req, pool):
        """(tokens of MLA KV fetched, bytes) of the prefix the scheduler counted on."""
        k = min(req.decode_cached_len // self.block, self.whole_blocks(req))
        if k <= 0 or not pool:
            return 0, 0
        reply, got = await self._fetch(pool, list(req.prefix_blocks[:k]), 0)
        return reply.kv_blocks * self.block, got

    async def put_received(self, req, have_tokens):
        """Whole blocks that came over the WAN (beyond what the pool gave) -> the local pool."""
        ids = list(req.prefix_blocks[:self.whole_blocks(req)])
        parts = [(bid, kind, _payload(self.sizes.of(kind)))
                 for bid, kind in received_parts(ids, have_tokens // self.block)]
        return await cache_wire.send_parts(self.sender, self.local_pool_blocks, parts)
