"""Namespace hosts with Ray nodes: machines of a Ray cluster, stood in for on one machine.

The ray backend's root tests (tests/test_ray_root.py) and its benchmark
(benchmarks/ray_vs_mininet.py) run the backend for real on namespaces that stand in for
machines: each host its own network namespace, veth and address, the hosts joined by an
unshaped fabric namespace, a Ray head on the first local host and a Ray node on every other
(`ray start --block --labels dc=...`). Two fabrics:

- `router` (one host per datacenter): each host on a /24 of its own, the fabric namespace
  routes each datacenter's instance subnet (`10.1.0.0/16`, `10.2.0.0/16`) to its one host, as a
  WAN router would;
- `bridge` (any number of hosts per datacenter): every host on one L2 segment
  (`10.250.0.0/24`), where the shaping agents' `/32` routes to each instance go to its host
  directly (docs/cluster.md).

Every namespace is recorded in the caller's `testbed.lifecycle.Registry` before it is made and
every `ray start` process when it starts; `stop_ray` stops Ray by those processes, then ends
what is left in the hosts' namespaces, matched by namespace inode, never by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time

from testbed import lifecycle
from testbed.net import pair
from testbed.net.ns import ns_path, ns_run, sysctl

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
ROUTER_NET = {"local": "10.250.2", "prfaas": "10.250.1"}     # router fabric: host subnets (/24)
BRIDGE_NET = "10.250.0"
DC_NET = {"prfaas": "10.1.0.0/16", "local": "10.2.0.0/16"}
RAY_PORT = 6391
NODE_WAIT_S = 150.0     # three nodes on a loaded 2-core machine took over 90 s once
# A node's own settings, never inherited from the caller (testbed.backend.agents.NODE_DIR_ENV,
# testbed.clocks.SKEW_ENV; named here so that this module imports neither).
NODE_ONLY_ENV = ("TESTBED_NODE_DIR", "TESTBED_CLOCK_SKEW_S")


ROOT_LOCK = "/tmp/prfaas-root.lock"     # the lock every user of root networking here holds


class HostsError(RuntimeError):
    """The namespace hosts or their Ray nodes could not be set up."""


@dataclasses.dataclass(frozen=True)
class Host:
    name: str     # the network namespace; its interface is `<name>0`
    dc: str
    ip: str


@contextlib.contextmanager
def root_lock(path=ROOT_LOCK):
    """Hold the shared root-networking lock (`flock`) for the block."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ray_bin():
    return str(pathlib.Path(sys.executable).with_name("ray"))


def netns_inode(name):
    return os.stat(ns_path(name)).st_ino


def pids_in(inodes):
    """PIDs of processes whose network namespace is one of `inodes`."""
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(p / "ns" / "net").st_ino in inodes:
                    out.append(int(p.name))
    return out


def _check(r, what):
    if r.returncode != 0:
        raise HostsError(f"{what}: {r.stderr.strip()}")


def build_router_hosts(reg, tag):
    """{dc: Host}, one per datacenter, behind a routing fabric namespace."""
    router = f"tb{tag}r"
    hosts = {dc: Host(f"tb{tag}{dc[0]}", dc, f"{net}.2") for dc, net in ROUTER_NET.items()}
    for n in (router, *(h.name for h in hosts.values())):
        pair.create_netns(reg, n)
    for dc, h in hosts.items():
        net = ROUTER_NET[dc]
        pair.add_veth(f"{h.name}0", h.name, f"{router}{dc[0]}", router)
        pair.address(h.name, f"{h.name}0", h.ip, gateway=f"{net}.1")
        pair.address(router, f"{router}{dc[0]}", f"{net}.1")
    sysctl(router, "net.ipv4.ip_forward=1")
    for dc in ROUTER_NET:
        _check(ns_run(router, ["ip", "route", "add", DC_NET[dc], "via", f"{ROUTER_NET[dc]}.2"],
                      capture_output=True, text=True), f"route {DC_NET[dc]} on {router}")
    return hosts


def build_bridged_hosts(reg, tag, dcs):
    """[Host] for `dcs` (one datacenter name per host, in order), on one bridge."""
    fabric = f"tb{tag}f"
    pair.create_netns(reg, fabric)
    _check(ns_run(fabric, ["ip", "link", "add", "br0", "type", "bridge"], capture_output=True,
                  text=True), f"bridge on {fabric}")
    _check(ns_run(fabric, ["ip", "link", "set", "br0", "up"], capture_output=True, text=True),
           f"bridge up on {fabric}")
    hosts = []
    for i, dc in enumerate(dcs):
        h = Host(f"tb{tag}{dc[0]}{i}", dc, f"{BRIDGE_NET}.{i + 2}")
        pair.create_netns(reg, h.name)
        pair.add_veth(f"{h.name}0", h.name, f"{fabric}{i}", fabric)
        pair.address(h.name, f"{h.name}0", h.ip)
        for argv in (["ip", "link", "set", f"{fabric}{i}", "master", "br0"],
                     ["ip", "link", "set", f"{fabric}{i}", "up"]):
            _check(ns_run(fabric, argv, capture_output=True, text=True), " ".join(argv))
        hosts.append(h)
    return hosts


def ray_env(**extra):
    """The environment of a Ray node or driver in the hosts: this checkout on PYTHONPATH, no
    usage stats, and only the node-only settings given in `extra`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", **extra)
    for key in NODE_ONLY_ENV:
        if key not in extra:
            env.pop(key, None)
    return env


def start_ray(reg, hosts, log_dir, env_of, num_cpus=8):
    """Ray head on the first `local` host of `hosts` ([Host]), a node on each other one,
    labelled `dc=<its dc>`; `env_of(host)` is each node's environment. Returns (head address,
    [ray start process]) once every node is alive."""
    head_host = next(h for h in hosts if h.dc == "local")
    head = f"{head_host.ip}:{RAY_PORT}"
    common = ["--block", "--num-cpus", str(num_cpus), "--num-gpus", "0",
              "--disable-usage-stats", "--node-ip-address"]
    procs = []
    order = [head_host] + [h for h in hosts if h is not head_host]
    for i, h in enumerate(order):
        role = (["--head", "--port", str(RAY_PORT), "--include-dashboard=false"]
                if h is head_host else ["--address", head])
        log = open(pathlib.Path(log_dir) / f"ray-{h.name}.log", "wb")
        p = subprocess.Popen(["nsenter", f"--net={ns_path(h.name)}", ray_bin(), "start", *role,
                              "--labels", f"dc={h.dc}", *common, h.ip],
                             stdout=log, stderr=subprocess.STDOUT, env=env_of(h),
                             start_new_session=True)
        log.close()
        reg.add_process(p.pid, f"ray start ({h.name}, dc={h.dc})")
        procs.append(p)
        if h is head_host:
            wait_port(h.name, h.ip, RAY_PORT, p)
        elif i < len(order) - 1:
            # One node at a time: the nodes of one machine share the session directory, and
            # two raylets starting together picked the same plasma-store socket there (the
            # second aborted with "bind: Address already in use").
            wait_nodes(head_host.name, head, procs, sorted(x.dc for x in order[:i + 1]))
    wait_nodes(head_host.name, head, procs, sorted(h.dc for h in hosts))
    return head, procs


def wait_port(ns, ip, port, proc, timeout_s=NODE_WAIT_S):
    deadline = time.monotonic() + timeout_s
    code = ("import socket,sys; s=socket.socket(); s.settimeout(0.5); "
            f"sys.exit(s.connect_ex(('{ip}', {port})))")
    while ns_run(ns, [sys.executable, "-c", code]).returncode != 0:
        if proc.poll() is not None:
            raise HostsError("ray start --head exited")
        if time.monotonic() >= deadline:
            raise HostsError(f"the Ray head did not listen within {timeout_s}s")
        time.sleep(0.5)


def wait_nodes(ns, head, procs, labels, timeout_s=NODE_WAIT_S):
    """Until the alive nodes' `dc` labels are `labels` (sorted; one bounded wait in a driver)."""
    code = ("import ray,time,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            f"d=time.monotonic()+{timeout_s}\n"
            "while time.monotonic()<d:\n"
            "  if sorted(n['Labels'].get('dc','') for n in ray.nodes() if n['Alive'])"
            f"=={labels!r}: sys.exit(0)\n"
            "  time.sleep(0.5)\n"
            "sys.exit(1)")
    r = ns_run(ns, [sys.executable, "-c", code, head], env=ray_env(), capture_output=True,
               text=True, timeout=timeout_s + 60)
    if r.returncode != 0 or any(p.poll() is not None for p in procs):
        raise HostsError(f"Ray nodes not up: {r.stderr[-2000:]}")


def stop_ray(procs, inodes):
    """SIGTERM the `ray start --block` processes (they stop what they started), give what is
    left in the hosts' namespaces (an agent's guard undoing its record) a bounded time to end,
    then SIGKILL it. Returns the PIDs still there."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=20)
    deadline = time.monotonic() + 5
    while pids_in(inodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while pids_in(inodes) and time.monotonic() < deadline:
        for pid in pids_in(inodes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    return pids_in(inodes)


@contextlib.contextmanager
def running(log_dir, env_of, hold=contextlib.nullcontext, bridged=None):
    """The hosts with their Ray nodes: yields ([Host], head). One host per datacenter behind a
    router, or hosts on one bridge for the datacenters in `bridged` (one name per host).
    `env_of(host)` is each node's environment; `hold()` a context held while the hosts are set
    up and again while they are taken down (a root lock). Raises HostsError, after taking
    everything down, if processes were left in the hosts' namespaces."""
    tag = secrets.token_hex(2)
    reg = lifecycle.Registry(f"raytest{tag}", kind="ray-test")
    procs, inodes, left = [], set(), []
    try:
        with hold():
            hosts = (build_bridged_hosts(reg, tag, bridged) if bridged
                     else list(build_router_hosts(reg, tag).values()))
            inodes = {netns_inode(h.name) for h in hosts}
            head, procs = start_ray(reg, hosts, log_dir, env_of)
        yield hosts, head
    finally:
        with hold():
            left = stop_ray(procs, inodes)
            reg.close()
    if left:
        raise HostsError(f"processes left in the hosts' namespaces: {left}")
