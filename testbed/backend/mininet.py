"""The Mininet backend: a deployment on one machine, a Mininet host per instance.

`start()` builds the two-datacenter network (`testbed.net.build.Network`: Linux bridges, a WAN
router whose two egress interfaces carry the deployment's emulated link model), `spawn()` runs a
process inside an instance's host (its network namespace), the shaper is the router's
`testbed.net.wan.Wan`, and `probe()` measures the WAN between the two probe hosts. The
network registers its own teardown with the run's registry as it is built.
"""

import os
import platform

from testbed import clocks
from testbed.net.build import Network
from testbed.net.calibrate import PROBE_TRIES, quiet_probe
from testbed.net.forward import Forward
from testbed.net.probe import measure_link
from testbed.net.tcp import CC_ENV


def _mininet_version():
    """Mininet's own VERSION (the Debian package has no Python package metadata)."""
    try:
        import mininet.net  # reason: mininet, only on the machine that runs this backend
        return mininet.net.VERSION
    except ImportError:
        return None


class MininetBackend:
    name = "mininet"

    def __init__(self, deployment, registry, events=None):
        self.deployment, self.registry, self.events = deployment, registry, events
        self.net = None

    def start(self):
        self.net = Network(self.deployment, self.registry, self.events).start()
        return self

    def rescale(self, deployment, events=None):
        """The built network carried over to `deployment` (the same instances, another
        scale.time: `Network.rescale`), its events now in `events`; returns the backend."""
        self.deployment = deployment
        self.events = events or self.events
        self.net.rescale(deployment, events)
        return self

    def correct_round_trip(self, off_ms):
        """The link calibration corrected by a probe's RTT error (`Network.correct_round_trip`);
        None where there is none to correct."""
        return self.net.correct_round_trip(off_ms)

    def spawn(self, host, argv, log_path, env=None):
        return self.net.popen(host, argv, log_path, env=env)

    @property
    def shaper(self):
        return self.net.wan

    def describe(self):
        topo, wan = self.net.topo, self.net.wan
        return {
            "backend": self.name, "versions": {"mininet": _mininet_version()},
            "topology": {"class": "topologies.two_dc.TwoDatacenterTopo",
                         "nodes": dict(topo.roles), "ips": dict(topo.ips),
                         "router_egress": dict(topo.router_intfs)},
            "segmentation_offload": not self.net.per_frame,
            "tcp_timers": self.net.tcp_timers,
            "link_calibration": self.net.calibration,
            "shaping": {"backend": wan.backend, "reason": getattr(wan, "backend_reason", ""),
                        "emulated": {d: link.params()
                                     for d, link in self.deployment.links.items()}}}

    def probe(self, congestion_control):
        """The KV direction measured as built, between the two probe hosts (link_fidelity)."""
        paths = self.net.netns_path
        os.environ[CC_ENV] = congestion_control      # the probe's TCP sender
        # per frame (offload off, for loss), bulk TCP keeps a delay line ms late on any
        # machine (docs/link_fidelity.md): its lateness then says nothing of a slow spell
        return quiet_probe(self.net.wan, lambda: measure_link(
            paths["probe_remote"], paths["probe_local"], self.net.ip("probe_local"),
            configured=self.deployment.links["kv"].params(),
            calibrated=self.net.calibration is not None),
            tries=0 if self.net.per_frame else PROBE_TRIES)

    def tcp_counters(self):
        """Each host's kernel TCP counters now (`testbed.fidelity.host_tcp_counters`)."""
        from testbed.fidelity import host_tcp_counters  # reason: fidelity loads numpy, pandas
        return host_tcp_counters(self.net.netns_path)

    def forward(self, host, port, listen_port=0):
        """127.0.0.1:`listen_port` in the root namespace relayed to `host`'s address:`port`
        inside its namespace (testbed/net/forward.py); stopped with the run's registry."""
        fwd = Forward(self.net.netns_path[host], (self.net.ip(host), port),
                      port=listen_port).start()
        self.registry.on_close(fwd.stop, "forward")
        return fwd

    def cli(self):
        self.net.cli()

    def clocks(self):
        """One machine, one clock: every offset 0 by construction."""
        return clocks.one_clock(platform.node(), [i.name for i in self.deployment.instances])

    def stop(self):
        if self.net is not None:
            self.net.stop()
