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
times its first and last bytes arrived, to a callback.

Checksums: crc32 0 in the header means "this frame carries no checksum of its own". A sender
passes `checksum=False` only for payloads that are checked end to end inside (state_wire frames:
a crc32 per tensor and per header), so the bytes are not hashed twice on each side; payloads
without an inner check (the profile engine's bytes) keep the frame crc32. A checked payload whose
crc32 happens to be 0 goes unchecked (one in 2**32). crc32 comes from zlib-ng when it is
installed (identical values, ~13x faster on this CPU), else from zlib.

Cost, measured on 2 cores (benchmarks/kv_transfer.py): the receiver is what limits the path, so
it avoids asyncio streams. `StreamReader.readexactly` copies every byte three times after the
kernel (recv -> bytes, bytes -> the reader's bytearray, slice -> bytes); the receiver here is a
`BufferedProtocol` whose socket reads land directly in the frame's payload buffer -- and, when
the consumer offers one (`payload_buffer`), directly in the state memory the payload is for --
and it delivers frames from the read callback, without a task switch per frame. The sender
(`SocketConnection`, what `SenderPool` hands out) writes the headers and payloads of all the
frames it is given (`send_frames`: a layer's frames at once) with `sendmsg` straight from the
caller's buffers and waits for the socket, not for a copy in a transport buffer, when the
kernel takes less.

Failures: a sender's data unacknowledged for `USER_TIMEOUT_MS` (a blackholed or cut link)
aborts its connection (TCP_USER_TIMEOUT), `drain` tells a transfer that got through (every byte
acknowledged) from one that did not, and receivers probe silent connections (keepalive, 1 s), so
a reset that reached only the sender does not leave the receiver's end open for good.
`workers.prefill` retries a failed transfer on a new connection from frame 0; the receiver's
sequence numbers (`workers.kvintake`) start it over and discard frames that come twice.
"""

import asyncio
import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import termios
import time

from testbed.net.tcp import set_congestion_control

try:    # zlib-ng's crc32 is the same CRC-32, vectorized: ~50 GB/s here against zlib's ~4
    from zlib_ng.zlib_ng import crc32
except ImportError:
    from zlib import crc32

MAGIC = b"TBKV"
HEADER = struct.Struct("!4sQIIQI")
FLAG_LAST = 1
FLAG_ABORT = 2
MAX_FRAME = 256 << 20


KEEPALIVE_S = 1            # receiver: a silent connection is probed after 1 s (then every 1 s)
USER_TIMEOUT_MS = 1000     # sender: data unacknowledged this long aborts the connection


def keepalive(sock, idle_s=KEEPALIVE_S, count=3):
    """Keepalive probes on a receiving socket: a sender that is gone (reset, killed, its
    connection aborted) is noticed within idle_s x (1 + count), not never."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, idle_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)


class FrameError(Exception):
    """A frame was malformed or failed its checksum."""


def header(request_id, seq, flags, payload, crc=True):
    c = crc32(payload) if crc else 0
    return HEADER.pack(MAGIC, request_id, seq, flags, memoryview(payload).nbytes, c)


async def read_frame(reader, crc=True):
    """(request_id, seq, flags, payload) of the next frame from a StreamReader, or None at a
    clean EOF. For stream-based peers and tests; `serve()` does not use it."""
    try:
        raw = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise FrameError("connection closed inside a frame header") from None
    rid, seq, flags, length, c = _parse(raw)
    try:
        payload = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError:
        raise FrameError(f"connection closed inside frame {seq} of request {rid}") from None
    if crc and c and crc32(payload) != c:
        raise FrameError(f"checksum mismatch in frame {seq} of request {rid}")
    return rid, seq, flags, payload


def _parse(raw):
    magic, rid, seq, flags, length, c = HEADER.unpack(raw)
    if magic != MAGIC or length > MAX_FRAME:
        raise FrameError(f"bad frame header (magic {bytes(magic)!r}, length {length})")
    return rid, seq, flags, length, c


class _Receiver(asyncio.BufferedProtocol):
    """One KV connection, receiver side: reads each header, then the payload in place.

    After the transport's read, `buffer_updated` keeps reading the socket itself (`readv`, up
    to `READS_PER_WAKEUP` times, until it would block): a burst of frames costs one event-loop
    turn, not two per frame. Each read fills the rest of the current target (header or
    payload) and, past it, a small staging buffer: the frames that follow, when small (a
    layer header, a conv tail), are taken from there with no syscall of their own, and of a
    large payload at most `STAGE_BYTES` are copied, the rest is read in place. A short read
    drained the socket: no further read (it would only say EAGAIN). While a large payload is
    read, SO_RCVLOWAT holds wake-ups until more of it is queued (never past what it still
    needs, so its last byte wakes it as before): loopback, 4 streams, 2031 -> 693 per 3 s.
    """

    READS_PER_WAKEUP = 64
    STAGE_BYTES = 8192
    LOWAT_MIN = 32 << 10
    LOWAT_MAX = 1 << 20

    def __init__(self, on_frame, on_error, payload_buffer):
        self.on_frame, self.on_error, self.payload_buffer = on_frame, on_error, payload_buffer
        self.head = memoryview(bytearray(HEADER.size))
        self.stage = memoryview(bytearray(self.STAGE_BYTES))
        self.transport = None
        self.fd = self.sock = None
        self.asked = 0
        self.lowat = 1
        self._expect_header()

    def _expect_header(self):
        self.buf, self.pos, self.frame = self.head, 0, None

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                self.sock = sock
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keepalive(sock)

    def get_buffer(self, sizehint):
        self.asked = len(self.buf) - self.pos
        return self.buf[self.pos:]

    def buffer_updated(self, nbytes):
        try:
            drained = nbytes < self.asked      # the kernel had no more: no readv to find that
            self._advance(nbytes)
            if not drained:
                self._read_more()
            self._wake_at()
        except (FrameError, OSError) as e:
            self._fail(e)

    def _wake_at(self):
        """Ask the kernel not to wake this connection before the rest of a large payload (up
        to LOWAT_MAX bytes) is queued (SO_RCVLOWAT): fewer, larger reads. Never more than the
        current target still needs, so the frame's last byte wakes it as before."""
        if self.sock is None or self.transport.is_closing():
            return
        need = len(self.buf) - self.pos if self.frame is not None else 1
        want = min(need, self.LOWAT_MAX) if need >= self.LOWAT_MIN else 1
        if want != self.lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            self.lowat = want

    def _read_more(self):
        if self.fd is None:
            return
        for _ in range(self.READS_PER_WAKEUP):
            if self.transport.is_closing():
                return
            rest = self.buf[self.pos:]
            try:
                n = os.readv(self.fd, (rest, self.stage))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._fail(e)
                return
            if n == 0:
                return                          # EOF: the transport's next read sees it too
            k = min(n, len(rest))
            self._advance(k)
            if n > k:
                self._consume(self.stage[:n - k])
            if n < len(rest) + self.STAGE_BYTES:
                return                          # drained: the next readv would not block less

    def _advance(self, n):
        """`n` bytes were read into the rest of the current target."""
        if self.pos == 0 and self.frame is None:
            self.t_first = time.time()
        self.pos += n
        if self.pos == len(self.buf):
            self._target_done()

    def _consume(self, data):
        """Bytes read past the current target: copy them into the targets that follow."""
        while data:
            if self.pos == 0 and self.frame is None:
                self.t_first = time.time()
            k = min(len(data), len(self.buf) - self.pos)
            self.buf[self.pos:self.pos + k] = data[:k]
            data = data[k:]
            self.pos += k
            if self.pos == len(self.buf):
                self._target_done()

    def _target_done(self):
        if self.frame is None:
            self._header_done()
        else:
            self._payload_done()

    def _header_done(self):
        rid, seq, flags, length, c = self.frame = _parse(self.head)
        if length == 0:
            return self._deliver(b"")
        buf = self.payload_buffer(rid, seq, flags, length) if self.payload_buffer else None
        if buf is None or memoryview(buf).nbytes != length:
            buf = bytearray(length)
        self.payload, self.buf, self.pos = buf, memoryview(buf).cast("B"), 0

    def _payload_done(self):
        rid, seq, _, _, c = self.frame
        if c and crc32(self.buf) != c:
            raise FrameError(f"checksum mismatch in frame {seq} of request {rid}")
        payload, self.payload = self.payload, None
        self._deliver(payload)

    def _deliver(self, payload):
        rid, seq, flags, _, _ = self.frame
        t_first = self.t_first
        self._expect_header()
        self.on_frame(rid, seq, flags, payload, t_first, time.time())

    def _fail(self, err):
        if self.on_error:
            self.on_error(err)
        self.transport.abort()

    def eof_received(self):
        if self.pos or self.frame is not None:
            where = ("a frame header" if self.frame is None
                     else f"frame {self.frame[1]} of request {self.frame[0]}")
            self._fail(FrameError(f"connection closed inside {where}"))
        return False

    def connection_lost(self, exc):
        if isinstance(exc, OSError) and self.on_error:
            self.on_error(exc)


async def serve(host, port, on_frame, on_error=None, payload_buffer=None):
    """Start the receiver: `on_frame(rid, seq, flags, payload, t_first, t_last)` per frame.

    `t_first` is when the frame's first header byte arrived, `t_last` when its last byte did
    (time.time()). `on_error(exc)` gets a malformed or corrupt frame (`FrameError`) or a broken
    connection; the connection is then closed. `payload_buffer(rid, seq, flags, length)`, if
    given, may return a writable buffer of exactly `length` bytes for the payload to be received
    into (it is then what `on_frame` gets), or None for a fresh bytearray.
    """
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Receiver(on_frame, on_error, payload_buffer),
                                    host, port)


def keep_receive_memory(trim_bytes=64 << 20, mmap_bytes=32 << 20):
    """Let this process reuse the memory of freed receive buffers instead of faulting in fresh
    pages for every frame; returns whether the allocator took the setting.

    Every frame (or state tensor) a receiver fills is newly allocated and freed soon after
    (the decode engine copies MLA state into its own cache). With glibc's defaults a freed
    block of a few MB goes back to the kernel (heap trim above 2x the mmap threshold, or
    munmap), so the next request's socket reads fault every page in again: ~12,800 minor
    faults and about half the receiver's CPU time per 68 MB in benchmarks/kv_transfer.py.
    Keeping up to `trim_bytes` of freed heap (and serving blocks below `mmap_bytes` from the
    heap) removes that. Process-wide, so the process that receives calls it, once.
    """
    try:
        # the process's own symbols, libc's among them: `ctypes.util.find_library` would run
        # `ldconfig -p` in every decode worker's start-up
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                        trim_bytes))


class Connection:
    """The sending side of one KV connection over a StreamReader/StreamWriter pair."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.broken = False
        sock = writer.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else None

    async def send(self, request_id, seq, flags, payload, checksum=True):
        """Send one frame; returns when the socket buffer accepted it (drain).

        `checksum=False` sends crc32 0 (no frame checksum): only for payloads verified end to
        end inside (state_wire frames)."""
        await self.send_frames([(request_id, seq, flags, payload)], checksum)

    async def send_frames(self, frames, checksum=True):
        """Send frames [(request_id, seq, flags, payload), ...] in order, as one write."""
        try:
            parts = _parts(frames, checksum)
            for part in self._writev(parts):
                self.writer.write(part)
            await self.writer.drain()
        except (ConnectionError, OSError):
            self.broken = True
            raise

    def _writev(self, parts):
        """Write what the kernel takes now, without copying; return the parts left over."""
        transport = self.writer.transport
        if self._fd is None or transport.get_write_buffer_size() or transport.is_closing():
            return parts
        try:
            n = os.writev(self._fd, parts[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            return parts
        return _after(parts, n)

    def close(self):
        self.writer.close()


class SocketConnection(Connection):
    """The sending side of one KV connection on a bare non-blocking socket (`SenderPool`'s).

    All frames handed over at once go out in `sendmsg` calls straight from the caller's
    buffers (headers and payloads as one scatter list, so a layer's small frames share
    segments instead of each being pushed on its own); when the kernel takes less, it waits
    until the socket is writable and goes on from there. Payload bytes are never copied in
    user space."""

    def __init__(self, sock):
        self.sock = sock
        self.broken = False

    async def send_frames(self, frames, checksum=True):
        try:
            parts = _parts(frames, checksum)
            while parts:
                try:
                    n = self.sock.sendmsg(parts[:IOV_MAX])
                except (BlockingIOError, InterruptedError):
                    n = 0
                parts = _after(parts, n)
                if parts:
                    await self._writable()
        except (ConnectionError, OSError):
            self.broken = True
            raise

    async def drain(self, poll_s=0.002):
        """Wait until the peer has acknowledged every byte written (the kernel's send queue,
        SIOCOUTQ, is empty); an OSError when the connection failed meanwhile (reset, or aborted
        by TCP_USER_TIMEOUT), so the caller knows the transfer did not get through."""
        buf = bytearray(4)
        while True:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.broken = True
                raise OSError(err, os.strerror(err))
            fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, buf)
            if not int.from_bytes(buf, "little"):
                return
            await asyncio.sleep(poll_s)

    async def _writable(self):
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.sock.fileno()
        loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_writer(fd)

    def close(self):
        self.sock.close()


IOV_MAX = 1024


def _parts(frames, checksum):
    parts = []
    for request_id, seq, flags, payload in frames:
        parts.append(header(request_id, seq, flags, payload, checksum))
        if memoryview(payload).nbytes:
            parts.append(memoryview(payload).cast("B"))
    return parts


def _after(parts, n):
    """The parts not yet written when the first `n` bytes of `parts` were."""
    i = 0
    while i < len(parts) and n >= len(parts[i]):
        n -= len(parts[i])
        i += 1
    rest = parts[i:]
    if rest and n:
        rest[0] = memoryview(rest[0])[n:]
    return rest


class SenderPool:
    """Idle connections per destination (host, port); `connection()` checks one out."""

    def __init__(self, connect_timeout_s=5.0):
        self.idle = {}
        self.connect_timeout_s = connect_timeout_s

    @contextlib.asynccontextmanager
    async def connection(self, host, port, connect_timeout_s=None):
        key = (host, port)
        pool = self.idle.setdefault(key, [])
        conn = pool.pop() if pool else None
        if conn is None:
            conn = SocketConnection(await self._connect(host, port, connect_timeout_s))
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

    async def warm(self, peers, timeout_s, retry_s=0.05, retry_max_s=1.0):
        """Open one idle connection to each (host, port) before the first request, retrying
        while the peer is not listening yet, for at most `timeout_s`. Returns the peers that
        could not be reached (their first request connects then, as before). The retry interval
        doubles up to `retry_max_s`: with many instances starting at once, fixed 50 ms retries
        from every prefill to every decode worker took the CPU the peers needed to start."""
        async def one(host, port):
            deadline = asyncio.get_running_loop().time() + timeout_s
            wait_s = retry_s
            while True:
                try:
                    sock = await self._connect(host, port)
                except (OSError, asyncio.TimeoutError):
                    if asyncio.get_running_loop().time() + wait_s > deadline:
                        return (host, port)
                    await asyncio.sleep(wait_s)
                    wait_s = min(2 * wait_s, retry_max_s)
                    continue
                self.idle.setdefault((host, port), []).append(SocketConnection(sock))
                return None

        missing = await asyncio.gather(*(one(h, p) for h, p in peers))
        return [m for m in missing if m is not None]

    async def _connect(self, host, port, timeout_s=None):
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
            set_congestion_control(sock)
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, addr),
                                   timeout_s or self.connect_timeout_s)
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self):
        for pool in self.idle.values():
            for c in pool:
                c.close()
        self.idle.clear()
