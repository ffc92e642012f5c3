"""Cache-aware placement: where a request prefills when prefix caches are in play (docs/cache.md).

The scheduler's global view of the caches is what the pools answer (`Lookup`, per request, in
both clusters): how many leading blocks each holds (MLA KV, what a decode instance can reuse)
and how many end at a KDA snapshot (what a prefill can continue from). Nothing is guessed
from past routing.

`scheduler.placement`:

- `least_loaded` (cache-oblivious routing): the PrfaaS threshold applies to the whole input
  length, the least-loaded instance of the chosen cluster prefills, continuing from whatever
  its own cluster's pool holds.
- `cache_aware` (PRFAAS.md "Scheduling"): with l_pd, l_prfaas the prefixes each cluster can
  continue from,
  - bandwidth scarce: judge each cluster's cache on its own: `L - l_pd <= t` prefills locally
    (from l_pd), else PrfaaS (from l_prfaas);
  - bandwidth abundant: `l_prefix = max(l_pd, l_prfaas)`; `L - l_prefix <= t` prefills locally,
    else on PrfaaS; when the longer prefix sits in the other cluster it is moved there first
    (pool -> pool over the WAN) if the plan with the move has the lower estimated TTFT.
  The WAN counts as abundant while its measured KV egress / link rate (the run's kernel
  counters, `timeseries.csv`, as `workers/adaptive.py` reads them) is below `cache.headroom`.
  Every plan (instance, prefix it continues from, prefix move) is costed by estimated TTFT =
  queued work + prefix fetch + uncached prefill + transfer (Mooncake's Conductor, Dynamo's
  KV router); the transfer term is the prefix move's and, on PrfaaS, the KV's WAN time. A request longer than the threshold that the rule keeps
  local only because of the local cache still goes to PrfaaS when PrfaaS's estimated TTFT
  (with its own cache) is lower: the cache may save WAN bytes, but not at the cost of TTFT.
  A cached prefix is used only when the part of its fetch not hidden behind the instance's
  queue (the worker fetches while the request waits; the time per byte is learned from the
  fetches prefill workers report, not assumed) costs less than computing it.

The decode side's prefix (`decode_cached_len`) is what the local pool holds: the prefill ships
only the recurrent state plus the MLA KV beyond it.

The decision has no RPC in it: `place` (the scheduler's, asyncio) is `lookup` (RPCs) ->
`plan` (cap the view, `choose`) -> `pull` if the plan moves a prefix (RPC) -> `settle` (route,
the request's cache fields). The simulator (testbed/sim/cache.py) calls `plan` and `settle`
around its own models of the two RPCs. `plan` books each decision (the router's book, what the
pools answered, the link reading, the learned fetch time) and `settle` writes it to the run's
decisions.jsonl with where the request went, so testbed/sim/replay.py can make it again.
"""

import asyncio
import dataclasses

from testbed.proto import testbed_pb2 as pb
from testbed.records import RunDir
from workers import cache_wire
from workers.adaptive import read_last_row
from workers.cache_core import BlockSizes
from workers.clock import WALL


@dataclasses.dataclass(frozen=True)
class CacheView:
    """Tokens each cluster's pool holds for one request (answers of `Lookup`)."""
    local_kv: int = 0
    local_state: int = 0
    prfaas_kv: int = 0
    prfaas_state: int = 0

    def state(self, dc):
        return self.prfaas_state if dc == "prfaas" else self.local_state

    def kv(self, dc):
        return self.prfaas_kv if dc == "prfaas" else self.local_kv


@dataclasses.dataclass(frozen=True)
class ClusterChoice:
    remote: bool            # prefill on PrfaaS
    routing_len: int        # the uncached length the rule compared with the threshold
    transfer_from: str = ""  # "local"/"prfaas": move the longer prefix from there first


def choose_cluster(placement, policy, threshold, input_len, view, abundant):
    """The cluster a request prefills in, by the rules in the module docstring (pure)."""
    fixed = {"naive": True, "homogeneous": False}.get(policy)
    if placement != "cache_aware":
        remote = fixed if fixed is not None else input_len > threshold
        return ClusterChoice(remote, input_len)
    if fixed is not None:
        remote = fixed
    elif abundant:
        remote = input_len - max(view.local_state, view.prfaas_state) > threshold
    else:
        remote = input_len - view.local_state > threshold
    here, there = ("prfaas", "local") if remote else ("local", "prfaas")
    move = there if abundant and view.state(there) > view.state(here) else ""
    best = max(view.state(here), view.state(there)) if move else view.state(here)
    return ClusterChoice(remote, input_len - best, move)


def estimated_ttft(queue_s, prefill_s, transfer_s=0.0):
    """The cost an instance is chosen by: queued work + its uncached prefill + prefix moves."""
    return queue_s + prefill_s + transfer_s


def link_state(row, last):
    """(utilisation or None, emulated link bit/s or None, new `last`) from the kernel counters'
    last row (a dict of timeseries.csv's columns or None; `kv_link_bps`, emulated like the byte
    counter) and the previous reading `last` = (time, kv_tx_bytes)."""
    try:
        now = (float(row["time"]), int(row["kv_tx_bytes"]))
        link_bps = float(row["kv_link_bps"])
    except (TypeError, KeyError, ValueError):
        return None, None, last
    if last is None or now[0] <= last[0] or link_bps <= 0:
        return None, link_bps if link_bps > 0 else None, now if last is None else last
    return (now[1] - last[1]) * 8 / (now[0] - last[0]) / link_bps, link_bps, now


def plan_fields(choice, best):
    """The placement's choice as a decision record holds it: `remote` (the cluster) and `plan`
    ([instance, tokens continued from, pool moved from] or None)."""
    return {"remote": choice.remote,
            "plan": None if best is None else [best[0].name, best[1], best[2]]}


def profile_prefill_s(scale, prof):
    """`prefill_s(inst, L, cached)` from the profile: T(L | P) in emulated seconds, the
    estimate the placement plans with (docs/cache.md)."""
    return lambda inst, l, cached: scale.emulated_s(
        prof.t_prefill_cached(inst.accelerator, max(l, 1), cached))


class CachePlacer:
    """The scheduler's cache hook: look up both pools, choose, move a prefix if it pays."""

    MIN_WINDOW_S = 0.1      # the link's utilisation is measured over at least this (emulated)

    def __init__(self, rt, router, prefill_s, log, clock=WALL, read_row=None, write=None):
        """`prefill_s(inst, L, cached)`: estimated prefill seconds (`profile_prefill_s`);
        `clock`: Unix time (virtual in the simulator), the link's utilisation is measured on
        it and the decisions stamped with it; `read_row()`: the kernel counters' last row as a
        dict (default: timeseries.csv's, as the emulation reads it; the simulator passes its
        sampler's); `write(DecisionRecord)`: the run's decisions.jsonl (None: not recorded)."""
        self.write, self.pending = write, {}    # request id -> its record until it is routed
        c = rt.cache
        self.clock = clock
        self.read_row = read_row or (lambda: read_last_row(self.timeseries))
        self.cfg, self.router, self.prefill_s, self.log = c, router, prefill_s, log
        self.placement = rt.scheduler.placement
        self.block = c.block
        self.pools = cache_wire.PoolClient()
        self.addr = {dc: cache_wire.pool_addr(rt, dc) for dc in ("local", "prfaas")}
        self.timeout = rt.kv_deadline_s
        self.timeseries = RunDir(rt.dir).timeseries
        self.link = (None, None)            # (utilisation, emulated link bit/s)
        self._last = None
        self._checked = 0.0
        self.sizes = BlockSizes(c.s_kv_real, self.block, rt.scale)
        self.fetch_s_per_byte = None        # learned from the prefill workers' reports

    def _link(self):
        now = self.clock.now()
        if now - self._checked >= self.MIN_WINDOW_S:
            self._checked = now
            util, bps, self._last = link_state(self.read_row(), self._last)
            if bps is not None:
                self.link = (util, bps)
        return self.link

    def abundant(self):
        mode = self.cfg.transfer
        if mode != "auto":
            return mode == "always"
        util, _ = self._link()
        return util is None or util < self.cfg.headroom

    async def lookup(self, blocks):
        async def one(dc):
            if not self.addr[dc] or not blocks:
                return 0, 0
            try:
                r = await self.pools.stub(self.addr[dc]).Lookup(pb.BlockList(blocks=blocks),
                                                                timeout=self.timeout)
            except Exception as e:      # noqa: BLE001  a pool that does not answer: no hit
                self.log.warning("lookup in %s pool failed: %s", dc, e)
                return 0, 0
            return r.kv_blocks * self.block, r.state_blocks * self.block
        (lk, ls), (pk, ps) = await asyncio.gather(one("local"), one("prfaas"))
        return CacheView(lk, ls, pk, ps)

    def set_book(self, rec):
        """Put the placement in the state a `DecisionRecord` under the cache recorded (the
        replay): its router's book, the link reading as the current one, the fetch time."""
        self.router.set_book(rec)
        self._checked = self.clock.now()
        self.link = tuple(rec.cache["link"])
        self.fetch_s_per_byte = rec.cache["fetch_s_per_byte"]

    def move_start(self, tokens, have_kv):
        """First block of a `tokens` prefix move that the destination lacks: a pool that already
        holds the KV of leading blocks (e.g. the local pool, which decode instances fill with
        the KV of PrfaaS prefills, but no snapshot) needs only the rest and the snapshot, which
        rides with the last block."""
        n = tokens // self.block
        return max(0, min(have_kv // self.block, n - 1))

    def transfer_s(self, tokens, have_kv=0):
        """Estimated WAN time of moving a `tokens` prefix to a pool holding `have_kv` of its KV."""
        _, bps = self._link()
        if not bps or tokens <= 0:
            return 0.0
        util = self.link[0] or 0.0
        n = tokens // self.block
        nbytes = (n - self.move_start(tokens, have_kv)) * self.sizes.kv + self.sizes.state
        return nbytes * 8 / (bps * max(0.05, 1.0 - util))

    def kv_s(self, input_len, decode_cached):
        """Estimated WAN time of the KV a PrfaaS prefill ships (emulated seconds)."""
        _, bps = self._link()
        if not bps:
            return 0.0
        util = self.link[0] or 0.0
        return self.sizes.shipped(input_len, decode_cached) * 8 / (bps * max(0.05, 1.0 - util))

    def observe(self, reply):
        """Learn the pool -> instance fetch time from what prefill workers measured."""
        if reply.cache_fetch_bytes > 0 and reply.cache_fetch_s > 0:
            per_byte = reply.cache_fetch_s / reply.cache_fetch_bytes
            self.fetch_s_per_byte = per_byte if self.fetch_s_per_byte is None else \
                0.9 * self.fetch_s_per_byte + 0.1 * per_byte

    def fetch_s(self, tokens):
        """Estimated time to fetch a `tokens` prefix (KV blocks + one snapshot) from the pool,
        from the fetch times the prefill workers reported (0 until the first one)."""
        if tokens <= 0 or self.fetch_s_per_byte is None:
            return 0.0
        return ((tokens // self.block) * self.sizes.kv + self.sizes.state) * self.fetch_s_per_byte

    def plan_cost(self, inst, L, cached, decode_cached, transfer_s=0.0):
        """Estimated TTFT of prefilling on `inst` from `cached` tokens: queued work, the prefix's
        fetch (plus a WAN prefix move), the uncached prefill, and the KV's WAN time for PrfaaS."""
        ship = self.kv_s(L, decode_cached) if inst.dc == "prfaas" else 0.0
        # The worker fetches as the request arrives, while it waits its turn: only the part of
        # the fetch longer than the queue delays it.
        return estimated_ttft(max(inst.outstanding_s, self.fetch_s(cached)),
                              self.prefill_s(inst, L, cached), transfer_s + ship)

    def worth(self, inst, L, tokens):
        """Use a cached prefix only when the part of its fetch not hidden behind the instance's
        queue costs less than computing it."""
        exposed = max(0.0, self.fetch_s(tokens) - inst.outstanding_s)
        return tokens if tokens > 0 and exposed < \
            self.prefill_s(inst, L, 0) - self.prefill_s(inst, L, tokens) else 0

    def choose(self, L, view, abundant):
        """The placement decision for a request of `L` tokens given what the pools hold
        (`view`, capped) and whether the WAN is abundant: (ClusterChoice, best plan) where the
        plan is (instance, tokens continued from, pool to move the prefix from or ""), None
        when no instance of the chosen cluster is up (or the placement is not cache_aware).
        No RPC and no asyncio: the emulation's `place` and a simulator decide alike."""
        r = self.router
        choice = choose_cluster(self.placement, r.policy, r.threshold, L, view, abundant)
        if self.placement != "cache_aware":
            return choice, None
        # Plans: (estimated TTFT, instance, tokens continued from, prefix move from, its time).
        plans = []
        here = "prfaas" if choice.remote else "local"
        for inst in (r.remote if choice.remote else r.local):
            if not inst.down:
                c = self.worth(inst, L, view.state(here))
                plans.append((self.plan_cost(inst, L, c, view.local_kv), inst, c, "", 0.0))
                if choice.transfer_from:
                    there = choice.transfer_from
                    t = self.transfer_s(view.state(there), view.kv(here))
                    c2 = self.worth(inst, L, view.state(there))
                    if c2 > c:
                        plans.append((self.plan_cost(inst, L, c2, view.local_kv, t), inst, c2,
                                      there, t))
        if not choice.remote and L > r.threshold and r.policy == "prfaas":
            # Local only thanks to a cache: PrfaaS (with its own) still serves it if faster.
            for inst in r.remote:
                if not inst.down:
                    c = self.worth(inst, L, view.prfaas_state)
                    plans.append((self.plan_cost(inst, L, c, view.local_kv), inst, c, "", 0.0))
        if not plans:
            return choice, None
        _, inst, cached, move_from, _ = min(plans, key=lambda x: (x[0], x[1].name))
        return choice, (inst, cached, move_from)

    async def place(self, req):
        """(kind, prefill Instance, decode Instance, Route fields) for one request; fills the
        request's cached_len / decode_cached_len."""
        blocks = self.prefix_of(req)
        view, choice, best = self.plan(req, await self.lookup(blocks))
        moved, ok = 0, True
        if best is not None and best[2]:
            inst, cached, move_from = best
            try:
                moved, ok = await self.pull(inst.dc, move_from,
                                            self.move_blocks(blocks, cached, view.kv(inst.dc)))
            except BaseException:           # cancelled: the request is not placed
                self.pending.pop(req.id, None)
                raise
        return self.settle(req, view, len(blocks), choice, best, moved, ok)

    def prefix_of(self, req):
        """The request's whole prefix blocks: what the pools are asked about."""
        whole = min(req.input_len // self.block, len(req.prefix_blocks))
        return list(req.prefix_blocks[:whole])

    def plan(self, req, view):
        """The pools' answer `view` capped (at least one token is computed) and the decision
        on it: (view, ClusterChoice, best plan or None), as `choose`."""
        cap = ((req.input_len - 1) // self.block) * self.block
        view = CacheView(view.local_kv, min(view.local_state, cap), view.prfaas_kv,
                         min(view.prfaas_state, cap))
        abundant = self.abundant()
        rec = self.router.book(req.id, self.clock.now(), req.input_len) if self.write else None
        choice, best = self.choose(req.input_len, view, abundant)
        if rec is not None:
            rec.uncached_len = choice.routing_len
            rec.cache = {"placement": self.placement, "input_len": req.input_len,
                         "view": list(dataclasses.astuple(view)), "abundant": abundant,
                         "link": list(self.link), "fetch_s_per_byte": self.fetch_s_per_byte,
                         **plan_fields(choice, best)}
            self.pending[req.id] = rec
        return view, choice, best

    def move_blocks(self, blocks, cached, have_kv):
        """The blocks a prefix move of `cached` tokens carries to a pool holding `have_kv`."""
        return blocks[self.move_start(cached, have_kv):cached // self.block]

    def settle(self, req, view, whole, choice, best, moved=0, ok=True):
        """After the prefix move (`moved` bytes arrived, `ok`: all of it) if the plan has one:
        route to the plan's instance (failing over as the router does) and fill the request's
        cache fields; (kind, prefill, decode, Route fields). No RPC."""
        rec = self.pending.pop(req.id, None)
        try:
            out = self._settle(req, view, whole, choice, best, moved, ok)
        except LookupError as e:
            if rec is not None:
                rec.error = str(e)
                self.write(rec)
            raise
        if rec is not None:
            rec.kind, rec.prefill, rec.decode = out[0], out[1].name, out[2].name
            self.write(rec)
        return out

    def _settle(self, req, view, whole, choice, best, moved, ok):
        L = req.input_len
        r = self.router
        if self.placement != "cache_aware":
            kind, p, d = r.route_to(choice.remote, L)
            return self._finish(req, kind, p, d, view, whole, p.dc, view.state(p.dc), 0)
        if best is None:                   # the chosen cluster is down: fail over as usual
            here = "prfaas" if choice.remote else "local"
            kind, p, d = r.route_to(choice.remote, L - view.state(here))
            return self._finish(req, kind, p, d, view, whole, p.dc, view.state(p.dc), 0)
        inst, cached, move_from = best
        if move_from and not ok:
            cached = self.worth(inst, L, view.state(inst.dc))
        kind, p, d = r.route_to(inst.dc == "prfaas", L - cached, lambda i: 0 if i is inst else 1)
        if p is not inst:                  # failed over meanwhile
            cached, move_from = self.worth(p, L, view.state(p.dc)), ""
        return self._finish(req, kind, p, d, view, whole, p.dc, cached, moved,
                            "transfer" if move_from and moved else "")

    def _finish(self, req, kind, p, d, view, whole, dc, cached, moved, source=""):
        req.cached_len = cached
        decode = view.local_kv
        if source == "transfer" and dc == "local":
            decode = max(decode, cached)
        req.decode_cached_len = min(decode, whole * self.block)
        req.cache_source = source or (dc if cached else "")
        return kind, p, d, {"cached_len": cached, "cache_source": req.cache_source,
                            "prefix_transfer_bytes": moved,
                            "lookup_local": view.local_state, "lookup_prfaas": view.prfaas_state}

    def decode_fields(self, kind):
        """DecodeRequest fields: the local pool to fetch the prefix from; store what comes over
        the WAN there."""
        return {"cache_pool": self.addr["local"] or "", "put_to_pool": kind == "remote"}

    async def pull(self, into, source, blocks):
        """Move `blocks` (and the snapshot after the last) from `source`'s pool into `into`'s,
        over the WAN; returns (bytes that arrived, whether all of it did)."""
        try:
            r = await self.pools.stub(self.addr[into]).Pull(
                pb.FetchRequest(blocks=blocks, state_at=len(blocks), source=self.addr[source]),
                timeout=self.timeout)
        except Exception as e:      # noqa: BLE001
            self.log.warning("prefix transfer %s -> %s failed: %s", source, into, e)
            return 0, False
        return r.bytes, r.kv_blocks == len(blocks) and r.state
