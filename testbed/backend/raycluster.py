"""The Ray backend: a deployment on the hosts of a Ray cluster, the WAN shaped on their NICs.

    describe -> deploy (Deployment) -> backend: RayBackend (place, shape, spawn) -> analyse

This module launches; it reaches the cluster through `raynodes` (connect, the labelled nodes,
actors pinned to a node) and asks `rayplacement` which node runs each instance. Hosts join the
cluster with `ray start ... --labels dc=prfaas` or `dc=local` (docs/cluster.md). `start()`:

1. connects to the cluster (`backend.address`) and places every instance of the deployment on
   an alive node labelled with its datacenter (`rayplacement.place`: the node with the most
   free CPUs that fits; one GPU per prefill/decode instance for the torch engine on CUDA,
   `backend.cpus` CPUs otherwise). A datacenter without a node, or instances that do not fit,
   is a ConfigError (exit 2) before anything starts (`rayplacement.preflight` runs the same
   check before the run directory is made);
2. starts a shaping agent (`agents.ShapingAgent`, zero CPUs) on every labelled node: the node
   carries its instances' addresses (the deployment's 10.1/16, 10.2/16 plan) and routes to the
   others', and shapes its datacenter's WAN direction on its egress interface for traffic to
   the other datacenter only (`testbed.net.hostshape.HostWan`);
3. starts a launcher (`agents.Launcher`) per node that runs instances, holding the instances'
   CPUs and GPUs; `spawn()` starts a worker through it and returns a `RemoteProcess`, a
   Popen-like handle whose poll/wait/terminate/kill/send_signal go to the launcher.

`shaper` is a `ClusterShaper`: `set` reaches every agent (both directions' parameters are kept
on each), `stats` sums the PrfaaS hosts' `kv` and the local hosts' `request` class counters.

Paths: the runner gives workers the run directory's paths (runtime.json, logs, ready files,
records). A host that sees the orchestrator's run directory (shared storage, or one machine)
uses it as it is; any other keeps a node-local copy (`agents.host_run_dir`), which
`runfiles.Mirror` keeps in step for the files runner and workers exchange while the run goes,
and `stop()` collects into the orchestrator's run directory (`runfiles.HostFiles.collect`),
also on errors and Ctrl-C. Every host needs the same checkout and Python environment at the
same path (docs/cluster.md).

Clocks: `start()` and `stop()` measure each launcher host's wall clock against the
orchestrator's (`testbed.clocks.measure`, min-RTT round trips through the launcher); `clocks()`
is what metadata.json records and analysis corrects the other hosts' stamps by.
"""

from __future__ import annotations

import platform
import secrets
import signal
import subprocess
import time

from testbed import clocks
from testbed.backend import agents, runfiles
from testbed.backend.raynodes import (DATACENTERS, DIRECTION_OF, READY_TIMEOUT_S, connect,
                                      labelled_nodes, pinned)
from testbed.backend.rayplacement import place, request
from testbed.backend.rayprobe import quiet_measure
from testbed.deploy import DC_NET
from testbed.errors import ConfigError, NetworkError

STATUS_TTL_S = 0.05


def clean(address):
    """Undo, on every alive node of the cluster at `address`, what shaping agents that died
    without stopping left (their state files); [(node IP, report lines, corrupt lines)]."""
    ray = connect(address)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [pinned(ray, agents.clean_host, n["NodeID"], num_cpus=0).remote() for n in nodes]
    return [(n["NodeManagerAddress"], *r)
            for n, r in zip(nodes, ray.get(refs, timeout=READY_TIMEOUT_S))]


# ---------------------------------------------------------------- the runner's handles

class RemoteProcess:
    """A `subprocess.Popen`-like handle of a process its node's launcher started."""

    def __init__(self, backend, node, key, pid):
        self.backend, self.node, self.key, self.pid = backend, node, key, pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.backend.returncode(self.node, self.key)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.key, timeout)
            time.sleep(STATUS_TTL_S)
        return self.returncode

    def send_signal(self, sig):
        self.backend.signal(self.node, self.key, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class ClusterShaper:
    """The WAN as the agents run it: `set` on every agent, `stats` summed per direction."""

    def __init__(self, ray, agents_by_dc, backend, reason, events=None):
        self.ray, self.agents, self.events = ray, agents_by_dc, events
        self.backend, self.backend_reason = backend, reason

    def set(self, direction=None, **changes):
        t0 = time.monotonic()
        self.ray.get([a.set.remote(direction, changes)
                      for dc in DATACENTERS for a in self.agents[dc]])
        took = time.monotonic() - t0
        if self.events is not None:
            self.events("wan_set", direction=direction or "both", apply_ms=round(took * 1e3, 3),
                        **changes)
        return took

    def stats(self):
        out = {}
        for dc in DATACENTERS:
            d = DIRECTION_OF[dc]
            per_host = self.ray.get([a.stats.remote() for a in self.agents[dc]])
            total = {k: sum(s[d][k] for s in per_host)
                     for k in ("tx_bytes", "tx_packets", "backlog_bytes", "backlog_packets",
                               "drops")}
            total.update(up=per_host[0][d]["up"], rate_bps=per_host[0][d]["rate_bps"])
            out[d] = total
        return out


# ---------------------------------------------------------------- the backend

class RayBackend:
    name = "ray"

    def __init__(self, deployment, registry, events=None, spec=None, run_dir=None):
        self.deployment, self.registry, self.events, self.spec = (deployment, registry, events,
                                                                  spec)
        self.run_dir = run_dir
        self.ray = None
        self.placement = {}
        self.nodes = []
        self.agents = {dc: [] for dc in DATACENTERS}
        self.agent_info = {}
        self.launchers = {}
        self.codes = {}
        self.host_dirs = {}      # node -> the launcher's info (its copy of the run directory)
        self.files = {}          # node -> runfiles.HostFiles, for hosts with their own copy
        self.mirror = None
        self.clock = {}          # node -> {"start": estimate, "end": estimate}
        self._count = 0
        self._shaper = None

    def start(self):
        self.ray = connect(self.spec.address)
        self.nodes = labelled_nodes(self.ray.nodes())
        self.placement = place(self.deployment, self.spec.cpus, self.nodes)
        self.registry.on_close(self.stop, "ray backend")
        self._start_agents()
        self._start_launchers()
        info = next(iter(self.agent_info.values()))
        self._shaper = ClusterShaper(self.ray, self.agents, info["backend"], info["reason"],
                                     self.events)
        return self

    def _ready(self, refs, what):
        from ray.exceptions import GetTimeoutError  # reason: optional [cluster] extra, heavy
        try:
            return self.ray.get(refs, timeout=READY_TIMEOUT_S)
        except GetTimeoutError:
            raise ConfigError(f"placement not met within {READY_TIMEOUT_S:.0f}s: {what} did "
                              f"not start (resources taken by another job?)",
                              key="backend") from None

    def _start_agents(self):
        dep = self.deployment
        params = {d: link.params() for d, link in dep.links.items()}
        refs = {}
        for i, node in enumerate(self.nodes):
            other = "local" if node.dc == "prfaas" else "prfaas"
            agent = pinned(self.ray, agents.ShapingAgent, node, num_cpus=0).remote(
                self.registry.run_id, f"{node.dc}{i}")
            self.agents[node.dc].append(agent)
            mine = self._addresses(node)
            routes = {inst.ip: self.placement[inst.name].ip for inst in dep.instances
                      if self.placement[inst.name] != node}
            peer = next(n.ip for n in self.nodes if n.dc == other)
            refs[node] = agent.start.remote(
                DIRECTION_OF[node.dc], f"{DC_NET[other]}.0.0/16", params, dep.shaping_backend,
                dep.seed * 2 + i, mine, routes, peer)
        try:
            infos = self._ready(list(refs.values()), "a shaping agent")
        except self.ray.exceptions.RayTaskError as e:
            raise NetworkError(f"shaping agent failed: {str(e).strip().splitlines()[-1]}") \
                from None
        self.agent_info = {n.ip: info for n, info in zip(refs, infos)}

    def _start_launchers(self):
        rt = self.deployment.runtime
        token = secrets.token_hex(8)
        marker = None
        if self.run_dir is not None:    # a host reading this token sees the run directory
            marker = self.run_dir / agents.SHARED_MARKER
            marker.write_text(token)
        try:
            for node in dict.fromkeys(self.placement.values()):
                need = [request(self.deployment.instance(name), rt, self.spec.cpus)
                        for name, n in self.placement.items() if n == node]
                self.launchers[node] = pinned(
                    self.ray, agents.Launcher, node, num_cpus=sum(c for c, _ in need),
                    num_gpus=sum(g for _, g in need)).remote(
                        None if self.run_dir is None else str(self.run_dir), token,
                        self.registry.run_id)
            infos = self._ready([launcher.info.remote() for launcher in self.launchers.values()],
                                "a launcher")
        finally:
            if marker is not None:
                marker.unlink(missing_ok=True)
        self.host_dirs = dict(zip(self.launchers, infos))
        errors = self._measure_clocks("start")
        if errors:
            raise NetworkError("; ".join(errors))
        self._start_files()

    def _start_files(self):
        """A `HostFiles` for every host with its own copy of the run directory, kept in step
        by a `runfiles.Mirror` while the run goes."""
        origins = {}
        for node, info in self.host_dirs.items():
            if not info["shared"]:
                launcher = self.launchers[node]
                self.files[node] = runfiles.HostFiles(
                    node.ip, lambda m, *a, _l=launcher: self.ray.get(getattr(_l, m).remote(*a)),
                    self.run_dir, origins)
        if self.files:
            self.mirror = runfiles.Mirror(self.files.values()).start()

    def _measure_clocks(self, when):
        """Each launcher host's wall clock against this one's (`clocks.measure`); the errors
        (a host whose launcher is gone)."""
        errors = []
        for node, launcher in self.launchers.items():
            try:
                self.clock.setdefault(node, {})[when] = clocks.measure(
                    lambda _l=launcher: self.ray.get(_l.clock.remote(), timeout=30))
            except Exception as e:     # noqa: BLE001  said in the teardown errors
                errors.append(f"clock offset of host {node.ip} at the {when}: {e}")
        return errors

    def clocks(self):
        """metadata.json `clocks`: per host the offset measured at start and end of the
        variant (`clocks.combine`), and which host each instance ran on."""
        hosts = {}
        for node, m in self.clock.items():
            if "start" in m:
                skew = self.host_dirs.get(node, {}).get("injected_skew_s", 0.0)
                hosts[node.ip] = clocks.combine(m["start"], m.get("end"), skew)
        return {"reference": platform.node(),
                "method": "min-RTT round trips from the orchestrator to each host's launcher "
                          f"({clocks.ROUNDS} per measurement, at start and end of the "
                          "variant): offset = host - (t0 + t1) / 2, uncertainty = rtt / 2",
                "hosts": hosts,
                "instances": {name: n.ip for name, n in self.placement.items()
                              if n.ip in hosts}}

    def spawn(self, host, argv, log_path, env=None):
        node = self.placement[host]
        self._count += 1
        key = f"{host}#{self._count}"
        gpu = request(self.deployment.instance(host), self.deployment.runtime,
                      self.spec.cpus)[1] > 0
        argv = list(map(str, argv))
        if node in self.files:       # its inputs (runtime.json, workload.parquet) first
            self.files[node].push_inputs(argv)
        pid = self.ray.get(self.launchers[node].spawn.remote(key, argv, str(log_path), env,
                                                             gpu))
        return RemoteProcess(self, node, key, pid)

    def returncode(self, node, key):
        stamp, codes = self.codes.get(node, (0.0, {}))
        if time.monotonic() - stamp > STATUS_TTL_S or key not in codes:
            codes = self.ray.get(self.launchers[node].returncodes.remote())
            self.codes[node] = (time.monotonic(), codes)
        return codes.get(key)

    def signal(self, node, key, sig):
        if node in self.files:       # what the signal asks the worker to read (control/)
            self.files[node].sync()
        self.ray.get(self.launchers[node].signal.remote(key, int(sig)))

    @property
    def shaper(self):
        return self._shaper

    def describe(self):
        info = next(iter(self.agent_info.values()), {})
        return {
            "backend": self.name, "versions": {"ray": self.ray.__version__},
            "topology": {"class": "testbed.backend.raycluster.RayBackend",
                         "address": self.spec.address,
                         "nodes": {n.ip: {"dc": n.dc, "node_id": n.node_id, "cpus": n.cpus,
                                          "gpus": n.gpus} for n in self.nodes},
                         "ips": {i.name: i.ip for i in self.deployment.instances},
                         "placement": {name: n.ip for name, n in self.placement.items()},
                         "agents": self.agent_info,
                         "run_dirs": {n.ip: info for n, info in self.host_dirs.items()}},
            # the agents turn TSO/GSO/GRO off once the link has loss (testbed.net.hostshape)
            "segmentation_offload": not self.deployment.per_frame,
            "shaping": {"backend": info.get("backend"), "reason": info.get("reason", ""),
                        "where": "rate and queue on the sending host's egress interface, "
                                 "delay, jitter, loss and cuts as the receiving host takes "
                                 "the packets in; traffic to the other datacenter only",
                        "emulated": {d: link.params()
                                     for d, link in self.deployment.links.items()}}}

    def probe(self, congestion_control):
        """The KV direction measured through the agents, from the PrfaaS host of the first
        PrfaaS instance to the local host of the scheduler (link_fidelity), by probe actors on
        the two hosts; no clock shared by them is needed (testbed.backend.rayprobe)."""
        dep = self.deployment
        dst_node = self.placement["scheduler"]
        # the host's first instance address: the source of what it sends to other hosts
        # (the agent's routes), so the probe's UDP echoes come back from the address asked
        dst_ip = self._addresses(dst_node)[0]
        src = next((i for i in dep.instances if i.dc == "prfaas"), None)
        src_node = self.placement[src.name] if src else next(
            n for n in self.nodes if n.dc == "prfaas")
        return quiet_measure(self.ray, src_node, dst_node, dst_ip, dep.links["kv"],
                             congestion_control)

    def _addresses(self, node):
        """The instance addresses placed on `node`, in the deployment's order."""
        return [i.ip for i in self.deployment.instances if self.placement[i.name] == node]

    def tcp_counters(self):
        """{"<dc> host <k>": kernel TCP counters} of every host, from its shaping agent."""
        hosts = [(f"{dc} host {k}", a) for dc in DATACENTERS
                 for k, a in enumerate(self.agents[dc])]
        counters = self.ray.get([a.tcp_counters.remote() for _, a in hosts])
        return dict(zip((name for name, _ in hosts), counters))

    def forward(self, host, port, listen_port=0):
        raise ConfigError("testbed up runs on the mininet backend only; the ray backend's front "
                          "door is reachable on its host's address (docs/cluster.md)",
                          key="backend.kind")

    def cli(self):
        print("the ray backend has no interactive CLI; the workers are up, press Enter to "
              "start the requests")
        input()

    def _collect(self):
        """Every host's own copy of the run directory into the orchestrator's (then removed
        there); the errors. A file the run directory already had is kept under another name
        (an events.csv row `file_renamed`)."""
        out = []
        for node, files in self.files.items():
            try:
                renamed = files.collect()
                if self.events is not None:
                    for rel, kept_as in renamed:
                        self.events("file_renamed", host=node.ip, path=rel, kept_as=kept_as)
                self.ray.get(self.launchers[node].remove_dir.remote(), timeout=30)
            except Exception as e:   # the host's copy stays where it is; say where
                out.append(f"collecting {self.host_dirs[node]['dir']} from host {node.ip}: "
                           f"{type(e).__name__}: {e}")
        self.files.clear()
        return out

    def stop(self):
        """Launchers (their processes), the hosts' files collected, then the agents (undo),
        then the actors themselves."""
        if self.ray is None:
            return
        errors = []
        if self.mirror is not None:
            errors += self.mirror.stop()
            self.mirror = None
        errors += self._measure_clocks("end")      # a launcher gone: its start one stays
        for launcher in self.launchers.values():
            try:
                self.ray.get(launcher.stop.remote(), timeout=agents.STOP_GRACE_S + 5)
            except Exception as e:   # the actor may be gone; its children die with it
                errors.append(f"launcher: {e}")
        errors += self._collect()
        for agent in [a for dc in DATACENTERS for a in self.agents[dc]]:
            try:
                errors += self.ray.get(agent.stop.remote(), timeout=30)
            except Exception as e:   # its guard process undoes what it did
                errors.append(f"shaping agent: {e}")
        for actor in [*self.launchers.values(), *(a for dc in DATACENTERS
                                                   for a in self.agents[dc])]:
            try:
                self.ray.kill(actor)
            except Exception as e:
                errors.append(f"killing an actor: {e}")
        self.launchers.clear()
        self.agents = {dc: [] for dc in DATACENTERS}
        self.ray = None
        if errors:
            raise NetworkError("; ".join(errors))
