"""The ray backend for real on this machine (root): namespaces stand in for machines.

Two namespace hosts, one per datacenter (`dc=prfaas`, `dc=local`), each with its own veth and
address, joined through an unshaped router namespace; a Ray head in the local host and a Ray
worker node in the PrfaaS host (`ray start --block`, labelled). tests/data/tiny.yaml runs with
`backend: ray` from the local host (the driver beside the head), shaped by the agents on the two
hosts' interfaces. Asserts on what was measured: every request ok, TTFT on the client's clock,
the kernel's count in the agents' shaped classes at least the KV bytes sent, and nothing of the
agents (qdisc, state file) left after the run.

The namespace hosts share this machine's disk and clock, so the test takes both away: each Ray
node keeps its own copy of the run directory (`TESTBED_NODE_DIR`, a directory of its own, not
the orchestrator's), so every log and record in the run directory got there by the collection;
and the PrfaaS node runs a known clock skew (`TESTBED_CLOCK_SKEW_S`, test-only, set only in its
`ray start` environment here), which the measured offset must recover within its uncertainty,
and with which the corrected phase stamps must still be in causal order. Every Ray process is stopped by what is recorded
of it: the `ray start --block` process, then whatever still runs in the test's namespaces
(matched by namespace inode, never by name); the namespaces are removed, also on failure.
"""

import contextlib
import importlib.util
import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from conftest import assert_remote_kv_crossed_the_wan
from testbed import clocks, lifecycle
from testbed.backend import agents
from testbed.net import pair
from testbed.net.ns import ns_path, ns_run, sysctl

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="the ray backend needs the [cluster] extra "
                                        "(pip install -e '.[cluster]')")]

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "tiny.yaml"
FABRIC = {"local": "10.250.2", "prfaas": "10.250.1"}     # host <-> router subnets (/24)
DC_NET = {"prfaas": "10.1.0.0/16", "local": "10.2.0.0/16"}
RAY_PORT = 6391
NODE_WAIT_S = 90.0
SKEW_S = {"prfaas": 3.25, "local": 0.0}     # the PrfaaS host's clock runs ahead (test-only)


def ray_bin():
    return str(pathlib.Path(sys.executable).with_name("ray"))


def _netns_inode(name):
    return os.stat(ns_path(name)).st_ino


def _pids_in(inodes):
    """PIDs of processes whose network namespace is one of `inodes`."""
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(p / "ns" / "net").st_ino in inodes:
                    out.append(int(p.name))
    return out


def _build_hosts(reg, tag):
    """Namespaces {dc: name} for the hosts and the router; addressed, routed, forwarding."""
    router = f"tb{tag}r"
    hosts = {dc: f"tb{tag}{dc[0]}" for dc in FABRIC}
    for n in (router, *hosts.values()):
        pair.create_netns(reg, n)
    for dc, h in hosts.items():
        net = FABRIC[dc]
        pair.add_veth(f"{h}0", h, f"{router}{dc[0]}", router)
        pair.address(h, f"{h}0", f"{net}.2", gateway=f"{net}.1")
        pair.address(router, f"{router}{dc[0]}", f"{net}.1")
    sysctl(router, "net.ipv4.ip_forward=1")
    # The fabric routes each datacenter's instance addresses to its host (docs/cluster.md).
    for dc in FABRIC:
        r = ns_run(router, ["ip", "route", "add", DC_NET[dc], "via", f"{FABRIC[dc]}.2"],
                   capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return hosts


def _ray_env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", **extra)
    for key in (agents.NODE_DIR_ENV, clocks.SKEW_ENV):     # a node's own, never inherited
        if key not in extra:
            env.pop(key, None)
    return env


def _node_env(dc, tmp, storage):
    """A Ray node's environment: its own run directories (`storage` "own"; "shared": it uses
    the orchestrator's, which it sees), and its clock's test-only skew."""
    extra = {agents.NODE_DIR_ENV: str(tmp / f"node-{dc}")} if storage == "own" else {}
    if SKEW_S[dc]:
        extra[clocks.SKEW_ENV] = repr(SKEW_S[dc])
    return _ray_env(**extra)


def _start_ray(reg, hosts, tmp, storage):
    head = f"{FABRIC['local']}.2:{RAY_PORT}"
    common = ["--block", "--num-cpus", "8", "--num-gpus", "0", "--disable-usage-stats"]
    argvs = {"local": ["start", "--head", "--port", str(RAY_PORT), "--node-ip-address",
                       f"{FABRIC['local']}.2", "--labels", "dc=local",
                       "--include-dashboard=false", *common],
             "prfaas": ["start", "--address", head, "--node-ip-address",
                        f"{FABRIC['prfaas']}.2", "--labels", "dc=prfaas", *common]}
    procs = []
    for dc in ("local", "prfaas"):
        log = open(tmp / f"ray-{dc}.log", "wb")
        p = subprocess.Popen(["nsenter", f"--net={ns_path(hosts[dc])}", ray_bin(), *argvs[dc]],
                             stdout=log, stderr=subprocess.STDOUT, env=_node_env(dc, tmp, storage),
                             start_new_session=True)
        log.close()
        reg.add_process(p.pid, f"ray start ({dc})")
        procs.append(p)
        if dc == "local":
            _wait_port(hosts["local"], f"{FABRIC['local']}.2", RAY_PORT, p)
    _wait_nodes(hosts["local"], head, procs)
    return head, procs


def _wait_port(ns, ip, port, proc, timeout_s=NODE_WAIT_S):
    deadline = time.monotonic() + timeout_s
    probe = ("import socket,sys; s=socket.socket(); s.settimeout(0.5); "
             f"sys.exit(s.connect_ex(('{ip}', {port})))")
    while ns_run(ns, [sys.executable, "-c", probe]).returncode != 0:
        assert proc.poll() is None, "ray start --head exited"
        assert time.monotonic() < deadline, f"the Ray head did not listen within {timeout_s}s"
        time.sleep(0.5)


def _wait_nodes(ns, head, procs, timeout_s=NODE_WAIT_S):
    """Until both labelled nodes are alive (one bounded wait inside a driver)."""
    code = ("import ray,time,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            f"d=time.monotonic()+{timeout_s}\n"
            "while time.monotonic()<d:\n"
            "  if sorted(n['Labels'].get('dc','') for n in ray.nodes() if n['Alive'])"
            "==['local','prfaas']: sys.exit(0)\n"
            "  time.sleep(0.5)\n"
            "sys.exit(1)")
    r = ns_run(ns, [sys.executable, "-c", code, head], env=_ray_env(), capture_output=True,
               text=True, timeout=timeout_s + 60)
    assert r.returncode == 0, f"Ray nodes not up: {r.stderr[-2000:]}"
    assert all(p.poll() is None for p in procs)


def _stop_ray(procs, inodes):
    """SIGTERM the `ray start --block` processes (they stop what they started), give what is
    left in the test's namespaces (an agent's guard undoing its record) a bounded time to end,
    then SIGKILL it."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=20)
    deadline = time.monotonic() + 5
    while _pids_in(inodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while _pids_in(inodes) and time.monotonic() < deadline:
        for pid in _pids_in(inodes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    return _pids_in(inodes)


@pytest.fixture
def ray_hosts(tmp_path, request):
    """The namespace hosts and their Ray nodes; `request.param` (indirect): "own" (default)
    for nodes keeping their own run directories, "shared" for the orchestrator's."""
    storage = getattr(request, "param", "own")
    tag = secrets.token_hex(2)
    reg = lifecycle.Registry(f"raytest{tag}", kind="ray-test")
    procs, inodes = [], set()
    try:
        hosts = _build_hosts(reg, tag)
        inodes = {_netns_inode(h) for h in hosts.values()}
        head, procs = _start_ray(reg, hosts, tmp_path, storage)
        yield hosts, head
    finally:
        left = _stop_ray(procs, inodes)
        reg.close()
        assert not left, f"processes left in the test's namespaces: {left}"


def test_tiny_run_on_ray_namespace_hosts(ray_hosts, tmp_path):
    hosts, head = ray_hosts
    out = tmp_path / "run"
    r = ns_run(hosts["local"], [sys.executable, "-m", "testbed.cli", "run", str(TINY),
                                "--backend", "ray", "--address", head, "--out", str(out),
                                "--no-progress"],
               capture_output=True, text=True, timeout=400, cwd=ROOT, env=_ray_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    df = pd.read_parquet(out / "requests.parquet")
    summary = json.loads((out / "summary.json").read_text())
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["backend"] == "ray"
    assert (df.status == "ok").all(), df[df.status != "ok"].error.tolist()
    assert_remote_kv_crossed_the_wan(df, summary)
    # The run measured the link the agents shaped, between the two namespace hosts.
    measured = meta["link_fidelity"]["measured"]
    assert measured["rtt_p50_ms"] > 0 and measured["goodput_bps"] > 0, meta["link_fidelity"]
    placed = meta["topology"]["placement"]
    assert placed["rp0"] == f"{FABRIC['prfaas']}.2" and placed["ld0"] == f"{FABRIC['local']}.2"
    # The agents undid everything: no HTB root, no state file, no alias address.
    for dc, h in hosts.items():
        qd = ns_run(h, ["tc", "qdisc", "show", "dev", f"{h}0"], capture_output=True,
                    text=True).stdout
        assert "htb" not in qd, qd
        addrs = ns_run(h, ["ip", "-4", "-o", "addr", "show"], capture_output=True,
                       text=True).stdout
        assert " 10.1." not in addrs and " 10.2." not in addrs, addrs
    assert not list(lifecycle.STATE_DIR.glob(f"ray-{meta['run_id']}-*.json"))
    _check_collected(out, meta, tmp_path)
    _check_clocks(out, meta, df)


def _check_collected(out, meta, tmp_path):
    """Every host kept its own copy of the run directory, and its logs and records reached the
    orchestrator's at the same paths as on Mininet; the copies are gone."""
    dirs = meta["topology"]["run_dirs"]
    assert {d["shared"] for d in dirs.values()} == {False}, dirs
    assert all(d["dir"].startswith(str(tmp_path / "node-")) for d in dirs.values()), dirs
    for d in dirs.values():
        assert not pathlib.Path(d["dir"]).exists(), d
    for name in meta["topology"]["placement"]:
        assert (out / "logs" / f"{name}.log").exists(), name
    assert '"ev":"finished"' in (out / "requests.jsonl").read_text()
    assert (out / "ready" / "rp0").exists()


def _check_clocks(out, meta, df):
    """The measured offsets recover the injected skew within their uncertainty; requests.jsonl
    keeps the PrfaaS stamps raw (ahead), the analysed table has them in causal order."""
    hosts = meta["clocks"]["hosts"]
    for dc, ip in (("prfaas", f"{FABRIC['prfaas']}.2"), ("local", f"{FABRIC['local']}.2")):
        c = hosts[ip]
        for m in (c["start"], c["end"]):
            assert abs(m["offset_s"] - SKEW_S[dc]) <= m["uncertainty_s"], (dc, m)
        assert c.get("injected_skew_s", 0.0) == SKEW_S[dc]
        assert abs(c["drift_s"]) <= c["start"]["uncertainty_s"] + c["end"]["uncertainty_s"]
    assert meta["clocks"]["instances"]["rp0"] == f"{FABRIC['prfaas']}.2"
    u = max(c["uncertainty_s"] for c in hosts.values())
    remote = df[df.route == "remote"]
    raw = {r["id"]: r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())
           if r.get("ev") == "done"}
    ahead = [raw[i]["prefill_start"] - raw[i]["send_time"] for i in remote.id]
    assert min(ahead) > SKEW_S["prfaas"] - 1.0, ahead            # raw: the host's own clock
    assert (remote.prefill_queued >= remote.send_time - u).all()
    assert (remote.send_start <= remote.kv_recv_start + u).all()
    assert (remote.prefill_end <= remote.kv_recv_end + u).all()
    tokens = pd.read_parquet(out / "tokens.parquet")
    first = tokens[tokens["index"] == 0].set_index("id")
    kv = remote.set_index("id").kv_recv_end
    assert (first.decode_time.reindex(kv.index) >= kv - u).all()
    assert (first.client_time >= first.decode_time - u).all()


def _leftovers(hosts, run_dir):
    """Shaping state on the namespace hosts and worker processes of the run still present
    (`run_dir`: a folder every path of the run is under, the hosts' own copies included)."""
    found = []
    for h in hosts.values():
        if "htb" in ns_run(h, ["tc", "qdisc", "show", "dev", f"{h}0"], capture_output=True,
                           text=True).stdout:
            found.append(f"{h}: htb qdisc")
        rules = ns_run(h, ["iptables-save"], capture_output=True, text=True).stdout
        found += [f"{h}: {ln}" for ln in rules.splitlines() if "TBWAN" in ln or "NFQUEUE" in ln]
        addrs = ns_run(h, ["ip", "-4", "-o", "addr", "show"], capture_output=True,
                       text=True).stdout
        found += [f"{h}: address {ln.split()[3]}" for ln in addrs.splitlines()
                  if " 10.1." in ln or " 10.2." in ln]
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if str(run_dir) in cmd or "tb-delayline" in cmd and any(
                        h in cmd for h in hosts.values()):
                    found.append(f"pid {p.name}: {cmd[:80]}")
    return found


@pytest.mark.parametrize("ray_hosts", ["shared"], indirect=True)
def test_sigkilled_orchestrator_then_clean_leaves_nothing(ray_hosts, tmp_path):
    """Also the shared-storage case: the nodes see the orchestrator's run directory and write
    into it directly (the PrfaaS worker's log is there while the run goes, nothing copied)."""
    hosts, head = ray_hosts
    out = tmp_path / "run"
    log = open(tmp_path / "orchestrator.log", "wb")
    orch = subprocess.Popen(
        ["nsenter", f"--net={ns_path(hosts['local'])}", sys.executable, "-m", "testbed.cli",
         "run", str(TINY), "--backend", "ray", "--address", head, "--out", str(out),
         "--no-progress", "--no-probe", "--set", "requests=400"],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=_ray_env())
    log.close()
    records = out / "requests.jsonl"
    deadline = time.monotonic() + 180
    while not (records.exists() and records.read_text().count('"ev":"done"') >= 10):
        assert orch.poll() is None, (tmp_path / "orchestrator.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no 10 requests done within 180 s"
        time.sleep(0.2)
    assert _leftovers(hosts, tmp_path)       # the run is shaping and running: something to undo
    assert (out / "logs" / "rp0.log").exists()     # written there by the PrfaaS host itself
    orch.kill()
    orch.wait()
    r = ns_run(hosts["local"], [sys.executable, "-m", "testbed.cli", "clean", "--backend", "ray",
                                "--address", head], capture_output=True, text=True, cwd=ROOT,
               env=_ray_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    deadline = time.monotonic() + 30     # Ray ends the dead driver's actors; their guards undo
    while _leftovers(hosts, tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _leftovers(hosts, tmp_path) == []
    assert not list(lifecycle.STATE_DIR.glob("ray-*.json"))
    for f in lifecycle.STATE_DIR.glob("*.json"):      # nor the orchestrator's own record
        with contextlib.suppress(OSError, lifecycle.CorruptState):
            assert lifecycle.read_state(f)["owner_pid"] != orch.pid, f
