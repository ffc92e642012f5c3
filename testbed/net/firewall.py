"""The firewall of the WAN's userspace backend: iptables state in the router namespace.

Place in the architecture: `testbed.net.wan.Wan` with the userspace backend drops packets for
independent loss and for a link that is down here (a `statistic` rule per direction), and sends
each direction through the delay line (`testbed.net.delayline`) by an NFQUEUE rule. Every rule
is put on record with the run's `Registry` as it is added, so a killed run is cleaned exactly.
"""

from __future__ import annotations

from testbed.errors import NetworkError
from testbed.net.linkmodel import DIRECTIONS
from testbed.net.ns import ns_argv, ns_run

DUP_MARK = "0x7b1"      # the delay line's duplicates (delayline.c DUP_MARK): not queued again


def ns_iptables(netns_path, argv, stdin=None, check=True):
    """Run an iptables command (`argv`, `stdin` for iptables-restore) in the namespace; a
    NetworkError naming it when it fails and `check`."""
    r = ns_run(netns_path, argv, input=stdin, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetworkError(f"{' '.join(argv[:2])} in {netns_path}: "
                           f"{r.stderr.strip() or r.returncode}")
    return r


class Firewall:
    """iptables state of the userspace backend in the router namespace: per direction a chain
    `TBWAN-<dir>` (link down, random loss) jumped to from FORWARD -o <iface>, and an NFQUEUE rule
    in mangle POSTROUTING when the delay line is on. Each change is one iptables-restore call."""

    def __init__(self, netns_path, registry=None):
        self.netns_path = netns_path
        self.registry = registry
        self.installed = {}   # direction -> iface

    def _run(self, argv, stdin=None, check=True):
        return ns_iptables(self.netns_path, argv, stdin, check)

    def _undo_argv(self, *argv):
        return ns_argv(self.netns_path, argv)

    @staticmethod
    def chain(direction):
        return f"TBWAN-{direction}"

    def _jump(self, direction, iface):
        """The filter rule sending the direction's packets through its chain (forwarded ones,
        on a router; `testbed.net.hostshape.HostFirewall` matches what a host receives)."""
        return ["FORWARD", "-o", iface, "-j", self.chain(direction)]

    def _queue(self, direction, iface, queue_num):
        """The mangle rule sending the direction's packets to the delay line."""
        return ["POSTROUTING", "-o", iface, "-m", "mark", "!", "--mark", DUP_MARK, "-j",
                "NFQUEUE", "--queue-num", str(queue_num)]

    def install(self, direction, iface):
        c = self.chain(direction)
        self._run(["iptables-restore", "-n"], stdin=f"*filter\n:{c} - [0:0]\nCOMMIT\n")
        jump = self._jump(direction, iface)
        if self._run(["iptables", "-C", *jump], check=False).returncode != 0:
            self._run(["iptables", "-A", *jump])   # not twice after a crashed run
        self.installed[direction] = iface
        if self.registry is not None:
            self.registry.add_undo_command(self._undo_argv("iptables", "-X", c))
            self.registry.add_undo_command(self._undo_argv("iptables", "-F", c))
            self.registry.add_undo_command(self._undo_argv("iptables", "-D", *jump))

    def sync(self, direction, up, loss):
        """Rewrite the direction's chain: DROP all when down, else drop with probability `loss`
        (0 when the delay line drops instead, for burst loss)."""
        c = self.chain(direction)
        rules = [f":{c} - [0:0]"]      # declaring a user chain under -n flushes it, atomically
        if not up:
            rules.append(f"-A {c} -j DROP")
        elif loss > 0:
            rules.append(f"-A {c} -m statistic --mode random --probability {loss:.9f} -j DROP")
        self._run(["iptables-restore", "-n"], stdin="*filter\n" + "\n".join(rules) + "\nCOMMIT\n")

    def queue_rule(self, direction, queue_num, on):
        rule = self._queue(direction, self.installed[direction], queue_num)
        exists = self._run(["iptables", "-t", "mangle", "-C", *rule], check=False).returncode == 0
        if on and not exists:
            self._run(["iptables", "-t", "mangle", "-A", *rule])
            if self.registry is not None:
                self.registry.add_undo_command(self._undo_argv("iptables", "-t", "mangle", "-D",
                                                               *rule))
        elif not on and exists:
            self._run(["iptables", "-t", "mangle", "-D", *rule])

    def counters(self, direction):
        """Packets dropped by the direction's chain so far (loss + down), or None."""
        r = self._run(["iptables", "-nvxL", self.chain(direction)], check=False)
        if r.returncode != 0:
            return None
        return sum(int(line.split()[0]) for line in r.stdout.splitlines()[2:] if line.strip())

    def remove(self):
        for direction, iface in list(self.installed.items()):
            c = self.chain(direction)
            self._run(["iptables", "-t", "mangle", "-D",
                       *self._queue(direction, iface, DIRECTIONS.index(direction))], check=False)
            self._run(["iptables", "-D", *self._jump(direction, iface)], check=False)
            self._run(["iptables", "-F", c], check=False)
            self._run(["iptables", "-X", c], check=False)
            del self.installed[direction]
