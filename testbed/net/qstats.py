"""Qdisc counters straight from netlink: the counter sampler's read, 20 times a second.

`Wan.stats()` runs at the counter sampler's 20 Hz for the whole run (testbed/measure.py). Through
pyroute2 one read (a qdisc dump per direction, every message decoded into Python objects) cost
~2.7 ms of CPU, ~5% of a core, in the orchestrator while the workers need the cores most.
`QdiscCounters` sends the same request, an RTM_GETQDISC dump, on its own NETLINK_ROUTE socket
made inside the router's namespace, and unpacks only the legacy `TCA_STATS` block (struct
tc_stats, what pyroute2's `TCA_STATS` attribute decodes) of each qdisc: one dump for every
interface, a few struct unpacks.

The socket is made by a short-lived thread that enters the namespace (setns affects the calling
thread only) and ends; the socket keeps the namespace it was made in.
"""

from __future__ import annotations

import errno as errno_mod
import os
import socket
import struct
import threading

from testbed.errors import NetworkError

NETLINK_ROUTE = 0
CLONE_NEWNET = 0x40000000
RTM_NEWQDISC, RTM_GETQDISC = 36, 38     # a dump request is GET, each qdisc comes as NEW
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCA_STATS = 3
NLMSG = struct.Struct("=IHHII")         # len, type, flags, seq, pid
TCMSG = struct.Struct("=BxxxiIII")       # family, ifindex, handle, parent, info
RTATTR = struct.Struct("=HH")           # len, type
TC_STATS = struct.Struct("=QIIIIIII")   # bytes, packets, drops, overlimits, bps, pps, qlen, backlog
STATS_KEYS = ("bytes", "packets", "drop", "overlimits", "bps", "pps", "qlen", "backlog")


def _align(n):
    return (n + 3) & ~3


def socket_in_netns(ns_path: str) -> socket.socket:
    """A NETLINK_ROUTE socket of the network namespace at `ns_path` (NetworkError if it cannot
    be made: the namespace is gone, or no privilege to enter it)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    box = {}

    def make():
        try:
            fd = os.open(ns_path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            finally:
                os.close(fd)
            box["sock"] = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        except OSError as e:
            box["error"] = e

    t = threading.Thread(target=make, name="netns-socket", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        e = box["error"]
        raise NetworkError(f"netlink socket in {ns_path}: {e.strerror or e}",
                           errno=e.errno or errno_mod.EIO)
    return box["sock"]


def parse_qdisc_dump(data: bytes) -> tuple[dict, bool]:
    """({(ifindex, handle): {bytes, packets, drop, overlimits, bps, pps, qlen, backlog}}, done)
    from the netlink messages in `data` (one recv of an RTM_GETQDISC dump)."""
    out, done, off = {}, False, 0
    while off + NLMSG.size <= len(data):
        length, kind, _flags, _seq, _pid = NLMSG.unpack_from(data, off)
        if length < NLMSG.size:
            break
        if kind == NLMSG_DONE:
            done = True
        elif kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", data, off + NLMSG.size)[0]
            if code:
                raise NetworkError(f"qdisc dump: {os.strerror(code)}", errno=code)
        elif kind == RTM_NEWQDISC:
            _fam, ifindex, handle, _parent, _info = TCMSG.unpack_from(data, off + NLMSG.size)
            a, end = off + NLMSG.size + TCMSG.size, off + length
            while a + RTATTR.size <= end:
                alen, atype = RTATTR.unpack_from(data, a)
                if alen < RTATTR.size:
                    break
                if atype == TCA_STATS and alen - RTATTR.size >= TC_STATS.size:
                    out[(ifindex, handle)] = dict(zip(STATS_KEYS,
                                                      TC_STATS.unpack_from(data, a + 4)))
                a += _align(alen)
        off += _align(length)
    return out, done


class QdiscCounters:
    """`read()`: every qdisc's counters in one namespace, {(ifindex, handle): {...}}."""

    def __init__(self, ns_path: str):
        self.ns_path = ns_path
        self.sock = socket_in_netns(ns_path)
        self.sock.bind((0, 0))
        self.seq = 0

    def read(self) -> dict:
        self.seq += 1
        req = NLMSG.pack(NLMSG.size + TCMSG.size, RTM_GETQDISC, NLM_F_REQUEST | NLM_F_DUMP,
                         self.seq, 0) + TCMSG.pack(0, 0, 0, 0, 0)
        self.sock.send(req)
        out = {}
        while True:
            part, done = parse_qdisc_dump(self.sock.recv(1 << 16))
            out.update(part)
            if done:
                return out

    def close(self):
        self.sock.close()
