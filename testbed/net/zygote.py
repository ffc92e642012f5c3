"""The worker launcher: one process that has imported the workers' modules forks each worker.

A worker started as `python -m workers.decode` spends ~0.17 CPU-s before its own code runs
(the interpreter, gRPC, protobuf, the testbed's modules), and a case-study run starts 39 of
them; a child forked from a process that has already imported them costs ~4 ms. So the Mininet
network (`testbed.net.build.Network`) starts one launcher (`Zygote`) with the network and
hands it each worker whose module is in `FORKABLE`; anything else (vLLM's workers, which load
torch) is started with mnexec as before.

The launcher (`python -m testbed.net.zygote`, `serve()`) imports `FORKABLE` once, with no
thread, event loop or gRPC channel yet, and then reads one JSON request a line on stdin. For
each it forks a child that, like `mnexec -da <host pid>`, joins the host's network (and mount)
namespace, calls setsid(), sets the parent-death signal (SIGKILL when the launcher dies; the
launcher itself dies with the orchestrator the same way), sends its output to the worker's log,
takes the worker's environment and argv and runs the module as `__main__` (as `python -m`
does). The launcher answers each request with the child's PID and start time, reaps its
children and reports each exit code and CPU time on stdout (`ZygoteProc.cpu_s`: the run's
CPU per request counts the workers, which are not the orchestrator's children).

The orchestrator's side: `Zygote.spawn()` returns a `ZygoteProc`, a Popen-like handle (pid,
returncode, poll, wait, send_signal, terminate, kill) whose exit code comes from the launcher's
report; signals go straight to the PID, and only while the recorded process (PID and start
time) is the one running. The network records every child's PID in the run's registry, as for
mnexec, so teardown and `testbed clean` find them.
"""

import atexit
import ctypes
import gc
import io
import json
import os
import pathlib
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback

from testbed import lifecycle
from testbed.errors import NetworkError
from testbed.net import netlink

# The profile engine's workers: their modules load no numpy or pyarrow at import (these start
# threads, and a process with threads must not fork: tests/test_zygote.py checks).
FORKABLE = ("workers.decode", "workers.prefill", "workers.scheduler", "workers.client")
LAUNCHER_MODULE = "testbed.net.zygote"    # this module, as `python -m` names it
CMDLINE_ROOM = 4096          # bytes of the launcher's argv, for each child's own (see below)
READY_TIMEOUT_S = 60.0       # the imports, on a loaded 2-core machine


def forkable(argv):
    """The module name when `argv` is `<this interpreter> -m <module in FORKABLE> ...`, else
    None (another interpreter, e.g. vLLM's environment, is started as a program)."""
    if len(argv) > 2 and str(argv[0]) == sys.executable and argv[1] == "-m" \
            and argv[2] in FORKABLE:
        return argv[2]
    return None


# ---- the launcher process -------------------------------------------------------------------

def _join_host(host_pid):
    """The host's network namespace, and its mount namespace where it has its own (mnexec -a).
    Joining a mount namespace moves the caller to its root directory; the worker keeps the
    launcher's working directory, as mnexec does, so relative paths (a run's `--out`) hold."""
    netlink.enter_ns(f"/proc/{host_pid}/ns/net")
    if os.readlink(f"/proc/{host_pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
        cwd = os.getcwd()
        netlink.enter_ns(f"/proc/{host_pid}/ns/mnt", netlink.CLONE_NEWNS)
        os.chdir(cwd)


def _set_cmdline(argv):
    """/proc/<pid>/cmdline shows the worker's argv, so `ps` and the profiler's sampler
    (testbed/profiling/sampler.py: roles by module) see a worker, not the launcher: written over
    the launcher's own argv (as setproctitle does), which `CMDLINE_ROOM` makes long enough."""
    fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])   # arg_start, arg_end: proc(5) fields 48, 49
    new = b"\0".join(a.encode() for a in argv)[:end - start - 1]
    ctypes.memmove(start, new.ljust(end - start, b"\0"), end - start)


def _redirect(log_path):
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    # PYTHONUNBUFFERED's streams: what a worker prints is in its log even if it is killed
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")


def _exit_code(exc):
    """The interpreter's exit status for a SystemExit (its code, or 1 after printing it)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(req, zygote_pid):
    """In the forked child: become the worker of `req` and run it; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        atexit._clear()         # the launcher's exit functions are not the worker's
        os.setsid()
        lifecycle.set_parent_death_signal(signal.SIGKILL, zygote_pid)
        _redirect(req["log"])
        _join_host(req["host_pid"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = req["argv"]
        _set_cmdline(argv)
        module = argv[2]
        sys.argv = [argv[0], *argv[3:]]
        sys.modules.pop(module, None)   # run as `python -m` runs it: a fresh __main__
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:       # noqa: BLE001 (the worker's crash, printed as Python would)
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code < 0:            # died of a signal, as the interpreter reports KeyboardInterrupt
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _send(msg):
    os.write(1, (json.dumps(msg) + "\n").encode())


def _fork(req, wake_fds):
    # The launcher's PID, taken before the fork: a child that asked getppid() after the launcher
    # died would get init's and take it for its parent (it then never got the parent-death
    # signal and slept on as an orphan: 1 in 12 of test_children_die_with_the_launcher).
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        for fd in wake_fds:
            os.close(fd)
        _child(req, me)
    # The child is not reaped before this read (only `_reap` reaps): the start time is its own.
    _send({"pid": pid, "start": lifecycle.proc_start_time(pid)})
    return pid


def _reap(children):
    """Reap exited children, reporting each one's exit code and CPU seconds (user + system,
    from wait4: what a Popen parent's RUSAGE_CHILDREN would have counted)."""
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status),
               "cpu": round(usage.ru_utime + usage.ru_stime, 4)})


def _read_requests(buf):
    """Whole lines of `buf` as requests, and the rest; b'' (stdin closed) gives None."""
    chunk = os.read(0, 1 << 16)
    if not chunk:
        return None, buf
    *lines, rest = (buf + chunk).split(b"\n")
    return [json.loads(line) for line in lines if line.strip()], rest


def _stop_children(children):
    """stdin closed: the orchestrator is done (it stopped the workers first); SIGKILL any
    child left, which this process can do safely (none is reaped before it is waited for)."""
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in list(children):
        os.waitpid(pid, 0)


def serve(preload=FORKABLE):
    """The launcher's main: import `preload`, say ready, serve requests until stdin closes."""
    for module in preload:
        __import__(module)
    threads = len(os.listdir("/proc/self/task"))
    gc.freeze()                 # the imported objects stay shared with every child
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send({"ready": os.getpid(), "threads": threads})
    children, buf = set(), b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])    # a request or a child's exit
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(children)
        if 0 in readable:
            reqs, buf = _read_requests(buf)
            if reqs is None:
                _stop_children(children)
                return
            for req in reqs:
                children.add(_fork(req, (wake_r, wake_w)))
        _reap(children)


# ---- the orchestrator's side ----------------------------------------------------------------

class ZygoteProc:
    """A worker forked by the launcher, handled like a subprocess.Popen."""

    def __init__(self, pid, start, args):
        self.pid, self.start, self.args = pid, start, args
        self.returncode = None
        self.cpu_s = None               # its CPU seconds, once the launcher reaped it
        self._done = threading.Event()

    def _exited(self, code, cpu_s=None):
        self.returncode, self.cpu_s = code, cpu_s
        self._done.set()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        """Signal the worker, only while the process recorded is the one running (a reaped
        worker's PID may be another process's by now)."""
        if self.returncode is None and lifecycle.proc_start_time(self.pid) == self.start:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The orchestrator's end of the launcher: start() it, spawn() workers, stop() it.

    A reader thread takes the launcher's answers: a spawned child's PID (to the spawn waiting
    for it) and each exit code (to that child's handle). If the launcher dies, its children die
    with it (their parent-death signal): every handle still running gets -SIGKILL.
    """

    def __init__(self, registry):
        self.registry = registry
        self.proc = None
        self.procs = {}                 # pid -> ZygoteProc
        self._replies = []
        self._early_exits = {}          # pid -> exit code, reported before spawn() returned
        self._cond = threading.Condition()
        self._spawn_lock = threading.Lock()

    def start(self):
        """Start the launcher (from the main thread: its parent-death signal is tied to the
        thread that forks it) and wait until it has imported FORKABLE."""
        # Its own errors (an import that failed) go to our stderr; each child writes to its log.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", LAUNCHER_MODULE, " " * CMDLINE_ROOM],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=lifecycle.orchestrator_env(),
            preexec_fn=lifecycle.die_with_parent(), start_new_session=True)
        self.registry.add_process(self.proc.pid, "worker launcher (testbed.net.zygote)")
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()
        ready = self._reply(READY_TIMEOUT_S)
        if ready.get("threads") != 1:
            self.stop()
            raise NetworkError(f"worker launcher: {ready.get('threads')} threads after its "
                               "imports (one is needed to fork safely)")
        return self

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "exit" in msg:
                with self._cond:
                    proc = self.procs.get(msg["exit"])
                    if proc is None:        # exited before its spawn() took the answer
                        self._early_exits[msg["exit"]] = (msg["code"], msg.get("cpu"))
                if proc is not None:
                    proc._exited(msg["code"], msg.get("cpu"))
                continue
            with self._cond:
                self._replies.append(msg)
                self._cond.notify_all()
        with self._cond:                # the launcher is gone, and its children with it
            self._replies.append({"error": f"the launcher exited ({self.proc.wait()})"})
            self._cond.notify_all()
            running = [p for p in self.procs.values() if p.returncode is None]
        for p in running:
            p._exited(-signal.SIGKILL)

    def _reply(self, timeout_s):
        with self._cond:
            if not self._cond.wait_for(lambda: self._replies, timeout_s):
                raise NetworkError(f"worker launcher: no answer in {timeout_s:.0f} s")
            msg = self._replies.pop(0)
        if "error" in msg:
            raise NetworkError(f"worker launcher: {msg['error']}")
        return msg

    def spawn(self, host_pid, argv, log_path, env):
        """Fork `argv` (python -m <module in FORKABLE> ...) inside the namespaces of the host
        whose shell is `host_pid`, output appended to `log_path`; a `ZygoteProc`."""
        req = {"host_pid": host_pid, "argv": [str(a) for a in argv], "log": str(log_path),
               "env": env}
        with self._spawn_lock:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            msg = self._reply(READY_TIMEOUT_S)
            proc = ZygoteProc(msg["pid"], msg["start"], argv)
            with self._cond:
                self.procs[proc.pid] = proc
                early = self._early_exits.pop(proc.pid, None)
        if early is not None:
            proc._exited(*early)
        return proc

    def stop(self):
        """Close the launcher's stdin: it SIGKILLs any child left (the run has stopped its
        workers before), reaps them and exits."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    serve()
