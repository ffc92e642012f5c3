"""What the Ray backend runs on each host: a launcher and a shaping agent (two Ray actors).

Place in the architecture: `testbed.backend.raycluster.RayBackend` (the orchestrator's side)
places one `Launcher` and one `ShapingAgent` on every host that runs instances of the
deployment. Both are plain classes here (unit-testable without Ray); the backend wraps them with
`ray.remote`. Both run on their host, as the user the Ray node runs as (root, for the agent).

- `Launcher`: starts an instance's process (the argv the runner gives, with its log file) and
  reports its PID and exit; signals it; stops everything it started. Its children die with it
  (parent-death signal, and `lifecycle.ORCHESTRATOR_ENV` naming the launcher for the workers'
  own watch), so an actor killed by Ray leaves no worker behind. It keeps the host's copy of
  the run directory (`host_run_dir`): the orchestrator's own where this host sees it (shared
  storage), else a node-local directory the runner's paths are mapped into; its file calls
  (`listing`, `read`, `write`) let the orchestrator copy files both ways
  (`testbed.backend.runfiles`). `clock()` is the host's wall clock, for the offset the
  orchestrator measures (`testbed.clocks`).
- `ShapingAgent`: makes the host carry its instances' addresses (/32 aliases on the egress
  interface, routes to the other hosts' instances) and installs its datacenter's WAN direction
  there (`testbed.net.hostshape.HostWan`): only traffic to the other datacenter is shaped. Every
  change is on record in a `lifecycle.Registry` state file on the host; `stop()` undoes it, and
  a guard process (`python -m testbed.backend.agents guard STATE`) undoes it when the actor dies
  without stopping (killed, its driver gone). `testbed clean` undoes what is left.
"""

import asyncio
import concurrent.futures
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from testbed import clocks, lifecycle
from testbed.errors import NetworkError
from testbed.net import netlink
from testbed.net.hostshape import HostWan
from testbed.records import RunDir

GUARD_INTERVAL_S = 0.2
STOP_GRACE_S = 3.0
REPO = pathlib.Path(__file__).resolve().parent.parent.parent
# Where a host keeps its copy of a run directory when it does not see the orchestrator's; set
# on a Ray node (`ray start`'s environment) it is used even where the orchestrator's is visible
# (node-local disk instead of NFS writes; the root test's proof that collection works).
NODE_DIR_ENV = "TESTBED_NODE_DIR"
SHARED_MARKER = ".testbed-host-check"     # the orchestrator's token, to recognise shared storage


def host_run_dir(run_dir, token, run_id, environ=None):
    """(this host's directory for the run, whether it is the orchestrator's own): the
    orchestrator's path where this host reads the orchestrator's `token` there and
    `NODE_DIR_ENV` is unset, else `<NODE_DIR_ENV or TMPDIR/prfaas-testbed-runs>/<run_id>-<name>`
    (made here)."""
    run_dir = pathlib.Path(run_dir)
    root = (os.environ if environ is None else environ).get(NODE_DIR_ENV)
    if not root:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if token and (run_dir / SHARED_MARKER).read_text() == token:
                return run_dir, True
        root = pathlib.Path(tempfile.gettempdir()) / "prfaas-testbed-runs"
    local = pathlib.Path(root) / f"{run_id}-{run_dir.name}"
    (local / RunDir.LOGS).mkdir(parents=True, exist_ok=True)
    return local, False


# ---------------------------------------------------------------- the launcher

class Launcher:
    """Processes of the deployment on this host, by key (the runner's name, plus a counter).

    `run_dir`: the orchestrator's run directory; the paths the runner gives under it are
    mapped to this host's copy (`host_run_dir`; none given: paths are used as they are)."""

    def __init__(self, run_dir=None, token="", run_id=""):
        self.procs = {}
        self.gpus = {}       # key -> the GPU id it was given
        self.run_dir = None if run_dir is None else pathlib.Path(run_dir)
        self.dir, self.shared = self.run_dir, True
        if run_dir is not None:
            self.dir, self.shared = host_run_dir(run_dir, token, run_id)

    def info(self):
        """Where this host keeps the run directory, and its clock's test-only skew."""
        return {"dir": None if self.dir is None else str(self.dir), "shared": self.shared,
                "injected_skew_s": clocks.test_skew_s()}

    def clock(self):
        """This host's wall clock, as its workers stamp it."""
        return clocks.wall()

    def local_path(self, path):
        """`path` (the orchestrator's) on this host: under the run directory it is mapped to
        this host's copy."""
        if self.shared or self.run_dir is None:
            return str(path)
        p = str(path)
        base = str(self.run_dir)
        if p == base or p.startswith(base + os.sep):
            return str(self.dir) + p[len(base):]
        return p

    def _file(self, rel):
        """A path inside this host's copy of the run directory (never outside it)."""
        p = None if self.dir is None else (self.dir / rel).resolve()
        if p is None or not p.is_relative_to(self.dir.resolve()):
            raise NetworkError(f"{rel}: not a path inside the run directory")
        return p

    def listing(self):
        """{relative path: [size, mtime_ns]} of every file in this host's copy."""
        out = {}
        for p in self.dir.rglob("*"):
            with contextlib.suppress(OSError):      # a file replaced while listed
                if p.is_file():
                    st = p.stat()
                    out[str(p.relative_to(self.dir))] = [st.st_size, st.st_mtime_ns]
        return out

    def read(self, rel, offset, size):
        """Up to `size` bytes of a file from `offset`."""
        with open(self._file(rel), "rb") as f:
            f.seek(offset)
            return f.read(size)

    def write(self, rel, data, offset=0):
        """Write a file's bytes: the whole file at offset 0 (replaced atomically, so a reader
        never sees half of it), else `data` appended at `offset` (the file's size)."""
        p = self._file(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        if offset == 0:
            tmp = p.with_name(f".{p.name}.part")
            tmp.write_bytes(data)
            tmp.replace(p)
            return
        with open(p, "r+b") as f:
            f.seek(offset)
            f.write(data)

    def remove_dir(self):
        """Remove this host's copy (after the orchestrator collected it); never a shared one."""
        if not self.shared and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def spawn(self, key, argv, log_path, env=None, gpu=False):
        """Start `argv` with output to `log_path` (its directory made if missing); its PID.
        `gpu`: give it one of the GPUs Ray assigned to this actor (CUDA_VISIBLE_DEVICES).
        Paths under the run directory, in `argv` and `log_path`, are this host's copy's."""
        argv = [self.local_path(a) for a in argv]
        log_path = pathlib.Path(self.local_path(log_path))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = clocks.worker_env(os.environ if env is None else env)
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = self._free_gpu(key)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=lifecycle.orchestrator_env(env),
                                    preexec_fn=lifecycle.die_with_parent())
        self.procs[key] = proc
        return proc.pid

    def _free_gpu(self, key):
        import ray  # reason: optional [cluster] extra, heavy
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
        # Ray installs uvloop's policy in its workers when uvloop is importable; pyroute2 opens
        # its netlink socket as an asyncio datagram endpoint, which uvloop refuses (AF_NETLINK:
        # "cannot open a UDP handle, invalid family 16"), so this process uses asyncio's loop
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())

    def _on_thread(self, fn, *args):
        return self._thread.submit(fn, *args).result()

    def start(self, direction, dst, params, backend, seed, addresses, routes, peer):
        return self._on_thread(self._start, direction, dst, params, backend, seed, addresses,
                               routes, peer)

    def _start(self, direction, dst, params, backend, seed, addresses, routes, peer):
        from pyroute2 import IPRoute  # reason: pyroute2, only where an agent shapes

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
        from testbed.fidelity import tcp_counters  # reason: fidelity loads numpy and pandas
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
