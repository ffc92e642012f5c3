"""Transition re-export of the WAN link emulation, which now lives in one module per job:

    linkmodel.py   Link, check_params (the one checker), queue/HTB arithmetic, gilbert
    delayline.py   DelayLine, delayline_binary (build + cache), delayline_capacity
    firewall.py    Firewall (iptables of the userspace backend)
    wan.py         Wan, probe_backend
    netlink.py     call, open_netns: the one netlink-error wrapper
    ns.py          disable_offloads

New code imports from those modules; this one keeps `from testbed.net.shaping import ...` of
branches written before the split working until they are merged, and then goes. Note that
`check_params` returns a `Link` (attributes, `.params()` for the dict) and `Wan` takes Links.
"""

from testbed.net.delayline import (DELAYLINE_CFLAGS, DELAYLINE_LIBS, DELAYLINE_SRC,
                                   MAX_NFQUEUE_PACKETS, ROOT_CACHE, DelayLine,
                                   delayline_binary, delayline_capacity)
from testbed.net.firewall import Firewall
from testbed.net.netlink import call as _netlink_call  # noqa: F401 (pair.py used it)
from testbed.net.netlink import open_netns as _open_netns  # noqa: F401
from testbed.net.netlink import register_fifo_plugins as _register_fifo_plugins  # noqa: F401
from testbed.net.linkmodel import (BURST_S, DIRECTIONS, FRAME_BYTES, MIN_BURST_BYTES,
                                   MIN_QUEUE_BYTES, SETTABLE, Link, burst_loss, check_params,
                                   default_queue_bytes, gilbert, htb_burst_bytes,
                                   htb_quantum_bytes, needs_delayline, needs_per_frame_packets,
                                   queue_limit, queue_packets)
from testbed.net.ns import disable_offloads
from testbed.net.wan import (CLASS_HANDLE, HTB_HANDLE, LEAF_HANDLE, TC_H_ROOT, Wan,
                             probe_backend)

__all__ = ["BURST_S", "CLASS_HANDLE", "DELAYLINE_CFLAGS", "DELAYLINE_LIBS", "DELAYLINE_SRC",
           "DIRECTIONS", "DelayLine", "FRAME_BYTES", "Firewall", "HTB_HANDLE", "LEAF_HANDLE",
           "Link", "MAX_NFQUEUE_PACKETS", "MIN_BURST_BYTES", "MIN_QUEUE_BYTES", "ROOT_CACHE",
           "SETTABLE", "TC_H_ROOT", "Wan", "burst_loss", "check_params", "default_queue_bytes",
           "delayline_binary", "delayline_capacity", "disable_offloads", "gilbert",
           "htb_burst_bytes", "htb_quantum_bytes", "needs_delayline", "needs_per_frame_packets",
           "probe_backend", "queue_limit", "queue_packets"]
