"""Prefix blocks on the wire: kvwire frames between pools and workers, and the pool's address.

Block bytes travel over plain TCP like KV (workers/kvwire.py), on each cache-capable process's
block socket (`CACHE_PORT`): a frame's request id is the block id and its seq the part (0: MLA
KV, 1: KDA snapshot after the block). A fetch ends with a frame of seq 2 whose id is the
fetch's tag: frames of one connection arrive in order, so when the tag's frame is in, every
block sent before it is too.
"""

import asyncio
import itertools
import os

import grpc

from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers import common, kvwire
from workers.cache_core import KIND_KV, KIND_STATE  # noqa: F401  (re-exported)

CACHE_PORT = 50053
KIND_DONE = 2
_tags = itertools.count(1)


def new_tag():
    """A fetch tag unique across the run's processes (pid in the high bits)."""
    return (os.getpid() << 32) | next(_tags)


class BlockReceiver:
    """The receiving side of a block socket: parts go to `on_part(block_id, kind, payload)`,
    closing frames wake `wait(tag)`."""

    def __init__(self, on_part):
        self.on_part = on_part
        self.done = {}
        self.bytes = 0

    def _event(self, tag):
        ev = self.done.get(tag)
        if ev is None:
            ev = self.done[tag] = asyncio.Event()
        return ev

    def on_frame(self, rid, seq, flags, payload, t_first, t_last):
        if seq == KIND_DONE:
            self._event(rid).set()
            return
        self.bytes += len(payload)
        self.on_part(rid, seq, payload)

    async def wait(self, tag, timeout):
        try:
            await asyncio.wait_for(self._event(tag).wait(), timeout)
        finally:
            self.done.pop(tag, None)

    async def serve(self, host, port=CACHE_PORT):
        return await kvwire.serve(host, port, self.on_frame)


async def send_parts(sender, addr, parts, tag=None):
    """Send [(block_id, kind, data)] to a block socket at host:port (then the closing frame of
    `tag`, if given); returns the payload bytes sent."""
    frames = [(bid, kind, 0, data) for bid, kind, data in parts]
    if tag is not None:
        frames.append((tag, KIND_DONE, kvwire.FLAG_LAST, b""))
    if not frames:
        return 0
    host, port = addr.rsplit(":", 1)
    async with sender.connection(host, int(port)) as conn:
        for i in range(0, len(frames), 256):
            await conn.send_frames(frames[i:i + 256])
    return sum(memoryview(d).nbytes for _, _, d in parts)


class PoolClient:
    """gRPC stubs of the cache pools, one channel per address."""

    def __init__(self):
        self.stubs = {}

    def stub(self, addr):
        s = self.stubs.get(addr)
        if s is None:
            ch = grpc.aio.insecure_channel(addr, options=common.grpc_options())
            s = self.stubs[addr] = pbg.CachePoolStub(ch)
        return s

    async def fetch_into(self, receiver, pool_addr, my_block_addr, blocks, state_at, timeout):
        """Ask the pool to send `blocks` (and the snapshot after `state_at`) to this process's
        block socket; returns (FetchReply, bytes) once they are all in: the bytes the pool sent
        for this fetch (the closing frame says they all arrived; the receiver's own counter
        would also count other transfers arriving at the same time)."""
        tag = new_tag()
        waiter = asyncio.ensure_future(receiver.wait(tag, timeout))
        try:
            reply = await self.stub(pool_addr).Fetch(
                pb.FetchRequest(blocks=blocks, state_at=state_at, dest=my_block_addr, tag=tag),
                timeout=timeout)
            await waiter
        except BaseException:
            waiter.cancel()
            raise
        return reply, reply.bytes


def block_addr(inst):
    return f"{inst.ip}:{inst.cache_port}"


def pool_addr(rt, dc):
    """host:port (gRPC) of datacenter `dc`'s pool, or None when the cache is off."""
    pool = rt.pool(dc)
    return pool.addr if pool is not None else None
