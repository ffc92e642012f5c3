"""The worker launcher (testbed/net/zygote.py): workers forked from one pre-imported process.

Unit: the forkable modules leave one thread after import (a process with threads must not
fork). Root (setns, the cmdline's PR_SET_MM): a real launcher forks a small module into another
network namespace, and the handle behaves as a Popen: exit codes, a crash, signals to the
process group, the PID on record, and nothing left when the launcher dies.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from testbed import lifecycle
from testbed.net.zygote import FORKABLE, Zygote, forkable

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = """
import os, sys, time
what = sys.argv[1]
print("hello", os.environ.get("ZYG_MARK"), os.readlink("/proc/self/ns/net"), flush=True)
print("where", os.readlink("/proc/self/ns/mnt"), os.getcwd(), flush=True)
if what == "sleep":
    time.sleep(60)
elif what == "exit":
    sys.exit(int(sys.argv[2]))
elif what == "crash":
    raise RuntimeError("boom")
elif what == "burn":                  # this much CPU, as its own clock counts it
    t0 = time.process_time()
    while time.process_time() - t0 < float(sys.argv[2]):
        pass
    print("burnt", time.process_time(), flush=True)
"""


def test_forkable_modules_leave_one_thread():
    code = (f"import os\nfor m in {FORKABLE!r}: __import__(m)\n"
            "print(len(os.listdir('/proc/self/task')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "1"


def test_forkable_argv():
    assert forkable([sys.executable, "-m", "workers.decode", "--name", "d0"]) == "workers.decode"
    assert forkable([sys.executable, "-m", "workers.vllm_server"]) is None
    assert forkable(["/other/python", "-m", "workers.decode"]) is None


class _Registry:
    def __init__(self):
        self.pids = []

    def add_process(self, pid, what):
        self.pids.append(pid)


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    (tmp_path / "zyg_target.py").write_text(TARGET)
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{tmp_path}")
    host = subprocess.Popen(["unshare", "-n", "sleep", "60"])    # a host: its own netns
    _until(lambda: os.readlink(f"/proc/{host.pid}/ns/net") != os.readlink("/proc/self/ns/net"))
    z = Zygote(_Registry()).start()
    yield z, host.pid, tmp_path
    z.stop()
    host.kill()
    host.wait()


def _until(cond, timeout_s=5.0):
    """Wait for `cond()` (a child's setup, a signal's effect), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _spawn(z, host_pid, tmp_path, *args):
    env = dict(os.environ, ZYG_MARK="m1")
    return z.spawn(host_pid, [sys.executable, "-m", "zyg_target", *args],
                   tmp_path / "w.log", env)


@pytest.mark.root
def test_exit_code_log_namespace(launcher):
    z, host_pid, tmp = launcher
    p = _spawn(z, host_pid, tmp, "exit", "3")
    assert p.wait(timeout=10) == 3 and p.returncode == 3
    log = (tmp / "w.log").read_text()
    assert f"hello m1 {os.readlink(f'/proc/{host_pid}/ns/net')}" in log
    assert z.registry.pids == [z.proc.pid]      # the network records the children (build.py)


@pytest.mark.root
def test_a_host_with_its_own_mounts_keeps_the_working_directory(tmp_path, monkeypatch):
    """Joining a mount namespace moves a process to its root: the worker is moved back to the
    launcher's directory, as mnexec does (a run's relative `--out` names its runtime.json)."""
    (tmp_path / "zyg_target.py").write_text(TARGET)
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{tmp_path}")
    monkeypatch.chdir(tmp_path)
    host = subprocess.Popen(["unshare", "-n", "-m", "sleep", "60"])
    _until(lambda: os.readlink(f"/proc/{host.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"))
    where = f"where {os.readlink(f'/proc/{host.pid}/ns/mnt')} {tmp_path}"
    z = Zygote(_Registry()).start()
    try:
        assert _spawn(z, host.pid, tmp_path, "exit", "0").wait(timeout=10) == 0
    finally:
        z.stop()
        host.kill()
        host.wait()
    assert where in (tmp_path / "w.log").read_text()


@pytest.mark.root
def test_crash_is_seen(launcher):
    z, host_pid, tmp = launcher
    p = _spawn(z, host_pid, tmp, "crash")
    assert p.wait(timeout=10) == 1
    assert "RuntimeError: boom" in (tmp / "w.log").read_text()


@pytest.mark.root
def test_a_reaped_child_reports_the_cpu_it_used(launcher):
    """The run's CPU per request counts its workers, which the launcher reaps: each exit
    carries the child's CPU seconds (wait4), here against the child's own clock."""
    z, host_pid, tmp = launcher
    idle = _spawn(z, host_pid, tmp, "exit", "0")
    busy = _spawn(z, host_pid, tmp, "burn", "0.3")
    assert idle.wait(timeout=10) == 0 and busy.wait(timeout=20) == 0
    own = float((tmp / "w.log").read_text().split("burnt ")[1].split()[0])
    assert 0 <= idle.cpu_s < 0.2
    assert own <= busy.cpu_s <= own + 0.1


@pytest.mark.root
def test_signals_group_and_cmdline(launcher):
    z, host_pid, tmp = launcher
    p = _spawn(z, host_pid, tmp, "sleep")
    _until(lambda: b"-m\0zyg_target\0sleep" in pathlib.Path(f"/proc/{p.pid}/cmdline").read_bytes())
    assert p.poll() is None and os.getpgid(p.pid) == p.pid      # setsid: its own group
    assert lifecycle.proc_start_time(p.pid) == p.start
    os.killpg(p.pid, signal.SIGSTOP)                # a `pause` fault
    _until(lambda: pathlib.Path(f"/proc/{p.pid}/stat").read_text().split(")")[1].split()[0] == "T")
    os.killpg(p.pid, signal.SIGCONT)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    p.terminate()
    assert p.wait(timeout=10) == -signal.SIGTERM


@pytest.mark.root
def test_children_die_with_the_launcher(launcher):
    z, host_pid, tmp = launcher
    procs = [_spawn(z, host_pid, tmp, "sleep") for _ in range(3)]
    z.proc.kill()                                   # as if the orchestrator's chain died
    for p in procs:
        assert p.wait(timeout=10) == -signal.SIGKILL
        _until(lambda: _dead(p))                    # gone, not only reported


def _dead(p):
    """The process is gone, or a zombie: dead, left for init to reap (an orphan's reaping
    waited past 5 s once on a busy machine, CI 2026-12-03)."""
    if lifecycle.proc_start_time(p.pid) != p.start:
        return True
    try:
        stat = pathlib.Path(f"/proc/{p.pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.mark.root
def test_stop_leaves_nothing(launcher):
    z, host_pid, tmp = launcher
    p = _spawn(z, host_pid, tmp, "sleep")
    z.stop()
    assert z.proc.returncode == 0
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert lifecycle.proc_start_time(p.pid) != p.start
