"""The direct token path, no root (workers/tokens.py, workers/decode.py): a decode worker sends
each client's tokens on that client's stream, first tokens at once and with a `direct` mark for
the scheduler; the client merges them with the scheduler's `Submit` stream in token order, takes
direct tokens only from the announced decode instance, and fails a request whose tokens would
repeat or never come."""

import asyncio
import types

import pytest

from testbed.proto import testbed_pb2 as pb
from workers import tokens
from workers.decode import DecodeService
from workers.kvintake import Slot
from workers.tokens import DirectCall, TokenStreams


def _chunk(first, n, done=False, rid=7):
    return pb.TokenChunk(id=rid, first_index=first, times=[float(first + i) for i in range(n)],
                         done=done, status="ok" if done else "")


def _announce(name, rid=7):
    return pb.TokenChunk(id=rid, decode_instance=name)


class _Submit:
    """A `Submit` call: yields what the test puts in, ends at None."""

    def __init__(self):
        self.q = asyncio.Queue()
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    async def _gen(self):
        while (c := await self.q.get()) is not None:
            yield c

    def __aiter__(self):
        return self._gen()


def _streams():
    return TokenStreams("client", [], types.SimpleNamespace(info=print, warning=print))


async def _collect(call, steps):
    """Run `steps` (callables, one per loop turn) while iterating `call`; its chunks."""
    got = []

    async def consume():
        async for c in call:
            got.append(c)
    task = asyncio.ensure_future(consume())
    for step in steps:
        await asyncio.sleep(0.01)
        step()
    await asyncio.wait_for(task, 2.0)
    return got


def test_direct_and_relayed_chunks_come_in_token_order_and_the_last_waits_for_the_gap():
    async def go():
        streams, sub = _streams(), _Submit()
        call = DirectCall(streams, sub, 7)
        return await _collect(call, [
            lambda: sub.q.put_nowait(_announce("ld0")),
            lambda: call.queue.put_nowait(("ld0", _chunk(3, 2), 1.0)),       # overtook tokens 0..2
            lambda: sub.q.put_nowait(_chunk(5, 1, done=True)),
            lambda: sub.q.put_nowait(_chunk(0, 3)),                     # relayed by the scheduler
            lambda: sub.q.put_nowait(None)]), streams
    got, streams = asyncio.run(go())
    assert [(c.first_index, c.done) for c in got] == [(0, False), (3, False), (5, True)]
    assert [t for c in got for t in c.times] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert not streams.calls


def test_a_last_chunk_whose_tokens_never_come_fails_the_request(monkeypatch):
    monkeypatch.setattr(tokens, "HELD_FINAL_S", 0.05)

    async def go():
        streams, sub = _streams(), _Submit()
        call = DirectCall(streams, sub, 7)
        return await _collect(call, [
            lambda: sub.q.put_nowait(_announce("ld0")),
            lambda: call.queue.put_nowait(("ld0", _chunk(0, 2), 1.0)),
            lambda: sub.q.put_nowait(_chunk(4, 2, done=True))])
    got = asyncio.run(go())
    final = got[-1]
    assert [c.first_index for c in got] == [0, 2]
    assert final.done and final.status == "failed" and "2 tokens from ld0" in final.error
    assert not final.times


def test_direct_tokens_count_only_from_the_announced_instance():
    async def go():
        streams, sub = _streams(), _Submit()
        call = DirectCall(streams, sub, 7)
        return await _collect(call, [
            lambda: call.queue.put_nowait(("ld1", _chunk(0, 1), 1.0)),   # before its announcement
            lambda: sub.q.put_nowait(_announce("ld0")),
            lambda: sub.q.put_nowait(_announce("ld1")),              # re-dispatched to ld1
            lambda: call.queue.put_nowait(("ld0", _chunk(0, 2), 1.0)),   # ld0 woke up: stale
            lambda: call.queue.put_nowait(("ld1", _chunk(1, 2), 1.0)),
            lambda: sub.q.put_nowait(_chunk(3, 0, done=True)),
            lambda: sub.q.put_nowait(None)])
    got = asyncio.run(go())
    assert [(c.first_index, len(c.times), c.done) for c in got] == [
        (0, 1, False), (1, 2, False), (3, 0, True)]
    assert got[-1].status == "ok"


def test_tokens_that_come_twice_fail_the_request_and_end_it_at_the_scheduler():
    async def go():
        streams, sub = _streams(), _Submit()
        call = DirectCall(streams, sub, 7)
        got = await _collect(call, [
            lambda: sub.q.put_nowait(_announce("ld0")),
            lambda: call.queue.put_nowait(("ld0", _chunk(0, 1), 1.0)),   # then ld0 died
            lambda: sub.q.put_nowait(_announce("ld1")),              # the scheduler missed it
            lambda: call.queue.put_nowait(("ld1", _chunk(0, 1), 1.0))])
        return got, sub
    got, sub = asyncio.run(go())
    assert [c.done for c in got] == [False, True]
    assert got[-1].status == "failed" and "came again from ld1" in got[-1].error
    assert sub.cancelled


def test_a_failure_from_the_scheduler_ends_the_request_at_once():
    async def go():
        streams, sub = _streams(), _Submit()
        call = DirectCall(streams, sub, 7)
        return await _collect(call, [
            lambda: sub.q.put_nowait(_announce("ld0")),
            lambda: call.queue.put_nowait(("ld0", _chunk(0, 3), 1.0)),
            lambda: sub.q.put_nowait(pb.TokenChunk(id=7, done=True, status="failed",
                                                   error="decode ld0 failed after 3 tokens"))])
    got = asyncio.run(go())
    assert [(c.first_index, c.done) for c in got] == [(0, False), (3, True)]
    assert got[-1].error == "decode ld0 failed after 3 tokens"


def test_a_worker_batch_reaches_each_open_call_once_over_the_token_port():
    """A decode worker's token port (tokens.serve) and a client's streams (TokenStreams) on
    loopback: the client says its name, the worker says open, each chunk of a batch reaches its
    request's call with its arrival time, and a closed worker stream is reopened."""
    inst = types.SimpleNamespace(name="ld0", ip="127.0.0.1", token_port=0)
    batch = pb.TokenBatch(chunks=[_chunk(0, 1), _chunk(0, 1, rid=8), _chunk(0, 1, rid=9)])

    async def go():
        sinks = {}
        server = await tokens.serve("127.0.0.1", 0, sinks)
        port = server.sockets[0].getsockname()[1]
        streams = TokenStreams("cli", [types.SimpleNamespace(**{**vars(inst),
                                                                 "token_port": port})],
                               types.SimpleNamespace(info=print, warning=print))
        c7, c8 = DirectCall(streams, _Submit(), 7), DirectCall(streams, _Submit(), 8)
        await streams.start(2.0)
        assert list(sinks) == ["cli"]
        sinks["cli"].send_batch(batch)
        sinks["cli"].send_batch(pb.TokenBatch(chunks=[_chunk(1, 2)]))
        item7 = await asyncio.wait_for(c7.queue.get(), 2.0)
        item8 = await asyncio.wait_for(c8.queue.get(), 2.0)
        again = await asyncio.wait_for(c7.queue.get(), 2.0)
        sinks["cli"].transport.abort()          # the stream breaks: the client reopens it
        await asyncio.sleep(0.05)
        await asyncio.wait_for(streams.opened["ld0"].wait(), 2.0)
        reopened = "cli" in sinks
        await streams.close()
        server.close()
        return item7, item8, again, reopened
    item7, item8, again, reopened = asyncio.run(go())
    assert item7[0] == "ld0" and item7[1].id == 7 and item7[2] > 0
    assert item8[1].id == 8 and (again[1].first_index, len(again[1].times)) == (1, 2)
    assert reopened


class _Sink:
    def __init__(self):
        self.batches = []

    def send_batch(self, batch):
        self.batches.append(batch)


def _decode_service():
    rt = types.SimpleNamespace(token_flush_s=0.5, kv_deadline_s=1.0)
    return DecodeService(rt, "ld0", types.SimpleNamespace(clock_factor=1.0), None)


def _slot(rid, client, n, emitted=0):
    s = Slot(rid)
    s.client, s.times, s.token_ids, s.emitted = client, [float(i) for i in range(n)], [0] * n, emitted
    return s


def test_decode_sends_each_clients_tokens_on_its_stream_and_wakes_first_tokens():
    async def go():
        svc = _decode_service()
        svc.last_flush = 100.0
        svc.token_streams = {"a": _Sink(), "b": _Sink()}
        first_a, first_b = _slot(1, "a", 1), _slot(2, "b", 1)
        later_a, relayed = _slot(3, "a", 4, emitted=1), _slot(4, "", 1)
        svc._send_batch([first_a, first_b, later_a, relayed], 100.1)     # not a flush
        between = {c: [[ch.id for ch in b.chunks] for b in q.batches] for c, q in
                   svc.token_streams.items()}
        svc._send_batch([first_a, later_a], 100.7)                        # a flush
        flush = [ch.id for ch in svc.token_streams["a"].batches[-1].chunks]
        return between, flush, first_a, later_a, relayed
    between, flush, first_a, later_a, relayed = asyncio.run(go())
    assert between == {"a": [[1]], "b": [[2]]}
    assert flush == [3]             # request 1's token already went
    assert first_a.wake.is_set() and not later_a.wake.is_set()
    assert first_a.emitted == 1 and later_a.emitted == 4 and relayed.emitted == 0


def _paced_service(tmp_path):
    import logging

    from conftest import SMALL_EXPERIMENT
    from testbed import config, deploy
    from workers.engine_profile import ProfileDecodeEngine

    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT)
    (exp,) = config.load_experiment(p)
    rt = deploy.compile(exp).runtime
    return DecodeService(rt, "ld0", ProfileDecodeEngine(rt, rt.instance("ld0")),
                         logging.getLogger("t"))


def test_the_paced_loop_stamps_every_step_on_schedule_and_wakes_only_for_events(
        tmp_path, monkeypatch):
    from workers import stepclock
    monkeypatch.setattr(stepclock, "MAX_WAKE_S", 1.0)      # no periodic wake-up in this test
    svc = _paced_service(tmp_path)
    svc.flush_s = 10.0              # one flush in the test: the first tokens, then the last
    events = []
    svc.events = lambda kind, **f: events.append((kind, f))

    async def go():
        svc.token_streams = {"c": _Sink()}
        slots = [_slot(rid, "c", 0) for rid in (1, 2)]
        for s, n in zip(slots, (60, 90)):
            s.output_len, s.input_len = n, 1000
        loop = asyncio.create_task(svc.clock.run())
        svc.waiting.extend(slots[:1])
        svc.clock.kick()
        await asyncio.sleep(0.02)
        svc.waiting.extend(slots[1:])       # joins at the next step boundary
        svc.clock.kick()
        while not slots[1].finished:
            await asyncio.sleep(0.01)
        loop.cancel()
        return slots, svc.token_streams["c"]
    (a, b), queue = asyncio.run(go())
    eng = svc.engine
    for s in (a, b):
        assert len(s.times) == s.output_len and s.finished
    # A step's end minus its start is T_step(B, C) of the batch and context it ran with.
    joined = a.times.index(next(t for t in a.times if t >= b.times[0]))
    want = [eng.step_seconds(1, 1000 + i) if i < joined else
            eng.step_seconds(2, 2000 + i + (i - joined)) for i in range(1, 60)]
    got = [y - x for x, y in zip(a.times, a.times[1:])]
    assert 0 < joined < 30
    # A step the loop woke for is stamped when it ran (a late wake-up lengthens it and
    # shortens the next); every other step is exactly on schedule, and the schedule holds.
    off = [i for i, (g, w) in enumerate(zip(got, want)) if abs(g - w) > 2e-6]
    assert len(off) <= 2 * svc.clock.wakeups
    assert sum(got) == pytest.approx(sum(want), abs=svc.clock.late_max + 2e-6)
    assert b.times[0] == a.times[joined]        # one step, one stamp
    assert svc.clock.steps == 90 + joined
    # Wake-ups: the two first tokens, the two last ones, the arrival; not one per step.
    assert svc.clock.wakeups <= 8 < svc.clock.steps
    firsts = [[c.id for c in b.chunks] for b in queue.batches[:2]]
    assert firsts == [[1], [2]]
    svc.clock.report(svc.events, svc.name)
    (kind, row), = events
    assert kind == "decode_wakeups" and row["wakeups"] == svc.clock.wakeups
    assert row["late_p50_ms"] <= row["late_max_ms"]


def test_the_run_reports_the_worst_decode_wakeup_lateness(tmp_path):
    from testbed import metrics
    from testbed.records import EventLog, RunDir, read_events
    from testbed.scale import Scale

    log = EventLog(tmp_path / "events.csv")
    log("decode_wakeups", instance="ld0", steps=900, wakeups=40, late_p50_ms=0.2,
        late_p99_ms=3.0, late_max_ms=9.5)
    log("decode_wakeups", instance="ld1", steps=100, wakeups=10, late_p50_ms=0.4,
        late_p99_ms=1.0, late_max_ms=2.0)
    log.close()
    got = metrics.decode_wakeups(read_events(RunDir(tmp_path).events), Scale(10.0))        # real-world ms: x 10
    assert got == pytest.approx({"instances": 2, "steps": 1000, "wakeups": 50, "late_p50_ms": 4.0,
                                 "late_p99_ms": 30.0, "late_max_ms": 95.0})
    assert metrics.decode_wakeups(read_events(RunDir(tmp_path / "none").events), Scale(10.0)) == {}
