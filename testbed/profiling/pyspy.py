"""py-spy for profiling a `testbed run`: starting a recorder, and charging CPU to functions.

`record` starts one `py-spy record --threads --format raw` on one PID (non-blocking, or with
native frames, which pause the target per sample). `read_profile` reads the raw file back per
thread; `attribute` splits each thread's measured CPU (from /proc, `testbed.profiling.sampler`)
over the functions its samples end in, so a function's share is CPU seconds, not samples.

Library code for benchmarks/profile_run.py; py-spy comes from the `profile` extra
(`pip install '.[profile]'`).
"""

import collections
import pathlib
import shutil
import subprocess
import sys


def pyspy_binary():
    found = shutil.which("py-spy") or str(pathlib.Path(sys.executable).with_name("py-spy"))
    if not pathlib.Path(found).exists():
        raise SystemExit("py-spy not found: pip install '.[profile]' (or use --no-pyspy)")
    return found


def record(pid, out, rate, native=False):
    """Start `py-spy record` on `pid` writing collapsed stacks per thread to `out` (its log
    beside it); returns (Popen, out). `native` adds native frames (gRPC's Cython and C core,
    syscalls), pausing the target at each sample."""
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [pyspy_binary(), "record", "--pid", str(pid), "--rate", str(rate),
            "--format", "raw", "--threads", "--output", str(out)]
    argv += ["--native"] if native else ["--nonblocking"]
    with open(out.with_suffix(".pyspy.log"), "wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL), out


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
