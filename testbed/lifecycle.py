"""Symmetric lifecycle: whatever a run starts registers how to stop it, in a state file.

A `Registry` is the run's record of what it created: processes (PID plus start time, so a reused
PID is never killed), named network namespaces, root-namespace interfaces (bridges, veths, IFBs),
and firewall objects. Each `add_*` writes the state file at once (`/run/prfaas-testbed/<id>.json`),
so a run killed with SIGKILL still leaves an exact list behind. `close()` undoes everything in
reverse order and removes the file; `testbed clean` calls `cleanup_all()`, which does the same for
every state file it finds. Nothing is ever killed or deleted by name pattern except interfaces
carrying this testbed's own prefix `tb` + run id.

Teardown callbacks (`on_close`) let a component register a Python-level stop function for the
normal path; the recorded kernel objects are the fallback for the crash path.

Children die with the orchestrator, even when it is SIGKILLed (no teardown runs then):
`die_with_parent()` is a `preexec_fn` that sets the kernel's parent-death signal (SIGKILL) in the
child before it execs, and `ORCHESTRATOR_ENV` names the orchestrator (PID and start time) so a
worker can also watch it (`workers.common.die_with_orchestrator`). The parent-death signal fires
when the *thread* that forked the child exits, so it is only set for children forked by the main
thread; children forked by other threads (a delay line started by a scheduled link change) rely on
the watch or, for the delay line, on its stdin closing.
"""

import contextlib
import ctypes
import json
import os
import pathlib
import signal
import subprocess
import threading
import time

from testbed.net import netlink

STATE_DIR = pathlib.Path(os.environ.get("TESTBED_STATE_DIR", "/run/prfaas-testbed"))
ORCHESTRATOR_ENV = "TESTBED_ORCHESTRATOR"   # "<pid>:<start time>" of the process to die with
PR_SET_PDEATHSIG = 1
# SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then keeps it ignored
# (no KeyboardInterrupt), so `kill -INT` to a backgrounded run would do nothing.
TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def sigterm_unwinds():
    """Make SIGINT, SIGTERM, SIGHUP and SIGQUIT tear down like Ctrl-C (KeyboardInterrupt), even
    when SIGINT was inherited as ignored; this process only.

    pyroute2 forks helper processes for namespaces; a fork inherits Python signal handlers, and a
    handler that raised there would unwind a copy of the caller's stack in the child, running its
    `finally` teardown (removing the namespaces the parent still uses). Forks get the default.
    """
    main_pid = os.getpid()

    def handler(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt

    for sig in TEARDOWN_SIGNALS:
        signal.signal(sig, handler)


def proc_start_time(pid):
    """Kernel start time of `pid` (clock ticks since boot), or None if it is gone."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid, start):
    return start is not None and proc_start_time(pid) == start


def identity(pid=None):
    """'<pid>:<start time>' of a process (default: this one), the value of ORCHESTRATOR_ENV."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{proc_start_time(pid)}"


def identity_alive(token):
    """Is the process named by an `identity()` string still the same process and running?"""
    try:
        pid, start = token.split(":")
        return _alive(int(pid), int(start))
    except ValueError:
        return False


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def set_parent_death_signal(sig=signal.SIGKILL, expected_parent=None):
    """prctl(PR_SET_PDEATHSIG, sig) for this process; exit at once if the parent is already gone.

    The kernel sends `sig` when the thread that forked this process exits. The signal survives
    execve (of a binary that is not set-user-ID), so a preexec_fn can set it for the program it
    starts. If `expected_parent` died before the prctl, nobody would signal: exit instead.
    """
    if _libc().prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)
    return True


def die_with_parent(sig=signal.SIGKILL):
    """A `preexec_fn` tying the child's life to this process, or None off the main thread.

    Off the main thread, the signal would fire when that thread ends, not when the orchestrator
    does, so it is not set there (the child's own watch covers it).
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    _libc()                          # loaded before the fork: the child only calls into it
    parent = os.getpid()
    return lambda: set_parent_death_signal(sig, parent)


def orchestrator_env(env=None):
    """`env` (default os.environ) plus ORCHESTRATOR_ENV naming this process."""
    return dict(os.environ if env is None else env, **{ORCHESTRATOR_ENV: identity()})


def kill_recorded(pid, start, grace_s=2.0):
    """SIGTERM, then SIGKILL after `grace_s`, the process `pid` only if it is the one recorded."""
    if not _alive(pid, start):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _alive(pid, start):
            return True
        time.sleep(0.02)
    if _alive(pid, start):           # checked again: the PID may have been reused meanwhile
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True


def terminate_all(procs, grace_s=3.0):
    """SIGTERM every running process of `procs` (Popen-like handles, in the order given), then
    SIGKILL those still running after `grace_s` in all."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=2)


class Registry:
    """Record of one run's kernel objects and processes; see the module docstring."""

    def __init__(self, run_id, kind="run", state_dir=None):
        self.run_id = run_id
        self.state_dir = pathlib.Path(state_dir or STATE_DIR)
        self.path = self.state_dir / f"{run_id}.json"
        self.state = {"run_id": run_id, "kind": kind, "owner_pid": os.getpid(),
                      "owner_start": proc_start_time(os.getpid()), "created": time.time(),
                      "processes": [], "netns": [], "links": [], "commands": []}
        self._callbacks = []
        self._save()

    @property
    def prefix(self):
        """Name prefix of every kernel object of this run (interfaces, bridges, namespaces)."""
        return f"tb{self.run_id[:4]}"

    def _save(self):
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.path)

    def add_process(self, pid, what):
        self.state["processes"].append({"pid": pid, "start": proc_start_time(pid), "what": what})
        self._save()

    def add_netns(self, name):
        self.state["netns"].append(name)
        self._save()

    def add_link(self, ifname):
        """A root-namespace interface (bridge, veth end, IFB) to delete at the end."""
        self.state["links"].append(ifname)
        self._save()

    def add_undo_command(self, argv):
        """An argv (iptables -D ..., nft delete table ...) that undoes a firewall change."""
        self.state["commands"].append(list(argv))
        self._save()

    def on_close(self, fn, what=""):
        self._callbacks.append((fn, what))

    def close(self):
        """Run callbacks (reverse order), then remove whatever recorded object is still there."""
        errors = []
        while self._callbacks:
            fn, what = self._callbacks.pop()
            try:
                fn()
            except Exception as e:  # teardown goes on; the recorded objects are the fallback
                errors.append(f"{what or fn}: {e}")
        _undo(self.state)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        return errors


def _namespace_owner_alive(argv, starts):
    """An undo command run inside /proc/<pid>/ns/net is only run if <pid> is still the recorded
    process: once it is gone its namespace (and the rules in it) went with it, and the PID may
    now belong to an unrelated process in another namespace."""
    for a in argv:
        if a.startswith("--net=/proc/"):
            pid = a[len("--net=/proc/"):].split("/", 1)[0]
            return pid.isdigit() and _alive(int(pid), starts.get(int(pid)))
    return True


def _undo(state):
    starts = {p["pid"]: p["start"] for p in state.get("processes", [])}
    for p in reversed(state.get("processes", [])):
        kill_recorded(p["pid"], p["start"])
    for argv in reversed(state.get("commands", [])):
        if not _namespace_owner_alive(argv, starts):
            continue
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if state.get("links") or state.get("netns"):
        from pyroute2 import IPRoute, netns  # reason: pyroute2, only for links and namespaces

        with IPRoute() as ipr:
            for name in reversed(state.get("links", [])):
                idx = ipr.link_lookup(ifname=name)
                if idx:
                    with contextlib.suppress(Exception):
                        ipr.link("del", index=idx[0])
        for name in reversed(state.get("netns", [])):
            with contextlib.suppress(Exception):
                netns.remove(name)


def undo_file(path):
    """Undo the record in one state file and remove the file (a guard's job once the owner
    died; `cleanup_all` does the same for a whole directory)."""
    _undo(read_state(path))
    pathlib.Path(path).unlink(missing_ok=True)


class CorruptState(Exception):
    """A state file that cannot be read as a run's record: reported, never deleted."""


def read_state(path):
    """The record in a state file, checked for shape; CorruptState says what is wrong."""
    try:
        state = json.loads(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptState(f"not readable as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CorruptState(f"expected a JSON object, found {type(state).__name__}")
    for key, kind in (("processes", list), ("netns", list), ("links", list), ("commands", list)):
        if not isinstance(state.get(key, []), kind):
            raise CorruptState(f"{key!r} is not a list")
    for p in state.get("processes", []):
        if not (isinstance(p, dict) and isinstance(p.get("pid"), int)
                and isinstance(p.get("start"), (int, type(None)))):
            raise CorruptState(f"process entry {p!r} lacks an integer pid and start time")
    if not all(isinstance(n, str) for n in state.get("netns", []) + state.get("links", [])):
        raise CorruptState("a namespace or interface name is not a string")
    if not all(isinstance(c, list) and c and all(isinstance(a, str) for a in c)
               for c in state.get("commands", [])):
        raise CorruptState("an undo command is not a list of strings")
    return state


def owner_alive(state):
    """Is the process that wrote `state` still running (PID and start time both match)?"""
    owner = state.get("owner_pid")
    if not isinstance(owner, int):
        return False
    start = state.get("owner_start")
    if start is None:        # a record written before start times were kept: PID only
        return pathlib.Path(f"/proc/{owner}").exists()
    return _alive(owner, start)


def cleanup_all(state_dir=None, include_live=False, kind=None):
    """Undo every recorded run whose owner is gone (or all, with include_live); only records
    of `kind` (a Registry's kind, e.g. ray-agent) when given.

    Returns (report lines, corrupt lines): a state file that cannot be read is left in place and
    reported (its path and what is wrong), so nothing is forgotten silently.
    """
    d = pathlib.Path(state_dir or STATE_DIR)
    report, corrupt = [], []
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            state = read_state(f)
        except CorruptState as e:
            corrupt.append(f"{f}: corrupt state file, left in place: {e}")
            continue
        if kind is not None and state.get("kind") != kind:
            continue
        if not include_live and owner_alive(state) and state.get("owner_pid") != os.getpid():
            report.append(f"{state.get('run_id')}: still running (pid {state['owner_pid']}), "
                          "left alone")
            continue
        n = (len(state.get("processes", [])), len(state.get("links", [])),
             len(state.get("netns", [])))
        _undo(state)
        f.unlink(missing_ok=True)
        report.append(f"{state.get('run_id')}: removed {n[0]} process(es), {n[1]} interface(s), "
                      f"{n[2]} namespace(s)")
    return report, corrupt


@contextlib.contextmanager
def scratch_netns(name, kind="scratch"):
    """A named network namespace on record while it exists (`testbed clean` removes it if the
    process dies first); yields the Registry, for processes started in it."""
    from pyroute2 import netns  # reason: pyroute2, only for a scratch namespace

    reg = Registry(name, kind=kind)
    try:
        reg.add_netns(name)
        netlink.call(f"creating netns {name}", netns.create, name)
        yield reg
    finally:
        reg.close()
