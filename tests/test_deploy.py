"""Deploy: an Experiment compiled into a Deployment -- instances, emulated links, one schedule,
the typed worker runtime and its JSON round trip (no root)."""

import dataclasses
import ipaddress
import json
import math
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, SMALL_EXPERIMENT
from testbed import config, deploy
from testbed import profile as profiles
from testbed.deploy import FaultAction, LinkChange
from testbed.errors import ConfigError
from testbed.runtime import WorkerRuntime
from testbed.scale import Scale


def load(tmp_path, text, overrides=()):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return [exp for exp, _ in deploy.load(p, overrides)]     # read, then compiled once


def test_instances_have_roles_clusters_and_distinct_addresses_in_their_datacenter(tmp_path):
    (exp,) = load(tmp_path, SMALL_EXPERIMENT, ["cache.enabled=true",
                                               "scheduler.placement=cache_aware"])
    dep = deploy.compile(exp)
    by = {i.name: i for i in dep.instances}
    assert list(by) == ["rp0", "lp0", "ld0", "scheduler", "client", "pool_prfaas",
                        "pool_local"]
    assert [(by[n].role, by[n].dc) for n in ("rp0", "lp0", "ld0")] == [
        ("prefill", "prfaas"), ("prefill", "local"), ("decode", "local")]
    assert by["rp0"].accelerator == "h200" and by["ld0"].accelerator == "h20"
    ips = [ipaddress.ip_address(i.ip) for i in dep.instances]
    assert len(set(ips)) == len(ips)
    for i in dep.instances:
        assert ipaddress.ip_address(i.ip) in ipaddress.ip_network(f"{deploy.DC_NET[i.dc]}.0.0/16")
    pool = by["pool_local"]
    assert pool.module == "workers.cachepool"
    cap = config.cache_capacity(exp, profiles.load(exp.model.profile), "local")
    assert pool.cache_capacity_bytes == int(dep.scale.emulated_bytes(cap))
    assert [i.name for i in dep.workers()] == ["rp0", "lp0", "ld0", "pool_prfaas", "pool_local"]
    assert dep.runtime.instances == by


def test_dual_role_workers_start_in_their_configured_role(tmp_path):
    text = SMALL_EXPERIMENT.replace("local: {instances: 2, prefill: 1, decode: 1}",
                                    "local: {instances: 3, prefill: 1, decode: 2}")
    (exp,) = load(tmp_path, text, ["scheduler.roles.enabled=true"])
    dep = deploy.compile(exp)
    local = [i for i in dep.instances if i.dc == "local" and i.role in ("prefill", "decode")]
    assert {i.module for i in local} == {"workers.dualrole"}
    assert [i.role for i in local] == ["prefill", "decode", "decode"]
    assert all(i.may_decode for i in local)
    assert dep.runtime.scheduler.roles.wan_rate_real_bps == 100e9


def test_links_are_emulated_once_through_the_scale(tmp_path):
    text = SMALL_EXPERIMENT.replace(
        "wan: {rate: 100Gbit, delay: 5ms}",
        "wan: {rate: 100Gbit, delay: 5ms, jitter: 1ms, queue: 64MiB, request: {rate: 10Gbit}}")
    (exp,) = load(tmp_path, text)
    dep = deploy.compile(exp)
    s = Scale(time=10, bytes=1e-3)
    assert dep.scale == s
    kv, req = dep.links["kv"], dep.links["request"]
    assert math.isclose(s.real_rate(kv.rate_bps), 100e9)
    assert math.isclose(s.real_rate(req.rate_bps), 10e9)
    assert math.isclose(s.real_s(kv.delay_s), 5e-3) and math.isclose(s.real_s(kv.jitter_s), 1e-3)
    assert kv.queue == {"bytes": int(s.emulated_bytes(64 * 2**20))}
    assert dep.links_real["request"]["rate_real_bps"] == 10e9
    assert kv.params()["rate"] == kv.rate_bps and set(kv.params()) >= {"rate", "delay", "up"}


def test_a_link_this_machine_cannot_shape_is_refused_once_with_its_key(tmp_path):
    with pytest.raises(ConfigError, match="scale.*above what this machine can shape"):
        load(tmp_path, SMALL_EXPERIMENT.replace("{time: 10, bytes: 1e-3}",
                                                "{time: 100, bytes: 1}"))
    with pytest.raises(ConfigError, match=r"faults\[0\]\.rate"):
        load(tmp_path, SMALL_EXPERIMENT + "faults: [{at: 1s, kind: link, rate: 10Tbit}]\n")
    with pytest.raises(ConfigError, match="below 8 kbit/s; raise scale.bytes"):
        load(tmp_path, SMALL_EXPERIMENT.replace("{time: 10, bytes: 1e-3}",
                                                "{time: 1, bytes: 1e-8}"))


def test_one_schedule_in_emulated_seconds_in_time_order(tmp_path):
    (tmp_path / "bw.csv").write_text("time,rate\n0s,100Gbit\n5s,20Gbit\n")
    text = SMALL_EXPERIMENT.replace("wan: {rate: 100Gbit, delay: 5ms}", textwrap.dedent("""\
        wan:
            rate: 100Gbit
            delay: 5ms
            rate_trace: {path: bw.csv, direction: kv}
            changes: [{at: 3s, rate: 50Gbit}]""")).replace("requests: 10", "requests: 20")
    text += textwrap.dedent("""\
        faults:
          - {at: 4s, kind: link, direction: kv, loss: 1%, duration: 2s}
          - {at: 2s, kind: pause, target: rp0, duration: 2s}
          - {at: 4s, kind: slow, target: ld0, duration: 1s, factor: 2}
        """)
    (exp,) = load(tmp_path, text)
    dep = deploy.compile(exp)
    times = [s.at_s for s in dep.schedule]
    assert times == sorted(times)
    assert {type(s) for s in dep.schedule} == {LinkChange, FaultAction}
    kinds = [(round(dep.scale.real_s(s.at_s), 9), type(s).__name__,
              getattr(s, "source", getattr(s, "phase", ""))) for s in dep.schedule]
    assert kinds == [(0.0, "LinkChange", "trace"), (2.0, "FaultAction", "inject"),
                     (3.0, "LinkChange", "change"), (4.0, "LinkChange", "fault"),
                     (4.0, "FaultAction", "inject"), (4.0, "FaultAction", "end"),
                     (5.0, "LinkChange", "trace"), (5.0, "FaultAction", "end"),
                     (6.0, "LinkChange", "fault")]
    # at the same instant, injections come before ends (the injector's order)
    at4 = [a for a in dep.fault_actions if math.isclose(a.at_s, 0.4)]
    assert [(a.kind, a.phase) for a in at4] == [("slow", "inject"), ("pause", "end")]
    end = dep.link_changes[-1]
    assert end.fault["phase"] == "end" and end.changes == {"loss": 0.0}   # what was in force
    t, d, ch, note = end.item()
    assert (d, note["fault_kind"]) == ("kv", "link")


def test_worker_runtime_round_trips_through_json_with_every_time_emulated(tmp_path):
    (exp,) = load(tmp_path, SMALL_EXPERIMENT, ["scheduler.adaptive.enabled=true",
                                               "scheduler.failover.enabled=true"])
    dep = deploy.compile(exp)
    dep.runtime.dump(tmp_path / "runtime.json")
    rt = WorkerRuntime.load(tmp_path / "runtime.json")
    assert rt == dep.runtime and rt.dir == tmp_path
    s = rt.scale
    assert math.isclose(s.real_s(rt.kv_deadline_s), exp.run.kv_deadline)
    assert math.isclose(s.real_s(rt.scheduler.health_interval_s),
                        exp.scheduler.failover.interval)
    assert math.isclose(s.real_s(rt.scheduler.adaptive.window_s), exp.scheduler.adaptive.window)
    assert math.isclose(s.real_s(rt.decode.step_s), rt.decode.step_real_s)
    assert rt.decode.model().step_s == rt.decode.step_real_s
    assert rt.instance("scheduler").addr.endswith(":50051")
    saved = json.loads((tmp_path / "runtime.json").read_text())
    assert saved["scale"] == {"time": 10, "bytes": 1e-3, "tokens": 1}
    assert "run_dir" not in saved and saved["scheduler"]["threshold"] == exp.scheduler.threshold


def test_a_stale_runtime_key_is_refused_at_load(tmp_path):
    (tmp_path / "runtime.json").write_text(json.dumps({"decode": {"model": {}}}))
    with pytest.raises(ValueError, match="unknown keys model"):
        WorkerRuntime.load(tmp_path / "runtime.json")


def test_deployment_json_is_self_contained(tmp_path):
    (exp,) = load(tmp_path, SMALL_EXPERIMENT + "faults: [{at: 1s, kind: kill, target: ld0}]\n")
    dep = deploy.compile(exp)
    dep.dump(tmp_path / "deployment.json")
    d = json.loads((tmp_path / "deployment.json").read_text())
    assert [i["name"] for i in d["instances"]] == [i.name for i in dep.instances]
    assert d["links"]["kv"] == dataclasses.asdict(dep.links["kv"])
    assert d["schedule"] == [{"type": "FaultAction", "at_s": 0.1, "phase": "inject", "fault": 0,
                              "occurrence": 0, "kind": "kill", "targets": ["ld0"],
                              "factor": None}]


def test_workers_load_their_runtime_without_mininet_or_torch(tmp_path):
    (exp,) = load(tmp_path, SMALL_EXPERIMENT)
    deploy.compile(exp).runtime.dump(tmp_path / "runtime.json")
    code = (f"import sys; from workers import common; "
            f"rt = common.load_runtime({str(tmp_path / 'runtime.json')!r}); "
            f"print(rt.instance('ld0').kv_addr, any(m.split('.')[0] in ('mininet', 'torch') "
            f"for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["10.2.2.1:50052", "False"]


def test_nothing_above_the_backend_seam_imports_mininet():
    code = ("import sys, testbed.run, testbed.config, testbed.deploy, testbed.metrics, "
            "testbed.plot, testbed.backend; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mininet', 'topologies'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
