"""TCP timers scaled with the run: per-route `rto_min` and `quickack` in every end host.

Place in the architecture: the builder (`net.build.Network`, after Mininet has set each host's
addresses and default route) calls `apply(ns_path, timers)` per end host; the run records
`TcpTimers.describe()` in `metadata.json` (`tcp.timers`). Everything else in the emulation is
divided by `scale.time`, but the kernel's TCP timers are constants: a retransmission timeout is
at least 200 ms (`TCP_RTO_MIN`) and a delayed ACK waits up to 40 ms (`TCP_DELACK_MIN`) in
emulated time, so at 10x one timeout costs 2 s of real-world time, 10x what it should.

Two route metrics fix that per destination, without touching the machine's own settings:

- `RTAX_RTO_MIN` (whole milliseconds; the kernel reads it only when the metric is locked, which
  `ip route ... rto_min` does implicitly and `RTAX_LOCK` does here): 200 ms / scale.time, at
  least 1 ms. The RTO is srtt + max(rttvar, rto_min), so with every RTT already scaled the whole
  timeout scales.
- `RTAX_QUICKACK`: ACK every segment at once, so no delayed-ACK timer runs at all.

Both go on every IPv4 route of the host's main table (its subnet and its default route), so
intra- and inter-datacenter connections alike. With scale.time <= 1 nothing is changed. What does
not scale (the jiffy granularity of the timer, the tail-loss probe's floor, the SYN's initial
timeout) is in docs/link.md.
"""

import dataclasses
import gzip
import math
import socket

from testbed.net import netlink
from testbed.net.ns import sysctl

KERNEL_RTO_MIN_S = 0.200        # TCP_RTO_MIN (HZ / 5)
KERNEL_DELACK_MIN_S = 0.040     # TCP_DELACK_MIN (HZ / 25)
SACK_DELAY_NS = 1_000_000       # net.ipv4.tcp_comp_sack_delay_ns default: SACK compression cap
SACK_SLACK_NS = 100_000         # net.ipv4.tcp_comp_sack_slack_ns default: its timer's slack
ROUTE_RTO_MIN_FLOOR_MS = 1      # RTAX_RTO_MIN is whole milliseconds
RTAX_RTO_MIN = 13               # linux/rtnetlink.h; its bit in RTAX_LOCK
MAIN_TABLE = 254


@dataclasses.dataclass(frozen=True)
class TcpTimers:
    """What the hosts' routes carry: rto_min in ms (None: kernel default) and quickack; and
    the hosts' SACK compression sysctls in ns (None: kernel default)."""

    rto_min_ms: int | None
    quickack: bool
    sack_delay_ns: int | None = None
    sack_slack_ns: int | None = None

    @classmethod
    def for_scale(cls, scale, hz=None):
        """The timers for a run at `scale` (testbed.scale.Scale) on a kernel with `hz` ticks per
        second (None: this kernel's, `kernel_hz()`).

        The RTO timer fires later than srtt + rto_min: the kernel keeps rto_min in whole
        jiffies and rounds the RTO up to whole jiffies (+1 jiffy while srtt is under one), and
        the timer wheel fires on the tick after the expiry (0-1 jiffy later, 0.5 on average).
        A jiffy (J, 4 ms at HZ=250) is the same emulated time at every scale: at 1x the
        overshoot is ~1 J on 200 ms (2%), at 10x it is ~1.5 J on 20 ms, times ten in real-world
        time. The floor is therefore ((200 ms + J) / scale.time - 1.5 J), to the nearest whole
        jiffy and at least one: at HZ=250, 96 ms at 2x, 36 ms at 5x, 16 ms at 10x, one jiffy
        (4 ms) from 20x on; measured in docs/link.md.
        Without a known tick, 200 ms / scale.time in whole ms."""
        if scale.time <= 1:
            return cls(rto_min_ms=None, quickack=False)
        hz = kernel_hz() if hz is None else hz
        sack = {"sack_delay_ns": round(scale.emulated_s(SACK_DELAY_NS)),
                "sack_slack_ns": round(scale.emulated_s(SACK_SLACK_NS))}
        if not hz:      # tick unknown: scale the floor alone, whole ms
            ms = round(scale.emulated_s(KERNEL_RTO_MIN_S) * 1e3)
            return cls(rto_min_ms=max(ROUTE_RTO_MIN_FLOOR_MS, ms), quickack=True, **sack)
        jiffy_ms = 1e3 / hz
        jiffies = round((scale.emulated_s(KERNEL_RTO_MIN_S + jiffy_ms / 1e3) * 1e3
                         - 1.5 * jiffy_ms) / jiffy_ms)
        # RTAX_RTO_MIN is whole ms, turned into jiffies rounding up: the largest ms in them
        return cls(rto_min_ms=math.floor(max(1, jiffies) * jiffy_ms + 1e-9), quickack=True,
                   **sack)

    @property
    def active(self):
        return self.rto_min_ms is not None or self.quickack

    def sysctls(self):
        """The hosts' namespace sysctls ('name=value')."""
        out = []
        if self.sack_delay_ns is not None:
            out.append(f"net.ipv4.tcp_comp_sack_delay_ns={self.sack_delay_ns}")
        if self.sack_slack_ns is not None:
            out.append(f"net.ipv4.tcp_comp_sack_slack_ns={self.sack_slack_ns}")
        return out

    def metrics(self):
        """pyroute2's RTA_METRICS for a route."""
        m = {}
        if self.rto_min_ms is not None:
            m.update(RTAX_LOCK=1 << RTAX_RTO_MIN, RTAX_RTO_MIN=self.rto_min_ms)
        if self.quickack:
            m["RTAX_QUICKACK"] = 1
        return m

    def describe(self, scale, hz=None):
        """For metadata.json: what was set, what it amounts to in real-world time."""
        hz = kernel_hz() if hz is None else hz
        rto_ms = self.rto_min_ms if self.rto_min_ms is not None else KERNEL_RTO_MIN_S * 1e3
        out = {"rto_min_ms": self.rto_min_ms, "quickack": self.quickack, "kernel_hz": hz,
               "rto_min_emu_ms": rto_ms}
        if hz:   # the timer runs in jiffies: the floor is rounded up to one
            jiffy_ms = 1e3 / hz
            rto_ms = math.ceil(rto_ms / jiffy_ms - 1e-9) * jiffy_ms
            out["rto_min_emu_ms"] = rto_ms
        out["rto_min_real_ms"] = scale.real_s(rto_ms)
        out["delayed_ack_real_ms"] = 0.0 if self.quickack else scale.real_s(
            KERNEL_DELACK_MIN_S * 1e3)
        out["sack_delay_ns"], out["sack_slack_ns"] = self.sack_delay_ns, self.sack_slack_ns
        return out


def kernel_hz():
    """CONFIG_HZ of the running kernel from /proc/config.gz, or None when it is not there."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            for line in f:
                if line.startswith("CONFIG_HZ="):
                    return int(line.split("=", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def _route_key(r):
    """The attributes that name route `r` for a replace (dst, table, proto, scope, type, gw,
    oif, prefsrc): the route is rewritten as it is, plus the metrics."""
    kw = {"dst": r.get_attr("RTA_DST") or "0.0.0.0", "dst_len": r["dst_len"],
          "table": MAIN_TABLE, "proto": r["proto"], "scope": r["scope"], "type": r["type"]}
    for attr, key in (("RTA_GATEWAY", "gateway"), ("RTA_OIF", "oif"),
                      ("RTA_PREFSRC", "prefsrc"), ("RTA_PRIORITY", "priority")):
        if r.get_attr(attr) is not None:
            kw[key] = r.get_attr(attr)
    return kw


def apply(ns_path, timers):
    """Put `timers` on every IPv4 route of the main table in the namespace at `ns_path`, and
    its sysctls in that namespace; returns the routes changed ('dst/len'). Raises NetworkError
    naming the route and errno, or the sysctl."""
    if not timers.active:
        return []
    if timers.sysctls():
        sysctl(ns_path, *timers.sysctls())

    changed = []
    with netlink.open_netns_here(ns_path) as ns:     # used here, by this thread, only
        routes = netlink.call(f"listing routes in {ns_path}", ns.get_routes,
                               family=socket.AF_INET, table=MAIN_TABLE)
        for r in routes:
            kw = _route_key(r)
            name = f"{kw['dst']}/{kw['dst_len']}"
            netlink.call(f"rto_min/quickack on route {name} in {ns_path}", ns.route,
                          "replace", metrics=timers.metrics(), **kw)
            changed.append(name)
    return changed
