"""Run-directory files without shared storage (testbed/backend/runfiles.py, the launcher's
side in testbed/backend/agents.py), with a `Launcher` called directly in place of its Ray
actor: a host's own copy, the runner's paths mapped into it, the live files both ways, and the
collection at the end into the same relative paths."""

import sys
import time

from testbed.backend import agents, runfiles


def _host(tmp_path, name, orch, origins, monkeypatch):
    """A launcher keeping its own copy (as a Ray node with NODE_DIR_ENV set), and its files."""
    monkeypatch.setenv(agents.NODE_DIR_ENV, str(tmp_path / f"node-{name}"))
    launcher = agents.Launcher(str(orch), "", "r1")
    assert not launcher.info()["shared"]
    files = runfiles.HostFiles(name, lambda m, *a: getattr(launcher, m)(*a), orch, origins)
    return launcher, files


def test_host_run_dir_is_the_orchestrators_only_where_its_token_is_seen(tmp_path):
    orch = tmp_path / "run"
    orch.mkdir()
    (orch / agents.SHARED_MARKER).write_text("tok")
    assert agents.host_run_dir(orch, "tok", "r1", environ={}) == (orch, True)
    local, shared = agents.host_run_dir(orch, "other", "r1",
                                        environ={agents.NODE_DIR_ENV: str(tmp_path / "n")})
    assert not shared and local == tmp_path / "n" / "r1-run" and (local / "logs").is_dir()
    # a node told to keep its own copy does so even where it sees the orchestrator's
    local, shared = agents.host_run_dir(orch, "tok", "r1",
                                        environ={agents.NODE_DIR_ENV: str(tmp_path / "n")})
    assert not shared


def test_launcher_maps_the_runners_paths_into_its_copy(tmp_path, monkeypatch):
    orch = tmp_path / "run"
    orch.mkdir()
    launcher, files = _host(tmp_path, "10.0.0.2", orch, {}, monkeypatch)
    (orch / "runtime.json").write_text('{"x": 1}')
    argv = [sys.executable, "-c",
            "import sys, pathlib; pathlib.Path(sys.argv[2]).write_text("
            "pathlib.Path(sys.argv[1]).read_text())",
            str(orch / "runtime.json"), str(orch / "requests.jsonl")]
    files.push_inputs(argv)
    launcher.spawn("w#1", argv, orch / "logs" / "w.log")
    deadline = time.monotonic() + 10
    while launcher.returncodes()["w#1"] is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert launcher.returncodes()["w#1"] == 0
    assert (launcher.dir / "requests.jsonl").read_text() == '{"x": 1}'
    assert (launcher.dir / "logs" / "w.log").exists()
    assert not (orch / "requests.jsonl").exists() and not (orch / "logs").exists()
    assert launcher.local_path("/elsewhere/x") == "/elsewhere/x"


def test_live_files_go_both_ways_and_the_rest_is_collected(tmp_path, monkeypatch):
    orch = tmp_path / "run"
    (orch / "ready").mkdir(parents=True)
    (orch / "events.csv").write_text("time,kind,detail\n1.0,start,\n")
    origins = {}
    a, fa = _host(tmp_path, "10.0.0.1", orch, origins, monkeypatch)
    b, fb = _host(tmp_path, "10.0.0.2", orch, origins, monkeypatch)
    # a worker on host a says it is ready, the client there writes records
    (a.dir / "ready").mkdir()
    (a.dir / "ready" / "rp0").write_text("5.0")
    (a.dir / "requests.jsonl").write_text('{"ev":"sent","id":1}\n')
    (orch / "timeseries.csv").write_text("time,kv_tx_bytes\n1,0\n")
    mirror = runfiles.Mirror([fa, fb])
    mirror.round()
    assert (orch / "ready" / "rp0").read_text() == "5.0"
    assert (b.dir / "ready" / "rp0").read_text() == "5.0"       # the scheduler's host sees it
    assert (b.dir / "timeseries.csv").read_text() == (orch / "timeseries.csv").read_text()
    # growing files continue where they were; the runner's start time reaches both hosts
    with open(a.dir / "requests.jsonl", "a") as f:
        f.write('{"ev":"done","id":1}\n')
    with open(orch / "timeseries.csv", "a") as f:
        f.write("2,100\n")
    (orch / "ready" / "start_at").write_text("123.5")
    mirror.round()
    assert (orch / "requests.jsonl").read_text().count("\n") == 2
    assert (b.dir / "timeseries.csv").read_text().endswith("2,100\n")
    assert (a.dir / "ready" / "start_at").read_text() == "123.5"
    assert mirror.stop() == []
    # at the end: logs and records back at the same paths, events rows appended
    (a.dir / "logs" / "rp0.log").write_bytes(b"x" * (runfiles.CHUNK + 10))
    (a.dir / "events.csv").write_text("7.0,kv_discarded,instance=ld0\n")
    (a.dir / "scheduler.csv").write_text("t\n")
    (b.dir / "scheduler.csv").write_text("u\n")
    with open(a.dir / "requests.jsonl", "a") as f:
        f.write('{"ev":"finished"}\n')
    assert fa.collect() == []
    assert fb.collect() == [("scheduler.csv", "scheduler.csv.10.0.0.2")]
    assert (orch / "logs" / "rp0.log").stat().st_size == runfiles.CHUNK + 10
    assert (orch / "requests.jsonl").read_text().count("\n") == 3
    assert (orch / "events.csv").read_text().splitlines()[-1] == "7.0,kv_discarded,instance=ld0"
    assert (orch / "scheduler.csv").read_text() == "t\n"
    assert (orch / "scheduler.csv.10.0.0.2").read_text() == "u\n"
    assert (orch / "timeseries.csv").read_text().count("\n") == 3      # never pulled back
    a.remove_dir()
    assert not a.dir.exists()
