"""The WAN: the link model (`testbed.net.linkmodel`) installed on the WAN router's two egress
interfaces.

Place in the architecture: the builder (the Mininet backend's `testbed.net.build`, or
`testbed.net.pair.routed_pair`) creates a router namespace with one interface toward each
datacenter and hands its namespace path and the deployment's checked `Link`s to `Wan`. The
router forwards between them; everything that crosses the WAN leaves through one of two egress
interfaces, so shaping there makes a real bottleneck whose queue fills and drops, instead of
back-pressuring the sender's socket.

    kv       PrfaaS -> local, leaves through ifaces["kv"]       (toward the local PD cluster)
    request  local -> PrfaaS, leaves through ifaces["request"]  (toward the PrfaaS cluster)

Two backends build it:

- `netem`: HTB class + netem child (delay, jitter, loss, limit); everything over netlink.
- `userspace` (kernels without netem, such as these machines): HTB class + bfifo/pfifo child;
  loss and link-down by iptables in the router namespace (`testbed.net.firewall`); delay, jitter
  and burst loss by the delay line (`testbed.net.delayline`), one per direction.

`auto` picks netem when a scratch namespace accepts an HTB + netem pair (`probe_backend`).
`Wan.set` changes a live link (one netlink request, or one write to the delay line, or one
iptables-restore) and logs the change; runs replay rate traces and scheduled changes through it
(`testbed.net.schedule.LinkSchedule`, fed by the deployment's schedule).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import functools
import os
import threading
import time

from testbed import lifecycle, units
from testbed.errors import ConfigError, NetworkError
from testbed.net import netlink
from testbed.net.delayline import DelayLine
from testbed.net.firewall import Firewall
from testbed.net.linkevents import LinkEvents
from testbed.net.linkmodel import (DIRECTIONS, PATH_KEYS, SETTABLE, STEADY_FAULTS, Link,
                                   burst_loss, htb_burst_bytes, htb_quantum_bytes,
                                   needs_delayline, queue_limit, queue_packets)
from testbed.net.pathlimit import PathLimits

HTB_HANDLE, CLASS_HANDLE, LEAF_HANDLE = 0x10000, 0x10010, 0x100000   # 1:  1:10  10:
TC_H_ROOT = 0xFFFFFFFF


def _leaf_stats(msgs, handle):
    """TCA_STATS of the qdisc with `handle` among a qdisc dump, or None."""
    for m in msgs:
        if m["handle"] == handle:
            return m.get_attr("TCA_STATS")
    return None


# ---------------------------------------------------------------- backend probe

@functools.lru_cache(maxsize=1)
def probe_backend():
    """('netem'|'userspace', reason): try HTB + a netem child on `lo` of a scratch namespace.

    Cached per process; needs root. The scratch namespace is `tbprobe<pid>`, on record (state
    file) while it exists, so `testbed clean` removes it if this process is killed meanwhile.
    """
    name = f"tbprobe{os.getpid()}"
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(lifecycle.scratch_netns(name, kind="netem-probe"))
        except Exception as e:  # not root, or namespaces unavailable: no kernel answer to give
            return "userspace", f"could not create a scratch namespace to probe netem ({e})"
        return _probe_netem(name)


def _probe_netem(name):
    with netlink.open_netns(f"/var/run/netns/{name}") as ns:
        lo = ns.link_lookup(ifname="lo")[0]
        ns.link("set", index=lo, state="up")
        try:
            netlink.call("htb", ns.tc, "add", "htb", index=lo, handle=HTB_HANDLE, default=0x10)
            netlink.call("htb class", ns.tc, "add-class", "htb", index=lo, handle=CLASS_HANDLE,
                         parent=HTB_HANDLE, rate="1gbit", ceil="1gbit",
                         burst=htb_burst_bytes(1e9), cburst=htb_burst_bytes(1e9))
        except NetworkError as e:
            return "userspace", f"htb qdisc not usable ({os.strerror(e.errno)})"
        try:
            netlink.call("netem", ns.tc, "add", "netem", index=lo, handle=LEAF_HANDLE,
                         parent=CLASS_HANDLE, delay=1000, limit=1000)
        except NetworkError as e:
            return "userspace", (f"netem qdisc missing from this kernel (errno {e.errno} "
                                 f"{errno_mod.errorcode.get(e.errno, '')} adding it); "
                                 "HTB + bfifo + NFQUEUE delay line instead")
        return "netem", "netem qdisc accepted as an HTB child in a scratch namespace"


# ---------------------------------------------------------------- the link

class Wan:
    """The two-direction WAN link on a router namespace; see the module docstring.

    A subclass may install part of it only (`testbed.net.hostshape.HostWan`): the directions
    whose rate and queue it installs are those in `_index` (the egress interfaces it found), the
    ones whose delay, jitter, loss and cuts it applies as packets arrive (userspace backend) are
    `_arrival`; `_apply` changes what is installed of both.
    """

    # A direction's delay change resizes the default queue (one BDP of the round trip) of the
    # other direction too: HostWan does; the router's Wan resizes the changed direction only.
    other_delay_resizes = False

    def __init__(self, netns_path, ifaces, links, backend="auto", seed=0, registry=None,
                 events=None):
        """`links`: direction -> `Link`, checked where they were made (`check_params`)."""
        if set(ifaces) != set(DIRECTIONS) or set(links) != set(DIRECTIONS):
            raise ConfigError(f"expected ifaces and links for exactly {DIRECTIONS}")
        bad = [d for d in DIRECTIONS if not isinstance(links[d], Link)]
        if bad:
            raise TypeError(f"Wan takes checked links (testbed.net.linkmodel.check_params), got "
                            f"{type(links[bad[0]]).__name__} for {bad[0]}")
        if backend not in ("auto", "netem", "userspace"):
            raise ConfigError(f"expected auto, netem or userspace, got {backend!r}",
                              key="network.wan.backend")
        self.netns_path = netns_path
        self.ifaces = dict(ifaces)
        self.links = dict(links)
        self.requested_backend = backend
        self.backend = None
        self.backend_reason = ""
        self.seed = seed
        self.registry = registry
        self.events = events
        self._ns = None
        self._index = {}
        self._arrival = set(DIRECTIONS)
        self._delaylines = {}
        self._firewall = None
        self._link_events = None      # LinkEvents, made by the first `event`
        self._limits = None           # PathLimits (mtu, police), made at start
        self._lock = threading.RLock()
        self._closed_callback = False

    # -- lifecycle

    def start(self):
        """Install both directions; on any failure, remove what was installed and raise."""
        self._pick_backend()
        for d in DIRECTIONS:   # before anything is built
            self._check_backend_supports(d, self.links[d])
        netlink.register_fifo_plugins()
        self._ns = netlink.open_netns(self.netns_path)
        try:
            for d in DIRECTIONS:
                found = self._ns.link_lookup(ifname=self.ifaces[d])
                if not found:
                    raise NetworkError(f"interface {self.ifaces[d]} ({d} egress) not found in "
                                       f"{self.netns_path}", errno=errno_mod.ENODEV)
                self._index[d] = found[0]
            if self.backend == "userspace":
                self._firewall = Firewall(self.netns_path, self.registry)
            for d in DIRECTIONS:
                self._install(d)
            self._limits = PathLimits(self.netns_path, self._ns, self.ifaces, self._index,
                                      self.registry)
            for d in DIRECTIONS:
                self._limits.sync(d, self.links[d])
        except BaseException:
            self.stop()
            raise
        if self.registry is not None and not self._closed_callback:
            self.registry.on_close(self.stop, "wan shaping")
            self._closed_callback = True
        self._event("wan_start", backend=self.backend, reason=self.backend_reason,
                    **{f"{d}_{k}": v for d in DIRECTIONS for k, v in self.describe(d).items()})
        return self

    def _pick_backend(self):
        if self.requested_backend == "auto":
            self.backend, self.backend_reason = probe_backend()
        else:
            self.backend = self.requested_backend
            self.backend_reason = f"backend {self.requested_backend} requested in the config"

    def stop(self):
        """Remove qdiscs, firewall rules and delay lines. Idempotent; never raises on 'gone'."""
        with self._lock:
            for dl in self._delaylines.values():
                dl.stop()
            self._delaylines.clear()
            if self._link_events is not None:
                self._link_events.remove()
                self._link_events = None
            if self._limits is not None:
                with contextlib.suppress(Exception):
                    self._limits.remove()
                self._limits = None
            if self._firewall is not None:
                self._firewall.remove()
                self._firewall = None
            if self._ns is not None:
                for d, idx in self._index.items():
                    with contextlib.suppress(Exception):
                        self._ns.tc("del", index=idx, handle=HTB_HANDLE, parent=TC_H_ROOT)
                with contextlib.suppress(Exception):
                    self._ns.close()
                self._ns = None
                self._index.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- installing one direction

    def _rtt_s(self):
        return sum(self.links[d].delay_s for d in DIRECTIONS)

    def describe(self, direction):
        """What is installed for `direction`: rate, burst, queue kind/limit, delay, loss, up."""
        lk = self.links[direction]
        kind, limit = queue_limit(lk.queue, lk.rate_bps, self._rtt_s())
        return {"rate_bps": lk.rate_bps, "burst_bytes": htb_burst_bytes(lk.rate_bps),
                "queue": f"{limit}{'B' if kind == 'bfifo' else 'p'}", "delay_s": lk.delay_s,
                "jitter_s": lk.jitter_s, "loss": lk.loss, "loss_burst": lk.loss_burst,
                "up": lk.up}

    def _install(self, d):
        idx, lk = self._index[d], self.links[d]
        with contextlib.suppress(Exception):   # a stale root qdisc from a crashed run
            self._ns.tc("del", index=idx, handle=HTB_HANDLE, parent=TC_H_ROOT)
        netlink.call(f"adding htb root on {self.ifaces[d]}", self._ns.tc, "add", "htb",
                     index=idx, handle=HTB_HANDLE, default=0x10)
        self._set_class(d, "add-class")
        self._set_leaf(d, "add")
        if self.backend == "userspace":
            self._firewall.install(d, self.ifaces[d])
            self._firewall.sync(d, lk.up, self._iptables_loss(lk))
            if needs_delayline(lk):
                self._ensure_delayline(d)

    @staticmethod
    def _iptables_loss(link):
        """Independent loss is iptables' job; burst loss is the delay line's."""
        return 0.0 if burst_loss(link) else link.loss

    def _set_class(self, d, command):
        rate = self.links[d].rate_bps
        burst = htb_burst_bytes(rate)
        netlink.call(f"{command} htb 1:10 rate {units.fmt_rate(rate)} on {self.ifaces[d]}",
                     self._ns.tc, command, "htb", index=self._index[d], handle=CLASS_HANDLE,
                     parent=HTB_HANDLE, rate=f"{int(rate)}bit", ceil=f"{int(rate)}bit",
                     burst=burst, cburst=burst, quantum=htb_quantum_bytes(rate))

    def _set_leaf(self, d, command):
        lk = self.links[d]
        idx, name = self._index[d], self.ifaces[d]
        if self.backend == "netem":
            limit = queue_packets(lk.queue, lk.rate_bps, self._rtt_s())
            loss = 100.0 if not lk.up else lk.loss * 100
            # netem: times in microseconds, loss in percent, limit in packets
            netlink.call(f"{command} netem 10: on {name}", self._ns.tc, command, "netem",
                         index=idx, handle=LEAF_HANDLE, parent=CLASS_HANDLE,
                         delay=int(lk.delay_s * 1e6), jitter=int(lk.jitter_s * 1e6),
                         loss=loss, limit=limit, **self._netem_faults(lk))
        else:
            kind, limit = queue_limit(lk.queue, lk.rate_bps, self._rtt_s())
            if command != "add":   # bfifo <-> pfifo needs a new qdisc, not a change
                command = "replace"
            netlink.call(f"{command} {kind} 10: limit {limit} on {name}", self._ns.tc,
                         command, kind, index=idx, handle=LEAF_HANDLE, parent=CLASS_HANDLE,
                         limit=limit)

    @staticmethod
    def _netem_faults(lk):
        """netem's duplicate, corrupt and reorder (percent), as `tc ... netem` takes them."""
        out = {"duplicate": lk.duplicate * 100} if lk.duplicate else {}
        if lk.corrupt:
            out["prob_corrupt"] = lk.corrupt * 100
        if lk.reorder_prob:
            out.update(prob_reorder=lk.reorder_prob * 100, gap=lk.reorder_gap)
        elif lk.reorder:
            out["gap"] = 0
        return out

    def _check_backend_supports(self, d, link):
        if self.backend == "netem" and burst_loss(link):
            # pyroute2 0.9.7 cannot encode TCA_NETEM_LOSS (netem's gemodel); refuse rather than
            # silently emulating independent loss
            raise ConfigError("burst loss (loss_burst) needs the userspace backend here: "
                              "pyroute2 cannot encode netem's gemodel",
                              key=f"network.wan.{d}.loss_burst")

    def _ensure_delayline(self, d):
        dl = self._delaylines.get(d)
        if dl is not None and dl.alive():
            dl.configure(self.links[d])
            return
        dl = DelayLine(self.netns_path, DIRECTIONS.index(d), self.links[d],
                       seed=self.seed * 2 + DIRECTIONS.index(d), registry=self.registry)
        dl.start()
        self._delaylines[d] = dl
        self._firewall.queue_rule(d, DIRECTIONS.index(d), on=True)

    # -- changing the link while it runs

    def set(self, direction=None, **changes):
        """Change rate=, delay=, jitter=, loss=, up=, queue= of one direction (None = both).

        Values are in emulation units (bit/s, seconds, probability) or unit strings ('50Mbit').
        Returns the time it took in seconds; logs a `wan_set` event.
        """
        unknown = set(changes) - set(SETTABLE)
        if unknown:
            raise ConfigError(f"unknown link setting(s) {sorted(unknown)}; expected {SETTABLE}")
        dirs = DIRECTIONS if direction is None else (direction,)
        if any(d not in DIRECTIONS for d in dirs):
            raise ConfigError(f"expected direction kv, request or None, got {direction!r}")
        t0 = time.monotonic()
        with self._lock:
            if self._ns is None:
                raise NetworkError("Wan.set() before start() or after stop()")
            new = {d: self.links[d].changed(d, **changes) for d in dirs}
            for d in dirs:
                self._check_backend_supports(d, new[d])
            for d in dirs:
                self._apply(d, new[d])
        took = time.monotonic() - t0
        self._event("wan_set", direction=direction or "both", apply_ms=round(took * 1e3, 3),
                    **{k: v for k, v in changes.items()})
        return took

    def event(self, direction=None, mode=None, port=0):
        """A link event (`testbed.net.linkevents`: blackhole, reject, reset; None: off) on one
        direction (None = both), in the router namespace, whichever the backend; logged as a
        `wan_event` event. Returns the time it took in seconds."""
        t0 = time.monotonic()
        with self._lock:
            if self._ns is None:
                raise NetworkError("Wan.event() before start() or after stop()")
            if self._link_events is None:
                self._link_events = LinkEvents(self.netns_path, self.ifaces, self.registry)
            for d in (DIRECTIONS if direction is None else (direction,)):
                self._link_events.set(d, mode, port)
        took = time.monotonic() - t0
        self._event("wan_event", direction=direction or "both", mode=mode or "off",
                    apply_ms=round(took * 1e3, 3))
        return took

    def event_counters(self):
        """direction -> packets the link events dropped, rejected or reset; {} without any."""
        with self._lock:
            return self._link_events.counters() if self._link_events is not None else {}

    def _apply(self, d, link):
        """A change of `d`: its rate and queue (netem: all of it) where it leaves through an
        interface here, its delay, jitter, loss and cuts where it arrives here (userspace)."""
        old, p = self.links[d].params(), link.params()
        self.links[d] = link
        changed = {k for k in SETTABLE if p[k] != old[k]}
        self._link_changed()
        egress = d in self._index
        if egress and "rate" in changed:
            self._set_class(d, "change-class")
        if egress and changed & set(PATH_KEYS) and self._limits is not None:
            self._limits.sync(d, link)
        if self.backend == "netem":
            if egress and changed:
                self._set_leaf(d, "change")
            return
        for e in self._resized_queues(d, changed):
            self._set_leaf(e, "replace")     # the default queue follows the BDP
        if d in self._arrival:
            if changed & {"loss", "loss_burst", "up"}:
                self._firewall.sync(d, link.up, self._iptables_loss(link))
            if changed & {"delay", "jitter", "loss", "loss_burst", *STEADY_FAULTS,
                          "reorder_gap"} and (
                    needs_delayline(link) or d in self._delaylines):
                self._ensure_delayline(d)

    def _link_changed(self):
        """`self.links` holds a change that is not installed yet (HostWan: offloads off)."""

    def _resized_queues(self, d, changed):
        """The egress directions whose queue a change of `d` sets, or whose default queue (one
        BDP) it resizes (userspace backend)."""
        out = []
        for e in self._index:
            own = e == d
            if own and "queue" in changed:
                out.append(e)
            elif self.links[e].queue is None and (
                    (own and changed & {"rate", "delay"})
                    or (not own and self.other_delay_resizes and "delay" in changed)):
                out.append(e)
        return out

    def delaylines(self):
        """The directions with a running delay line (those `subtract_fixed_cost` acts on)."""
        return sorted(self._delaylines)

    def subtract_fixed_cost(self, offsets):
        """Hold each direction's packets for its delay less `offsets[d]` seconds (the path's
        fixed cost, measured by `testbed.net.calibrate`), from now on and in later changes."""
        with self._lock:
            for d, off in offsets.items():
                dl = self._delaylines[d]
                dl.offset_s = max(0.0, off)
                dl.configure(self.links[d])

    # -- counters

    def stats(self):
        """Per direction: tx_bytes, tx_packets, backlog_bytes, backlog_packets, drops (bottleneck
        queue), up, rate_bps, from one dump of the router's qdiscs (one netlink round trip for
        both directions: the kernel dumps every interface's anyway, and pyroute2's filter by
        interface costs more than the few qdiscs it drops; 20 Hz in `CounterSampler`)."""
        out = {}
        with self._lock:
            if self._ns is None:
                raise NetworkError("Wan.stats() before start() or after stop()")
            netlink.keep_thread_loop(self._ns)      # the sampler's thread calls this
            by_index = {}
            for m in self._ns.get_qdiscs():
                by_index.setdefault(m["index"], []).append(m)
            for d in DIRECTIONS:
                # the HTB root's counters include its leaf's (drops, backlog propagate up)
                root = _leaf_stats(by_index.get(self._index[d], ()), HTB_HANDLE) or {}
                out[d] = {"tx_bytes": root.get("bytes", 0), "tx_packets": root.get("packets", 0),
                          "backlog_bytes": root.get("backlog", 0),
                          "backlog_packets": root.get("qlen", 0),
                          "drops": root.get("drop", 0),
                          "up": self.links[d].up, "rate_bps": self.links[d].rate_bps}
        return out

    def police_drops(self):
        """direction -> packets the policers dropped so far (directions with one only)."""
        with self._lock:
            return self._limits.police_drops() if self._limits is not None else {}

    def delayline_counters(self):
        """{'kv': {'held','passed','dropped'}, ...} for directions with a running delay line."""
        return {d: dl.counters() for d, dl in self._delaylines.items()}

    def _event(self, kind, **fields):
        if self.events is not None:
            self.events(kind, **fields)