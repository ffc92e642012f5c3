"""The KV path under damage, duplication and resets, injected at the application level (no root).

A prefill worker's sender (`PrefillService._send`) streams a transfer to a decode worker's KV
intake (`KvIntake` behind `kvwire.serve`) on loopback. TCP hides link corruption, so the damage
is done above it: a bit flipped in a frame's payload after its crc32 was taken, a frame sent
twice, the receiver's end of the connection aborted mid-transfer. Asserted on what the intake
received: the transfer completes whole (bytes, last frame), the damaged frame was refused by
its checksum, the duplicate discarded and counted, the retries counted.
"""

import asyncio
import logging
import socket

from testbed.proto import testbed_pb2 as pb
from testbed.runtime import WorkerRuntime
from workers import control, kvwire
from workers.kvintake import KvIntake
from workers.prefill import PrefillService

LOG = logging.getLogger("test")
N, SIZE = 8, 4096


class _Engine:
    frames_checksummed = False


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _intake(on_frame=None):
    intake = KvIntake("ld0", None, False, 30.0, LOG)
    errors = []
    port = _port()
    server = await kvwire.serve("127.0.0.1", port, on_frame or intake.on_frame, errors.append)
    return intake, server, port, errors


async def _done(intake, rid, timeout_s=10.0):
    """The request's slot once its KV is complete (the kernel acknowledges before the intake
    has read the bytes: bounded wait)."""
    for _ in range(int(timeout_s / 0.01)):
        slot = intake.slots.get(rid)
        if slot is not None and slot.kv_done.is_set():
            return slot
        await asyncio.sleep(0.01)
    raise AssertionError(f"KV of request {rid} not complete after {timeout_s}s")


async def _send(port, wire=None):
    svc = PrefillService(WorkerRuntime(kv_deadline_s=10.0), "rp0", _Engine(), LOG)
    queue = asyncio.Queue()
    for i in range(N):
        queue.put_nowait((i, bytes([i]) * SIZE, i == N - 1))
    reply = pb.PrefillReply()
    await asyncio.wait_for(svc._send(wire or control.wire_id(5, 0), "127.0.0.1", port, queue,
                                     reply), 20)
    svc.pool.close()
    return svc, reply


def test_a_damaged_frame_is_refused_and_the_transfer_sent_again(monkeypatch):
    parts, calls = kvwire._parts, []

    def damaging(frames, checksum):
        out = parts(frames, checksum)
        calls.append(1)
        if len(calls) == 1:       # the first write: one payload bit flipped after its crc32
            out[1] = bytearray(out[1])
            out[1][7] ^= 0x10
        return out
    monkeypatch.setattr(kvwire, "_parts", damaging)

    async def main():
        intake, server, port, errors = await _intake()
        svc, reply = await _send(port)
        slot = await _done(intake, 5)
        server.close()
        return intake, svc, reply, slot, errors
    intake, svc, reply, slot, errors = asyncio.run(main())
    assert any("checksum" in str(e) for e in errors), errors
    assert svc.kv_retries >= 1
    assert slot.kv_bytes == N * SIZE and not slot.kv_error and slot.next_seq == N
    assert reply.kv_bytes == N * SIZE


def test_a_frame_that_comes_twice_is_discarded_and_counted():
    async def main():
        intake, server, port, errors = await _intake()
        pool = kvwire.SenderPool()
        wire = control.wire_id(6, 0)
        frames = [(wire, i, kvwire.FLAG_LAST if i == 3 else 0, bytes([i]) * SIZE)
                  for i in range(4)]
        async with pool.connection("127.0.0.1", port) as conn:
            await conn.send_frames(frames[:2] + [frames[1]] + frames[2:])
            await conn.drain()
        slot = await _done(intake, 6)
        pool.close()
        server.close()
        return intake, slot, errors
    intake, slot, errors = asyncio.run(main())
    assert errors == [] and intake.duplicate_frames == 1
    assert slot.kv_bytes == 4 * SIZE and not slot.kv_error


def test_a_gap_fails_the_transfer_naming_the_missing_frame():
    intake = KvIntake("ld0", None, False, 30.0, LOG)
    wire = control.wire_id(7, 0)
    intake.on_frame(wire, 0, 0, b"a", 0.0, 0.0)
    intake.on_frame(wire, 2, 0, b"c", 0.0, 0.0)
    slot = intake.slots[7]
    assert slot.kv_done.is_set() and "frame 1" in slot.kv_error


def test_a_call_ended_at_its_kv_deadline_keeps_what_came_for_the_next_call():
    """The scheduler may open a decode stream again at its KV deadline (the prefill still
    runs): what arrived before stays, and the transfer goes on into the next call's slot."""
    intake = KvIntake("ld0", None, False, 30.0, LOG)
    wire = control.wire_id(8, 0)
    first = intake.claim(8)
    intake.on_frame(wire, 0, 0, b"a" * 10, 1.0, 1.0)
    first.kv_late = True                  # the call's deadline passed: DecodeService keeps it
    intake.keep(8, first)
    kept = intake.slots[8]
    assert kept is not first and not kept.claimed and kept.kv_bytes == 10
    intake.on_frame(wire, 1, 0, b"b" * 10, 2.0, 2.0)       # between the two calls
    again = intake.claim(8)
    assert again is kept and not again.kv_late
    intake.on_frame(wire, 2, kvwire.FLAG_LAST, b"c" * 10, 3.0, 3.0)
    assert again.kv_done.is_set() and not again.kv_error
    assert again.kv_bytes == 30 and again.kv_first == 1.0 and again.kv_last == 3.0
    # a newer attempt (the scheduler prefilled it again) supersedes what was kept
    late = intake.claim(9)
    intake.on_frame(control.wire_id(9, 0), 0, 0, b"x" * 5, 1.0, 1.0)
    intake.keep(9, late)
    intake.on_frame(control.wire_id(9, 1), 0, kvwire.FLAG_LAST, b"y" * 7, 2.0, 2.0)
    slot = intake.claim(9)
    assert slot.kv_done.is_set() and slot.kv_bytes == 7 and slot.attempt == 1


def test_a_reset_connection_is_retried_and_the_transfer_starts_over():
    async def main():
        holder = {}

        def on_frame(rid, seq, flags, payload, t0, t1):
            intake.on_frame(rid, seq, flags, payload, t0, t1)
            if seq == 3 and not holder.get("reset"):     # mid-transfer: the receiver's RST
                holder["reset"] = True
                raise kvwire.FrameError("reset injected by the test")
        intake, server, port, errors = await _intake(on_frame)
        svc, reply = await _send(port)
        slot = await _done(intake, 5)
        server.close()
        return intake, svc, slot, errors
    intake, svc, slot, errors = asyncio.run(main())
    assert any("reset injected" in str(e) for e in errors)
    assert svc.kv_retries >= 1
    # the partial first transfer was discarded; the second arrived whole
    assert slot.kv_bytes == N * SIZE and not slot.kv_error
    assert sum(e["bytes"] for e in intake.discarded.values()) >= 3 * SIZE or intake.discarded == {}
