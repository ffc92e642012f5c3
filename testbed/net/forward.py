"""Forward: a TCP relay from the root namespace's loopback into an instance's network namespace.

`testbed up` serves the OpenAI front door on the client host's address, inside the emulated local
datacenter (the host's own network namespace), which a tool on the machine itself cannot reach.
`Forward` listens on 127.0.0.1:PORT in the root namespace and, for each connection it accepts,
connects to the front door's IP:PORT from inside the client host's namespace and copies bytes
both ways. It listens on loopback only (any other address is refused): the testbed never opens
a port on the machine's real interfaces.

The connection into the namespace is a socket created there: one thread of this process enters
the namespace (setns(2) moves only the calling thread) and makes every outgoing socket; a socket
keeps the namespace it was created in, so the relay's event loop, in the root namespace, uses it
like any other. The relay runs its own asyncio loop in a thread; `stop()` closes the listener and
every open connection, then joins the thread. The runner registers `stop` with the run's
lifecycle registry, so the relay is torn down with the rest of the run (also on Ctrl-C); it
holds no kernel object that outlives this process.
"""

import asyncio
import concurrent.futures
import ipaddress
import os
import socket
import threading

from testbed import eventloop
from testbed.errors import NetworkError
from testbed.net import netlink

START_TIMEOUT_S = 5.0         # binding the listener and entering the namespace are immediate
CONNECT_TIMEOUT_S = 5.0       # the target is one hop away, in the same machine
STOP_TIMEOUT_S = 5.0
CHUNK_BYTES = 1 << 16


def _netns_inode(path):
    return os.stat(path).st_ino


def _thread_netns_inode():
    return _netns_inode(f"/proc/self/task/{threading.get_native_id()}/ns/net")


def _connect(target):
    """A TCP connection to `target`, made in the calling thread's namespace; non-blocking."""
    sock = socket.create_connection(target, timeout=CONNECT_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


async def _pipe(reader, writer):
    """Copy `reader` to `writer` until EOF, then half-close `writer`."""
    try:
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


class Forward:
    """127.0.0.1:`port` in this namespace relayed to `target` (host, port) inside the network
    namespace file `netns_path` (/proc/PID/ns/net of an instance's host; None: this
    namespace, no setns). `port` 0 picks a free port; `address` is the one bound once `start()`
    returns."""

    def __init__(self, netns_path, target, host="127.0.0.1", port=0):
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the forward listens on loopback only, not {host}")
        self.netns_path, self.target = netns_path, (target[0], int(target[1]))
        self.host, self.port = host, int(port)
        self.address = None
        self.connections = 0          # accepted so far
        self._loop = self._thread = self._stopped = None
        self._tasks = set()
        self._started = threading.Event()
        self._error = None
        self._connector = None

    def start(self):
        """Enter the namespace (checked), bind the listener; raise NetworkError if either
        fails. Returns self."""
        enter = {} if self.netns_path is None else {"initializer": netlink.enter_ns,
                                                     "initargs": (self.netns_path,)}
        self._connector = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="forward-connect", **enter)
        try:
            inode = self._connector.submit(_thread_netns_inode).result(START_TIMEOUT_S)
        except concurrent.futures.BrokenExecutor as e:   # the initializer raised
            self._connector.shutdown(wait=False)
            raise NetworkError(f"forward: cannot enter {self.netns_path} ({e})") from None
        if inode != _netns_inode(self.netns_path or "/proc/self/ns/net"):
            self._connector.shutdown(wait=False)
            raise NetworkError(f"forward: the connecting thread is not in {self.netns_path}")
        self._thread = threading.Thread(target=self._run, name="forward", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise NetworkError(f"forward: no listener on {self.host}:{self.port} after "
                               f"{START_TIMEOUT_S:.0f}s")
        if self._error is not None:
            self._connector.shutdown(wait=False)
            raise NetworkError(f"forward: cannot listen on {self.host}:{self.port}: "
                               f"{self._error.strerror}", errno=self._error.errno)
        return self

    def _run(self):
        self._loop = eventloop.new_loop()
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self):
        self._stopped = asyncio.Event()
        try:
            server = await asyncio.start_server(self._relay, self.host, self.port,
                                                reuse_address=True)
        except OSError as e:
            self._error = e
            self._started.set()
            return
        self.address = server.sockets[0].getsockname()[:2]
        self._started.set()
        await self._stopped.wait()
        server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    async def _relay(self, c_reader, c_writer):
        self.connections += 1
        task = asyncio.current_task()
        self._tasks.add(task)
        t_writer = None
        try:
            c_writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP,
                                                         socket.TCP_NODELAY, 1)
            sock = await self._loop.run_in_executor(self._connector, _connect, self.target)
            t_reader, t_writer = await asyncio.open_connection(sock=sock)
            await asyncio.gather(_pipe(c_reader, t_writer), _pipe(t_reader, c_writer))
        except OSError:
            pass            # the target refused or went away: the client sees its end close
        finally:
            self._tasks.discard(task)
            for w in (c_writer, t_writer):
                if w is not None:
                    w.close()

    def stop(self):
        """Close the listener and every relayed connection; join the relay's thread."""
        if self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(STOP_TIMEOUT_S)
        if self._connector is not None:
            self._connector.shutdown(wait=False)
