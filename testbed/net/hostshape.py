"""The WAN link model on a host's own NIC, for traffic to the other datacenter only.

Place in the architecture: the Mininet backend shapes the WAN on a router between the two
datacenters (`testbed.net.wan.Wan`). On real machines (the Ray backend,
`testbed.backend.raycluster`) there is no such router: each host's shaping agent
(`testbed.backend.agents.ShapingAgent`) installs its datacenter's egress direction on its own
interface -- PrfaaS hosts the `kv` direction, local hosts the `request` direction -- and the
rest of the other direction where that direction's packets arrive, with the same model and
code:

    egress, to the other DC (this host's direction):
      HTB root (default: unclassified, sent directly, unshaped)
        u32 dst <other DC> -> class 1:10 at `rate` -> bfifo/pfifo 10: (or netem 10: with the
        direction's delay, jitter, loss where the kernel has netem)
    ingress, from the other DC (the other direction; userspace backend):
      mangle PREROUTING -i IF -s <other DC> -> NFQUEUE -> tb-delayline   delay, jitter, bursts
      filter INPUT -i IF -s <other DC> -> TBWAN-<dir>                    loss, link down

So a direction is its rate and queue on the sending host, then its delay and loss on the
receiving one: the order of a real WAN (bottleneck, then propagation). Not all of it on the
sender, which would differ from a wire in two ways (measured on the namespace hosts of
tests/test_ray_root.py): a packet held in a delay line on the sending host still counts
against its socket's TCP Small Queues budget (about 1 ms of its pacing rate), so a 100 Mbit/s,
10 ms RTT link carried 9.1 Mbit/s; and a packet the sending host's own netfilter drops fails
the send with EPERM (the probe's UDP sender died of it), which TCP takes as "not sent yet" and
resends without a loss, a timeout or its backoff. netem on the egress (where the kernel has it)
has neither problem: it detaches the packets it holds from their socket and reports its drops
as sent.

Only packets to (egress) or from (ingress) the other datacenter's subnet are shaped;
everything else (Ray's own control traffic, ssh, the same datacenter) is untouched.
Counters (`stats`) are the egress class's, so they count WAN bytes only.

Segmentation offload: loss must hit single frames (`linkmodel.needs_per_frame_packets`), so
once either direction has loss -- at start, or from the first `set` that brings it (a link
change or fault) -- TSO and GSO (the sender's bursts) and GRO (the receiver merges frames
before PREROUTING sees them) go off on `iface` (`per_frame_packets`), as the Mininet backend
does; their previous state is recorded first as an undo command (`ethtool -K IF tso on ...`),
so the agent's stop, its guard and `testbed clean --backend ray` put them back.

`HostWan` runs inside the namespace it shapes (the agent's own): netlink goes through
`IPRoute`, not `NetNS`, which would fork a helper from the agent's many-threaded Ray worker
process (measured: it hangs there); `auto` asks a fresh process (`probe_backend`) for the same
reason. `netns_path` names the namespace for the iptables, delay line and undo commands.

`HostWan` is a `Wan` with one egress direction and the other's ingress half; `set` of either
reaches what this host installed of it (the default queue is one bandwidth-delay product of the
round trip). Every kernel object is on record in the agent's `lifecycle.Registry` as an undo
command (qdisc, iptables rules, the delay line's PID), so a crashed agent's host is cleaned
from its state file (`testbed clean`, or the agent's guard process).
"""

import contextlib
import errno as errno_mod
import ipaddress
import json
import subprocess
import sys

from testbed.errors import ConfigError, NetworkError
from testbed.net import netlink
from testbed.net.firewall import Firewall
from testbed.net.linkmodel import (DIRECTIONS, Link, check_params, needs_delayline,
                                   needs_per_frame_packets, other_direction)
from testbed.net.ns import ns_argv, ns_run
from testbed.net.wan import CLASS_HANDLE, HTB_HANDLE, LEAF_HANDLE, TC_H_ROOT, Wan, _leaf_stats

ETH_P_IP = 0x0800
FILTER_PRIO = 1
# ethtool -K short names and the -k lines that show them
OFFLOADS = {"tso": "tcp-segmentation-offload", "gso": "generic-segmentation-offload",
            "gro": "generic-receive-offload"}


def offload_state(netns_path, iface):
    """{tso, gso, gro: 'on' | 'off'} of `iface` (features the driver fixes are left out)."""
    r = ns_run(netns_path, ["ethtool", "-k", iface], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetworkError(f"reading the offloads of {iface}: {r.stderr.strip() or r.returncode}")
    shown = dict(line.strip().partition(": ")[::2] for line in r.stdout.splitlines())
    return {short: shown[long].split()[0] for short, long in OFFLOADS.items()
            if long in shown and "[fixed]" not in shown[long]}


def per_frame_packets(netns_path, iface, registry=None):
    """TSO, GSO and GRO off on `iface`; what was on is recorded in `registry` first, as the
    command that turns it on again. Returns the state before."""
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
    """The userspace backend's iptables state for what arrives from the other datacenter
    (`src`, a subnet): the direction's chain is jumped to from INPUT, its NFQUEUE rule is in
    mangle PREROUTING."""

    def __init__(self, netns_path, registry, src):
        super().__init__(netns_path, registry)
        self.src = src

    def _jump(self, direction, iface):
        return ["INPUT", "-i", iface, "-s", self.src, "-j", self.chain(direction)]

    def _queue(self, direction, iface, queue_num):
        return ["PREROUTING", "-i", iface, "-s", self.src, "-j", "NFQUEUE", "--queue-num",
                str(queue_num)]


class HostWan(Wan):
    """`direction`'s egress half on a host's interface `iface` (packets to `dst`, the other
    datacenter's subnet) and the other direction's ingress half (packets from `dst`). A change
    of either is `Wan._apply`'s, on this host's halves.

    `params` holds both directions (emulated `Link`s, or their `Link.params()` form as they
    cross to a Ray actor).
    """

    other_delay_resizes = True   # the egress queue's BDP is of the round trip, both delays

    def __init__(self, netns_path, iface, direction, dst, params, backend="auto", seed=0,
                 registry=None, events=None):
        if direction not in DIRECTIONS:
            raise NetworkError(f"expected direction kv or request, got {direction!r}")
        links = {d: p if isinstance(p, Link) else check_params(p, d) for d, p in params.items()}
        super().__init__(netns_path, {d: iface for d in DIRECTIONS}, links,
                         backend=backend, seed=seed, registry=registry, events=events)
        self.direction, self.dst, self.iface = direction, str(ipaddress.IPv4Network(dst)), iface
        self.ingress = other_direction(direction)
        self._arrival = {self.ingress}
        self.offload_before = None      # {tso, gso} before they went off (loss), else None

    def start(self):
        """Install the direction on `iface`; on any failure, remove what was installed."""
        from pyroute2 import IPRoute  # reason: pyroute2, only where a host is shaped

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

    def _check_backend_supports(self, d, link):
        super()._check_backend_supports(d, link)
        for key, on in (("mtu", link.mtu), ("police", link.police)):
            if on:
                raise ConfigError(f"{key} is the WAN router's (testbed.net.pathlimit); the Ray "
                                  "backend shapes on the hosts and has no router: run it on "
                                  "the mininet backend", key=f"network.wan.{d}.{key}")

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
        """`d` (this host's direction) on the egress; the ingress half of the other one."""
        self._per_frame_if_lossy()
        idx = self._index[d]
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
            d_in, lk_in = self.ingress, self.links[self.ingress]
            self._firewall = HostFirewall(self.netns_path, self.registry, self.dst)
            self._firewall.install(d_in, self.iface)
            self._firewall.sync(d_in, lk_in.up, self._iptables_loss(lk_in))
            if needs_delayline(lk_in):
                self._ensure_delayline(d_in)

    def _undo_tc(self):
        return ["nsenter", f"--net={self.netns_path}", "tc", "qdisc", "del", "dev", self.iface,
                "root"]

    def _link_changed(self):
        """A change (`Wan._apply`: this host's egress direction, or the ingress half of the
        other) turns the offloads off before a loss it brings applies."""
        self._per_frame_if_lossy()

    def _per_frame_if_lossy(self):
        if self.offload_before is None and needs_per_frame_packets(self.links):
            self.offload_before = per_frame_packets(self.netns_path, self.iface, self.registry)
            self._event("segmentation_offload", iface=self.iface, state="off",
                        before=json.dumps(self.offload_before))

    def describe(self, direction):
        out = super().describe(direction)
        out["segmentation_offload"] = "on" if self.offload_before is None else "off"
        out["where"] = "egress" if direction == self.direction else "ingress"
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
