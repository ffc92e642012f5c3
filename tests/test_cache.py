"""The prefix cache pool (no root): LRU and hybrid-snapshot semantics, accounting, the cached
prefill formula, placement rules and cost on recorded inputs, config checks, and real block
bytes moving between a pool process's servers and a receiver over loopback TCP."""

import asyncio
import json
import logging
import socket

import pandas as pd
import pytest

from testbed import profile as profiles
from testbed.config import load_experiment
from testbed.errors import ConfigError
from testbed.runtime import CacheRuntime, InstanceRuntime, SchedulerRuntime, WorkerRuntime
from testbed.scale import Scale
from workers.adaptive import read_last_row
from workers.cache_core import KIND_KV, KIND_STATE, BlockSizes, BlockStore, snapshot_blocks
from workers.placement import CacheView, choose_cluster, estimated_ttft, link_state
from workers.policy import Instance, Router


def fill(store, ids, kv=10, state=None, snap=()):
    for i, bid in enumerate(ids, 1):
        store.put(bid, KIND_KV, bytes(kv))
        if i in snap:
            store.put(bid, KIND_STATE, bytes(state))


def test_kv_matches_any_prefix_state_only_at_a_snapshot():
    s = BlockStore(10_000)
    fill(s, [1, 2, 3, 4, 5], kv=10, state=100, snap={2})
    assert s.match([1, 2, 3, 4, 5, 6]) == (5, 2)      # MLA: 5 blocks, KDA: only up to block 2
    assert s.match([1, 2, 9]) == (2, 2)
    assert s.match([1, 9, 3]) == (1, 0)                # no snapshot at or before block 1
    assert s.match([7, 1]) == (0, 0)


def test_snapshot_without_its_kv_is_not_kept():
    s = BlockStore(10_000)
    s.put(42, KIND_STATE, bytes(100))
    assert s.match([42]) == (0, 0) and s.prefix_bytes == 0


def test_lru_evicts_least_recently_used_block_with_its_snapshot():
    s = BlockStore(100)
    fill(s, [1, 2], kv=10, state=30, snap={1, 2})     # 80 bytes
    s.match([1])                                       # block 1 is now the most recent
    evicted = s.put(3, KIND_KV, bytes(30))             # 110 > 100: evict block 2 (40 bytes)
    assert evicted == [2]
    assert s.prefix_bytes == 70 and s.evicted_bytes == 40
    assert s.match([1, 3], touch=False) == (2, 1) and s.match([2], touch=False) == (0, 0)


def test_transfer_cache_comes_out_of_the_same_pool_and_is_freed_on_release():
    s = BlockStore(100)
    fill(s, [1, 2, 3], kv=20)
    s.reserve("r1", 50)                                # 110 > 100: evicts block 1 (LRU)
    assert s.prefix_bytes == 40 and s.transfer_bytes == 50 and s.used == 90
    assert s.match([1], touch=False) == (0, 0) and s.match([2, 3], touch=False) == (2, 0)
    s.release("r1")
    assert s.transfer_bytes == 0 and s.stats()["transfers"] == 0
    s.reserve("big", 500)                              # over-committed: said, not hidden
    assert s.over_bytes == 400 and s.prefix_bytes == 0


def test_snapshot_policy():
    assert snapshot_blocks(20, 8) == {8, 16, 20}
    assert snapshot_blocks(16, 8) == {8, 16}
    assert snapshot_blocks(3, 0) == {3}
    assert snapshot_blocks(0, 8) == set()


def test_block_sizes_follow_the_profile_fit():
    prof = profiles.load("kimi-linear-1t")
    a, b = prof.kv_size.coeffs[:2]
    z = BlockSizes(prof.kv_size.coeffs, 512, Scale(bytes=1e-3))
    assert z.kv == round(b * 512 * 1e-3) and z.state == round(a * 1e-3)
    # Nothing cached at decode: the whole S_kv(L); 8K cached: less exactly b * 8K.
    assert z.shipped(20000, 0) == pytest.approx(prof.s_kv(20000) * 1e-3, abs=1)
    assert z.shipped(20000, 0) - z.shipped(20000, 8192) == pytest.approx(b * 8192 * 1e-3, abs=1)


def test_cached_prefill_formula():
    prof = profiles.load("kimi-linear-1t")
    f = prof.prefill["h20"]
    a, _, c = f.coeffs
    L = 32768
    assert prof.t_prefill_cached("h20", L, 0) == pytest.approx(prof.t_prefill("h20", L))
    for P in (4096, 16384, 28672):
        t = prof.t_prefill_cached("h20", L, P)
        # The suffix attends over the whole context: 2cP(L-P) more than a fresh L-P prompt.
        assert t - prof.t_prefill("h20", L - P) == pytest.approx(2 * c * P * (L - P))
        assert a < t < prof.t_prefill("h20", L)
    times = [prof.t_prefill_cached("h20", L, P) for P in range(0, L, 4096)]
    assert times == sorted(times, reverse=True)


# ---- placement on recorded inputs ----

def test_least_loaded_ignores_the_cache_when_routing():
    v = CacheView(local_kv=30000, local_state=30000)
    ch = choose_cluster("least_loaded", "prfaas", 19866, 40000, v, abundant=True)
    assert ch.remote and ch.routing_len == 40000 and not ch.transfer_from


def test_bandwidth_scarce_judges_each_cluster_on_its_own():
    v = CacheView(local_state=4096, prfaas_state=30000)
    ch = choose_cluster("cache_aware", "prfaas", 19866, 32000, v, abundant=False)
    assert ch.remote and not ch.transfer_from          # 32000 - 4096 > t: PrfaaS, own cache
    v = CacheView(local_state=16384)
    assert not choose_cluster("cache_aware", "prfaas", 19866, 32000, v, False).remote


def test_bandwidth_abundant_moves_the_longer_prefix():
    v = CacheView(local_state=0, prfaas_state=24576)
    ch = choose_cluster("cache_aware", "prfaas", 19866, 30000, v, abundant=True)
    # 30000 - 24576 <= t: prefill locally, after moving PrfaaS's prefix over.
    assert not ch.remote and ch.transfer_from == "prfaas" and ch.routing_len == 30000 - 24576
    ch = choose_cluster("cache_aware", "prfaas", 19866, 60000, v, abundant=True)
    assert ch.remote and not ch.transfer_from          # PrfaaS holds it already


def test_estimated_ttft_trades_queue_against_cache():
    insts = [Instance("lp0", "prefill", "local", "h20", "a", outstanding_s=2.0),
             Instance("lp1", "prefill", "local", "h20", "b", outstanding_s=0.5),
             Instance("ld0", "decode", "local", "h20", "c", "c:1")]
    r = Router("prfaas", 19866, insts, lambda i, l: 0.0)
    prefill = {"lp0": 0.4, "lp1": 3.0}       # lp0 holds the prefix (cheap), lp1 is idle
    _, p, _ = r.route_to(False, 1000, lambda i: estimated_ttft(i.outstanding_s, prefill[i.name]))
    assert p.name == "lp0"                   # 2.4 s < 3.5 s
    insts[0].outstanding_s = 4.0
    _, p, _ = r.route_to(False, 1000, lambda i: estimated_ttft(i.outstanding_s, prefill[i.name]))
    assert p.name == "lp1"


def test_link_state_from_kernel_counters(tmp_path):
    ts = tmp_path / "timeseries.csv"
    ts.write_text("time,kv_tx_bytes,kv_link_bps\n1.0,0,1e9\n")
    util, bps, last = link_state(read_last_row(ts), None)
    assert util is None and bps == 1e9 and last == (1.0, 0)
    with open(ts, "a") as f:
        f.write("1.5,31250000,1e9\n")                  # 250 Mbit in 0.5 s on 1 Gbit/s
    util, bps, last = link_state(read_last_row(ts), last)
    assert util == pytest.approx(0.5) and last == (1.5, 31250000)


# ---- configuration ----

def _exp(tmp_path, text, *sets):
    p = tmp_path / "e.yaml"
    p.write_text(text)
    return load_experiment(p, list(sets))


@pytest.mark.parametrize("sets, key", [
    (("cache.capacity=1MB",), "cache.capacity"),
    (("cache.block=300",), "cache.block"),
    (("cache.block=1024",), "cache.block"),
    (("cache.enabled=false", "scheduler.placement=cache_aware"), "scheduler.placement"),
    (("scheduler.policy=naive", "scheduler.placement=cache_aware"), "scheduler.placement"),
])
def test_bad_cache_settings_name_the_key(tmp_path, small_experiment, sets, key):
    with pytest.raises(ConfigError) as e:
        _exp(tmp_path, small_experiment, "cache.enabled=true", *sets)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_default_capacity_is_memory_left_after_weights(tmp_path, small_experiment):
    from testbed.config import cache_capacity
    exp = _exp(tmp_path, small_experiment, "cache.enabled=true")[0]
    prof = profiles.load("kimi-linear-1t")
    assert cache_capacity(exp, prof, "local") == (768e9 - 520e9) * 2
    assert cache_capacity(exp, prof, "prfaas") == (1128e9 - 520e9) * 1


# ---- metrics ----

def test_cache_summary_on_recorded_requests(tmp_path, small_experiment):
    from testbed.metrics import cache_summary
    from testbed.rundir import RunInfo
    exp = _exp(tmp_path, small_experiment, "cache.enabled=true")[0]
    df = pd.DataFrame({"input_len": [1000, 2048, 4096], "cached_len": [0, 1024, 2048],
                       "prefill_end": [1.0, 1.0, 1.0], "route": ["local", "local", "remote"],
                       "kv_bytes_sent": [100, 100, 100], "prefix_transfer_bytes": [0, 0, 7],
                       "cache_fetch_bytes": [0, 5, 5], "decode_cache_bytes": [0, 1, 1],
                       "cache_source": ["", "local", "transfer"]})
    s = cache_summary(df, RunInfo.of(exp))
    assert s["cache_hit_share"] == pytest.approx(3072 / 7144)
    assert s["prefill_tokens_computed"] == 7144 - 3072
    assert s["prefix_transfer_bytes"] == 7 and s["cache_fetch_bytes"] == 12
    assert s["cache_hit_share_local"] == pytest.approx(1024 / 3048)
    assert s["cache_hit_share_prfaas"] == pytest.approx(2048 / 4096)
    assert s["cache_hits_by_source"] == {"local": 1, "transfer": 1}


# ---- real bytes over loopback TCP ----

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pool_serves_real_bytes_over_tcp(tmp_path):
    """Blocks written to a pool's block socket are looked up and fetched back, byte for byte,
    by a receiver on another socket; a second pool pulls them (a cross-cluster transfer)."""
    from testbed.proto import testbed_pb2 as pb
    from testbed.proto import testbed_pb2_grpc as pbg
    from workers import cache_wire, common
    from workers.cachepool import CachePoolService
    from workers import kvwire

    async def main():
        insts = {n: InstanceRuntime(name=n, role="cachepool", dc=dc, ip="127.0.0.1",
                                    grpc_port=_free_port(), cache_port=_free_port(),
                                    cache_capacity_bytes=10_000)
                 for n, dc in (("pa", "local"), ("pb", "prfaas"))}
        rt = WorkerRuntime(run_dir=str(tmp_path), kv_deadline_s=5.0, instances=insts)
        servers, pools = [], {}
        for n, inst in insts.items():
            svc = pools[n] = CachePoolService(rt, n, inst, logging.getLogger(n))
            servers.append(await svc.receiver.serve("127.0.0.1", inst.cache_port))
            servers.append(await common.start_grpc(inst, pbg.add_CachePoolServicer_to_server,
                                                   svc))
        sender = kvwire.SenderPool()
        parts = [(11, KIND_KV, b"a" * 100), (12, KIND_KV, b"b" * 100),
                 (12, KIND_STATE, b"S" * 500)]
        n = await cache_wire.send_parts(sender, cache_wire.block_addr(insts["pa"]), parts, tag=1)
        assert n == 700
        await pools["pa"].receiver.wait(1, 5.0)
        client = cache_wire.PoolClient()
        addr = {k: v.addr for k, v in insts.items()}
        r = await client.stub(addr["pa"]).Lookup(pb.BlockList(blocks=[11, 12, 13]))
        assert (r.kv_blocks, r.state_blocks) == (2, 2)
        got = []
        recv = cache_wire.BlockReceiver(lambda bid, kind, data: got.append((bid, kind,
                                                                            bytes(data))))
        rport = _free_port()
        rsrv = await recv.serve("127.0.0.1", rport)
        reply, nbytes = await client.fetch_into(recv, addr["pa"], f"127.0.0.1:{rport}",
                                                [11, 12], 2, 5.0)
        assert reply.state and reply.kv_blocks == 2 and nbytes == 700
        assert got == parts
        pulled = await client.stub(addr["pb"]).Pull(
            pb.FetchRequest(blocks=[11, 12], state_at=2, source=addr["pa"]))
        assert pulled.bytes == 700 and pools["pb"].store.match([11, 12]) == (2, 2)
        stats = json.loads((await client.stub(addr["pa"]).Stats(pb.Empty())).json)
        assert stats["bytes_in"] == 700 and stats["bytes_out"] == 1400
        sender.close()
        rsrv.close()
        for s in servers:
            if hasattr(s, "stop"):
                await s.stop(None)
            else:
                s.close()
        for p in pools.values():
            p.sender.close()

    asyncio.run(main())


def _placer(tmp_path, view, fetch_s_per_byte=None):
    """A CachePlacer on recorded inputs: pools answer `view`; moves succeed without a network."""
    from workers import placement
    prof = profiles.load("kimi-linear-1t")
    insts = [Instance("rp0", "prefill", "prfaas", "h200", "a"),
             Instance("lp0", "prefill", "local", "h20", "b"),
             Instance("ld0", "decode", "local", "h20", "c", "c:1")]
    router = Router("prfaas", 19866, insts, lambda i, l: 0.0)
    rt = WorkerRuntime(run_dir=str(tmp_path), kv_deadline_s=5.0, scale=Scale(bytes=1e-3),
                       scheduler=SchedulerRuntime(placement="cache_aware"),
                       cache=CacheRuntime(enabled=True, block=512,
                                          s_kv_real=tuple(prof.kv_size.coeffs),
                                          transfer="always", headroom=0.5))
    pl = placement.CachePlacer(rt, router, lambda i, l, c: prof.t_prefill_cached(
        i.accelerator, l, c) / 10, logging.getLogger("t"))
    pl.fetch_s_per_byte = fetch_s_per_byte
    moves = []

    async def lookup(blocks):
        return view

    async def pull(into, source, blocks):
        moves.append((into, source, len(blocks)))
        return 1000, True
    pl.lookup, pl.pull = lookup, pull
    return pl, router, moves


def _req(L):
    from testbed.proto import testbed_pb2 as pb
    return pb.Request(id=1, input_len=L, prefix_blocks=list(range(-(-L // 512))))


def test_cache_aware_moves_a_prefix_only_when_the_plan_is_faster(tmp_path):
    # PrfaaS holds 24K of a 30K prompt; local nothing. Rule: 30K - 24K <= t -> local + move.
    view = CacheView(prfaas_kv=24576, prfaas_state=24576)
    pl, router, moves = _placer(tmp_path, view)
    kind, p, _, info = asyncio.run(pl.place(_req(30000)))
    # Local H20 from 24K cached beats PrfaaS H200 from 24K plus its KV over the WAN? The
    # costs decide; whichever wins, the request's fields say what was done.
    if p.dc == "local":
        assert moves == [("local", "prfaas", 48)] and info["cache_source"] == "transfer"
    else:
        assert moves == [] and info["cache_source"] == "prfaas"
    assert info["cached_len"] == 24576
    # With a long local queue, the move to local no longer pays: PrfaaS serves from its cache.
    router.local[0].outstanding_s = 100.0
    moves.clear()
    kind, p, _, info = asyncio.run(pl.place(_req(30000)))
    assert kind == "remote" and moves == [] and info["cache_source"] == "prfaas"


def test_a_prefix_slower_to_fetch_than_to_compute_is_not_used(tmp_path):
    view = CacheView(local_kv=512, local_state=512)
    pl, _, _ = _placer(tmp_path, view, fetch_s_per_byte=1.0)     # absurdly slow fabric
    _, p, _, info = asyncio.run(pl.place(_req(4000)))
    assert p.dc == "local" and info["cached_len"] == 0
    pl.fetch_s_per_byte = 1e-12
    _, p, _, info = asyncio.run(pl.place(_req(4000)))
    assert info["cached_len"] == 512 and info["cache_source"] == "local"
    # A slow fetch hidden behind the instance's queue costs nothing: the prefix is used.
    pl.fetch_s_per_byte = 1e-6                                  # ~0.19 s for 512 tokens
    _, p, _, info = asyncio.run(pl.place(_req(4000)))
    assert info["cached_len"] == 0
    pl.router.local[0].outstanding_s = 1.0
    _, p, _, info = asyncio.run(pl.place(_req(4000)))
    assert p.dc == "local" and info["cached_len"] == 512


def test_a_prefix_move_ships_only_what_the_destination_lacks(tmp_path):
    # A PrfaaS prefill left its KV in the local pool (decode stores it) but no KDA snapshot:
    # moving the 16Ki prefix back needs only the snapshot, which rides with the last block.
    view = CacheView(local_kv=16384, local_state=0, prfaas_kv=16384, prfaas_state=16384)
    pl, _, moves = _placer(tmp_path, view)
    _, p, _, info = asyncio.run(pl.place(_req(18000)))
    assert p.dc == "local" and info["cache_source"] == "transfer"
    assert moves == [("local", "prfaas", 1)] and info["cached_len"] == 16384
    # Its estimated WAN time is that of one block and a snapshot, not of 32 blocks and one.
    assert pl.move_start(16384, 16384) == 31 and pl.move_start(16384, 4096) == 8
    assert pl.move_start(16384, 0) == 0 and pl.move_start(16384, 32768) == 31
    pl.link, pl._checked = (0.0, 1e9), float("inf")         # an idle 1 Gbit/s emulated link
    s = pl.sizes
    assert pl.transfer_s(16384, 16384) == pytest.approx((s.kv + s.state) * 8 / 1e9)
    assert pl.transfer_s(16384, 0) == pytest.approx((32 * s.kv + s.state) * 8 / 1e9)
