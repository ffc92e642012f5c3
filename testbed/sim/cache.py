"""The prefix cache in virtual time: the pools, the placement and the workers' cache steps.

    cluster.SimCluster -> CachedCluster (this): workers.placement.CachePlacer (the decision),
    workers.cache_core.PoolBook per datacenter (LRU, snapshots, transfer-cache, counters),
    workers.cache_core's part lists (what a prefill fetches and writes, what decode writes)

Per request, what the emulation's scheduler, prefill and decode workers do with `cache.enabled`
(docs/cache.md), on the same decision code and the same books:

1. placement (`CachePlacer.plan` and `.settle`, the emulation's `place` without its RPCs): both
   pools are looked up when the PrfaaS pool's answer is back (a round trip over the WAN from the
   scheduler), the view capped, the cluster and the plan chosen; a prefix move (`Pull`) is a
   flow of the blocks the destination lacks on the WAN direction from the source pool to it,
   after the Pull and Fetch calls' one-way delays; then the router routes to the plan's
   instance and the request's cached_len / decode_cached_len are set. The WAN's utilisation
   the placement reads is the sampler's last row, as the emulation reads timeseries.csv;
2. prefill: on arrival the instance fetches the planned prefix from its own cluster's pool
   (`fetch_blocks`; a flow on the datacenter's fabric) and continues from what came
   (`continued_from`: a block or snapshot evicted meanwhile costs the hit), reserves the tail
   as transfer-cache, then queues and computes T(L | P) (`ProfilePrefillEngine.compute_s`) and
   ships `S_kv` less the decode side's prefix; at the compute's end it writes the new blocks
   and snapshots into the pool (`computed_parts`, a fabric flow); the reply releases the
   reservation and the scheduler learns the fetch time per byte (`CachePlacer.observe`);
3. decode: the instance fetches the local pool's prefix (`decode_cached_len`) over the local
   fabric while the KV comes and joins once both are in; a request prefilled on PrfaaS has its
   whole blocks written into the local pool (`received_parts`, KV only);
4. the record carries the emulation's cache fields (Route, PrefillReply, the decode chunk's),
   and each pool's `PoolBook.stats()` is the run directory's cache_<name>.json, so analysis
   computes the same cache hit share.

With failover a re-dispatch stays in the cluster the request was placed in (`reroute`, the
scheduler's `route(req, kind)`); the new instance fetches from its own pool.

Not modelled: the control RPCs' own latency (Lookup, Fetch, Transfer within a datacenter), a
pool's per-byte service time beyond the fabric, and failures of cache operations (a pool in
the sim always answers); a cancelled attempt writes no blocks, and a decode instance a request
moves to does not fetch the prefix again. Each placement is a line of decisions.jsonl, written
by `CachePlacer.plan` / `.settle` as in the emulation (testbed/sim/replay.py replays them).
"""

from __future__ import annotations

import json
import logging

from testbed import profile as profiles
from testbed.proto import testbed_pb2 as pb
from testbed.records import RunDir
from testbed.sim.cluster import SimCluster
from workers.cache_core import (PoolBook, computed_parts, continued_from, fetch_blocks,
                                received_parts)
from workers.engine_profile import _payload
from workers.placement import CachePlacer, CacheView, profile_prefill_s

LOG = logging.getLogger("testbed.sim.cache")


class CacheReq:
    """One request's prefix and cache fields: what the placement reads and fills (the fields
    `workers.placement.CachePlacer` uses of a `pb.Request`) and what the workers measured."""

    __slots__ = ("id", "input_len", "prefix_blocks", "cached_len", "decode_cached_len",
                 "cache_source", "route", "kind", "arrived", "fetched", "cache_fetch_bytes",
                 "cache_fetch_s", "cache_put_bytes", "decode_tokens", "decode_bytes",
                 "decode_ready", "decode_pending")

    def __init__(self, w):
        self.id, self.input_len = int(w.id), int(w.input_len)
        prefix = getattr(w, "prefix_blocks", None)
        self.prefix_blocks = [int(b) for b in prefix] if prefix is not None else []
        self.cached_len = self.decode_cached_len = 0
        self.cache_source, self.route, self.kind = "", {}, ""
        self.arrived = self.decode_ready = self.decode_pending = None
        self.fetched = self.cache_fetch_bytes = self.cache_put_bytes = 0
        self.cache_fetch_s = 0.0
        self.decode_tokens = self.decode_bytes = 0


def _nbytes(parts):
    return sum(memoryview(d).nbytes for _, _, d in parts)


class CachedCluster(SimCluster):
    """`SimCluster` with the prefix cache pools and the cache-aware placement."""

    def __init__(self, dep, loop, records, events, run_dir, base_unix, *args, **kwargs):
        super().__init__(dep, loop, records, events, run_dir, base_unix, *args, **kwargs)
        rt = self.rt
        self.run_dir = RunDir(run_dir)
        self.pools = {}
        for dc in ("local", "prfaas"):
            pool = rt.pool(dc)
            if pool is not None:
                self.pools[dc] = PoolBook(pool.name, dc, pool.cache_capacity_bytes)
        self.placer = CachePlacer(rt, self.router, profile_prefill_s(
            rt.scale, profiles.load(rt.profile)), LOG, clock=self, read_row=self._counters,
            write=self.decisions.write if self.decisions is not None else None)
        self.block = self.placer.block
        self.every = rt.cache.snapshot_every
        self.sizes = self.placer.sizes
        self.of = {}                # request id -> CacheReq, while the request is in flight

    def now(self):
        """The placement's clock (`workers.clock.Clock`): the run's virtual Unix time."""
        return self.unix(self.loop.now())

    def _counters(self):
        """The sampler's last row as the placement reads timeseries.csv's (None: none yet)."""
        if self.last_sample is None:
            return None
        t, counts = self.last_sample
        return {"time": t, "kv_tx_bytes": counts["kv"], "kv_link_bps": self.links["kv"].link_bps()}

    def _transfer(self, link, nbytes, then, *args):
        """`nbytes` over `link` (a WAN direction or a fabric) as one flow from now; `then(*args)`
        when its last byte has arrived (at once when there is nothing to send)."""
        if nbytes <= 0:
            then(*args)
            return
        flow = link.open(lambda first, sent, arrived: self.loop.at(arrived, then, *args))
        link.push(flow, nbytes, True)

    def _whole(self, c):
        return c.prefix_blocks[:min(c.input_len // self.block, len(c.prefix_blocks))]

    # ---- placement ----
    def submit(self, w):
        self.of[int(w.id)] = CacheReq(w)
        super().submit(w)

    def place(self, r, now):
        """Both pools' answers are in after the PrfaaS pool's round trip over the WAN."""
        rtt = (self.links["request"].one_way_s() + self.links["kv"].one_way_s()
               if "prfaas" in self.pools else 0.0)
        self.loop.after(rtt, self._looked_up, r)

    def _lookup(self, dc, blocks):
        pool = self.pools.get(dc)
        if pool is None or not blocks:
            return 0, 0
        kv, state = pool.lookup(blocks)
        return kv * self.block, state * self.block

    def _looked_up(self, r):
        c = self.of[r.id]
        blocks = self.placer.prefix_of(c)
        (lk, ls), (pk, ps) = self._lookup("local", blocks), self._lookup("prfaas", blocks)
        view, choice, best = self.placer.plan(c, CacheView(lk, ls, pk, ps))
        if best is None or not best[2]:
            self._settle(r, c, view, len(blocks), choice, best, 0, True)
            return
        inst, cached, move_from = best
        self._pull(inst.dc, move_from, self.placer.move_blocks(blocks, cached, view.kv(inst.dc)),
                   self._settle, r, c, view, len(blocks), choice, best)

    def _pull(self, into, source, blocks, then, *args):
        """A prefix move (the pool `into` pulls `blocks` and the snapshot after the last from
        `source`): the Pull call, the Fetch call to the source, the blocks on the WAN direction
        source -> into, the Pull's reply; `then(*args, moved bytes, all of it)`."""
        up, down = self.links["request"], self.links["kv"]
        calls = (up.one_way_s() if into == "prfaas" else 0.0) + \
            (up if into == "local" else down).one_way_s()
        reply = down.one_way_s() if into == "prfaas" else 0.0
        self.loop.after(calls, self._pull_send, into, source, blocks, reply, then, args)

    def _pull_send(self, into, source, blocks, reply, then, args):
        src, dst = self.pools[source], self.pools[into]
        parts = src.store.parts(blocks, len(blocks))
        n = _nbytes(parts)
        kv, state = src.sent(parts, n)
        ok = kv == len(blocks) and state

        def arrived():
            for bid, kind, data in parts:
                dst.received(bid, kind, data)
            dst.pulled(n)
            self.loop.after(reply, then, *args, n, ok)
        self._transfer(self.links["kv" if source == "prfaas" else "request"], n, arrived)

    def _settle(self, r, c, view, whole, choice, best, moved, ok):
        try:
            r.kind, r.p, r.d, c.route = self.placer.settle(c, view, whole, choice, best, moved,
                                                           ok)
        except LookupError as e:
            self._fail(r, f"scheduler: {e}")
            return
        c.kind = r.kind
        self.routed(r)
        self._decode_fetch(r, c)

    def predict_s(self, r, p):
        return self.placer.prefill_s(p, r.input_len, self.of[r.id].cached_len)

    def reroute(self, r):
        """A re-dispatch stays in the cluster the request was placed in, whose pool holds the
        prefix it counted on, while an instance is up there (`SchedulerService.route`)."""
        c = self.of[r.id]
        return lambda: self.router.route_to(c.kind == "remote", r.input_len - c.cached_len)

    def cached_lens(self, r):
        c = self.of[r.id]
        return c.fetched, c.decode_cached_len

    # ---- the prefill worker's cache steps ----
    def prefill_arrives(self, r, attempt=None):
        """Fetch the planned prefix from the instance's pool, then queue (the worker's
        `_cache_fetch` precedes its FIFO); a frozen instance fetches at its resume."""
        rec = self.recovery
        if r.failed or attempt not in (None, r.attempt) or (rec is not None
                                                            and not rec.arrives(r)):
            return
        c = self.of[r.id]
        c.arrived = self.loop.now()
        pool = self.pools.get(r.p.dc)
        k = fetch_blocks(c.cached_len, c.input_len, len(self._whole(c)), self.block)
        if k <= 0 or pool is None:
            c.fetched = 0
            self._queue(r, c, 0, r.attempt)
            return
        parts = pool.store.parts(c.prefix_blocks[:k], k)
        n = _nbytes(parts)
        kv, state = pool.sent(parts, n)
        c.fetched = continued_from(k, self.block, kv, state)
        self._transfer(self.fabric[r.p.dc], n, self._queue, r, c, n, r.attempt)

    def _queue(self, r, c, fetched_bytes, attempt):
        if r.failed or r.attempt != attempt:
            return
        c.cache_fetch_bytes = fetched_bytes
        c.cache_fetch_s = self.loop.now() - c.arrived if fetched_bytes else 0.0
        pool = self.pools.get(r.p.dc)
        if pool is not None:
            pool.transfer(r.id, self.sizes.shipped(c.input_len, c.decode_cached_len), False)
        r.flow = None
        super().prefill_arrives(r, attempt)
        if r.flow is None:
            return                      # held (frozen since the fetch) or failed (dead)
        r.queued = c.arrived            # the worker stamps `queued` as the call arrives
        if pool is not None:
            self.loop.at(r.end, self._put, r, c, pool, attempt)

    def _put(self, r, c, pool, attempt):
        """The new blocks and their snapshots into the prefilling cluster's pool (a cancelled
        attempt's are not: the emulation's worker would write them once it resumes)."""
        if r.attempt != attempt:
            return
        parts = [(bid, kind, _payload(self.sizes.of(kind)))
                 for bid, kind in computed_parts(self._whole(c), c.fetched // self.block,
                                                 self.every)]
        c.cache_put_bytes = _nbytes(parts)
        self._transfer(self.fabric[r.p.dc], c.cache_put_bytes, self._store, pool, parts)

    @staticmethod
    def _store(pool, parts):
        for bid, kind, data in parts:
            pool.received(bid, kind, data)

    def _prefill_replied(self, r, attempt, p, predicted):
        c = self.of.get(r.id)
        if c is not None and r.attempt == attempt and not r.failed:
            if p.dc in self.pools:
                self.pools[p.dc].transfer(r.id, 0, True)
            self.placer.observe(c)
        super()._prefill_replied(r, attempt, p, predicted)

    # ---- the decode worker's cache steps ----
    def _decode_fetch(self, r, c):
        """The local pool's prefix to the decode instance over the local fabric."""
        pool = self.pools.get("local")
        k = min(c.decode_cached_len // self.block, len(self._whole(c)))
        if k <= 0 or pool is None:
            c.decode_ready = self.loop.now()
            return
        parts = pool.store.parts(c.prefix_blocks[:k], 0)
        n = _nbytes(parts)
        kv, _ = pool.sent(parts, n)
        c.decode_tokens, c.decode_bytes = kv * self.block, n
        self._transfer(self.fabric["local"], n, self._decode_fetched, r, c)

    def _decode_fetched(self, r, c):
        c.decode_ready = self.loop.now()
        if c.decode_pending is not None:
            self._decode(r, c.decode_pending)

    def _decode(self, r, last_arrival):
        """The KV is in: the instance waits for its prefix from the pool too, then writes the
        blocks that came over the WAN into the local pool."""
        c = self.of[r.id]
        if c.decode_ready is None:
            c.decode_pending = last_arrival
            return
        t = max(last_arrival, c.decode_ready)
        if r.kind == "remote" and "local" in self.pools:
            self.loop.at(t, self._put_received, c)
        super()._decode(r, t)

    def _put_received(self, c):
        parts = [(bid, kind, _payload(self.sizes.of(kind)))
                 for bid, kind in received_parts(self._whole(c), c.decode_tokens // self.block)]
        self._transfer(self.fabric["local"], _nbytes(parts), self._store, self.pools["local"],
                       parts)

    # ---- records ----
    def _last_chunk(self, r, slot, times):
        chunk = super()._last_chunk(r, slot, times)
        c = self.of.pop(r.id)
        chunk.route.MergeFrom(pb.Route(**c.route))
        chunk.prefill.MergeFrom(pb.PrefillReply(
            cached_len=c.fetched, cache_fetch_bytes=c.cache_fetch_bytes,
            cache_put_bytes=c.cache_put_bytes, cache_fetch_s=c.cache_fetch_s))
        chunk.decode_cached_len, chunk.cache_fetch_bytes = c.decode_tokens, c.decode_bytes
        return chunk

    def _fail(self, r, error):
        self.of.pop(r.id, None)
        super()._fail(r, error)

    def close(self):
        super().close()
        for pool in self.pools.values():
            self.run_dir.cache_pool(pool.name).write_text(json.dumps(pool.stats(), indent=1))
