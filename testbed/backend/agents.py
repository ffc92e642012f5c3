"""What the Ray backend runs on each host: a launcher and a shaping agent (two Ray actors).

Place in the architecture: `testbed.backend.raycluster.RayBackend` (the orchestrator's side)
places one `Launcher` and one `ShapingAgent` on every host that runs instances of the
deployment. Both are plain classes here (unit-testable without Ray); the backend wraps them with
`ray.remote`. Both run on their host, as the user the Ray node runs as (root, for the agent).

- `Launcher`: starts an instance's process (the argv the runner gives, with its log file) and
  reports its PID and exit; signals it; stops everything it started. Its children die with it
  (parent-death signal, and `lifecycle.ORCHESTRATOR_ENV` naming the launcher for the workers'
  own watch), so an actor killed by Ray leaves no worker behind.
- `ShapingAgent`: makes the host carry its instances' addresses (/32 aliases on the egress
  interface, routes to the other hosts' instances) and installs its datacenter's WAN direction
  there (`testbed.net.hostshape.HostWan`): only traffic to the other datacenter is shaped. Every
  change is on record in a `lifecycle.Registry` state file on the host; `stop()` undoes it, and
  a guard process (`python -m testbed.backend.agents guard STATE`) undoes it when the actor dies
  without stopping (killed, its driver gone). `testbed clean` undoes what is left.
"""

import concurrent.futures
import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

from testbed import lifecycle
from testbed.errors import NetworkError

GUARD_INTERVAL_S = 0.2
STOP_GRACE_S = 3.0
REPO = pathlib.Path(__file__).resolve().parent.parent.parent


# ---------------------------------------------------------------- the launcher

class Launcher:
    """Processes of the deployment on this host, by key (the runner's name, plus a counter)."""

    def __init__(self):
        self.procs = {}
        self.gpus = {}       # key -> the GPU id it was given

    def spawn(self, key, argv, log_path, env=None, gpu=False):
        """Start `argv` with output to `log_path` (its directory made if missing); its PID.
        `gpu`: give it one of the GPUs Ray assigned to this actor (CUDA_VISIBLE_DEVICES)."""
        log_path = pathlib.Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if env is None else env)
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = self._free_gpu(key)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=lifecycle.orchestrator_env(env),
                                    preexec_fn=lifecycle.die_with_parent())
        self.procs[key] = proc
        return proc.pid

    def _free_gpu(self, key):
        import ray
        held = {g for k, g in self.gpus.items() if self.procs[k].poll() is None}
        free = [str(g) for g in ray.get_gpu_ids() if str(g) not in held]
        if not free:
            raise NetworkError(f"{key}: no GPU left among those Ray assigned to this launcher")
        self.gpus[key] = free[0]
        return free[0]

    def returncodes(self):
        """{key: exit code or None while running} of every process started here."""
        return {k: p.poll() for k, p in self.procs.items()}

    def wait(self, key, timeout_s):
        """The exit code of `key`, or None if it still runs after `timeout_s`."""
        try:
            return self.procs[key].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, key, sig):
        p = self.procs[key]
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)

    def stop(self):
        """SIGTERM what still runs, SIGKILL what is left after STOP_GRACE_S; the exit codes."""
        lifecycle.terminate_all(self.procs.values(), STOP_GRACE_S)
        return self.returncodes()


# ---------------------------------------------------------------- the shaping agent

def own_netns_path():
    """A path naming this process's network namespace that outlives it: /proc/1/ns/net for
    the host's own, /var/run/netns/NAME for a named one (the namespace hosts of the root
    test); the undo commands enter it after this process is gone."""
    mine = os.stat("/proc/self/ns/net").st_ino
    candidates = ["/proc/1/ns/net"] + sorted(str(p) for p in pathlib.Path(
        "/var/run/netns").glob("*"))
    for c in candidates:
        with contextlib.suppress(OSError):
            if os.stat(c).st_ino == mine:
                return c
    raise NetworkError("the shaping agent's network namespace has no lasting name "
                       "(neither the host's nor one under /var/run/netns)")


def boot_id():
    """This machine's boot id: equal on two hosts only when they are one machine."""
    return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def _route_to(ns, ip):
    """(interface index, gateway or None) of this namespace's route to `ip`."""
    routes = shaping_call(f"route to {ip}", ns.route, "get", dst=ip)
    r = routes[0]
    return r.get_attr("RTA_OIF"), r.get_attr("RTA_GATEWAY")


def shaping_call(what, fn, *args, **kwargs):
    from testbed.net import netlink
    return netlink.call(what, fn, *args, **kwargs)


class ShapingAgent:
    """One host's side of the WAN: its instances' addresses, routes, and its egress direction.

    `start(...)` takes everything from the backend (no Ray import here): this host's
    `direction`, the other datacenter's subnet `dst`, both directions' emulated `params`, the
    shaping `backend`, `addresses` (this host's instance IPs), `routes` ({instance IP: IP of
    the host that carries it}) and `peer` (a host of the other datacenter: the egress interface
    is the one its route leaves through)."""

    KIND = "ray-agent"      # of its lifecycle record

    def __init__(self, run_id, tag):
        self.run_id, self.tag = run_id, tag
        self.registry = None
        self.wan = None
        self.guard = None
        # pyroute2's sync objects belong to the thread that made them; Ray may run an actor's
        # calls on different threads, so every call runs on this one
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agent")

    def _on_thread(self, fn, *args):
        return self._thread.submit(fn, *args).result()

    def start(self, direction, dst, params, backend, seed, addresses, routes, peer):
        return self._on_thread(self._start, direction, dst, params, backend, seed, addresses,
                               routes, peer)

    def _start(self, direction, dst, params, backend, seed, addresses, routes, peer):
        from pyroute2 import IPRoute

        from testbed.net.hostshape import HostWan

        if os.geteuid() != 0:
            raise NetworkError("the shaping agent changes qdiscs, routes and iptables and needs "
                               "root: start the Ray node as root (docs/cluster.md)")
        self.registry = lifecycle.Registry(f"ray-{self.run_id}-{self.tag}", kind=self.KIND)
        self._start_guard()
        path = own_netns_path()
        with IPRoute() as ns:     # this namespace: NetNS would fork (see hostshape)
            idx, _ = _route_to(ns, peer)
            iface = ns.get_links(idx)[0].get_attr("IFLA_IFNAME")
            self._addresses(ns, path, idx, iface, addresses)
            self._routes(ns, path, idx, addresses, routes)
        self.wan = HostWan(path, iface, direction, dst, params, backend=backend, seed=seed,
                           registry=self.registry).start()
        return {"iface": iface, "netns": path, "boot_id": boot_id(),
                "backend": self.wan.backend,
                "reason": self.wan.backend_reason, "state": str(self.registry.path),
                "installed": self.wan.describe(direction)}

    def _start_guard(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
        self.guard = subprocess.Popen(
            [sys.executable, "-m", "testbed.backend.agents", "guard", str(self.registry.path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env, start_new_session=True)     # outlives this process on purpose

    def _addresses(self, ns, path, idx, iface, addresses):
        for ip in addresses:
            self.registry.add_undo_command(["nsenter", f"--net={path}", "ip", "addr", "del",
                                            f"{ip}/32", "dev", iface])
            shaping_call(f"address {ip}/32 on {iface}", ns.addr, "add", index=idx,
                         address=ip, prefixlen=32)

    def _routes(self, ns, path, idx, addresses, routes):
        # The source is one of this host's instance addresses, so replies come back to the
        # deployment's subnet and cross the other host's shaped class too (ACKs included).
        src = next(iter(addresses), None)
        for ip, host in sorted(routes.items()):
            oif, gateway = _route_to(ns, host)
            self.registry.add_undo_command(["nsenter", f"--net={path}", "ip", "route", "del",
                                            f"{ip}/32"])
            kw = {"prefsrc": src} if src else {}
            shaping_call(f"route {ip}/32 via {gateway or host}", ns.route, "add",
                         dst=f"{ip}/32", gateway=gateway or host, oif=oif, **kw)

    def set(self, direction, changes):
        return self._on_thread(lambda: self.wan.set(direction, **changes))

    def stats(self):
        return self._on_thread(self.wan.stats)

    def tcp_counters(self):
        """This host's kernel TCP counters (`testbed.fidelity.tcp_counters`): the agent runs in
        the host's network namespace."""
        from testbed.fidelity import tcp_counters
        return tcp_counters(f"/proc/{os.getpid()}/ns/net")

    def stop(self):
        """Undo everything this agent did (reverse order); the errors, if any."""
        return self._on_thread(self._stop)

    def _stop(self):
        if self.registry is None:
            return []
        errors = self.registry.close()      # the Wan's stop, then the recorded undo commands
        self.registry = None
        if self.guard is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.guard.wait(timeout=2 * GUARD_INTERVAL_S + 1)
        return errors


def clean_host():
    """`testbed clean --backend ray` on one host: undo the shaping agents' records whose agent
    is gone; (report lines, corrupt lines)."""
    return lifecycle.cleanup_all(kind=ShapingAgent.KIND)


def guard(state_path):
    """Wait for the state file's owner to go; if the file is still there then, undo it."""
    path = pathlib.Path(state_path)
    while path.exists():
        try:
            state = lifecycle.read_state(path)
        except lifecycle.CorruptState:
            if not path.exists():
                return 0
            raise
        if not lifecycle.owner_alive(state):
            lifecycle.undo_file(path)
            return 0
        time.sleep(GUARD_INTERVAL_S)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "guard":
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # a Ctrl-C of the group is not its end
        sys.exit(guard(sys.argv[2]))
    sys.exit("usage: python -m testbed.backend.agents guard STATE_FILE")
