"""The WAN link model on a host's own NIC, for traffic to the other datacenter only.

Place in the architecture: the Mininet backend shapes the WAN on a router between the two
datacenters (`testbed.net.wan.Wan`). On real machines (the Ray backend,
`testbed.backend.raycluster`) there is no such router: each host's shaping agent
(`testbed.backend.agents.ShapingAgent`) installs its datacenter's egress direction on its own
interface -- PrfaaS hosts the `kv` direction, local hosts the `request` direction -- with the
same model and the same code:

    POSTROUTING -d <other DC> -> NFQUEUE -> tb-delayline   delay, jitter, loss, link down
    HTB root (default: unclassified, sent directly, unshaped)
      u32 dst <other DC> -> class 1:10 at `rate` -> bfifo/pfifo 10: (or netem 10:)

Only packets to the other datacenter's subnet enter the shaped class and the firewall chains;
everything else (Ray's own control traffic, ssh, the same datacenter) leaves unshaped.

Loss and a cut link are drops on the wire, so they are the delay line's (userspace backend;
netem's own loss where netem shapes), never a netfilter DROP on this host: a packet that the
sending host's own OUTPUT or POSTROUTING chain drops fails the send with EPERM (measured: the
probe's UDP sender died of it), and TCP takes it as "not sent yet" and sends it again soon,
without a loss, a retransmission timeout or its backoff. A verdict of the delay line comes
after the send returned, as a wire loss does. Independent loss is its chain with P_GB = loss,
P_BG = 1 - loss (each packet bad with probability `loss`, whatever the one before); down is
every packet dropped. The firewall chain TBWAN-<dir> (OUTPUT) stays empty.
Counters (`stats`) are the shaped class's, so they count WAN bytes only.

Segmentation offload: loss must hit single frames (`linkmodel.needs_per_frame_packets`), so
once the installed direction has loss -- at start, or from the first `set` that brings it (a
link change or fault) -- TSO and GSO go off on `iface` (`per_frame_packets`), as the Mininet
backend does on its hosts; their previous state is recorded first as an undo command
(`ethtool -K IF tso on gso on`), so the agent's stop, its guard and `testbed clean --backend
ray` put them back. GRO stays: it merges what this host receives, after the link's loss.

`HostWan` runs inside the namespace it shapes (the agent's own): netlink goes through
`IPRoute`, not `NetNS`, which would fork a helper from the agent's many-threaded Ray worker
process (measured: it hangs there); `auto` asks a fresh process (`probe_backend`) for the same
reason. `netns_path` names the namespace for the iptables, delay line and undo commands.

`HostWan` is a `Wan` with one installed direction: the other direction's parameters are kept
(the default queue is one bandwidth-delay product of the round trip), and `set` of it only
updates them. Every kernel object is on record in the agent's `lifecycle.Registry` as an undo
command (qdisc, iptables rules, the delay line's PID), so a crashed agent's host is cleaned
from its state file (`testbed clean`, or the agent's guard process).
"""

import contextlib
import errno as errno_mod
import ipaddress
import json
import subprocess
import sys

from testbed.errors import NetworkError
from testbed.net import netlink
from testbed.net.delayline import DelayLine
from testbed.net.firewall import Firewall
from testbed.net.linkmodel import (DIRECTIONS, Link, burst_loss, check_params, gilbert,
                                   needs_delayline, needs_per_frame_packets)
from testbed.net.ns import ns_argv, ns_run
from testbed.net.wan import CLASS_HANDLE, HTB_HANDLE, LEAF_HANDLE, TC_H_ROOT, Wan, _leaf_stats

ETH_P_IP = 0x0800
FILTER_PRIO = 1
# ethtool -K short names and the -k lines that show them
OFFLOADS = {"tso": "tcp-segmentation-offload", "gso": "generic-segmentation-offload"}


def offload_state(netns_path, iface):
    """{tso, gso: 'on' | 'off'} of `iface` (features the driver fixes are left out)."""
    r = ns_run(netns_path, ["ethtool", "-k", iface], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetworkError(f"reading the offloads of {iface}: {r.stderr.strip() or r.returncode}")
    shown = dict(line.strip().partition(": ")[::2] for line in r.stdout.splitlines())
    return {short: shown[long].split()[0] for short, long in OFFLOADS.items()
            if long in shown and "[fixed]" not in shown[long]}


def per_frame_packets(netns_path, iface, registry=None):
    """TSO and GSO off on `iface`; what was on is recorded in `registry` first, as the command
    that turns it on again. Returns the state before."""
    before = offload_state(netns_path, iface)
    on = [k for k, v in before.items() if v == "on"]
    if not on:
        return before
    if registry is not None:
        registry.add_undo_command(ns_argv(netns_path, ["ethtool", "-K", iface,
                                                       *(w for k in on for w in (k, "on"))]))
    r = ns_run(netns_path, ["ethtool", "-K", iface, *(w for k in on for w in (k, "off"))],
               capture_output=True, text=True)
    if r.returncode != 0:
        raise NetworkError(f"turning segmentation offload off on {iface}: "
                           f"{r.stderr.strip() or r.returncode}")
    return before


def u32_dst_key(subnet):
    """pyroute2's u32 key 'value/mask+offset' matching an IPv4 destination in `subnet`
    (the destination address is at offset 16 of the IP header)."""
    net = ipaddress.IPv4Network(subnet)
    return f"0x{int(net.network_address):08x}/0x{int(net.netmask):08x}+16"


class HostFirewall(Firewall):
    """The userspace backend's iptables state for locally sent packets: the direction's chain
    is jumped to from OUTPUT and the NFQUEUE rule matches, both only for `dst` (a subnet)."""

    def __init__(self, netns_path, registry, dst):
        super().__init__(netns_path, registry)
        self.dst = dst

    def _jump(self, direction, iface):
        return ["OUTPUT", "-o", iface, "-d", self.dst, "-j", self.chain(direction)]

    def _queue(self, direction, iface, queue_num):
        return ["POSTROUTING", "-o", iface, "-d", self.dst, "-j", "NFQUEUE", "--queue-num",
                str(queue_num)]

    def sync(self, direction, up, loss):
        """Nothing dropped here: loss and down are the delay line's (`HostDelayLine`)."""
        super().sync(direction, True, 0.0)


class HostDelayLine(DelayLine):
    """The delay line of a host's egress: it also drops independent loss and, while the link
    is down, everything (the module docstring says why not iptables)."""

    @staticmethod
    def _args(link):
        if not link.up or link.loss >= 1.0:
            chain = (1.0, 1.0, 1.0, 1.0)
        elif burst_loss(link):
            chain = (*gilbert(link.loss, link.loss_burst), 0.0, 1.0)
        elif link.loss > 0:
            chain = (link.loss, 1.0 - link.loss, 0.0, 1.0)
        else:
            chain = (0.0, 1.0, 0.0, 1.0)
        return DelayLine._args(link)[:4] + [f"{x:.9g}" for x in chain]


def needs_host_delayline(link):
    """The userspace backend on a host runs the delay line for delay, jitter, loss or down."""
    return needs_delayline(link) or link.loss > 0 or not link.up


class HostWan(Wan):
    """One WAN direction on a host's egress interface `iface`, for packets to `dst` only.

    `params` holds both directions (emulated `Link`s, or their `Link.params()` form as they
    cross to a Ray actor); only `direction` is installed.
    """

    DELAYLINE = HostDelayLine

    def __init__(self, netns_path, iface, direction, dst, params, backend="auto", seed=0,
                 registry=None, events=None):
        if direction not in DIRECTIONS:
            raise NetworkError(f"expected direction kv or request, got {direction!r}")
        links = {d: p if isinstance(p, Link) else check_params(p, d) for d, p in params.items()}
        super().__init__(netns_path, {d: iface for d in DIRECTIONS}, links,
                         backend=backend, seed=seed, registry=registry, events=events)
        self.direction, self.dst, self.iface = direction, str(ipaddress.IPv4Network(dst)), iface
        self.offload_before = None      # {tso, gso} before they went off (loss), else None

    def start(self):
        """Install the direction on `iface`; on any failure, remove what was installed."""
        from pyroute2 import IPRoute

        self._pick_backend()
        for d in DIRECTIONS:
            self._check_backend_supports(d, self.links[d])
        netlink.register_fifo_plugins()
        self._ns = IPRoute()
        try:
            found = self._ns.link_lookup(ifname=self.iface)
            if not found:
                raise NetworkError(f"interface {self.iface} not found in {self.netns_path}",
                                   errno=errno_mod.ENODEV)
            self._index = {self.direction: found[0]}
            self._install(self.direction)
        except BaseException:
            self.stop()
            raise
        if self.registry is not None:
            self.registry.on_close(self.stop, f"wan shaping on {self.iface}")
        return self

    def _pick_backend(self):
        if self.requested_backend != "auto":
            return super()._pick_backend()
        code = ("import json; from testbed.net.wan import probe_backend; "
                "print(json.dumps(probe_backend()))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            raise NetworkError(f"probing the shaping backend: {r.stderr.strip()[-300:]}")
        self.backend, self.backend_reason = json.loads(r.stdout.strip().splitlines()[-1])

    def _install(self, d):
        self._per_frame_if_lossy(self.links[d])
        if self.backend == "userspace" and not isinstance(self._firewall, HostFirewall):
            self._firewall = HostFirewall(self.netns_path, self.registry, self.dst)
        idx, lk = self._index[d], self.links[d]
        with contextlib.suppress(Exception):   # a stale root qdisc from a crashed run
            self._ns.tc("del", index=idx, handle=HTB_HANDLE, parent=TC_H_ROOT)
        # default 0: unclassified packets bypass the classes (HTB's direct queue), unshaped
        netlink.call(f"adding htb root on {self.iface}", self._ns.tc, "add", "htb",
                              index=idx, handle=HTB_HANDLE, default=0)
        if self.registry is not None:
            self.registry.add_undo_command(self._undo_tc())
        self._set_class(d, "add-class")
        self._set_leaf(d, "add")
        netlink.call(
            f"adding u32 filter dst {self.dst} -> 1:10 on {self.iface}", self._ns.tc,
            "add-filter", "u32", index=idx, parent=HTB_HANDLE, prio=FILTER_PRIO,
            protocol=ETH_P_IP, target=CLASS_HANDLE,
            keys=[u32_dst_key(self.dst)])
        if self.backend == "userspace":
            self._firewall.install(d, self.iface)
            self._firewall.sync(d, lk.up, 0.0)
            if needs_host_delayline(lk):
                self._ensure_delayline(d)

    def _undo_tc(self):
        return ["nsenter", f"--net={self.netns_path}", "tc", "qdisc", "del", "dev", self.iface,
                "root"]

    def _apply(self, d, link):
        if d != self.direction:        # the peer's direction: kept for the round trip only
            self.links[d] = link
            return
        self._per_frame_if_lossy(link)   # before the loss applies
        super()._apply(d, link)
        if self.backend == "userspace" and (needs_host_delayline(link) or d in self._delaylines):
            self._ensure_delayline(d)      # loss and up are the delay line's here

    def _per_frame_if_lossy(self, link):
        if self.offload_before is None and needs_per_frame_packets({self.direction: link}):
            self.offload_before = per_frame_packets(self.netns_path, self.iface, self.registry)
            self._event("segmentation_offload", iface=self.iface, state="off",
                        before=json.dumps(self.offload_before))

    def describe(self, direction):
        out = super().describe(direction)
        if direction == self.direction:
            out["segmentation_offload"] = "on" if self.offload_before is None else "off"
        return out

    def stats(self):
        """{direction: tx_bytes, tx_packets of the shaped class (WAN bytes only); backlog_bytes,
        backlog_packets, drops of its leaf; up; rate_bps}."""
        d = self.direction
        with self._lock:
            if self._ns is None:
                raise NetworkError("HostWan.stats() before start() or after stop()")
            idx = self._index[d]
            # get_classes: pyroute2 0.9.7's sync tc("dump-class") hands back its async generator
            cls = next((m.get_attr("TCA_STATS") for m in self._ns.get_classes(index=idx)
                        if m["handle"] == CLASS_HANDLE), None) or {}
            leaf = _leaf_stats(list(self._ns.tc("dump", index=idx)),
                                       LEAF_HANDLE) or {}
        return {d: {"tx_bytes": cls.get("bytes", 0), "tx_packets": cls.get("packets", 0),
                    "backlog_bytes": leaf.get("backlog", 0),
                    "backlog_packets": leaf.get("qlen", 0), "drops": leaf.get("drop", 0),
                    "up": self.links[d].up, "rate_bps": self.links[d].rate_bps}}
