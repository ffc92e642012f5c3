"""Build: a deployment's topology made real with Mininet, and the WAN link model applied.

`Network(deployment, registry)` creates the two-datacenter topology (`topologies.two_dc`) from
the deployment's instances with Linux bridges and no controller, turns the WAN router into a
router (IPv4 forwarding), and hands its two egress interfaces to the link model
(`testbed.net.wan.Wan`) with the deployment's emulated link parameters. Used by the Mininet
backend (`testbed.backend.mininet`). Every node's shell PID and
every bridge is recorded in the run's `Registry` as it is created, so a killed run can be cleaned
up exactly (`testbed clean`); `stop()` tears down in reverse order.
"""

import os
import subprocess
import sys

from testbed import lifecycle
from testbed.errors import NetworkError, PrivilegeError
from testbed.net.calibrate import calibrate, correct, shortfall
from testbed.net.linkmodel import SETTABLE, needs_checksums
from testbed.net.ns import disable_checksum_offload, disable_offloads, sysctl
from testbed.net.timers import TcpTimers, apply
from testbed.net.wan import Wan
from testbed.net.zygote import Zygote, forkable


def _mininet():
    try:
        from mininet.log import setLogLevel  # reason: mininet, optional until a network is built
        from mininet.net import Mininet  # reason: as above
        from mininet.nodelib import LinuxBridge  # reason: as above
    except ImportError as e:
        raise NetworkError(f"Mininet is not importable ({e}); run `sudo make deps` (Debian "
                           "package mininet, used from a venv made with --system-site-packages)")
    setLogLevel(os.environ.get("TESTBED_MININET_LOG", "error"))
    return Mininet, LinuxBridge


class Network:
    """The emulated network of one run. Use as: start(), host(role), popen(...), stop()."""

    def __init__(self, deployment, registry, events=None):
        self.deployment = deployment
        self.registry = registry
        self.events = events
        self.net = None
        self.topo = None
        self.wan = None
        self.calibration = None      # testbed.net.calibrate, once the WAN is shaped
        self.tcp_timers = {}
        self.timers_applied = None   # the TcpTimers the hosts' routes carry
        self.zygote = None           # the worker launcher (testbed.net.zygote)

    def start(self):
        if os.geteuid() != 0:
            raise PrivilegeError("building the emulated network needs root: run with sudo")
        Mininet, LinuxBridge = _mininet()
        from topologies.two_dc import TwoDatacenterTopo  # reason: imports mininet.topo

        self.topo = TwoDatacenterTopo(prefix=self.registry.prefix,
                                      instances=self.deployment.instances)
        self.net = Mininet(topo=None, switch=LinuxBridge, controller=None, build=False,
                           autoSetMacs=False, waitConnected=False)
        self.registry.on_close(self.stop, "network")
        # Started first: its imports overlap the build; from the main thread (see Zygote.start).
        self.zygote = Zygote(self.registry).start()
        # Build node by node so each shell PID and bridge is on record before the next exists.
        for name in self.topo.switches():
            self.net.addSwitch(name, **self.topo.nodeInfo(name))
            self.registry.add_link(name)
        for name in self.topo.hosts():
            node = self.net.addHost(name, **self.topo.nodeInfo(name))
            self.registry.add_process(node.pid, f"mininet host {name}")
        for name in self.topo.switches():
            self.registry.add_process(self.net[name].pid, f"mininet switch shell {name}")
        for src, dst, info in self.topo.links(sort=True, withKeys=False, withInfo=True):
            self.net.addLink(**info)
        self.net.build()
        # The bridge ports are veth ends in the root namespace: deleting one deletes its peer,
        # even when the peer's namespace lingers (sockets keep a dead namespace alive a while).
        for name in self.topo.switches():
            for intf in self.net[name].intfList():
                if intf.name != "lo":
                    self.registry.add_link(intf.name)
        self.net.start()
        paths = self.netns_path
        for role, path in paths.items():
            # TCP buffers up to 64 MB: the default 6 MB caps the window below a 1 Gbit/s x 40 ms
            # emulated BDP (per-namespace sysctls; the machine's own are untouched).
            sysctl(path, "net.ipv4.tcp_rmem=4096 131072 67108864",
                   "net.ipv4.tcp_wmem=4096 16384 67108864",
                   *(["net.ipv4.ip_forward=1"] if role == "wan" else []))
        self._scale_tcp_timers()
        self._per_frame_if_lossy()
        self._shape(self.host("wan"))
        return self

    def rescale(self, deployment, events=None):
        """Carry the built network over to `deployment`: the same instances at another
        scale.time (testbed/autoscale.py tries several on one network). The WAN takes its
        links, the hosts' routes its TCP timers, and the calibration's shortfall is re-checked;
        `events`: the event log of the run it now serves (its link changes are that run's)."""
        self.deployment = deployment
        if events is not None:
            self.events = self.wan.events = events
        for d, link in deployment.links.items():
            self.wan.set(d, **{k: v for k, v in link.params().items() if k in SETTABLE})
        self._scale_tcp_timers()
        if self.calibration is not None:
            self.calibration.pop("warning", None)
            short = shortfall(self.calibration, deployment.links, deployment.scale)
            if short:
                self.calibration["warning"] = short
        return self

    def correct_round_trip(self, off_ms):
        """The delay lines' fixed cost moved by `off_ms` (a probe's RTT p50 over the configured
        one: `testbed.net.calibrate.correct`); the calibration record, or None where nothing
        was calibrated (netem, no delay) and so nothing can be corrected."""
        if self.calibration is None or not self.calibration.get("fixed_cost_ms"):
            return None
        return correct(self.wan, self.calibration, off_ms)

    def _scale_tcp_timers(self):
        """rto_min and quickack on the end hosts' routes (`net.timers`); recorded for metadata.
        Not again when the hosts carry these timers already (a rescale to the same scale.time:
        a pilot's first step on the network just built, a run at the last step's scale; 3-3.7 s
        for many_instances' 98 hosts on 2026-12-03)."""
        scale = self.deployment.scale
        timers = TcpTimers.for_scale(scale)
        if self.tcp_timers and timers == self.timers_applied:
            return
        self.timers_applied = timers
        routes = {role: apply(path, timers) for role, path in self.netns_path.items()
                  if role != "wan"}
        self.tcp_timers = {**timers.describe(scale), "hosts": len(routes),
                           "routes": sorted({r for rs in routes.values() for r in rs})}

    def _per_frame_if_lossy(self):
        """With loss configured (now or by a scheduled change), hosts send single frames."""
        self.per_frame = self.deployment.per_frame
        if not self.per_frame:
            return
        dep = self.deployment
        checksums = needs_checksums(dep.links) or any(   # corrupt/duplicate, now or later
            getattr(c, "changes", {}).get(k) for c in dep.schedule
            for k in ("corrupt", "duplicate"))
        for name in self.topo.hosts():
            node = self.net[name]
            if node is self.host("wan"):
                continue
            for intf in node.intfList():
                if intf.name != "lo":
                    disable_offloads(f"/proc/{node.pid}/ns/net", intf.name)
                    if checksums:
                        disable_checksum_offload(f"/proc/{node.pid}/ns/net", intf.name)

    def _shape(self, router):
        dep = self.deployment
        self.wan = Wan(netns_path=f"/proc/{router.pid}/ns/net",
                       ifaces=dict(self.topo.router_intfs),
                       links=dict(dep.links),
                       backend=dep.shaping_backend, seed=dep.seed,
                       registry=self.registry, events=self.events)
        self.wan.start()
        paths = self.netns_path
        self.calibration = calibrate(self.wan, paths["probe_remote"], paths["probe_local"],
                                     self.ip("probe_local"))
        short = shortfall(self.calibration, dep.links, dep.scale)
        if short:
            self.calibration["warning"] = short
        for line in (short, (self.calibration or {}).get("spell")):
            if line:
                print(f"warning: {line}", file=sys.stderr, flush=True)

    def host(self, role):
        return self.net[self.topo.roles[role]]

    def ip(self, role):
        return self.topo.ips[role]

    @property
    def netns_path(self):
        return {role: f"/proc/{self.net[name].pid}/ns/net"
                for role, name in self.topo.roles.items() if role not in ("sR", "sL")}

    def popen(self, role, argv, log_path, env=None):
        """Start `argv` inside host `role`, output to `log_path`; the PID goes on record.

        A worker of the profile engine (`python -m <module in zygote.FORKABLE>`) is forked by
        the worker launcher (testbed/net/zygote.py), which joins the host's namespaces, calls
        setsid() and sets the parent-death signal as mnexec does; its handle is Popen-like.
        Anything else: Mininet runs `mnexec -da <host shell pid> argv` as a child of this
        process (not of the host's shell); mnexec joins the namespace, calls setsid() and execs `argv`, so the
        parent-death signal set here (before the exec) ties `argv` to this process. The
        environment names this process (ORCHESTRATOR_ENV) for the worker's own watch.
        """
        if self.zygote is not None and forkable(argv):
            proc = self.zygote.spawn(self.host(role).pid, argv, log_path,
                                     lifecycle.orchestrator_env(env))
            self.registry.add_process(proc.pid, f"{role}: {' '.join(map(str, argv[:4]))}")
            return proc
        log = open(log_path, "ab")
        try:
            proc = self.host(role).popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=lifecycle.orchestrator_env(env),
                                         preexec_fn=lifecycle.die_with_parent())
        finally:
            log.close()
        self.registry.add_process(proc.pid, f"{role}: {' '.join(map(str, argv[:4]))}")
        return proc

    def cli(self):
        """The Mininet CLI on the running network (its output needs Mininet's 'output' level)."""
        from mininet.cli import CLI  # reason: mininet, optional until a network is built
        from mininet.log import setLogLevel  # reason: as above
        setLogLevel("output")
        roles = ", ".join(f"{role}={name}" for role, name in sorted(self.topo.roles.items()))
        print(f"*** workers are up; nodes: {roles}\n*** e.g. `{self.topo.roles['client']} ping "
              f"-c3 {self.topo.ips['probe_remote']}` crosses the WAN; `exit` starts the requests")
        try:
            CLI(self.net)
        finally:
            setLogLevel(os.environ.get("TESTBED_MININET_LOG", "error"))

    def stop(self):
        if self.zygote is not None:
            zygote, self.zygote = self.zygote, None
            zygote.stop()
        if self.wan is not None:
            wan, self.wan = self.wan, None
            wan.stop()
        if self.net is not None:
            net, self.net = self.net, None
            net.stop()
