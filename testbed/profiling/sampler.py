"""The /proc side of profiling a `testbed run`: a sampler thread that walks one process tree.

`Sampler` follows the process tree of one root PID (the `testbed run` a profiler started, and
nothing else) every `interval_s` seconds: each process's CPU time (user, system), threads and
command line from /proc, and each Python process's per-thread CPU. Once a worker has written its
ready file it hands the process to `testbed.profiling.pyspy` (one py-spy per role and variant by
default). `Proc` is what it saw of one process; `Proc.to_json` / `from_json` keep it in
profiles/processes.json, which `testbed.profiling.report` reads back.

Library code for benchmarks/profile_run.py (the CLI); Linux only, no root needed to read
one's own children, root to attach py-spy to a root-owned run.
"""

import collections
import os
import pathlib
import threading
import time

from testbed.net.zygote import LAUNCHER_MODULE as LAUNCHER
from testbed.profiling import pyspy
from testbed.rundir import RunDir

CLK_TCK = os.sysconf("SC_CLK_TCK")
PYSPY_WAIT_S = 15.0       # py-spy writes its file when its target exits; bounded wait after


# ---- /proc --------------------------------------------------------------------------------

def read_stat(pid):
    """(ppid, user cpu s, system cpu s, threads, start ticks) of `pid`, or None if gone."""
    try:
        raw = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw.rsplit(")", 1)[1].split()
    # fields after the comm: state(0) ppid(1) ... utime(11) stime(12) ... num_threads(17) ...
    # starttime(19)
    return int(f[1]), int(f[11]) / CLK_TCK, int(f[12]) / CLK_TCK, int(f[17]), int(f[19])


def read_cmdline(pid):
    try:
        raw = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def thread_cpu(pid):
    """{tid: (kernel thread name, user cpu s, system cpu s)} of the threads of `pid`. gRPC core
    names its threads; Python threads all carry the interpreter's name (py-spy names them by
    tid)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            raw = pathlib.Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        f = raw.rsplit(")", 1)[1].split()
        out[int(tid)] = (raw[raw.index("(") + 1:raw.rindex(")")], int(f[11]) / CLK_TCK,
                         int(f[12]) / CLK_TCK)
    return out


def children_map():
    """{ppid: [pid, ...]} of every process on the machine (one pass over /proc)."""
    kids = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = read_stat(int(entry))
            if st is not None:
                kids[st[0]].append(int(entry))
    return kids


def descendants(root):
    kids, out, todo = children_map(), [], [root]
    while todo:
        pid = todo.pop()
        if pid != os.getpid():      # never this script (it is not in the tree; be explicit)
            out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def machine_busy():
    """(busy jiffies, total jiffies) over all cores, from /proc/stat."""
    f = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


# ---- one process of the run ---------------------------------------------------------------

class Proc:
    """What the sampler saw of one process (pid + start time) of the run's tree."""

    def __init__(self, pid, start):
        self.pid, self.start = pid, start
        self.argv = []
        self.samples = []           # (unix time, cpu seconds)
        self.sys_s = 0.0            # of which in the kernel (last sample)
        self.threads_max = 0
        self.threads = {}           # tid -> (kernel name, user s, system s) at its last sample
        self.threads_at_attach = {}     # the same when py-spy started
        self.ready_cpu = None       # cpu seconds when the worker's ready file appeared
        self.pyspy = None           # (Popen, output path)
        self.is_root = False

    def arg(self, flag):
        return self.argv[self.argv.index(flag) + 1] if flag in self.argv[:-1] else ""

    @property
    def module(self):
        return self.arg("-m")

    @property
    def variant_dir(self):
        rt = self.arg("--runtime")
        return pathlib.Path(rt).parent if rt else None

    @property
    def name(self):
        return self.arg("--name") or pathlib.Path(self.argv[0]).name if self.argv else "?"

    FIELDS = ("pid", "start", "argv", "samples", "sys_s", "threads_max", "threads",
              "threads_at_attach", "ready_cpu", "is_root")

    def to_json(self):
        d = {k: getattr(self, k) for k in self.FIELDS}
        d["pyspy"] = str(self.pyspy[1]) if self.pyspy else None
        return d

    @classmethod
    def from_json(cls, d):
        p = cls(d["pid"], d["start"])
        for k in cls.FIELDS:
            setattr(p, k, d[k])
        for k in ("threads", "threads_at_attach"):
            setattr(p, k, {int(tid): tuple(v) for tid, v in d[k].items()})
        p.samples = [tuple(x) for x in p.samples]
        p.pyspy = (None, pathlib.Path(d["pyspy"])) if d["pyspy"] else None
        return p

    @property
    def exe(self):
        return pathlib.Path(self.argv[0]).name if self.argv else ""

    @property
    def is_python(self):
        return self.exe.startswith("python")

    @property
    def role(self):
        m = self.module
        if m.startswith("workers."):
            return m.split(".", 1)[1]
        if m == "testbed.cli":      # pyroute2 forks the orchestrator for namespace work
            return "orchestrator" if self.is_root else "orchestrator fork"
        if m == LAUNCHER:
            return "worker launcher"
        if m == "testbed.net.proberoles":
            return "link probe"
        if m == "testbed.live.exporter":
            return "live exporter"
        exe = self.exe
        if exe.startswith("tb-delayline"):
            return "delayline"
        if exe in ("bash", "sh"):
            return "host shell"
        return exe or "?"

    def cpu_at(self, t, system=False):
        """CPU seconds (of them in the kernel: `system`) at time `t`: the last sample at or
        before it; 0 before the first."""
        cpu = 0.0
        for ts, c, *sys_s in self.samples:
            if ts > t:
                break
            cpu = (sys_s[0] if sys_s else 0.0) if system else c
        return cpu

    @property
    def cpu(self):
        return self.samples[-1][1] if self.samples else 0.0


class Sampler:
    """Samples the run's process tree; starts one py-spy per Python process once it is known."""

    def __init__(self, root_pid, profiles_dir, interval_s, use_pyspy, rate, every, native=()):
        self.root, self.dir, self.interval_s = root_pid, profiles_dir, interval_s
        self.use_pyspy, self.rate, self.every = use_pyspy, rate, every
        self.native = set(native)
        self.profiled_roles = set()     # (variant dir, role) with a py-spy already
        self.procs = {}             # (pid, start) -> Proc
        self.passes = 0
        self.stop = threading.Event()
        self.busy0 = machine_busy()
        self.thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def _loop(self):
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval_s)

    def sample(self):
        now = time.time()
        self.passes += 1
        for pid in descendants(self.root):
            st = read_stat(pid)
            if st is None:
                continue
            p = self.procs.setdefault((pid, st[4]), Proc(pid, st[4]))
            p.is_root = pid == self.root
            if p.is_root or not (p.is_python and p.module.startswith(("workers.", "testbed.net"))
                                 and p.module != LAUNCHER):
                p.argv = read_cmdline(pid) or p.argv    # fork, mnexec, exec, the launcher's
                # fork: until it is itself (a zombie's cmdline is empty)
            p.samples.append((now, st[1] + st[2], st[2]))
            p.sys_s = st[2]
            p.threads_max = max(p.threads_max, st[3])
            worker = p.is_python and p.module.startswith("workers.")
            if (worker or p.is_root) and self.passes % 2 == 0:    # per-thread: every 2nd pass
                p.threads.update(thread_cpu(pid))
            ready = False
            if worker:
                vd = p.variant_dir
                ready = vd is not None and (RunDir(vd).ready / p.name).exists()
                if p.ready_cpu is None and ready:
                    p.ready_cpu = st[1] + st[2]
            elif p.is_root:     # the interpreter is up once the run has written a config
                ready = any(self.dir.parent.glob(f"**/{RunDir.CONFIG}"))
            if self.use_pyspy and p.pyspy is None and ready and self._wanted(p):
                self._attach(p)

    def _wanted(self, p):
        """Profile every Python process, or (default) one per role and variant: py-spy costs
        CPU on the same two cores, and the instances of a role run the same code."""
        key = (p.variant_dir, p.role)
        if not self.every and key in self.profiled_roles:
            return False
        self.profiled_roles.add(key)
        return True

    def _attach(self, p):
        vd = p.variant_dir
        sub = self.dir / (vd.name if vd is not None else "")
        name = "orchestrator" if p.is_root else p.name
        p.threads_at_attach = thread_cpu(p.pid)     # only what py-spy sees is attributed
        p.pyspy = pyspy.record(p.pid, sub / f"{name}.txt", self.rate, p.role in self.native)

    def finish(self):
        """Stop sampling; wait (bounded) for every py-spy to write its profile."""
        self.stop.set()
        self.thread.join()
        self.busy1 = machine_busy()
        deadline = time.monotonic() + PYSPY_WAIT_S
        for p in self.procs.values():
            if p.pyspy is None:
                continue
            proc = p.pyspy[0]
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is None:
                proc.terminate()        # a py-spy of ours whose target outlived the run
                proc.wait(timeout=5)
