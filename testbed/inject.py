"""Failure injection at run time: the `Injector` carries out the deployment's instance fault
actions (`testbed.deploy.FaultAction`: pause, kill, restart, slow) at their times.

Link faults are not here: they are link changes of the deployment's schedule, applied by the
same `testbed.net.schedule.LinkSchedule` as `network.wan.changes`. A `slow` fault writes the
worker's control file in the run directory and sends SIGUSR1 (workers/control.py reads it).
"""

import json
import os
import signal
import subprocess
import threading
import time

from testbed.records import RunDir


def _leads_group(p):
    """A local worker leading its own process group (Mininet starts each one with setsid;
    a Ray handle's PID is another host's)."""
    try:
        return isinstance(p, subprocess.Popen) and os.getpgid(p.pid) == p.pid
    except OSError:
        return False


class Injector:
    """Carries out the instance faults (pause, kill, restart, slow) at their times, in a thread.

    `procs()` returns the run's {name: Popen}; `respawn(name)` starts a worker again; `events`
    is the run's EventLog. Every injection and its end are logged (`fault_inject`, `fault_end`).
    `stop()` resumes anything still paused and restores clocks, so teardown finds live processes.
    """

    def __init__(self, actions, run_dir, procs, respawn, events):
        self.dir = RunDir(run_dir)
        self.procs, self.respawn, self.events = procs, respawn, events
        self.actions = list(actions)        # deploy.FaultAction, emulated seconds, in order
        self.paused = set()
        self._stop = threading.Event()
        self._thread = None
        self.error = None

    def start(self, t0):
        if self.actions:
            self._thread = threading.Thread(target=self._run, args=(t0,), daemon=True,
                                            name="faults")
            self._thread.start()
        return self

    def _run(self, t0):
        for a in self.actions:
            if self._stop.wait(max(0.0, t0 + a.at_s - time.time())):
                return
            try:
                # Logged as it starts: what it causes (a health transition) comes after.
                self.events(f"fault_{a.phase}", fault=a.fault, occurrence=a.occurrence,
                            fault_kind=a.kind, target=a.target)
                for name in a.targets:
                    self._do(a, name)
            except Exception as e:  # keep measuring; say what failed
                self.error = e
                self.events("fault_error", fault=a.fault, error=f"{type(e).__name__}: {e}")

    def _signal(self, name, sig):
        p = self.procs().get(name)
        if p is not None and p.poll() is None:
            if _leads_group(p):     # all it started (a vLLM server, EngineCore) with it
                os.killpg(p.pid, sig)
            else:
                p.send_signal(sig)  # a Popen or a backend's handle (another host's process)

    def _do(self, a, name):
        k, phase = a.kind, a.phase
        if k == "pause":
            if phase == "inject":
                self._signal(name, signal.SIGSTOP)
                self.paused.add(name)
            else:
                self._signal(name, signal.SIGCONT)
                self.paused.discard(name)
        elif k in ("kill", "restart") and phase == "inject":
            p = self.procs().get(name)
            self._signal(name, signal.SIGKILL)
            if p is not None:
                p.wait(timeout=5)
        elif k == "restart":
            self.respawn(name)
        elif k == "slow":
            self.set_clock(name, a.factor if phase == "inject" else 1.0)

    def set_clock(self, name, factor):
        """The worker's engine clock factor, through control/<name>.json and SIGUSR1."""
        path = self.dir.control_file(name)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}")
        tmp.write_text(json.dumps({"clock_factor": factor}))
        tmp.replace(path)
        self._signal(name, signal.SIGUSR1)

    def fast_tail(self, names, factor):
        """A pilot step's decode tail (testbed/autoscale.py): every first token is out, so
        what the step judges is over; the engines of `names` run the rest `factor` times their
        time. Logged as `pilot_tail`, whose steps the step ratio leaves out (testbed/metrics.py).
        Returns True."""
        self.events("pilot_tail", fault="pilot_tail", occurrence=0, fault_kind="slow",
                    target=",".join(names))
        for name in names:
            self.set_clock(name, factor)
        return True

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for name in list(self.paused):
            try:
                self._signal(name, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.paused.clear()
