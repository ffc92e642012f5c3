"""vLLM's KV events without vLLM: the batch decoder, the sequence handling, the view, the
placement it feeds and its replay.

Batches are recorded ones (tests/data/kv_events/: payloads a vLLM 0.32 CPU server published,
captured by tests/test_vllm.py's subscriber with TESTBED_KV_EVENTS_RECORD=DIR) and constructed
ones (`_pack`, a msgpack writer of the few types vLLM's msgspec encoder uses for a
`KVEventBatch`).
"""

import asyncio
import dataclasses
import json
import pathlib
import struct
import sys

import pytest

from testbed.proto import testbed_pb2 as pb
from testbed.sim import replay
from workers import kvevents as ke
from workers import policy
from workers.kvfeed import KvEventFeed
from workers.kvplace import KvPlacer
from workers.kvsub import Subscriber
from workers.kvview import CacheView, prompt_keys

RECORDED = pathlib.Path(__file__).parent / "data" / "kv_events"


def _pack(v):
    """msgpack of None, bool, int, float, str, bytes, list, dict (enough for a batch)."""
    if v is None:
        return b"\xc0"
    if isinstance(v, bool):
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        return b"\xcf" + struct.pack(">Q", v) if v >= 0 else b"\xd3" + struct.pack(">q", v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        return b"\xd9" + bytes([len(b)]) + b
    if isinstance(v, bytes):
        return b"\xc4" + bytes([len(v)]) + v
    if isinstance(v, list):
        return b"\xdc" + struct.pack(">H", len(v)) + b"".join(_pack(x) for x in v)
    if isinstance(v, dict):
        return b"\xde" + struct.pack(">H", len(v)) + b"".join(
            _pack(k) + _pack(x) for k, x in v.items())
    raise TypeError(type(v))


def stored(hashes, parent, ids, size, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": ids, "block_size": size, "lora_id": None, "medium": "CPU",
            "lora_name": None, **extra}


def batch(*events, ts=100.0):
    return _pack([ts, list(events), 0])


def test_decodes_every_event_kind_and_big_hashes():
    h = (1 << 64) - 5                        # vLLM's default: 64-bit int hashes
    b = ke.decode_batch(batch(stored([h, 7], None, list(range(8)), 4),
                              {"type": "BlockRemoved", "block_hashes": [h], "medium": "CPU"},
                              {"type": "AllBlocksCleared"}, {"type": "SomethingNew"}))
    assert b.ts == 100.0 and b.dp_rank == 0
    s, r, c = b.events                       # the unknown kind is skipped
    assert s.block_hashes == (h, 7) and s.parent is None
    assert s.blocks() == [(h, (0, 1, 2, 3)), (7, (4, 5, 6, 7))]
    assert r == ke.Removed((h,), "CPU") and c == ke.Cleared()


@pytest.mark.parametrize("payload, why", [
    (b"\x93\xcb", "truncated"),
    (_pack([1.0, []]) + b"\x00", "after the value"),
    (_pack({"a": 1}), "expected"),
    (_pack([1.0, [stored([1], None, [1, 2, 3], 2)]]), "token ids"),
    (b"\xc1", "0xc1"),
])
def test_bad_payloads_raise_decode_error_naming_the_problem(payload, why):
    with pytest.raises(ke.DecodeError, match=why):
        ke.decode_batch(payload)


def test_recorded_batches_decode_to_the_prompt_they_stored():
    """Two live batches a real server published (tests/test_vllm.py's KV-event test, block
    size 128): 000002 stores 3 blocks after a cached prefix (its parent is the 4th block of
    the request before it, in a batch not recorded here); 000003 is a reset
    (AllBlocksCleared) and then a 300-token prompt's 2 whole blocks from the start."""
    meta = json.loads((RECORDED / "meta.json").read_text())
    first, second = (ke.decode_batch((RECORDED / f).read_bytes())
                     for f in ("000002.bin", "000003.bin"))
    (ext,) = first.events
    assert isinstance(ext, ke.Stored) and ext.parent is not None and len(ext.block_hashes) == 3
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in ext.block_hashes)
    cleared, st = second.events
    assert cleared == ke.Cleared() and st.parent is None and st.block_size == meta["block_size"]
    assert st.token_ids == tuple(meta["prompt"][:2 * meta["block_size"]])
    assert 0 < first.ts <= second.ts
    view = CacheView(["p0"])
    view.apply("p0", first)                 # its parent is unknown here: not a hit
    view.apply("p0", second)
    assert view.of("p0").counts.orphans == 3
    assert view.hit_tokens(meta["prompt"], ["p0"]) == {"p0": 256}


def test_sequencer_classifies():
    s = ke.Sequencer()
    assert s.classify(0) == ke.IN_ORDER
    s.applied(0)
    assert [s.classify(x) for x in (1, 0, 5)] == [ke.IN_ORDER, ke.RESTARTED, ke.GAP]
    s.applied(1)
    s.applied(2)
    assert s.classify(1) == ke.DUPLICATE


class FakePub:
    def __init__(self, name, buffer, answer=True):
        self.name, self.buffer, self.answer = name, buffer, answer
        self.seq = ke.Sequencer()
        self.asked = []

    def replay(self, start):
        self.asked.append(start)
        return [(s, p) for s, p in self.buffer if s >= start] if self.answer else None


class Out:
    def __init__(self):
        self.data = b""

    def write(self, b):
        self.data += b

    def flush(self):
        pass


def records(data):
    out = []
    while data:
        hn, pn = ke.frame_lengths(data[:ke.FRAME_PREFIX])
        head = json.loads(data[ke.FRAME_PREFIX:ke.FRAME_PREFIX + hn])
        out.append((head, data[ke.FRAME_PREFIX + hn:ke.FRAME_PREFIX + hn + pn]))
        data = data[ke.FRAME_PREFIX + hn + pn:]
    return out


def _seqs(recs):
    return [(h["seq"], h["replayed"]) for h, _ in recs if h["kind"] == "batch"]


def test_a_late_join_is_replayed_in_order_and_duplicates_dropped():
    buf = [(s, b"p%d" % s) for s in range(4)]     # 4 not published yet at the replay
    pub, out = FakePub("rp0", buf), Out()
    sub = Subscriber(out)
    sub.deliver(pub, 3, b"p3")              # joined late: 0..2 missing
    sub.deliver(pub, 4, b"p4")
    sub.deliver(pub, 4, b"p4")              # a duplicate
    recs = records(out.data)
    assert pub.asked == [0]
    assert [h["kind"] for h, _ in recs][:2] == ["gap", "replay"]
    assert _seqs(recs) == [(0, True), (1, True), (2, True), (3, True), (4, False)]
    assert [p for h, p in recs if h["kind"] == "batch"] == [b"p0", b"p1", b"p2", b"p3", b"p4"]


def test_a_gap_the_buffer_no_longer_holds_resyncs_and_says_so():
    pub, out = FakePub("rp0", [(s, b"x") for s in range(6, 9)]), Out()
    pub.seq.applied(1)
    Subscriber(out).deliver(pub, 8, b"x")
    recs = records(out.data)
    resync = [h for h, _ in recs if h["kind"] == "resync"]
    assert resync == [{"kind": "resync", "inst": "rp0", "lost_from": 2, "lost_to": 5,
                       "why": "replay buffer starts later"}]
    assert _seqs(recs) == [(6, True), (7, True), (8, True)] and pub.seq.next == 9


def test_no_replay_answer_resyncs_and_a_restart_is_reported():
    pub, out = FakePub("lp0", [], answer=False), Out()
    sub = Subscriber(out)
    pub.seq.applied(0)
    sub.deliver(pub, 4, b"x")
    sub.deliver(pub, 0, b"y")               # the server started over
    kinds = [h["kind"] for h, _ in records(out.data)]
    assert kinds == ["gap", "resync", "batch", "restarted", "batch"]


def test_catch_up_delivers_what_the_publisher_buffered_and_no_answer_is_no_loss():
    pub, out = FakePub("rp0", [(0, b"a"), (1, b"b")]), Out()
    sub = Subscriber(out)
    sub.catch_up(pub)
    assert _seqs(records(out.data)) == [(0, True), (1, True)] and pub.quiet_checked
    silent, out2 = FakePub("lp0", [], answer=False), Out()
    Subscriber(out2).catch_up(silent)
    assert out2.data == b"" and silent.seq.next == 0


def _feed_of(*records_):
    feed = KvEventFeed([("rp0", "e", "r"), ("lp0", "e", "r")], "python")
    for h, p in records_:
        feed.handle(h, p, now=101.0)
    return feed


def _b(inst, seq, payload, replayed=False):
    return ({"kind": "batch", "inst": inst, "seq": seq, "recv": 100.5,
             "replayed": replayed}, payload)


def test_view_holds_stored_blocks_by_token_ids_and_drops_removed_and_cleared():
    ids = list(range(10, 22))                 # 3 blocks of 4
    feed = _feed_of(_b("rp0", 0, batch(stored([11, 12], None, ids[:8], 4))),
                    _b("rp0", 1, batch(stored([13], 12, ids[8:], 4))),
                    _b("lp0", 0, batch(stored([99], None, ids[:4], 4))))
    v = feed.view
    assert v.hit_tokens(ids, ["rp0", "lp0"]) == {"rp0": 12, "lp0": 4}
    assert v.hit_tokens(ids[:4] + [0] * 8, ["rp0"]) == {"rp0": 4}   # diverges at block 2
    feed.handle(*_b("rp0", 2, batch({"type": "BlockRemoved", "block_hashes": [12],
                                     "medium": "CPU"})), now=101.0)
    assert v.hit_tokens(ids, ["rp0"]) == {"rp0": 4}     # the chain breaks where vLLM's does
    feed.handle(*_b("lp0", 1, batch({"type": "AllBlocksCleared"})), now=101.0)
    assert v.hit_tokens(ids, ["lp0"]) == {"lp0": 0} and v.blocks_held("lp0") == 0
    s = feed.summary(requests=2)
    assert s["events"] == {"stored": 3, "removed": 1, "cleared": 1} and s["batches"] == 5
    assert s["delay_s"]["p50"] == 1.0 and s["stored_events_per_request"] == 1.5


def test_salted_and_orphan_blocks_are_not_hits_and_a_resync_drops_the_instance():
    ids = list(range(8))
    salted = stored([5], None, ids[:4], 4, extra_keys=[["salt"]])
    feed = _feed_of(_b("rp0", 0, batch(salted, stored([6], 404, ids[4:], 4))))
    v = feed.view
    assert v.hit_tokens(ids, ["rp0"]) == {"rp0": 0}
    assert v.of("rp0").counts.orphans == 1
    feed.handle(*_b("rp0", 1, batch(stored([7], None, ids[:4], 4))), now=101.0)
    assert v.holds("rp0", ids[:4])
    feed.handle({"kind": "resync", "inst": "rp0", "lost_from": 2, "lost_to": 3, "why": "t"},
                b"")
    assert not v.holds("rp0", ids[:4]) and feed.summary()["resync"] == 1


def test_an_undecodable_batch_resyncs_and_is_counted():
    feed = _feed_of(_b("rp0", 0, batch(stored([1], None, [1, 2], 2))), _b("rp0", 1, b"\xc1"))
    assert feed.summary()["undecodable"] == 1 and feed.view.blocks_held("rp0") == 0


def test_prompt_keys_chain_over_whole_blocks_only():
    assert len(prompt_keys(list(range(10)), 4)) == 2
    a, b = prompt_keys([1, 2, 3, 4, 5, 6, 7, 8], 4), prompt_keys([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]                       # the same tokens after another parent


def test_the_feed_reads_framed_records_from_its_subscriber(tmp_path):
    """The pipe end of the feed: a subscriber's framed records, read and applied, and the
    wait on the view returns once the block is there."""
    script = tmp_path / "fake_sub.py"
    rec = ke.frame({"kind": "batch", "inst": "rp0", "seq": 0, "recv": 1.0, "replayed": False},
                   batch(stored([3], None, [1, 2, 3, 4], 4)))
    script.write_bytes(b"import sys\nsys.stdout.buffer.write(" + repr(rec).encode() +
                       b")\nsys.stdout.flush()\n")

    async def go():
        feed = KvEventFeed([("rp0", "e", "r")], "python", rows_path=tmp_path / "rows.csv")
        await feed.start([sys.executable, str(script)])
        ok = await feed.wait_until(lambda: feed.view.holds("rp0", [1, 2, 3, 4]), 10)
        await feed.close(tmp_path / "kv_events.json", requests=1)
        return ok
    assert asyncio.run(go())
    assert json.loads((tmp_path / "kv_events.json").read_text())["batches"] == 1
    assert (tmp_path / "rows.csv").read_text().count("\n") == 2


def test_a_placement_by_the_view_is_recorded_and_replays(tmp_path):
    """KvPlacer on a view fed by constructed batches: the request goes where its prefix is
    (though that instance is busier), its decision line carries the hits, and the replay
    (testbed/sim/replay.py) decides the same from the line alone."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    insts = [policy.Instance(name=n, role="prefill", dc="local", accelerator="cpu", addr="")
             for n in ("p0", "p1")] + [
        policy.Instance(name="d0", role="decode", dc="local", accelerator="cpu", addr="")]
    insts[0].outstanding_s = 0.005     # 5 ms queued, against 8 ms the 8-token hit saves
    router = policy.Router("prfaas", 4096, insts, lambda i, n: n * 1e-3)
    lines, view = [], CacheView(["p0", "p1"])
    placer = KvPlacer(router, view, 5, str(tmp_path), 4, lines.append)
    req = pb.Request(id=1, input_len=40, prefix_blocks=[7, 8])
    ids = placer.prompt(req)
    view.apply("p0", ke.decode_batch(batch(stored([1, 2], None, ids[:8], 4))))
    kind, p, _, route = placer.place(req, 1.0)
    assert (p.name, req.cached_len) == ("p0", 8)
    assert route == {"cached_len": 8, "cache_source": "local"}
    (rec,) = lines
    assert rec.cache["hits"] == {"p0": 8} and rec.cache["prefix_blocks"] == 2
    fresh = policy.Router("prfaas", 4096, [dataclasses.replace(i, outstanding_s=0.0)
                                           for i in insts], lambda i, n: n * 1e-3)
    assert replay.decide(fresh, rec) == replay.outcome(rec) == ("prfaas", "local", "p0", "d0", "")
