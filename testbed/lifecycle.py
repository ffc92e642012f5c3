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
"""

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import time

STATE_DIR = pathlib.Path(os.environ.get("TESTBED_STATE_DIR", "/run/prfaas-testbed"))


def sigterm_unwinds():
    """Make SIGTERM tear down like Ctrl-C (KeyboardInterrupt) in this process only.

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

    signal.signal(signal.SIGTERM, handler)


def proc_start_time(pid):
    """Kernel start time of `pid` (clock ticks since boot), or None if it is gone."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid, start):
    return start is not None and proc_start_time(pid) == start


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
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


class Registry:
    """Record of one run's kernel objects and processes; see the module docstring."""

    def __init__(self, run_id, kind="run", state_dir=None):
        self.run_id = run_id
        self.state_dir = pathlib.Path(state_dir or STATE_DIR)
        self.path = self.state_dir / f"{run_id}.json"
        self.state = {"run_id": run_id, "kind": kind, "owner_pid": os.getpid(),
                      "created": time.time(), "processes": [], "netns": [], "links": [],
                      "commands": []}
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


def _undo(state):
    for p in reversed(state.get("processes", [])):
        kill_recorded(p["pid"], p["start"])
    for argv in reversed(state.get("commands", [])):
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if state.get("links") or state.get("netns"):
        from pyroute2 import IPRoute, netns

        with IPRoute() as ipr:
            for name in reversed(state.get("links", [])):
                idx = ipr.link_lookup(ifname=name)
                if idx:
                    with contextlib.suppress(Exception):
                        ipr.link("del", index=idx[0])
        for name in reversed(state.get("netns", [])):
            with contextlib.suppress(Exception):
                netns.remove(name)


def cleanup_all(state_dir=None, include_live=False):
    """Undo every recorded run whose owner is gone (or all, with include_live). Returns a report."""
    d = pathlib.Path(state_dir or STATE_DIR)
    report = []
    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            state = json.loads(f.read_text())
        except (OSError, ValueError):
            f.unlink(missing_ok=True)
            continue
        owner = state.get("owner_pid")
        if owner and not include_live and pathlib.Path(f"/proc/{owner}").exists() \
                and owner != os.getpid():
            report.append(f"{state.get('run_id')}: still running (pid {owner}), left alone")
            continue
        n = (len(state.get("processes", [])), len(state.get("links", [])),
             len(state.get("netns", [])))
        _undo(state)
        f.unlink(missing_ok=True)
        report.append(f"{state.get('run_id')}: removed {n[0]} process(es), {n[1]} interface(s), "
                      f"{n[2]} namespace(s)")
    return report
