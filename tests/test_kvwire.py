"""The KV wire over loopback, without root: frames arrive whole and in order with their flags,
concurrent transfers use their own connections, corruption is reported, and `SenderPool.warm`
opens connections to peers that start listening late (workers start in any order)."""

import asyncio
import os
import socket

import pytest

from workers import kvwire


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _receiver(port, **kw):
    frames, errors = [], []
    server = await kvwire.serve("127.0.0.1", port,
                                lambda rid, seq, flags, data, t0, t1:
                                frames.append((rid, seq, flags, bytes(data), t0, t1)),
                                errors.append, **kw)
    return server, frames, errors


async def _until(cond, timeout_s=5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("checksum", [True, False])
def test_frames_arrive_whole_in_order_with_flags(checksum):
    async def main():
        port = _free_port()
        server, frames, errors = await _receiver(port)
        pool = kvwire.SenderPool()
        payloads = [os.urandom(n) for n in (0, 1, 4095, 1 << 20, 17)]
        async with pool.connection("127.0.0.1", port) as conn:
            await conn.send_frames([(7, i, kvwire.FLAG_LAST if i == len(payloads) - 1 else 0, p)
                                    for i, p in enumerate(payloads)], checksum=checksum)
        await _until(lambda: len(frames) == len(payloads))
        pool.close()
        server.close()
        assert errors == []
        assert [f[:4] for f in frames] == [(7, i, kvwire.FLAG_LAST if i == 4 else 0, p)
                                          for i, p in enumerate(payloads)]
        assert all(f[4] <= f[5] for f in frames)       # first byte before last byte
    asyncio.run(main())


def test_concurrent_transfers_use_their_own_connections_and_idle_ones_are_reused():
    async def main():
        port = _free_port()
        server, frames, _ = await _receiver(port)
        pool = kvwire.SenderPool()

        async def transfer(rid):
            async with pool.connection("127.0.0.1", port) as conn:
                for seq in range(3):
                    await conn.send(rid, seq, kvwire.FLAG_LAST if seq == 2 else 0, b"x" * 1000)
                    await asyncio.sleep(0.001)
        await asyncio.gather(*(transfer(r) for r in range(4)))
        assert len(pool.idle[("127.0.0.1", port)]) == 4          # four at once: four streams
        await transfer(9)
        assert len(pool.idle[("127.0.0.1", port)]) == 4          # then reused
        await _until(lambda: len(frames) == 15)
        for rid in (0, 1, 2, 3, 9):
            assert [f[1] for f in frames if f[0] == rid] == [0, 1, 2]
        pool.close()
        server.close()
    asyncio.run(main())


def test_a_corrupt_payload_is_reported_and_the_connection_closed():
    async def main():
        port = _free_port()
        server, frames, errors = await _receiver(port)
        payload = b"abcdef" * 100
        head = kvwire.header(3, 0, kvwire.FLAG_LAST, payload)
        bad = bytearray(payload)
        bad[10] ^= 0xFF
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + bytes(bad))
        await writer.drain()
        await _until(lambda: errors)
        assert isinstance(errors[0], kvwire.FrameError) and "checksum" in str(errors[0])
        assert frames == []
        assert await reader.read() == b""                       # closed by the receiver
        writer.close()
        server.close()
    asyncio.run(main())


def test_warm_waits_for_a_late_listener_and_reports_an_absent_one():
    async def main():
        late, absent = _free_port(), _free_port()
        pool = kvwire.SenderPool()

        async def listen_later():
            await asyncio.sleep(0.3)
            return await _receiver(late)
        task = asyncio.create_task(listen_later())
        missing = await pool.warm([("127.0.0.1", late), ("127.0.0.1", absent)], timeout_s=1.5)
        server, frames, _ = await task
        assert missing == [("127.0.0.1", absent)]
        assert len(pool.idle[("127.0.0.1", late)]) == 1
        async with pool.connection("127.0.0.1", late) as conn:   # the warm one, no new connect
            await conn.send(1, 0, kvwire.FLAG_LAST, b"kv")
        await _until(lambda: frames)
        assert len(pool.idle[("127.0.0.1", late)]) == 1
        pool.close()
        server.close()
    asyncio.run(main())


def test_a_large_payload_sent_in_pieces_arrives_when_its_last_byte_does():
    """The receiver holds wake-ups while a large payload is read (SO_RCVLOWAT): never past what
    the frame still needs, so a payload sent in pieces with pauses between completes, and its
    last byte's arrival time is after the last piece was sent."""
    async def main():
        port = _free_port()
        server, frames, errors = await _receiver(port)
        payload = os.urandom(3 << 20)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        wire = kvwire.header(5, 0, kvwire.FLAG_LAST, payload) + payload
        cuts = [0, 100, 1 << 20, (3 << 20) - 10, len(wire)]
        for a, b in zip(cuts, cuts[1:]):
            writer.write(wire[a:b])
            await writer.drain()
            await asyncio.sleep(0.05)
        await _until(lambda: frames)
        writer.close()
        server.close()
        assert errors == []
        assert frames[0][:4] == (5, 0, kvwire.FLAG_LAST, payload)
        assert frames[0][5] - frames[0][4] >= 0.14     # it took the three pauses to arrive
    asyncio.run(main())


def test_the_receiver_keeps_freed_memory_without_running_ldconfig():
    """glibc takes the receiver's allocator settings (`keep_receive_memory`), found among the
    process's own symbols: no child process (find_library ran `ldconfig -p` in each decode
    worker's start-up)."""
    import resource
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert kvwire.keep_receive_memory() is True
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert (after.ru_utime, after.ru_stime) == (before.ru_utime, before.ru_stime)
