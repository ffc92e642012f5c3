"""The ray backend for real on this machine (root): namespaces stand in for machines.

Two namespace hosts, one per datacenter (`dc=prfaas`, `dc=local`), each with its own veth and
address, joined through an unshaped router namespace; a Ray head in the local host and a Ray
worker node in the PrfaaS host (`ray start --block`, labelled). tests/data/tiny.yaml runs with
`backend: ray` from the local host (the driver beside the head), shaped by the agents on the two
hosts' interfaces. Asserts on what was measured: every request ok, TTFT on the client's clock,
the kernel's count in the agents' shaped classes at least the KV bytes sent, and nothing of the
agents (qdisc, state file) left after the run. Also: `testbed linktest --backend ray` within
linktest's tolerances (with loss: offload off during, restored after), `testbed clean --backend
ray` after a SIGKILLed lossy run (offload restored), a worker kill plus a link cut on Ray
(nothing delivered during the cut, by the receiving hosts' kernel counters), and, with two local
hosts on one bridge, tokens streamed across hosts from a decode worker to the client (the token
port). The hosts and Ray nodes are `testbed.net.nshosts`'s.

The namespace hosts share this machine's disk and clock, so the test takes both away: each Ray
node keeps its own copy of the run directory (`TESTBED_NODE_DIR`, a directory of its own, not
the orchestrator's), so every log and record in the run directory got there by the collection;
and the PrfaaS node runs a known clock skew (`TESTBED_CLOCK_SKEW_S`, test-only, set only in its
`ray start` environment here), which the measured offset must recover within its uncertainty,
and with which the corrected phase stamps must still be in causal order. Every Ray process is
stopped by what is recorded of it: the `ray start --block` process, then whatever still runs in
the test's namespaces (matched by namespace inode, never by name); the namespaces are removed,
also on failure.
"""

import contextlib
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest

from conftest import assert_remote_kv_crossed_the_wan
from testbed import clocks, lifecycle
from testbed.backend import agents
from testbed.net import nshosts, probe
from testbed.net.hostshape import offload_state
from testbed.net.ns import ns_path, ns_run
from testbed.runtime import TOKEN_PORT

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="the ray backend needs the [cluster] extra "
                                        "(pip install -e '.[cluster]')")]

ROOT = nshosts.ROOT
TINY = ROOT / "tests" / "data" / "tiny.yaml"
FABRIC = nshosts.ROUTER_NET     # host <-> router subnets (/24)
SKEW_S = {"prfaas": 3.25, "local": 0.0}     # the PrfaaS host's clock runs ahead (test-only)
_ray_env = nshosts.ray_env
_pids_in = nshosts.pids_in
_netns_inode = nshosts.netns_inode


def _node_env(dc, tmp, storage):
    """A Ray node's environment: its own run directories (`storage` "own"; "shared": it uses
    the orchestrator's, which it sees), and its clock's test-only skew."""
    extra = {agents.NODE_DIR_ENV: str(tmp / f"node-{dc}")} if storage == "own" else {}
    if SKEW_S[dc]:
        extra[clocks.SKEW_ENV] = repr(SKEW_S[dc])
    return _ray_env(**extra)


@pytest.fixture
def ray_hosts(tmp_path, request):
    """The namespace hosts and their Ray nodes; `request.param` (indirect): "own" (default)
    for nodes keeping their own run directories, "shared" for the orchestrator's."""
    storage = getattr(request, "param", "own")
    with nshosts.running(tmp_path, lambda h: _node_env(h.dc, tmp_path, storage)) as (
            built, head):
        yield {h.dc: h.name for h in built}, head


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
        found += [f"{h}: {k} off" for k, v in offload_state(ns_path(h), f"{h}0").items()
                  if v == "off" and k in ("tso", "gso")]       # a veth's default: on
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if str(run_dir) in cmd or "tb-delayline" in cmd and any(
                        h in cmd for h in hosts.values()):
                    found.append(f"pid {p.name}: {cmd[:80]}")
    return found


def _guard_pids(hosts):
    """PIDs of the shaping agents' guard processes in the test's namespaces."""
    out = []
    for pid in _pids_in({_netns_inode(h) for h in hosts.values()}):
        with contextlib.suppress(OSError):
            argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"testbed.backend.agents" in argv and b"guard" in argv:
                out.append(pid)
    return out


def _wait_owners_gone(pattern, timeout_s=60):
    """Until no state file matching `pattern` has a live owner."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for f in lifecycle.STATE_DIR.glob(pattern):
            with contextlib.suppress(OSError, lifecycle.CorruptState):
                if lifecycle.owner_alive(lifecycle.read_state(f)):
                    alive.append(f.name)
        if not alive:
            return
        assert time.monotonic() < deadline, f"owners still alive: {alive}"
        time.sleep(0.2)


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
         "--no-progress", "--no-probe", "--set", "requests=400",
         "--set", "network.wan.loss=0.1%"],      # loss: the agents turn TSO/GSO off
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=_ray_env())
    log.close()
    records = out / "requests.jsonl"
    deadline = time.monotonic() + 180
    while not (records.exists() and records.read_text().count('"ev":"done"') >= 10):
        assert orch.poll() is None, (tmp_path / "orchestrator.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no 10 requests done within 180 s"
        time.sleep(0.2)
    shaping = _leftovers(hosts, tmp_path)    # the run is shaping and running: something to undo
    assert any(f.endswith("tso off") for f in shaping), shaping
    assert (out / "logs" / "rp0.log").exists()     # written there by the PrfaaS host itself
    # The agents' guards go first (SIGKILL by PID: the guard processes in this test's
    # namespaces), so what the agents did is left to `testbed clean` alone.
    guards = _guard_pids(hosts)
    assert len(guards) == 2, guards
    for pid in guards:
        os.kill(pid, signal.SIGKILL)
    orch.kill()
    orch.wait()
    _wait_owners_gone("ray-*.json")      # Ray ends the dead driver's actors
    assert any(f.endswith("tso off") for f in _leftovers(hosts, tmp_path))
    r = ns_run(hosts["local"], [sys.executable, "-m", "testbed.cli", "clean", "--backend", "ray",
                                "--address", head], capture_output=True, text=True, cwd=ROOT,
               env=_ray_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    deadline = time.monotonic() + 30     # the workers see their launcher gone and exit
    while _leftovers(hosts, tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _leftovers(hosts, tmp_path) == [], r.stdout    # TSO/GSO on again, among the rest
    assert not list(lifecycle.STATE_DIR.glob("ray-*.json"))
    for f in lifecycle.STATE_DIR.glob("*.json"):      # nor the orchestrator's own record
        with contextlib.suppress(OSError, lifecycle.CorruptState):
            assert lifecycle.read_state(f)["owner_pid"] != orch.pid, f


@pytest.fixture
def two_local_hosts(tmp_path):
    """Three namespace hosts on one bridge (`nshosts.build_bridged_hosts`): one PrfaaS, two
    local, with their Ray nodes (on the orchestrator's run directory); yields ({dc: [Host]},
    head)."""
    with nshosts.running(tmp_path, lambda h: _ray_env(),
                         bridged=("local", "prfaas", "local")) as (built, head):
        yield {dc: [h for h in built if h.dc == dc] for dc in ("prfaas", "local")}, head


def _token_packets_in(host):
    """(packets, bytes) that arrived on `host`'s interface from a token port (the iptables
    counting rule of `_count_token_bytes`)."""
    r = ns_run(host.name, ["iptables", "-nvxL", "INPUT"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if f"spt:{TOKEN_PORT}" in ln]
    assert len(rows) == 1, r.stdout
    return int(rows[0][0]), int(rows[0][1])


def _count_token_bytes(host):
    r = ns_run(host.name, ["iptables", "-I", "INPUT", "-i", f"{host.name}0", "-p", "tcp",
                           "--sport", str(TOKEN_PORT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_token_streams_cross_hosts_to_the_client(two_local_hosts, tmp_path):
    """With two local hosts, a decode worker placed on another host than the client streams its
    tokens to the client across hosts on its token port: every request ok with all its tokens,
    and the client's host's kernel counted bytes arriving from the token port (an iptables
    counting rule on its interface; a worker without a stream would send through the scheduler
    instead, on the gRPC port)."""
    hosts, head = two_local_hosts
    for h in hosts["local"]:
        _count_token_bytes(h)
    out = tmp_path / "run"
    r = ns_run(hosts["local"][0].name,
               [sys.executable, "-m", "testbed.cli", "run", str(TINY), "--backend", "ray",
                "--address", head, "--out", str(out), "--no-progress", "--no-probe",
                "--set", "clusters.local.instances=3", "--set", "clusters.local.decode=2"],
               capture_output=True, text=True, timeout=400, cwd=ROOT, env=_ray_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    placed = json.loads((out / "metadata.json").read_text())["topology"]["placement"]
    far = [d for d in ("ld0", "ld1") if placed[d] != placed["client"]]
    assert far, placed
    df = pd.read_parquet(out / "requests.parquet")
    assert (df.status == "ok").all(), df[df.status != "ok"].error.tolist()
    assert (df.n_tokens == df.output_len).all(), df[["id", "n_tokens", "output_len"]]
    crossed = df[df.decode_instance.isin(far)]
    assert len(crossed) > 0, df.decode_instance.value_counts()
    client_host = next(h for h in hosts["local"] if h.ip == placed["client"])
    packets, arrived = _token_packets_in(client_host)
    # TCP/IP headers are at most 60 bytes here (timestamps, SYN options); what is left is the
    # streams' payload: more than the opening empty frame (4 bytes) and each crossed request's
    # first token, which goes direct at once (a TokenChunk: id, a double stamp, a token id).
    payload_min = arrived - 60 * packets
    assert payload_min >= 4 + 12 * len(crossed), (packets, arrived, placed)
    print(f"placement {placed}; {len(crossed)} requests ({int(crossed.n_tokens.sum())} tokens) "
          f"decoded on {far}; {packets} packets, {arrived} bytes from the token port arrived on "
          f"the client's host (payload at least {payload_min} bytes)")


def _linktest(hosts, head, *args):
    r = ns_run(hosts["local"], [sys.executable, "-m", "testbed.cli", "linktest", "--backend",
                                "ray", "--address", head, "--json", "--duration", "1.5", *args],
               capture_output=True, text=True, timeout=240, cwd=ROOT, env=_ray_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(" ".join(args), json.dumps({k: out[k] for k in ("measured", "deviation", "warnings",
                                                          "agents")}))
    return out


def test_linktest_through_the_agents_meets_linktest_tolerances(ray_hosts, tmp_path):
    """`testbed linktest --backend ray`: the probe between the two hosts' probe actors, shaped
    by their agents, within the tolerances `testbed linktest` warns at (probe.compare): the
    rate without loss, the loss (binomial bound) with it, and RTT and jitter side by side.
    Offload goes off on both NICs for the lossy link and is back on afterwards."""
    hosts, head = ray_hosts
    before = {h: offload_state(ns_path(h), f"{h}0") for h in hosts.values()}
    assert all(s["tso"] == s["gso"] == "on" for s in before.values()), before
    # linktest measures a probe again once when it warns in a slow spell (its RTTs spread); the
    # machine's spells can outlast that (+28% RTT in one clean-clone run), so up to three tries
    # of the clean link too, the best kept
    clean_tries = []
    for _ in range(3):
        clean_tries.append(_linktest(hosts, head, "--rate", "100Mbit", "--delay", "5ms"))
        assert len(clean_tries[-1]["tries"]) in (1, 2), clean_tries[-1]["tries"]
        if not clean_tries[-1]["warnings"]:
            break
    clean = min(clean_tries, key=lambda o: abs(o["deviation"]["rtt_p50"]))
    # the jitter of the lossy link is a standard deviation, which one burst of this machine's
    # own latency inflates (+27% once in a clean-clone run, the clean link's 0.11 ms at
    # another moment); such a burst only adds spread, so up to three tries, the best kept
    # (subtracting the clean link's spread in quadrature did not work: measured at another
    # moment, it was 0.11 ms once and 0.78 ms the next time). Up to five, two seconds apart: in
    # a clean-clone run on 2026-12-04 three in a row were in one spell (jitter +14% to +149%,
    # goodput -41% to -65%)
    lossy_tries = []
    for i in range(5):
        time.sleep(2.0 if i else 0.0)
        lossy_tries.append(_linktest(hosts, head, "--rate", "50Mbit", "--delay", "5ms",
                                     "--jitter", "1ms", "--loss", "2%"))
        if abs(lossy_tries[-1]["deviation"]["jitter"]) <= probe.DEVIATION_WARN:
            break
    lossy = min(lossy_tries, key=lambda o: abs(o["deviation"]["jitter"]))
    for out, loss in ((clean, 0.0), (lossy, 0.02)):
        assert out["hosts"]["src"] == f"{FABRIC['prfaas']}.2", out["hosts"]
        assert out["hosts"]["dst"] == f"{FABRIC['local']}.2", out["hosts"]
        # never less delay than configured; this machine's own wake-ups and NFQUEUE round trips
        # add to it (0.2-1.8 ms a round trip seen, varying by the minute: +14% in one CI run),
        # so the upper bound is loose here and the comparison is the side-by-side one below
        assert -probe.DEVIATION_WARN <= out["deviation"]["rtt_p50"] <= 0.25, out["deviation"]
        # an RTT probe comes back when neither way loses it: binomial, 4 sigma below the mean
        n, p = probe.PROBES, (1 - loss) ** 2
        assert out["measured"]["probes"] >= min(0.95 * n, n * p - 4 * (n * p * (1 - p)) ** 0.5)
    assert abs(clean["deviation"]["goodput"]) <= probe.DEVIATION_WARN, clean["measured"]
    assert clean["measured"]["loss"] is None
    m = lossy["measured"]
    assert m["loss_packets"] > 0 and 0 < m["loss"], m
    assert {"jitter", "loss"} <= set(lossy["deviation"]), lossy["deviation"]
    # side by side: both links have 5 ms each way, so their medians agree within linktest's
    # tolerance; the jitter is the best try's, within it
    rtt = {k: o["measured"]["rtt_p50_ms"] for k, o in (("clean", clean), ("lossy", lossy))}
    assert abs(rtt["lossy"] - rtt["clean"]) <= probe.DEVIATION_WARN * 10.0, rtt
    assert abs(lossy["deviation"]["jitter"]) <= probe.DEVIATION_WARN, [
        o["deviation"] for o in lossy_tries]
    assert {a["segmentation_offload"] for a in clean["agents"].values()} == {"on"}
    assert {a["segmentation_offload"] for a in lossy["agents"].values()} == {"off"}
    # undone: offload as before, no qdisc, rule, address or state file of the agents
    assert {h: offload_state(ns_path(h), f"{h}0") for h in hosts.values()} == before
    assert _leftovers(hosts, tmp_path) == []
    assert not list(lifecycle.STATE_DIR.glob("ray-linktest-*.json"))


def _delivered(host, direction):
    """(bytes delivered, bytes dropped) of `direction` at the host that receives it so far,
    from one snapshot of the kernel's rule counters (`iptables-save -c`): what the INPUT jump
    into TBWAN-<direction> saw, less what that chain dropped (loss, a cut link); None while the
    agent has no such rule."""
    dump = ns_run(host, ["iptables-save", "-c", "-t", "filter"], capture_output=True,
                  text=True).stdout
    arrived = dropped = None
    for ln in dump.splitlines():
        if not ln.startswith("["):
            continue
        count, rule = ln.split(" ", 1)
        nbytes = int(count.strip("[]").split(":")[1])
        if rule.startswith("-A INPUT ") and rule.endswith(f"-j TBWAN-{direction}"):
            arrived = (arrived or 0) + nbytes
        elif rule.startswith(f"-A TBWAN-{direction} ") and rule.endswith("-j DROP"):
            dropped = (dropped or 0) + nbytes
    if arrived is None:
        return None
    return arrived - (dropped or 0), dropped or 0


def _fault_window(ev, i):
    """(inject, end) times of fault `i` in events.csv."""
    rows = ev[ev.detail.str.contains(f"fault={i} ", na=False)]
    return (float(rows[rows.kind == "fault_inject"].time.iloc[0]),
            float(rows[rows.kind == "fault_end"].time.iloc[0]))


class _Sampler(threading.Thread):
    """(start, end, {direction: (bytes delivered, dropped)}) at the receiving hosts, every
    20 ms: the counters were read somewhere between start and end. Every read is kept (CI
    2026-12-03 skipped reads over 50 ms as unplaced and was left 3 in a 0.8 s cut); `_within`
    places a read in a window only when all of it lies there."""

    def __init__(self, hosts):
        super().__init__(daemon=True)
        self.at = {"kv": hosts["local"], "request": hosts["prfaas"]}
        self.rows, self.done = [], threading.Event()

    def run(self):
        while not self.done.wait(0.02):
            t0 = time.time()
            got = {d: _delivered(h, d) for d, h in self.at.items()}
            if all(v is not None for v in got.values()):
                self.rows.append((t0, time.time(), got))


def _within(rows, lo, hi):
    """The reads among `rows` made wholly between lo and hi (times), as {direction: value}."""
    return [g for t0, t1, g in rows if lo <= t0 and t1 <= hi]


def test_link_cut_and_worker_kill_on_ray(ray_hosts, tmp_path):
    """Faults with `backend: ray`: rp0 is SIGKILLed through its launcher at 3 s, the kv direction
    degraded to 5% loss from 4 s for 3 s, then the WAN is cut in both directions through the
    agents from 10 s for 5 s (real-world; scale.time 5). Every request is accounted for (none
    lost, failures with their reason), the scheduler's health check saw rp0 down and the
    requests went to rp1; the receiving hosts' kernel counters show no byte delivered across
    the link while it was down (and bytes before and after), and kv drops during the
    degradation only, while bytes still crossed; offload is back on after the run."""
    hosts, head = ray_hosts
    out = tmp_path / "run"
    faults = ("[{at: 3s, kind: kill, target: rp0}, "
              "{at: 10s, kind: link, direction: both, up: false, duration: 5s}, "
              "{at: 4s, kind: link, direction: kv, loss: 5%, duration: 3s}]")
    sampler = _Sampler(hosts)
    sampler.start()
    try:
        r = ns_run(hosts["local"], [
            sys.executable, "-m", "testbed.cli", "run", str(TINY), "--backend", "ray",
            "--address", head, "--out", str(out), "--no-progress", "--no-probe",
            "--set", "scale.time=5", "--set", "requests=40",
            "--set", "clusters.prfaas.instances=2",
            "--set", "scheduler.failover={enabled: true, interval: 1s, timeout: 1s}",
            "--set", f"faults={faults}"],
            capture_output=True, text=True, timeout=400, cwd=ROOT, env=_ray_env())
    finally:
        sampler.done.set()
        sampler.join()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    df = pd.read_parquet(out / "requests.parquet")
    s = json.loads((out / "summary.json").read_text())
    ev = pd.read_csv(out / "events.csv").sort_values("time")
    assert s["accounting"]["lost"] == 0 and s["accounting"]["sent"] == 40, s["accounting"]
    failed = df[df.status != "ok"]
    assert failed.error.notna().all() and (failed.error != "").all(), failed.error.tolist()
    kill, cut, _ = s["faults"]
    # the kill: the worker died, the health check saw it, nothing was prefilled on it after
    assert ev.kind.eq("worker_died").any() and kill["detect_s"] is not None, kill
    down = ev[(ev.kind == "health") & ev.detail.str.contains("instance=rp0 role=prefill "
                                                             "state=down")]
    assert len(down), ev.kind.tolist()
    assert not (df.prefill_instance == "rp0")[df.prefill_start > float(down.time.iloc[0])].any()
    assert (df.prefill_instance == "rp1").any()
    # the cut, as the agents' shaper recorded it and as the receiving hosts' kernels counted
    assert cut["target"] == "wan:both"
    ts = pd.read_csv(out / "timeseries.csv")
    assert (ts.kv_up == 0).any() and ts.kv_up.iloc[-1] == 1 and ts.request_up.iloc[-1] == 1
    t_cut, t_end = _fault_window(ev, 1)
    rows = [(t0, t1, {d: v[0] for d, v in g.items()}) for t0, t1, g in sampler.rows]
    during = _within(rows, t_cut + 0.2, t_end)
    before = _within(rows, 0, t_cut)
    after = _within(rows, t_end + 0.5, float("inf"))
    assert len(during) >= 3 and before and after, (len(rows), t_cut, t_end)
    sent = ts[(ts.time >= t_cut + 0.2) & (ts.time <= t_end)]
    print(f"cut {t_end - t_cut:.2f} s: delivered "
          f"{ {d: during[-1][d] - during[0][d] for d in ('kv', 'request')} } B over "
          f"{len(during)} samples; sent into it (egress class) "
          f"{ {d: int(sent[f'{d}_tx_bytes'].max() - sent[f'{d}_tx_bytes'].min()) for d in ('kv', 'request')} } B; "
          f"ok {int((df.status == 'ok').sum())}/40, redispatched {kill['redispatched']}, "
          f"kill detect {kill['detect_s']} s, cut detect {cut['detect_s']} s")
    for d in ("kv", "request"):
        assert during[-1][d] - during[0][d] == 0, (d, _within(sampler.rows, t_cut - 0.3,
                                                              t_end + 0.1))
        assert before[-1][d] > 0 and after[-1][d] > during[-1][d], (d, before[-1], after[-1])
    # the degradation: kv drops only while it lasts (before the cut's own drops), bytes still
    # cross. It comes before the cut: after a cut, offload may stay off a while (no KV crosses)
    t_deg, t_deg_end = _fault_window(ev, 2)
    kv = [(t0, t1, g["kv"]) for t0, t1, g in sampler.rows]
    deg = _within(kv, t_deg + 0.2, t_deg_end)
    pre = _within(kv, 0, t_deg)
    post = _within(kv, t_deg_end + 0.2, t_cut)
    assert len(deg) >= 3 and pre and post, (len(kv), t_deg, t_deg_end)
    assert deg[-1][1] > deg[0][1] and deg[-1][0] > deg[0][0], (deg[0], deg[-1])
    assert pre[-1][1] == pre[0][1] and post[-1][1] == post[0][1], (pre, post)
    assert _leftovers(hosts, out) == []
