"""The vLLM engine's pieces that need no vLLM: the refusals (exit 2, one line), the server's
command line and environment, the prompts' token ids, and `VllmServer.stop` reaching every
process below the server (a stand-in that forks as vLLM's API server does)."""

import json
import os
import pathlib
import subprocess
import sys
import time
import types

import pytest

from testbed import lifecycle
from workers import vllm_engine
from workers import vllm_server as vs

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "vllm_tiny.yaml"


def _workload(*extra, env=None):
    return subprocess.run([sys.executable, "-m", "testbed.cli", "workload", str(TINY), *extra],
                          cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **(env or {})})


def test_a_scale_other_than_1_is_refused_in_one_line():
    r = _workload("--set", "scale.time=10")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "scale.time and scale.bytes must be 1" in lines[0], lines


def test_engine_vllm_without_vllm_says_make_vllm():
    r = _workload(env={"TESTBED_VLLM_PYTHON": "/nonexistent/python"})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "`make vllm`" in lines[0], lines


def _spec(**kw):
    return vs.ServerSpec(python="/x/python", model_dir="/m", role=kw.pop("role", "prefill"),
                         host="10.1.0.5", port=8100, side_port=5600, **kw)


def test_server_command_line_and_environment():
    a = vs.argv(_spec(role="decode", dtype="bfloat16", nixl_progress_delay_us=0))
    cfg = json.loads(a[a.index("--kv-transfer-config") + 1])
    # the testbed's NixlConnector also unpaced: it keeps the forward pass on its CPUs
    assert cfg == {"kv_connector": "TestbedNixlConnector", "kv_connector_module_path": "tb_nixl",
                   "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    assert a[a.index("--dtype") + 1] == "bfloat16" and "--enforce-eager" in a
    e = vs.env(_spec(kv_cache_space_gib=2, cpus="1"),
               base={"PYTHONPATH": "/repo", "OMP_NUM_THREADS": "1", "PATH": "/bin"})
    assert e["PYTHONPATH"] == vs.PLUGIN_DIR and "OMP_NUM_THREADS" not in e
    assert e["TESTBED_NIXL_PROGRESS_DELAY_US"] == "1000" and e["TESTBED_SHM_BUSY_LOOP_S"] == "0"
    assert e["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.0.5"   # the pull crosses the WAN to it
    assert e["VLLM_CPU_KVCACHE_SPACE"] == "2" and e["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert e["UCX_TLS"] == "tcp,self" and e["HF_HUB_OFFLINE"] == "1"
    e = vs.env(_spec(nixl_progress_delay_us=0), base={"PYTHONPATH": "/repo"})
    assert e["PYTHONPATH"] == vs.PLUGIN_DIR and e["TESTBED_NIXL_PROGRESS_DELAY_US"] == "0"


def test_the_dumping_connector_is_nixl_plus_its_module_on_the_servers_path(tmp_path):
    a = vs.argv(_spec(kv_dump_dir=str(tmp_path)))
    cfg = json.loads(a[a.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "KVDumpNixlConnector" and cfg["kv_role"] == "kv_producer"
    e = vs.env(_spec(kv_dump_dir=str(tmp_path)), base={"PATH": "/bin"})
    module = pathlib.Path(e["PYTHONPATH"]) / f"{cfg['kv_connector_module_path']}.py"
    assert module.is_file()
    assert e["TESTBED_KV_DUMP_DIR"] == str(tmp_path)
    assert "class KVDumpNixlConnector(TestbedNixlConnector)" in module.read_text()
    with pytest.raises(ValueError):
        vs.kv_transfer_config(_spec(kv_dump_dir=str(tmp_path), connector="Other"))


def test_the_pid_record_takes_a_restarted_server_once(tmp_path):
    """A `restart` fault's worker rewrites vllm/<name>.json with its new server's PIDs: the
    next refresh puts those on the lifecycle record, and no PID twice."""
    from testbed import vllmrun
    from testbed.records import RunDir
    rd = RunDir(tmp_path)
    rd.vllm.mkdir()
    reg = lifecycle.Registry("t0", state_dir=tmp_path / "state")
    me = (os.getpid(), lifecycle.proc_start_time(os.getpid()))
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        rd.vllm_file("rp0").write_text(json.dumps({"pids": [me]}))
        (rd.vllm / ".rp0.json").write_text("{half")       # a worker's temporary: not read
        rec = vllmrun.PidRecord(rd, reg)
        assert rec.refresh(force=True) == 1 and rec.refresh(force=True) == 0
        new = (sleeper.pid, lifecycle.proc_start_time(sleeper.pid))
        rd.vllm_file("rp0").write_text(json.dumps({"pids": [new]}))
        assert rec.refresh() == 0            # read at most every REFRESH_S
        assert rec.refresh(force=True) == 1
        on_record = [(p["pid"], p["start"]) for p in reg.state["processes"]]
        assert on_record == [me, new]
    finally:
        sleeper.kill()
        sleeper.wait()
        reg.path.unlink(missing_ok=True)


def test_cpus_auto_gives_each_instance_its_own_cpu_or_binds_none():
    rt = types.SimpleNamespace(vllm=types.SimpleNamespace(cpus="auto"), of_role=lambda *r: [
        types.SimpleNamespace(name=n) for n in ("rp0", "lp0", "ld0")])
    assert [vllm_engine.cpus_for(rt, n, {0, 1, 2}) for n in ("rp0", "lp0", "ld0")] == \
        ["0", "1", "2"]
    # more instances than CPUs: two bound to one CPU stalled a prefill 60 s; none is bound
    assert [vllm_engine.cpus_for(rt, n, {0, 1}) for n in ("rp0", "lp0", "ld0")] == \
        ["nobind"] * 3
    rt.vllm.cpus = "1"
    assert vllm_engine.cpus_for(rt, "ld0", {0, 1}) == "1"


def test_prompts_share_their_prefix_blocks_and_nothing_else():
    a = types.SimpleNamespace(id=1, input_len=300, prefix_blocks=[7, 8])
    b = types.SimpleNamespace(id=2, input_len=250, prefix_blocks=[7, 9])
    ia, ib = (vllm_engine.prompt_ids(r, 0, 4096, 100) for r in (a, b))
    assert len(ia) == 300 and len(ib) == 250
    assert ia[:100] == ib[:100] and ia[100:200] != ib[100:200]
    assert max(ia + ib) < 4093 and ia == vllm_engine.prompt_ids(a, 0, 4096, 100)


FORKS = """
import multiprocessing, signal, sys, time
def child():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # an EngineCore that ignores the server
    time.sleep(600)
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    multiprocessing.get_context("spawn").Process(target=child).start()
    time.sleep(600)
"""


def _running(pid, start):
    """Alive and not a zombie (an orphan's reaper may take its time)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and lifecycle.proc_start_time(pid) == start


def test_stop_ends_the_server_and_every_process_below_it(tmp_path, monkeypatch):
    script = tmp_path / "server.py"
    script.write_text(FORKS)
    monkeypatch.setattr(vs, "argv", lambda spec: [sys.executable, str(script)])
    srv = vs.VllmServer(_spec(), tmp_path / "log")
    srv.start()
    try:
        deadline = time.monotonic() + 30
        while len(srv.pids()) < 3 and time.monotonic() < deadline:   # server, tracker, child
            time.sleep(0.1)
        pids = srv.pids()
        assert len(pids) >= 2
    finally:
        srv.stop(grace_s=2)
    alive = [p for p, start in pids if _running(p, start)]
    assert not alive, alive


def test_failure_heatmap_without_a_fault_free_variant(tmp_path):
    """experiments/vllm_faults.yaml has only faulted variants: the p90 inflation has nothing to
    divide by, and the heatmap says so instead of crashing."""
    from testbed import plot
    (tmp_path / "failure_matrix.csv").write_text(
        "policy,failover,fault,case,p90_inflation,failed\n"
        "prfaas,True,kill,kill-rp0,,0\nprfaas,True,pause,pause-rp0,,0\n")
    assert plot.failure_heatmap(tmp_path, tmp_path / "figures").exists()


def test_a_thread_that_dies_while_the_server_starts_fails_the_wait_at_once(tmp_path,
                                                                           monkeypatch):
    """A stand-in server whose handshake thread raises (as vLLM's NIXL listener did when its
    port was taken) and which then never answers /health: the wait says so within a poll or
    two, not after its bound."""
    import asyncio

    import aiohttp

    script = tmp_path / "server.py"
    script.write_text("import threading, time\n"
                      "def listen():\n"
                      "    raise OSError('Address already in use')\n"
                      "threading.Thread(target=listen, name='nixl_handshake_listener').start()\n"
                      "time.sleep(60)\n")
    monkeypatch.setattr(vs, "argv", lambda spec: [sys.executable, str(script)])
    log = tmp_path / "log"
    log.write_text("an earlier server's lines\nException in thread old:\n")    # not this one's
    srv = vs.VllmServer(_spec(), log)
    srv.start()

    async def wait():
        async with aiohttp.ClientSession() as session:
            return await srv.wait_healthy(120, session)
    t0 = time.monotonic()
    try:
        with pytest.raises(vs.ServerFailed, match="thread nixl_handshake_listener died"):
            asyncio.run(wait())
        assert time.monotonic() - t0 < 10
    finally:
        srv.stop()
