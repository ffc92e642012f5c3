"""The ray backend's parts that need neither root nor a Ray cluster: the `backend:` section,
placement by label and resources, the launcher's process handling, the agent's guard, the u32
key of the shaped subnet. tests/test_ray_root.py runs the whole backend on namespace hosts."""

import os
import signal
import subprocess
import sys
import time
import types

import pytest

from testbed import config, deploy, lifecycle
from testbed.backend import agents, raycluster, raynodes, rayplacement, rayprobe
from testbed.errors import ConfigError, NetworkError
from testbed.net.hostshape import offload_state, u32_dst_key
from testbed.net.probe import measure_link


def _deployment(tmp_path, small_experiment, overrides=()):
    f = tmp_path / "e.yaml"
    f.write_text(small_experiment)
    return deploy.compile(config.load_experiment(f, list(overrides))[0])


def _ray_node(ip, dc, cpus=8.0, gpus=0.0, alive=True):
    return {"NodeID": f"id-{ip}", "NodeManagerAddress": ip, "Alive": alive,
            "Labels": {"dc": dc} if dc else {}, "Resources": {"CPU": cpus, "GPU": gpus}}


def test_backend_section_defaults_to_mininet(tmp_path, small_experiment):
    f = tmp_path / "e.yaml"
    f.write_text(small_experiment)
    exp = config.load_experiment(f)[0]
    assert exp.backend.kind == "mininet"
    import importlib.util
    if importlib.util.find_spec("ray") is None:     # without the [cluster] extra: one line, 2
        with pytest.raises(ConfigError) as e:
            config.load_experiment(f, ["backend.kind=ray", "backend.address=10.0.0.1:6379"])
        assert "pip install" in str(e.value) and e.value.exit_code == 2
        return
    ray = config.load_experiment(f, ["backend.kind=ray", "backend.address=10.0.0.1:6379"])[0]
    assert (ray.backend.kind, ray.backend.address) == ("ray", "10.0.0.1:6379")


@pytest.mark.parametrize("override, key", [("backend.address=10.0.0.1", "backend.address"),
                                           ("backend.kind=k8s", "backend.kind"),
                                           ("backend.cpus=0", "backend.cpus")])
def test_backend_section_rejects_bad_values(tmp_path, small_experiment, override, key):
    f = tmp_path / "e.yaml"
    f.write_text(small_experiment)
    with pytest.raises(ConfigError) as e:
        config.load_experiment(f, [override])
    assert key in str(e.value) and e.value.exit_code == 2


def test_labelled_nodes_keeps_alive_nodes_with_a_known_dc():
    nodes = raynodes.labelled_nodes([_ray_node("10.0.0.1", "local"),
                                       _ray_node("10.0.0.2", "prfaas"),
                                       _ray_node("10.0.0.3", None),
                                       _ray_node("10.0.0.4", "prfaas", alive=False),
                                       _ray_node("10.0.0.5", "elsewhere")])
    assert [(n.ip, n.dc) for n in nodes] == [("10.0.0.1", "local"), ("10.0.0.2", "prfaas")]


def test_place_puts_every_instance_in_its_datacenter(tmp_path, small_experiment):
    dep = _deployment(tmp_path, small_experiment)
    nodes = raynodes.labelled_nodes([_ray_node("10.0.0.1", "local", cpus=2),
                                       _ray_node("10.0.0.3", "local", cpus=2),
                                       _ray_node("10.0.0.2", "prfaas")])
    placed = rayplacement.place(dep, 1.0, nodes)
    assert set(placed) == {i.name for i in dep.instances}
    for inst in dep.instances:
        assert placed[inst.name].dc == inst.dc
    local = [placed[i.name].ip for i in dep.instances if i.dc == "local"]
    assert sorted(local) == ["10.0.0.1", "10.0.0.1", "10.0.0.3", "10.0.0.3"]   # spread


def test_place_refuses_a_missing_datacenter_or_too_few_cpus(tmp_path, small_experiment):
    dep = _deployment(tmp_path, small_experiment)
    with pytest.raises(ConfigError, match="dc=prfaas"):
        rayplacement.place(dep, 1.0, raynodes.labelled_nodes([_ray_node("10.0.0.1", "local")]))
    nodes = raynodes.labelled_nodes([_ray_node("10.0.0.1", "local", cpus=3),
                                       _ray_node("10.0.0.2", "prfaas")])
    with pytest.raises(ConfigError, match="placement cannot be met") as e:
        rayplacement.place(dep, 1.0, nodes)
    assert e.value.exit_code == 2


def test_torch_on_cuda_asks_a_gpu_per_prefill_and_decode(tmp_path, small_experiment):
    dep = _deployment(tmp_path, small_experiment)
    rt = dep.runtime.__class__(**{**dep.runtime.__dict__, "engine": "torch", "device": "cuda"})
    asks = {i.name: rayplacement.request(i, rt, 2.0) for i in dep.instances}
    assert asks["rp0"] == asks["ld0"] == (0.0, 1.0)
    assert asks["scheduler"] == (2.0, 0.0)


def test_u32_key_matches_the_destination_subnet():
    assert u32_dst_key("10.2.0.0/16") == "0x0a020000/0xffff0000+16"
    assert u32_dst_key("10.1.0.0/16") == "0x0a010000/0xffff0000+16"


def test_launcher_reports_exit_codes_and_stops_what_runs(tmp_path):
    launcher = agents.Launcher()
    log = tmp_path / "logs" / "x.log"
    launcher.spawn("done#1", [sys.executable, "-c", "print('hi'); raise SystemExit(3)"], log)
    pid = launcher.spawn("sleeper#2", [sys.executable, "-c", "import time; time.sleep(60)"],
                         tmp_path / "logs" / "y.log")
    deadline = time.monotonic() + 10
    while launcher.returncodes()["done#1"] is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert launcher.returncodes() == {"done#1": 3, "sleeper#2": None}
    assert log.read_text().strip() == "hi"
    codes = launcher.stop()
    assert codes["sleeper#2"] == -signal.SIGTERM
    assert lifecycle.proc_start_time(pid) is None


def test_remote_process_proxies_to_its_launcher(tmp_path):
    launcher = agents.Launcher()

    class Backend:      # RayBackend's two calls, without Ray
        def returncode(self, node, key):
            return launcher.returncodes()[key]

        def signal(self, node, key, sig):
            launcher.signal(key, sig)

    pid = launcher.spawn("w#1", [sys.executable, "-c", "import time; time.sleep(60)"],
                         tmp_path / "w.log")
    p = raycluster.RemoteProcess(Backend(), None, "w#1", pid)
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.1)
    p.kill()
    assert p.wait(timeout=10) == -signal.SIGKILL and p.returncode == -signal.SIGKILL


def test_guard_undoes_the_record_once_its_owner_is_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(lifecycle, "STATE_DIR", tmp_path)
    marker = tmp_path / "undone"
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reg = lifecycle.Registry("ray-test-guard", kind="ray-agent", state_dir=tmp_path)
    reg.state.update(owner_pid=owner.pid, owner_start=lifecycle.proc_start_time(owner.pid))
    reg.add_undo_command(["touch", str(marker)])
    guard = subprocess.Popen([sys.executable, "-m", "testbed.backend.agents", "guard",
                              str(reg.path)], env=dict(os.environ, PYTHONPATH=str(agents.REPO)))
    time.sleep(3 * agents.GUARD_INTERVAL_S)
    assert guard.poll() is None and not marker.exists()     # the owner still runs
    owner.kill()
    owner.wait()
    assert guard.wait(timeout=10) == 0
    assert marker.exists() and not reg.path.exists()


def test_ray_without_the_extra_is_refused_with_exit_2(tmp_path, small_experiment, monkeypatch):
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else find(name, *a))
    f = tmp_path / "e.yaml"
    f.write_text(small_experiment)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[cluster\]'") as e:
        config.load_experiment(f, ["backend.kind=ray"])
    assert e.value.exit_code == 2


def test_no_ray_head_at_the_address_is_exit_2_before_anything(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run",
                        str(agents.REPO / "tests" / "data" / "tiny.yaml"), "--backend", "ray",
                        "--address", "127.0.0.1:1", "--out", str(out)],
                       capture_output=True, text=True, timeout=60, cwd=agents.REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "backend.address" in r.stderr and not out.exists()


class _Actor:
    """A Ray actor handle whose calls run at once, in this process (`ray.get` is identity)."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        return types.SimpleNamespace(remote=getattr(self.obj, name))


class _Ray:
    @staticmethod
    def get(ref, timeout=None):
        return ref


def test_probe_runs_through_remote_sides_over_loopback():
    """measure_link drives both ends through ProbeHost/RemoteSide (what a Ray host runs), here
    in this namespace over loopback: every figure comes from one side's own counts or clock."""
    hosts = [rayprobe.ProbeHost(), rayprobe.ProbeHost()]
    src, dst = (rayprobe.RemoteSide(_Ray, _Actor(h)) for h in hosts)
    try:
        r = measure_link(src, dst, "127.0.0.1", {"rate": 1e9, "delay": 0.0, "loss": 0.01},
                         duration_s=0.5, loss_packets=2000, probes=20)
    finally:
        for h in hosts:
            h.stop()
    m = r["measured"]
    assert m["probes"] == 20 and m["rtt_p50_ms"] > 0 and m["jitter_ms"] >= 0
    assert m["goodput_bps"] > 0
    assert m["loss_packets"] == 2000 and m["loss"] == 0.0      # loopback drops nothing
    assert all(p.proc.poll() is not None for h in hosts for p in h.procs.values())


def test_remote_side_reports_a_failed_role_as_one_network_error():
    side = rayprobe.RemoteSide(_Ray, _Actor(rayprobe.ProbeHost()))
    p = side.spawn("no-such-role")
    with pytest.raises(NetworkError, match="probe x failed"):
        p.result("x", 10)


def test_offload_state_reads_tso_gso_and_gro():
    state = offload_state(None, "lo")
    assert set(state) <= {"tso", "gso", "gro"} and set(state.values()) <= {"on", "off"}
