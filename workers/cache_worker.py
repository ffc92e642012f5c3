"""The prefix cache as the prefill and decode workers use it (docs/cache.md).

`PrefillCache`: before compute, fetch the cached prefix (the MLA KV of its blocks and the KDA
snapshot after the last one) from the instance's own cluster pool over the intra-DC link; the
request continues from what really arrived. While the tail ships, account it as transfer-cache
in the pool. After compute, write the new whole blocks and their snapshots
(`cache_core.snapshot_blocks`) into the pool.

`DecodeCache`: fetch the MLA KV of the prefix the local pool holds (the scheduler counted on
it, so the prefill shipped only the rest) and, for a request prefilled in the other cluster,
write the whole blocks that came over the WAN into the local pool (KV only: no snapshot crossed).
"""

import asyncio
import time

from workers import cache_wire, kvwire
from workers.cache_core import KIND_KV, KIND_STATE, BlockSizes, snapshot_blocks
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
        k = min(req.cached_len // self.block, self.whole_blocks(req),
                (req.input_len - 1) // self.block)
        if k <= 0:
            return 0, 0, 0.0
        t0 = time.time()
        blocks = list(req.prefix_blocks[:k])
        reply, got = await self._fetch(self.pool, blocks, k)
        # The recurrent state is reusable only at exactly the snapshot's length.
        cached = k * self.block if reply.kv_blocks == k and reply.state else 0
        return cached, got, time.time() - t0

    async def reserve(self, rid, nbytes):
        await self.pools.stub(self.pool).Transfer(
            cache_wire.pb.TransferRequest(tag=rid, bytes=nbytes), timeout=self.timeout)

    async def release(self, rid):
        await self.pools.stub(self.pool).Transfer(
            cache_wire.pb.TransferRequest(tag=rid, release=True), timeout=self.timeout)

    async def put(self, req, cached_len):
        """Write the blocks this prefill computed (and their snapshots) into the pool."""
        n = self.whole_blocks(req)
        first = cached_len // self.block
        ids = list(req.prefix_blocks[:n])
        parts = [(ids[i], KIND_KV, _payload(self.sizes.kv)) for i in range(first, n)]
        parts += [(ids[k - 1], KIND_STATE, _payload(self.sizes.state))
                  for k in sorted(snapshot_blocks(n, self.every)) if k > first]
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
        n = self.whole_blocks(req)
        ids = list(req.prefix_blocks[:n])
        parts = [(ids[i], KIND_KV, _payload(self.sizes.kv))
                 for i in range(have_tokens // self.block, n)]
        return await cache_wire.send_parts(self.sender, self.local_pool_blocks, parts)
