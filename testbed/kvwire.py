"""The KV data path: length-prefixed frames over plain TCP between prefill and decode workers.

KV state does not travel over gRPC: a bare TCP socket is what reaches the link's rate (one gRPC
stream reached ~0.4 of a raw socket here), and it is what the paper's transfer engine uses
(several TCP connections, layer-wise streaming). A frame is

    header  = magic 'TBKV' | request id (u64) | seq (u32) | flags (u32) | length (u64) | crc32 (u32)
    payload = `length` bytes

`seq` numbers the frames of one request (layer-wise pieces); `FLAG_LAST` closes a transfer,
`FLAG_ABORT` cancels it. A connection carries one transfer at a time; `SenderPool` keeps idle
connections per destination and opens another when all are busy, so concurrent transfers use
concurrent TCP streams. `serve()` runs the receiver side and hands each complete frame, with the
time its last byte arrived, to a callback.
"""

import asyncio
import contextlib
import struct
import time
import zlib

MAGIC = b"TBKV"
HEADER = struct.Struct("!4sQIIQI")
FLAG_LAST = 1
FLAG_ABORT = 2
MAX_FRAME = 256 << 20


class FrameError(Exception):
    """A frame was malformed or failed its checksum."""


def header(request_id, seq, flags, payload, crc=True):
    c = zlib.crc32(payload) if crc else 0
    return HEADER.pack(MAGIC, request_id, seq, flags, len(payload), c)


async def read_frame(reader, crc=True):
    """(request_id, seq, flags, payload) of the next frame, or None at a clean EOF."""
    try:
        raw = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise FrameError("connection closed inside a frame header") from None
    magic, rid, seq, flags, length, c = HEADER.unpack(raw)
    if magic != MAGIC or length > MAX_FRAME:
        raise FrameError(f"bad frame header (magic {magic!r}, length {length})")
    try:
        payload = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        raise FrameError(f"connection closed inside frame {seq} of request {rid}") from None
    if crc and c and zlib.crc32(payload) != c:
        raise FrameError(f"checksum mismatch in frame {seq} of request {rid}")
    return rid, seq, flags, payload


async def serve(host, port, on_frame, on_error=None):
    """Start the receiver: `on_frame(rid, seq, flags, payload, t_first, t_last)` per frame.

    `t_first` is when the frame's header arrived, `t_last` when its last byte did (time.time()).
    """

    async def handle(reader, writer):
        try:
            while True:
                t_first = time.time()
                frame = await read_frame(reader)
                if frame is None:
                    break
                on_frame(*frame, t_first, time.time())
        except (FrameError, ConnectionError) as e:
            if on_error:
                on_error(e)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port, limit=4 << 20)


class Connection:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.broken = False

    async def send(self, request_id, seq, flags, payload):
        """Send one frame; returns when the socket buffer accepted it (drain)."""
        try:
            self.writer.write(header(request_id, seq, flags, payload))
            if payload:
                self.writer.write(payload)
            await self.writer.drain()
        except (ConnectionError, OSError):
            self.broken = True
            raise

    def close(self):
        self.writer.close()


class SenderPool:
    """Idle connections per destination (host, port); `connection()` checks one out."""

    def __init__(self, connect_timeout_s=5.0):
        self.idle = {}
        self.connect_timeout_s = connect_timeout_s

    @contextlib.asynccontextmanager
    async def connection(self, host, port):
        key = (host, port)
        pool = self.idle.setdefault(key, [])
        conn = pool.pop() if pool else None
        if conn is None:
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port),
                                          self.connect_timeout_s)
            sock = w.get_extra_info("socket")
            if sock is not None:
                import socket
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(r, w)
        try:
            yield conn
        except BaseException:
            conn.broken = True
            raise
        finally:
            if conn.broken:
                conn.close()
            else:
                pool.append(conn)

    def close(self):
        for pool in self.idle.values():
            for c in pool:
                c.close()
        self.idle.clear()
