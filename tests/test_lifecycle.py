"""Lifecycle and output safety without namespaces: parent-death signal, the orchestrator watch,
teardown signals, `testbed clean`'s identity checks and corrupt state, `--out`, ownership under
sudo, scheduled link changes that fail, and analysing a killed run from its directory."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pandas as pd
import pytest
import yaml

from testbed import analysis, config, lifecycle, ownership, rundir
from testbed.net.schedule import LinkSchedule

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _gone_within(pid, start, timeout_s):
    """Seconds until process (pid, start) is gone, or None if it outlived `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if lifecycle.proc_start_time(pid) != start:
            return time.monotonic() - t0
        try:                               # our own child: reap it, a zombie still has a stat
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.01)
    return None


def _zombie_or_gone(pid):
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_parent_death_signal_kills_the_grandchild_when_its_parent_is_sigkilled():
    # A middle process starts `sleep` with die_with_parent(), prints its PID, and waits; SIGKILL
    # of the middle (no teardown at all) must take the sleep with it.
    code = textwrap.dedent("""
        import subprocess, sys, time
        from testbed import lifecycle
        p = subprocess.Popen(["sleep", "60"], preexec_fn=lifecycle.die_with_parent())
        print(p.pid, flush=True)
        time.sleep(60)
        """)
    mid = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                           env=ENV)
    try:
        pid = int(mid.stdout.readline())
        start = lifecycle.proc_start_time(pid)
        assert start is not None
        mid.kill()
        mid.wait()
        t0 = time.monotonic()
        while not _zombie_or_gone(pid):
            assert time.monotonic() - t0 < 2.0, "the grandchild outlived its parent by 2 s"
            time.sleep(0.01)
    finally:
        mid.kill()


def test_die_with_parent_is_not_set_off_the_main_thread():
    import threading
    got = []
    t = threading.Thread(target=lambda: got.append(lifecycle.die_with_parent()))
    t.start()
    t.join()
    assert got == [None] and lifecycle.die_with_parent() is not None


def _switches(pid):
    """Voluntary context switches of every thread of `pid` so far."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                total += int(line.split()[1])
    return total


def test_worker_watch_exits_when_the_orchestrator_is_gone():
    """Alive while the orchestrator is, SIGKILLed once it is gone. The watch waits on a
    pidfd: a worker that sleeps wakes no thread in a second (the polling watch
    woke five times a second in every worker)."""
    orchestrator = subprocess.Popen(["sleep", "60"])
    token = lifecycle.identity(orchestrator.pid)
    code = "from workers import common; import time; common.die_with_orchestrator(); time.sleep(60)"
    worker = subprocess.Popen([sys.executable, "-c", code],
                              env=dict(ENV, **{lifecycle.ORCHESTRATOR_ENV: token}))
    try:
        time.sleep(1.5)
        before = _switches(worker.pid)
        time.sleep(1.0)
        assert _switches(worker.pid) - before <= 1
        assert worker.poll() is None               # alive while the orchestrator is
        orchestrator.kill()
        orchestrator.wait()
        worker.wait(timeout=2.0)
        assert worker.returncode == -signal.SIGKILL
    finally:
        orchestrator.kill()
        worker.kill()


def test_identity_checks_start_time_not_just_pid():
    me = lifecycle.identity()
    assert lifecycle.identity_alive(me)
    pid, start = me.split(":")
    assert not lifecycle.identity_alive(f"{pid}:{int(start) + 1}")   # a reused PID
    assert not lifecycle.identity_alive("garbage")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_teardown_signals_unwind_like_ctrl_c(sig):
    code = textwrap.dedent("""
        import time
        from testbed import lifecycle
        lifecycle.sigterm_unwinds()
        try:
            print("ready", flush=True)
            time.sleep(30)
        except KeyboardInterrupt:
            print("unwound", flush=True)
        """)
    # Started with SIGINT ignored, as a shell starts a background job.
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(sig)
    out, _ = p.communicate(timeout=10)
    assert out.strip() == "unwound" and p.returncode == 0


def test_kill_recorded_spares_a_process_whose_start_time_differs():
    p = subprocess.Popen(["sleep", "30"])
    try:
        start = lifecycle.proc_start_time(p.pid)
        assert lifecycle.kill_recorded(p.pid, start + 1, grace_s=0.2) is False
        assert p.poll() is None
        assert lifecycle.kill_recorded(p.pid, start, grace_s=1.0) is True
        assert p.wait(timeout=2) == -signal.SIGTERM
    finally:
        p.kill()


def _state(d, name, **fields):
    s = {"run_id": name, "kind": "test", "owner_pid": 1, "owner_start": -5, "processes": [],
         "netns": [], "links": [], "commands": [], **fields}
    (d / f"{name}.json").write_text(json.dumps(s))


def test_clean_reports_corrupt_state_and_keeps_it(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    _state(tmp_path, "badproc", processes=[{"pid": "x"}])
    _state(tmp_path, "dead", owner_start=-5)          # PID 1 but not that process: gone
    _state(tmp_path, "live", owner_pid=os.getppid(),
           owner_start=lifecycle.proc_start_time(os.getppid()))
    report, corrupt = lifecycle.cleanup_all(state_dir=tmp_path)
    assert len(corrupt) == 3 and all("corrupt state file" in c for c in corrupt)
    assert {pathlib.Path(c.split(":")[0]).name for c in corrupt} == \
        {"bad.json", "list.json", "badproc.json"}
    assert (tmp_path / "bad.json").exists() and (tmp_path / "list.json").exists()
    assert not (tmp_path / "dead.json").exists()
    assert (tmp_path / "live.json").exists()
    assert any("live: still running" in r for r in report)


def test_clean_command_exits_nonzero_on_corrupt_state(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("testbed clean needs root")
    (tmp_path / "bad.json").write_text("\x00\x01")
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "clean"], capture_output=True,
                       text=True, env=dict(ENV, TESTBED_STATE_DIR=str(tmp_path)), timeout=60)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "bad.json" in r.stderr
    assert (tmp_path / "bad.json").exists()


def test_out_must_be_new_or_empty(tmp_path):
    exp = ROOT / "tests" / "data" / "tiny.yaml"
    old = tmp_path / "old"
    old.mkdir()
    (old / "requests.jsonl").write_text("{}\n")
    afile = tmp_path / "file"
    afile.write_text("x")
    for out, what in ((old, "not empty"), (afile, "not a directory")):
        r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(exp), "--out",
                            str(out)], capture_output=True, text=True, env=ENV, timeout=60)
        assert r.returncode == 2
        assert len(r.stderr.strip().splitlines()) == 1 and what in r.stderr and str(out) in r.stderr
    assert (old / "requests.jsonl").read_text() == "{}\n" and sorted(os.listdir(old)) == \
        ["requests.jsonl"]
    rundir.check_out(tmp_path / "new")                  # absent: fine
    (tmp_path / "empty").mkdir()
    rundir.check_out(tmp_path / "empty")                # empty: fine


def test_outputs_are_handed_to_the_sudo_user(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    monkeypatch.setenv("SUDO_UID", "65534")
    monkeypatch.setenv("SUDO_GID", "65534")
    top = tmp_path / "a" / "b" / "run"
    made = ownership.missing_ancestors(top)
    assert made == [top, top.parent, top.parent.parent]
    (top / "logs").mkdir(parents=True)
    (top / "logs" / "x.log").write_text("x")
    (top / "link").symlink_to("/etc/hostname")      # never followed
    ownership.hand_back(top)
    ownership.hand_back(*made[1:], recursive=False)
    for p in [top, top / "logs", top / "logs" / "x.log", *made[1:]]:
        st = p.stat()
        assert (st.st_uid, st.st_gid) == (65534, 65534), p
    assert os.lstat(top / "link").st_uid == 65534 and os.stat("/etc/hostname").st_uid == 0
    assert tmp_path.stat().st_uid == 0               # existed before: not ours to give away
    monkeypatch.setenv("SUDO_UID", "0")
    assert ownership.invoking_user() is None


class FlakyWan:
    def __init__(self, fail_at):
        self.fail_at, self.applied = fail_at, []

    def set(self, direction=None, **changes):
        if changes.get("rate") == self.fail_at:
            raise RuntimeError("tc said no")
        self.applied.append(changes["rate"])


def test_a_failed_link_change_is_reported_and_later_ones_still_apply():
    events, warnings = [], []
    wan = FlakyWan(fail_at=2e6)
    items = [(0.0, None, {"rate": 1e6}), (0.05, "kv", {"rate": 2e6}), (0.1, None, {"rate": 3e6})]
    s = LinkSchedule(wan, items, lambda kind, **f: events.append((kind, f)), warnings.append)
    s.start(time.time())
    s._thread.join(timeout=5)
    assert wan.applied == [1e6, 3e6] and s.applied == 2
    assert [e[0] for e in events] == ["link_schedule_error"]
    assert "tc said no" in events[0][1]["error"] and events[0][1]["direction"] == "kv"
    assert len(warnings) == 1 and "later changes still apply" in warnings[0]
    assert s.error and "tc said no" in s.error


def _killed_run_dir(tmp_path, small_experiment):
    """A run directory as a SIGKILLed `testbed run` leaves it: config, workload, partial records
    (the last line cut mid-way), timeseries, events; no metadata.json, no summary."""
    src = tmp_path / "exp.yaml"
    src.write_text(small_experiment)
    exp = config.load_experiment(src)[0]
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump(config.resolved(exp), sort_keys=False))
    n = exp.requests
    pd.DataFrame({"id": np.arange(n), "arrival_s": np.arange(n, dtype=float),
                  "input_len": [1000] * n, "output_len": [16] * n}).to_parquet(
        d / "workload.parquet", index=False)
    lines = []
    for i in range(7):                                # 7 sent; 0-3 done (3 failed), 4-6 not
        lines.append({"ev": "sent", "id": i, "send_time": 100.0 + i, "lateness_s": 0.001})
    for i in range(4):
        lines.append({"ev": "done", "id": i, "send_time": 100.0 + i, "first_token": 100.2 + i,
                      "last_token": 100.5 + i, "n_tokens": 16,
                      "status": "ok" if i != 3 else "failed", "error": "" if i != 3 else "boom",
                      "route": "remote", "kv_bytes": 10, "kv_bytes_sent": 10,
                      "token_times": list(np.linspace(100.2 + i, 100.5 + i, 16))})
    text = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines)
    (d / "requests.jsonl").write_text(text + '{"ev":"done","id":4,"send_ti')   # cut by the kill
    (d / "events.csv").write_text("time,kind,detail\n1,workers_ready,count=4\n")
    from testbed.measure import CounterSampler
    ts = pd.DataFrame(0.0, index=range(30), columns=CounterSampler.COLUMNS)
    ts["time"] = 99 + 0.5 * ts.index
    ts["t_s"] = 0.5 * ts.index
    ts["t_real_s"] = 5.0 * ts.index
    ts["kv_tx_bytes"] = 1000 * ts.index
    ts["kv_up"] = ts["request_up"] = 1
    (d / "timeseries.csv").write_text(ts.to_csv(index=False) + "113.0,7")   # a cut last line
    return d, n


def test_a_killed_run_is_analysed_from_its_directory(tmp_path, small_experiment):
    d, n = _killed_run_dir(tmp_path, small_experiment)
    s = analysis.analyse(d)
    assert s["incomplete"] is True
    assert "no metadata.json" in s["incomplete_reason"] and "finished" in s["incomplete_reason"]
    assert (s["completed"], s["failed"]) == (3, n - 3)
    assert (s["not_finished"], s["not_sent"]) == (3, n - 7)
    df = pd.read_parquet(d / "requests.parquet")
    assert len(df) == n and list(df.status[:4]) == ["ok", "ok", "ok", "failed"]
    assert df.error[4].startswith("no reply") and df.error[9].startswith("never sent")
    assert json.loads((d / "summary.json").read_text())["incomplete"] is True
    # KV bytes from the counters over the measured span (sends 100..102, last token 102.5)
    assert s["wan_bytes_measured"] == 1000 * (int((102.5 - 99) / 0.5)
                                              - int((100 - 99) / 0.5))


def test_analyse_command_on_a_killed_run(tmp_path, small_experiment):
    d, n = _killed_run_dir(tmp_path, small_experiment)
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "analyse", str(d)],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "3 completed" in r.stdout and "incomplete" in r.stdout
    assert (d / "requests.parquet").exists() and (d / "figures" / "ttft_cdf.png").exists()
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "analyse", str(tmp_path / "nope")],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_undo_commands_never_enter_a_namespace_whose_process_is_gone(tmp_path):
    marker = tmp_path / "ran"
    p = subprocess.Popen(["sleep", "30"])
    try:
        start = lifecycle.proc_start_time(p.pid)
        cmd = ["sh", "-c", f"echo x >> {marker}", f"--net=/proc/{p.pid}/ns/net"]
        state = {"processes": [{"pid": p.pid, "start": start + 1, "what": "reused pid"}],
                 "commands": [cmd], "netns": [], "links": []}
        lifecycle._undo(state)                  # the recorded process is not this one: skip
        assert not marker.exists() and p.poll() is None
        state["processes"][0]["start"] = start
        assert lifecycle._namespace_owner_alive(cmd, {p.pid: start})
    finally:
        p.kill()
