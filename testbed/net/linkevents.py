"""Link events in the WAN router: blackhole, reject and TCP reset (the `faults:` kinds of the
same names, `testbed.faultspec`), by iptables in the router namespace, on both shaping backends.

Place in the architecture: `testbed.net.wan.Wan.event` makes one `LinkEvents` on first use;
the run's `testbed.net.schedule.LinkSchedule` turns an event on at the fault's injection and off
at its end. Per direction a chain `TBEVT-<dir>`, jumped to first in FORWARD -o <iface> (before
the link model's own `TBWAN-<dir>` chain, so an event acts on what the link would carry):

- `blackhole`: every packet dropped, silently (the sender learns nothing until its timers fire);
- `reject`: TCP answered with a RST in the receiver's name (connect: ECONNREFUSED, established:
  ECONNRESET), anything else with ICMP host unreachable: the sender sees a fast error;
- `reset`: TCP segments of established connections (not SYN) to or from `port` (the KV port:
  `dport` on the kv direction, where the KV data goes, `sport` on the request direction, where
  its ACKs come back) answered with a RST, as toxiproxy's reset_peer, for a short window. The
  sender's next segment meets the RST (ECONNRESET at once); the receiver, whose ACKs stop with
  the data, learns it from its next packet after the window (the KV receiver's keepalive, 1 s
  idle, workers/kvwire.py), which the sender's kernel answers with a RST.

Counters (`counters`) are the chain's own: packets dropped, rejected or reset so far. Every
chain is on record with the run's `Registry` as it is made, so a killed run is cleaned exactly.
"""

from __future__ import annotations

from testbed.errors import NetworkError
from testbed.net.firewall import ns_iptables
from testbed.net.ns import ns_argv

MODES = ("blackhole", "reject", "reset")


def rules(chain, direction, mode, port):
    """The iptables-restore lines of one direction's chain for `mode` (None: pass all)."""
    out = [f":{chain} - [0:0]"]      # declaring a user chain under -n flushes it, atomically
    if mode == "blackhole":
        out.append(f"-A {chain} -j DROP")
    elif mode == "reject":
        out.append(f"-A {chain} -p tcp -j REJECT --reject-with tcp-reset")
        out.append(f"-A {chain} -j REJECT --reject-with icmp-host-unreachable")
    elif mode == "reset":
        side = "--dport" if direction == "kv" else "--sport"
        out.append(f"-A {chain} -p tcp ! --syn {side} {int(port)} "
                   "-j REJECT --reject-with tcp-reset")
    elif mode is not None:
        raise NetworkError(f"unknown link event {mode!r}; expected one of {', '.join(MODES)}")
    return out


class LinkEvents:
    """The event chains of the router namespace `netns_path`, one per direction in `ifaces`."""

    def __init__(self, netns_path, ifaces, registry=None):
        self.netns_path, self.ifaces, self.registry = netns_path, dict(ifaces), registry
        self.installed = set()
        self.mode = {}
        self.total = {}     # direction -> packets matched by the rules replaced so far

    @staticmethod
    def chain(direction):
        return f"TBEVT-{direction}"

    def _run(self, argv, stdin=None, check=True):
        return ns_iptables(self.netns_path, argv, stdin, check)

    def _jump(self, direction):
        return ["FORWARD", "-o", self.ifaces[direction], "-j", self.chain(direction)]

    def _install(self, direction):
        c = self.chain(direction)
        self._run(["iptables-restore", "-n"], stdin=f"*filter\n:{c} - [0:0]\nCOMMIT\n")
        jump = self._jump(direction)
        if self._run(["iptables", "-C", *jump], check=False).returncode != 0:
            self._run(["iptables", "-I", jump[0], "1", *jump[1:]])
        self.installed.add(direction)
        if self.registry is not None:
            for argv in (("iptables", "-X", c), ("iptables", "-F", c),
                         ("iptables", "-D", *jump)):
                self.registry.add_undo_command(ns_argv(self.netns_path, argv))

    def set(self, direction, mode, port=0):
        """Turn `mode` (blackhole | reject | reset | None: off) on for `direction`."""
        if direction not in self.installed:
            if mode is None:
                return
            self._install(direction)
        self.total[direction] = self.counters().get(direction, 0)   # rewriting zeroes them
        lines = rules(self.chain(direction), direction, mode, port)
        self._run(["iptables-restore", "-n"], stdin="*filter\n" + "\n".join(lines) +
                  "\nCOMMIT\n")
        self.mode[direction] = mode

    def counters(self):
        """direction -> packets the chain's rules matched so far (dropped, rejected, reset)."""
        out = {}
        for d in sorted(self.installed):
            r = self._run(["iptables", "-nvxL", self.chain(d)], check=False)
            if r.returncode == 0:
                out[d] = self.total.get(d, 0) + sum(
                    int(line.split()[0]) for line in r.stdout.splitlines()[2:] if line.strip())
        return out

    def remove(self):
        for d in sorted(self.installed):
            self._run(["iptables", "-D", *self._jump(d)], check=False)
            self._run(["iptables", "-F", self.chain(d)], check=False)
            self._run(["iptables", "-X", self.chain(d)], check=False)
        self.installed.clear()
