"""Profile one `testbed run`: CPU per process, thread and role, and where the time goes inside
the Python processes (py-spy), in one table (docs/performance.md shows one and how to read it).

Needs root (it starts `testbed run` and attaches py-spy to that run's processes), so on a shared
machine run it under the root lock, e.g. the 40x case study:

    flock /tmp/prfaas-root.lock .venv/bin/python benchmarks/profile_run.py \\
        experiments/paper_case_study.yaml --set scale.time=40 --set scale.bytes=2.5e-4 \\
        --set workload.arrival.rate=4/s

How: `testbed run FILE --out DIR` runs as a child of this script. A sampler thread walks that
child's process tree (and nothing else) every `--interval` seconds and reads each process's CPU
time (user, system), threads and command line from /proc, and each Python process's per-thread
CPU. Once a worker has written its ready file, one instance per role and variant (`--every`: all)
and the run's own process get a `py-spy record --threads` of their own (non-blocking; `--native
ROLE` adds native frames and pauses that role's processes per sample), writing collapsed stacks
to DIR/profiles/<variant>/<name>.txt. py-spy only ever attaches to PIDs found in the run's tree.

After the run it reads each variant's `metadata.json` (start/end), `events.csv` (phases),
`summary.json` (steady throughput, the planner's prediction, the emulation's own fidelity
warnings) and `requests.jsonl` (token chunks), and prints per variant: fidelity, phases, the
cores the run used while requests ran; per process: CPU seconds in the variant, % of its wall,
system CPU, start-up CPU, idle CPU %, threads, the top functions by estimated own CPU (each
thread's measured CPU split over its py-spy samples, see `attribute`) and the busiest threads;
per role; and per role over every variant. The machine line gives the load average before and
after, the busy share of all cores, the run tree's CPU (rusage of the reaped `testbed run`, a
check on the sampled sum) and py-spy's own CPU.

`--no-pyspy` measures CPU only (no sampling overhead); run both to see what profiling costs.
DIR/profiles/ keeps processes.json (every sample; `--report DIR` prints the report again) and
profile.json (the report).
"""

import argparse
import collections
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
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
        if m == "testbed.net.probe":
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

    def __init__(self, root_pid, profiles_dir, interval_s, pyspy, rate, every, native=()):
        self.root, self.dir, self.interval_s = root_pid, profiles_dir, interval_s
        self.pyspy, self.rate, self.every, self.native = pyspy, rate, every, set(native)
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
            if p.is_root or not (p.is_python and p.module.startswith(("workers.", "testbed.net"))):
                p.argv = read_cmdline(pid) or p.argv    # fork, mnexec, exec: until it is
                # itself (a zombie's cmdline is empty)
            p.samples.append((now, st[1] + st[2], st[2]))
            p.sys_s = st[2]
            p.threads_max = max(p.threads_max, st[3])
            worker = p.is_python and p.module.startswith("workers.")
            if (worker or p.is_root) and self.passes % 2 == 0:    # per-thread: every 2nd pass
                p.threads.update(thread_cpu(pid))
            ready = False
            if worker:
                vd = p.variant_dir
                ready = vd is not None and (vd / "ready" / p.name).exists()
                if p.ready_cpu is None and ready:
                    p.ready_cpu = st[1] + st[2]
            elif p.is_root:     # the interpreter is up once the run has written a config
                ready = any(self.dir.parent.glob("**/config.yaml"))
            if self.pyspy and p.pyspy is None and ready and self._wanted(p):
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
        sub.mkdir(parents=True, exist_ok=True)
        name = "orchestrator" if p.is_root else p.name
        p.threads_at_attach = thread_cpu(p.pid)     # only what py-spy sees is attributed
        out = sub / f"{name}.txt"
        log = open(sub / f"{name}.pyspy.log", "wb")
        argv = [pyspy_binary(), "record", "--pid", str(p.pid), "--rate", str(self.rate),
                "--format", "raw", "--threads", "--output", str(out)]
        # Native frames (gRPC's Cython and C core, syscalls) need the target paused per sample.
        argv += ["--native"] if p.role in self.native else ["--nonblocking"]
        p.pyspy = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL), out)
        log.close()

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


def pyspy_binary():
    found = shutil.which("py-spy") or str(pathlib.Path(sys.executable).with_name("py-spy"))
    if not pathlib.Path(found).exists():
        raise SystemExit("py-spy not found: pip install '.[profile]' (or use --no-pyspy)")
    return found


# ---- py-spy raw profiles ------------------------------------------------------------------

def short(frame):
    """'func (path/to/file.py:12)' -> 'func (file.py)': own samples summed over lines. A native
    frame without a symbol ('0x7f.. (libc.so.6)') is charged to its library: '[libc.so.6]'."""
    func, _, where = frame.partition(" (")
    lib = pathlib.Path(where.rstrip(")").rsplit(":", 1)[0]).name
    if func.startswith("0x"):
        return f"[{lib}]"
    return f"{func} ({lib})" if where else func


def read_profile(path):
    """{tid: (py-spy thread name, [(frames outermost first, count)])} of a py-spy raw file
    recorded with --threads; {} if missing."""
    threads = {}
    try:
        lines = pathlib.Path(path).read_text().splitlines()
    except OSError:
        return threads
    for line in lines:
        stack, _, n = line.rpartition(" ")
        head, *frames = stack.split(";")
        # 'thread (8549): Thread-1 (_poll_wrapper)', or 'thread (8550)' (a thread without name)
        tid, _, name = head.removeprefix("thread (").partition(")")
        entry = threads.setdefault(int(tid), (name.removeprefix(": ") or f"thread {tid}", []))
        entry[1].append((frames, int(n)))
    return threads


def leaf(frames, thread_name):
    """The function a sample is charged to. A thread whose innermost Python frame is
    Thread.run runs compiled code (gRPC's Cython poller): named after the thread."""
    f = short(frames[-1])
    return f"[{thread_name}: compiled code]" if f.startswith("Thread.run ") else f


# Where a thread waits for its next event: a sample there is a thread woken (runnable, maybe
# waiting for a core on a busy machine) or inside the syscall, never Python work.
WAIT_LEAVES = {"EpollSelector.select (selectors.py)", "epoll_wait (libc.so.6)"}
SYSCALLS = {"epoll_wait", "epoll_pwait", "sendmsg", "recvmsg", "send", "recv", "write", "read",
            "writev", "readv", "syscall", "eventfd_write", "eventfd_read", "clock_nanosleep",
            "nanosleep", "getpid", "futex", "poll", "ppoll", "accept4", "close", "sendto",
            "recvfrom", "__libc_sendmsg", "__libc_recvmsg"}
KERNEL = "[kernel: system calls]"


def is_syscall(f):
    return f in WAIT_LEAVES or f.split(" (", 1)[0] in SYSCALLS


def attribute(profile, threads):
    """Estimated CPU seconds per function and per thread.

    /proc says how much CPU each thread used, in user space and in the kernel; py-spy's samples
    say where a thread was when it was not idle (on a loaded machine that includes threads
    woken and waiting for a core). Each thread's user CPU is split over the functions its
    samples end in, leaving out samples that wait for events (the selector's epoll_wait) and
    system calls; its kernel CPU over the system calls its native samples end in (with
    --native), else charged to `[kernel: system calls]`. A thread with CPU and no Python sample
    (gRPC core's C threads) is charged as `[name thread]`.
    Returns (own Counter, inclusive Counter, per-thread rows, samples).
    """
    own, incl, rows, total = collections.Counter(), collections.Counter(), [], 0
    for tid, (comm, user, sys_s) in threads.items():
        name, stacks = profile.get(tid, (comm, []))
        stacks = [(fr, n) for fr, n in stacks if fr]
        total += sum(n for _, n in stacks)
        work = [(fr, n) for fr, n in stacks if not is_syscall(short(fr[-1]))]
        calls = [(fr, n) for fr, n in stacks if is_syscall(short(fr[-1]))
                 and short(fr[-1]) != "EpollSelector.select (selectors.py)"]
        t_own = collections.Counter()
        for part, cpu in ((work, user), (calls, sys_s)):
            n_all = sum(n for _, n in part)
            if not n_all:
                t_own[KERNEL if part is calls and stacks else f"[{name} thread]"] += cpu
                continue
            for frames, n in part:
                t_own[leaf(frames, name)] += cpu * n / n_all
                for f in {short(f) for f in frames}:
                    incl[f] += cpu * n / n_all
        own.update(t_own)
        if user + sys_s >= 0.01:
            rows.append({"tid": tid, "thread": name, "cpu_s": user + sys_s, "sys_s": sys_s,
                         "samples": sum(n for _, n in stacks),
                         "waiting_samples": sum(n for fr, n in stacks
                                                if short(fr[-1]) in WAIT_LEAVES),
                         "top_own_cpu_s": t_own.most_common(5)})
    rows.sort(key=lambda r: -r["cpu_s"])
    return own, incl, rows, total


# ---- report -------------------------------------------------------------------------------

PHASES = (("wan_start", "network build"), ("workers_ready", "workers start"),
          ("client_started", "link probe, client start"), ("client_finished", "requests"))


def event_times(vdir):
    """{event kind: unix time of its first occurrence} from a variant's events.csv."""
    import csv
    seen = {}
    try:
        with open(vdir / "events.csv") as f:
            for row in csv.DictReader(f):
                seen.setdefault(row["kind"], float(row["time"]))
    except OSError:
        pass
    return seen


def phases(vdir, t0, t1):
    """Seconds of each phase of a variant from its events.csv: build, workers, probe, requests,
    teardown."""
    seen = event_times(vdir)
    if not seen:
        return {}
    out, last = {}, t0
    for kind, label in PHASES:
        if kind in seen:
            out[label] = seen[kind] - last
            last = seen[kind]
    out["teardown"] = t1 - last
    return out


def variant_spans(out):
    """{variant dir: (start, end, summary dict)} from each run directory the run wrote."""
    spans = {}
    for meta in sorted(out.glob("**/metadata.json")):
        m = json.loads(meta.read_text())
        summ = meta.with_name("summary.json")
        s = json.loads(summ.read_text()) if summ.exists() else {}
        spans[meta.parent] = (m["start_time"], m["end_time"], s)
    return spans


def token_messages(vdir):
    """(requests finished, token chunks the client received): a chunk is one gRPC message on
    each hop of the token path (decode -> scheduler -> client); the client stamps each with its
    arrival, so distinct arrival times count them."""
    n = chunks = 0
    try:
        with open(vdir / "requests.jsonl") as f:
            for line in f:
                if '"ev":"done"' in line:
                    n += 1
                    rec = json.loads(line)
                    chunks += len(rec.get("client_chunks") or set(rec.get("client_times") or ()))
    except OSError:
        pass
    return n, chunks


def fidelity(summary):
    emu = summary.get("emulation") or {}
    pred = summary.get("prediction") or {}
    return {"completed": summary.get("completed"), "failed": summary.get("failed"),
            "steady_rps": summary.get("steady_throughput"),
            "predicted_rps_expected": pred.get("lambda_max_expected", pred.get("lambda_max")),
            "prediction": pred,
            "first_token_lag_ms": emu.get("first_token_lag_ms"),
            "decode_step_ratio": emu.get("decode_step_ratio"),
            "prefill_ratio": emu.get("prefill_ratio"),
            "warnings": list(dict.fromkeys((summary.get("warnings") or [])
                                           + (emu.get("warnings") or []))),
            "ttft_p90_ms": summary.get("p90_ttft_ms"), "tpot_mean_ms": summary.get("mean_tpot_ms")}


def build_report(sampler, out, wall_s, tree_cpu_s, spy_cpu_s, load0, load1, top_n):
    spans = variant_spans(out)
    busy = [b - a for a, b in zip(sampler.busy0, sampler.busy1)]
    report = {"wall_s": wall_s, "load_before": load0, "load_after": load1,
              "machine_busy_share": busy[0] / busy[1] if busy[1] else None,
              "cores": os.cpu_count(), "run_tree_cpu_s": tree_cpu_s,
              "profiler_cpu_s": spy_cpu_s,
              "sampled_cpu_s": sum(p.cpu for p in sampler.procs.values()), "variants": []}
    for vdir, (t0, t1, summary) in spans.items():
        report["variants"].append(variant_report(sampler, vdir, t0, t1, summary))
    report["roles_all_variants"] = all_variants(report["variants"])
    return report


def frange(a, b, step):
    while a <= b:
        yield a
        a += step


def all_variants(variants):
    """Per role over every variant: CPU seconds and its functions (the instances of a role run
    the same code in each deployment, so their profiles add up to more samples)."""
    roles = {}
    for v in variants:
        for r in v["roles"]:
            a = roles.setdefault(r["role"], {"cpu_s": 0.0, "own": collections.Counter()})
            a["cpu_s"] += r["cpu_s"]
            a["own"].update(dict(r["own_cpu_s"]))
    out = []
    for role, a in sorted(roles.items(), key=lambda kv: -kv[1]["cpu_s"]):
        tot = sum(a["own"].values()) or 1.0
        out.append({"role": role, "cpu_s": a["cpu_s"],
                    "top_own": [(f, c / tot) for f, c in a["own"].most_common(15)]})
    return out


def process_row(p, cpu, t0, t1):
    """One process in one variant: CPU over [t0, t1], threads, and where its CPU went (from
    py-spy's attach to its end: a worker's start-up is not in its profile, and the
    orchestrator's profile covers the whole run, analysis and plots included)."""
    row = {"name": "testbed run" if p.role == "orchestrator" else p.name, "role": p.role,
           "pid": p.pid, "argv": p.argv[:6], "cpu_s": cpu, "sys_s": p.sys_s,
           "cpu_pct_of_variant": 100 * cpu / (t1 - t0), "startup_cpu_s": p.ready_cpu,
           "threads": p.threads_max}
    if p.pyspy is None:
        return row, None
    before = p.threads_at_attach
    seen = {tid: (name, user - before.get(tid, ("", 0.0, 0.0))[1],
                  sys_s - before.get(tid, ("", 0.0, 0.0))[2])
            for tid, (name, user, sys_s) in p.threads.items()}
    own, incl, threads, samples = attribute(read_profile(p.pyspy[1]), seen)
    tot = sum(own.values()) or 1.0
    row.update(profiled=True, samples=samples, thread_cpu=threads,
               top_own=[(f, c / tot) for f, c in own.most_common(12)],
               top_inclusive=[(f, c / tot) for f, c in incl.most_common(40)])
    return row, (own, incl)


def variant_report(sampler, vdir, t0, t1, summary):
    rows, roles = [], {}
    ev = event_times(vdir)
    # Workers up, no request yet (link probe, client start): the CPU floor of an idle worker.
    idle = (ev["workers_ready"] + sampler.interval_s, ev["client_started"]) \
        if "workers_ready" in ev and "client_started" in ev else None
    for p in sampler.procs.values():
        cpu = p.cpu_at(t1 + sampler.interval_s) - p.cpu_at(t0)
        if p.variant_dir not in (None, vdir) or cpu <= 0:
            continue
        row, prof = process_row(p, cpu, t0, t1)
        row["sys_s"] = p.cpu_at(t1 + sampler.interval_s, True) - p.cpu_at(t0, True)
        if idle is not None and p.samples and p.samples[0][0] < idle[0]:
            row["idle_cpu_pct"] = 100 * (p.cpu_at(idle[1]) - p.cpu_at(idle[0])) / (
                idle[1] - idle[0])
        rows.append(row)
        r = roles.setdefault(p.role, {"cpu_s": 0.0, "processes": 0, "own": collections.Counter(),
                                      "incl": collections.Counter()})
        r["cpu_s"] += cpu
        r["processes"] += 1
        if prof is not None:
            r["own"].update(prof[0])
            r["incl"].update(prof[1])
    rows.sort(key=lambda r: -r["cpu_s"])
    role_rows = []
    for role, r in sorted(roles.items(), key=lambda kv: -kv[1]["cpu_s"]):
        tot = sum(r["own"].values()) or 1.0
        role_rows.append({"role": role, "processes": r["processes"], "cpu_s": r["cpu_s"],
                          "own_cpu_s": r["own"].most_common(40),
                          "cpu_pct_of_variant": 100 * r["cpu_s"] / (t1 - t0),
                          "top_own": [(f, c / tot) for f, c in r["own"].most_common(12)],
                          "top_inclusive": [(f, c / tot) for f, c in r["incl"].most_common(40)]})
    done, chunks = token_messages(vdir)
    busy = None
    if "client_started" in ev and "client_finished" in ev:
        # The requests phase alone: how many of the machine's cores the run's processes used.
        a, b = ev["client_started"], ev["client_finished"]
        mine = [p for p in sampler.procs.values() if p.variant_dir in (None, vdir)]

        def used(x, y):
            return sum(p.cpu_at(y) - p.cpu_at(x) for p in mine)
        peak = max((used(x, x + 2.0) / 2.0 for x in frange(a, b - 2.0, 0.5)), default=None)
        busy = {"seconds": b - a, "cpu_s": used(a, b), "cores_used": used(a, b) / (b - a),
                "peak_2s_cores_used": peak}
    return {"variant": vdir.name, "dir": str(vdir), "wall_s": t1 - t0,
            "phases_s": phases(vdir, t0, t1), "requests_done": done, "token_chunks": chunks,
            "requests_phase": busy,
            "fidelity": fidelity(summary), "processes": rows, "roles": role_rows}


def fmt_top(top, n):
    return ", ".join(f"{f} {100 * s:.0f}%" for f, s in top[:n] if s >= 0.005)


def print_report(rep, top_n):
    spans = sum(v["wall_s"] for v in rep["variants"])
    print(f"wall {rep['wall_s']:.1f} s ({rep['wall_s'] - spans:.1f} s outside the variants: "
          f"imports, analysis, figures); load average before {rep['load_before']}, after "
          f"{rep['load_after']}; all {rep['cores']} cores busy "
          f"{100 * (rep['machine_busy_share'] or 0):.0f}% over the run; run tree CPU "
          f"{rep['run_tree_cpu_s']:.1f} s (sampled {rep['sampled_cpu_s']:.1f} s); py-spy's own "
          f"CPU {rep['profiler_cpu_s']:.1f} s")
    for v in rep["variants"]:
        print_variant(v, top_n)
    print(f"\n== every variant: {'role':<12} {'CPU s':>6}  top functions (profiled instances)")
    for r in rep["roles_all_variants"]:
        print(f"   {r['role']:<28} {r['cpu_s']:6.2f}  {fmt_top(r['top_own'], top_n + 3)}")


def print_variant(v, top_n):
    """One variant's block: fidelity, phases, requests phase, the process and role tables."""
    f = v["fidelity"]
    pred = f["predicted_rps_expected"]
    ratio = f"{f['steady_rps'] / pred:.3f}" if f["steady_rps"] and pred else "-"
    print(f"\n== {v['variant']}: wall {v['wall_s']:.1f} s; completed {f['completed']}, "
          f"failed {f['failed']}; steady {f['steady_rps'] or float('nan'):.3f} req/s vs "
          f"predicted (E[T]) {pred or float('nan'):.3f} ({ratio}); first-token lag "
          f"{f['first_token_lag_ms'] or float('nan'):.0f} ms; decode step "
          f"{f['decode_step_ratio'] or float('nan'):.3f}x, prefill "
          f"{f['prefill_ratio'] or float('nan'):.3f}x")
    print("   phases: " + ", ".join(f"{k} {s:.1f} s" for k, s in v["phases_s"].items()))
    rp = v["requests_phase"]
    if rp:
        print(f"   requests phase: {rp['seconds']:.1f} s, the run's processes used "
              f"{rp['cpu_s']:.1f} CPU-s = {rp['cores_used']:.2f} of {os.cpu_count()} cores "
              f"(busiest 2 s: {rp['peak_2s_cores_used'] or float('nan'):.2f})")
    print(f"   token path: {v['token_chunks']} chunks for {v['requests_done']} requests "
          f"({v['token_chunks'] / max(v['requests_done'], 1):.1f} per request)")
    for w in f["warnings"]:
        print(f"   warning: {w}")
    print(f"{'process':<12} {'role':<12} {'CPU s':>6} {'% wall':>6} {'sys':>5} {'start':>5} "
          f"{'idle%':>5} {'thr':>3}  top {top_n} functions by own CPU (py-spy share x /proc "
          f"thread CPU)")
    for r in v["processes"]:
        if r["cpu_s"] < 0.05:
            continue
        start = f"{r['startup_cpu_s']:.1f}" if r["startup_cpu_s"] is not None else "-"
        idle = f"{r['idle_cpu_pct']:.1f}" if r.get("idle_cpu_pct") is not None else "-"
        print(f"{r['name'][:12]:<12} {r['role']:<12} {r['cpu_s']:6.2f} "
              f"{r['cpu_pct_of_variant']:6.1f} {r['sys_s']:5.2f} {start:>5} {idle:>5} "
              f"{r['threads']:3d}  {fmt_top(r.get('top_own', []), top_n)}")
        for t in r.get("thread_cpu", [])[:4]:
            print(f"{'':<14}thread {t['thread'][:28]:<28} {t['cpu_s']:5.2f} s  "
                  f"{fmt_top([(f, c / (t['cpu_s'] or 1)) for f, c in t['top_own_cpu_s']], 3)}")
    print(f"{'role':<12} {'n':>3} {'CPU s':>6} {'% wall':>6}  top functions (profiled "
          f"instances)")
    for r in v["roles"]:
        print(f"{r['role']:<12} {r['processes']:3d} {r['cpu_s']:6.2f} "
              f"{r['cpu_pct_of_variant']:6.1f}  {fmt_top(r['top_own'], top_n)}")


# ---- main ---------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", help="experiment file, or with --report a profiled run dir")
    ap.add_argument("--report", action="store_true",
                    help="only rebuild and print the report of an earlier profiled run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="run directory (new or empty); default results/profile/<time>")
    ap.add_argument("--no-pyspy", action="store_true", help="CPU per process only")
    ap.add_argument("--no-probe", action="store_true", help="testbed run --no-probe")
    ap.add_argument("--metrics", type=int, metavar="PORT",
                    help="testbed run --metrics PORT (the live exporter, docs/live.md)")
    ap.add_argument("--rate", type=int, default=25, help="py-spy samples per second")
    ap.add_argument("--every", action="store_true",
                    help="py-spy on every worker (default: one per role and variant)")
    ap.add_argument("--native", action="append", default=[], metavar="ROLE",
                    help="also sample native frames (gRPC core, syscalls) of this role's "
                         "processes; pauses them at each sample")
    ap.add_argument("--interval", type=float, default=0.25, help="/proc sampling period, s")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    if args.report:
        report(pathlib.Path(args.experiment).resolve(), args.top)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("profile_run: needs root (testbed run and py-spy); run it under sudo")
    if not args.no_pyspy:
        pyspy_binary()
    out = pathlib.Path(args.out or REPO / "results" / "profile" / time.strftime("%Y%m%d-%H%M%S"))
    out = out.resolve()
    argv = [sys.executable, "-m", "testbed.cli", "run", args.experiment, "--out", str(out)]
    for s in args.set:
        argv += ["--set", s]
    if args.no_probe:
        argv.append("--no-probe")
    if args.metrics:
        argv += ["--metrics", str(args.metrics)]
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f".{out.name}.testbed-run.log"
    load0 = os.getloadavg()
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    with open(log_path, "wb") as log:
        run = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    profiles = out / "profiles"
    sampler = Sampler(run.pid, profiles, args.interval, not args.no_pyspy, args.rate,
                      args.every, args.native).start()
    try:
        _, status, usage = os.wait4(run.pid, 0)
    except KeyboardInterrupt:
        run.terminate()
        _, status, usage = os.wait4(run.pid, 0)
    run.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - t0
    sampler.finish()
    tree_cpu = usage.ru_utime + usage.ru_stime
    spy_cpu = _children_cpu() - tree_cpu      # what is left of our reaped children: py-spy
    load1 = os.getloadavg()
    profiles.mkdir(parents=True, exist_ok=True)
    shutil.move(str(log_path), profiles / "testbed-run.log")
    if run.returncode != 0:
        print(f"testbed run exited with {run.returncode}; see {profiles / 'testbed-run.log'}",
              file=sys.stderr)
    run_info = {"argv": sys.argv, "wall_s": wall, "tree_cpu_s": tree_cpu, "spy_cpu_s": spy_cpu,
                "load0": [round(x, 2) for x in load0], "load1": [round(x, 2) for x in load1],
                "interval_s": sampler.interval_s, "busy0": sampler.busy0,
                "busy1": sampler.busy1, "returncode": run.returncode,
                "processes": [p.to_json() for p in sampler.procs.values()]}
    (profiles / "processes.json").write_text(json.dumps(run_info))
    report(out, args.top)
    return 0 if run.returncode == 0 else 1


def report(out, top_n):
    """Build, save and print the report of a profiled run from DIR/profiles/processes.json."""
    profiles = out / "profiles"
    info = json.loads((profiles / "processes.json").read_text())
    sampler = argparse.Namespace(
        interval_s=info["interval_s"], busy0=info["busy0"], busy1=info["busy1"],
        procs={(d["pid"], d["start"]): Proc.from_json(d) for d in info["processes"]})
    rep = build_report(sampler, out, info["wall_s"], info["tree_cpu_s"], info["spy_cpu_s"],
                       info["load0"], info["load1"], top_n)
    rep["argv"] = info["argv"]
    (profiles / "profile.json").write_text(json.dumps(rep, indent=1))
    print_report(rep, top_n)
    print(out)


def _children_cpu():
    """CPU seconds of every child this script started and reaped (the run's tree, py-spy)."""
    import resource
    return sum(getattr(resource.getrusage(resource.RUSAGE_CHILDREN), k)
               for k in ("ru_utime", "ru_stime"))


if __name__ == "__main__":
    sys.exit(main())
