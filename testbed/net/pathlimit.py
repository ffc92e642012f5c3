"""Path limits of the WAN router: a path MTU per direction, with or without ICMP
"fragmentation needed" (the PMTU blackhole), and a token-bucket policer; on both shaping
backends.

Place in the architecture: `testbed.net.wan.Wan` makes one `PathLimits` at start and syncs a
direction whenever its `mtu`, `mtu_icmp`, `police` or `police_burst` change (the YAML, scheduled
changes, link faults). They belong to the router, not to the shaper, so they are the same under
netem and under the userspace delay line:

- `mtu`: the MTU metric (RTAX_MTU, over pyroute2) of the router's routes out of the direction's
  egress interface. A forwarded packet above it with DF set is dropped and answered with ICMP
  "fragmentation needed" (type 3 code 4); the sender's path-MTU discovery lowers its MSS. Not
  the interface's own MTU: a veth with a smaller MTU also refuses larger packets arriving from
  the other direction, which a one-way path MTU must not do.
- `mtu_icmp: false`: those ICMP messages are dropped as they leave the router (iptables OUTPUT,
  out of the other direction's egress), so the sender learns nothing and its segments above the
  MTU vanish: the PMTU blackhole.
- `police`: nftables' `limit rate over R bytes/second burst B bytes drop` in a forward hook,
  matched on the egress interface: a token bucket that drops above its rate and queues nothing,
  ahead of the shaper. This kernel has no act_police (`tc ... action police` fails with "Failed
  to load TC action module"); nftables' limit is the same token bucket and exists wherever
  nftables does. It counts IP bytes (no Ethernet header): TCP payload is at most 1448/1500 of
  its rate.

Every iptables rule and the nftables table are put on record with the run's `Registry` as they
are made; the routes go with the router's namespace.
"""

from __future__ import annotations

import json
import socket

from testbed.errors import NetworkError
from testbed.net import netlink
from testbed.net.firewall import ns_iptables
from testbed.net.linkmodel import DIRECTIONS, other_direction
from testbed.net.ns import ns_argv, ns_run

NFT_TABLE = "testbed_police"      # family ip, in the router namespace
MAIN_TABLE = 254
# the route attributes a replace must carry over (pyroute2 keyword <- attribute)
_ROUTE_ATTRS = {"dst": "RTA_DST", "prefsrc": "RTA_PREFSRC", "gateway": "RTA_GATEWAY",
                "priority": "RTA_PRIORITY"}


def police_rules(policers, ifaces):
    """The nftables script of the policer table: one rule per direction in `policers`
    (direction -> (rate bit/s, burst bytes)); an empty chain when there is none."""
    lines = [f"table ip {NFT_TABLE} {{",
             "  chain forward {",
             "    type filter hook forward priority -10; policy accept;"]
    for d, (rate, burst) in sorted(policers.items()):
        lines.append(f'    oifname "{ifaces[d]}" limit rate over {int(rate // 8)} bytes/second '
                     f'burst {int(burst)} bytes counter drop comment "{d}"')
    return "\n".join([*lines, "  }", "}", ""])


def _drops(listing):
    """direction -> packets dropped, from `nft -j list table` output."""
    out = {}
    for item in json.loads(listing).get("nftables", []):
        rule = item.get("rule")
        if rule and rule.get("comment") in DIRECTIONS:
            for e in rule.get("expr", []):
                if "counter" in e:
                    out[rule["comment"]] = int(e["counter"]["packets"])
    return out


class PathLimits:
    """The path limits of the router namespace `netns_path` (`ns`: its pyroute2 handle, owned
    by the caller), one per direction of `ifaces` (direction -> egress interface name) whose
    interface index is in `index`."""

    def __init__(self, netns_path, ns, ifaces, index, registry=None):
        self.netns_path, self.ns, self.registry = netns_path, ns, registry
        self.ifaces, self.index = dict(ifaces), dict(index)
        self.mtu = dict.fromkeys(self.index, 0)
        self.icmp_dropped = set()       # directions whose frag-needed messages are dropped
        self.policers = {}              # direction -> (rate bit/s, burst bytes)
        self._table = False
        self._dropped_before = dict.fromkeys(self.index, 0)   # counts of replaced tables

    def sync(self, d, link):
        """Make direction `d`'s limits those of `link` (a checked `Link`)."""
        if link.mtu != self.mtu[d]:
            self._route_mtu(d, link.mtu)
        self._icmp(d, drop=bool(link.mtu) and not link.mtu_icmp)
        want = (link.police, link.police_burst) if link.police else None
        if want != self.policers.get(d):
            if want:
                self.policers[d] = want
            else:
                self.policers.pop(d, None)
            self._write_policers()

    def _route_mtu(self, d, mtu):
        """Replace every IPv4 route of the main table out of `d`'s egress with the same route
        and an MTU metric `mtu` (0: none)."""
        idx = self.index[d]
        routes = netlink.call(f"listing routes out of {self.ifaces[d]}", self.ns.get_routes,
                              oif=idx, table=MAIN_TABLE, family=socket.AF_INET)
        for r in routes:
            kw = {k: r.get_attr(a) for k, a in _ROUTE_ATTRS.items() if r.get_attr(a) is not None}
            kw.update(dst_len=r["dst_len"], oif=idx, table=MAIN_TABLE, proto=r["proto"],
                      scope=r["scope"], type=r["type"])
            if mtu:
                kw["metrics"] = {"mtu": int(mtu)}
            netlink.call(f"route {kw.get('dst', 'default')}/{r['dst_len']} via "
                         f"{self.ifaces[d]} mtu {mtu or 'none'}", self.ns.route, "replace", **kw)
        self.mtu[d] = mtu

    def _icmp_rule(self, d):
        return ["OUTPUT", "-o", self.ifaces[other_direction(d)], "-p", "icmp", "--icmp-type",
                "fragmentation-needed", "-j", "DROP"]

    def _icmp(self, d, drop):
        if drop == (d in self.icmp_dropped):
            return
        rule = self._icmp_rule(d)
        if drop:
            ns_iptables(self.netns_path, ["iptables", "-A", *rule])
            self.icmp_dropped.add(d)
            if self.registry is not None:
                self.registry.add_undo_command(ns_argv(self.netns_path,
                                                       ["iptables", "-D", *rule]))
        else:
            ns_iptables(self.netns_path, ["iptables", "-D", *rule], check=False)
            self.icmp_dropped.discard(d)

    def _nft(self, argv, stdin=None, check=True):
        r = ns_run(self.netns_path, ["nft", *argv], input=stdin, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise NetworkError(f"nft {' '.join(argv)} in {self.netns_path}: "
                               f"{r.stderr.strip() or r.returncode}")
        return r

    def _write_policers(self):
        """Rewrite the policer table in one nftables transaction (its counters so far kept)."""
        script = police_rules(self.policers, self.ifaces)
        if self._table:
            for d, n in self.counters().items():
                self._dropped_before[d] += n
            script = f"delete table ip {NFT_TABLE}\n" + script
        self._nft(["-f", "-"], stdin=script)
        if not self._table and self.registry is not None:
            self.registry.add_undo_command(ns_argv(self.netns_path,
                                                   ["nft", "delete", "table", "ip", NFT_TABLE]))
        self._table = True

    def counters(self):
        """direction -> packets the policer dropped in the table now installed."""
        if not self._table:
            return {}
        r = self._nft(["-j", "list", "table", "ip", NFT_TABLE], check=False)
        return _drops(r.stdout) if r.returncode == 0 else {}

    def police_drops(self):
        """direction -> packets the policers dropped since start."""
        now = self.counters()
        return {d: self._dropped_before[d] + now.get(d, 0) for d in self.index
                if self._dropped_before[d] or d in now}

    def remove(self):
        """Remove the rules and the table (the routes go with the namespace)."""
        for d in list(self.icmp_dropped):
            self._icmp(d, drop=False)
        if self._table:
            self._nft(["delete", "table", "ip", NFT_TABLE], check=False)
            self._table = False
