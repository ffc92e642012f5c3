"""Instance faults, health checks and re-dispatch in the simulator (testbed/sim/faults.py), on
the decisions the emulation's scheduler runs (workers/redispatch.py). No root, seconds."""

import csv
import types

import pandas as pd
import pytest

from conftest import ROOT, assert_decisions_replay
from testbed import cli, config, rundir, sim
from workers.policy import Instance
from workers.redispatch import (MAX_ATTEMPTS, HealthBook, after_kv_timeout, after_prefill_failure,
                                reroute_decode)

GRAY = str(ROOT / "experiments" / "gray_failure.yaml")
TINY = str(ROOT / "tests" / "data" / "tiny.yaml")
WAN_FAILURE = str(ROOT / "experiments" / "wan_failure.yaml")


def _events(d):
    out = []
    with open(d / "events.csv") as f:
        for row in csv.reader(f):
            if len(row) >= 3 and row[0][:1].isdigit():
                out.append((float(row[0]), row[1], dict(kv.split("=", 1) for kv in
                                                        row[2].split(" ") if "=" in kv)))
    return out


def test_the_health_book_judges_as_the_scheduler_does():
    t = [0.0]
    rows = []
    inst = Instance("rp0", "prefill", "prfaas", "h200", "x")
    book = HealthBook(["rp0"], lambda kind, **f: rows.append(f), lambda: t[0])
    assert book.checked(inst, False, 0.0, 0.5, "DEADLINE_EXCEEDED") is None   # one miss
    down, why = book.checked(inst, False, 1.5, 0.5, "DEADLINE_EXCEEDED")
    assert down and "2 missed" in why and book.set(inst, down, why) and inst.down
    t[0] = 3.3
    book.seen(inst)                     # chunks still arriving late in the wait: no miss
    assert book.checked(inst, False, 3.0, 0.5) == (False, "answered a health check")
    assert book.set(inst, False, "answered") and not inst.down
    assert [r["state"] for r in rows] == ["down", "up"]


def test_the_redispatch_decisions():
    p, d, d2 = (Instance(n, r, "local", "h20", "x") for n, r in
                (("lp0", "prefill", ), ("ld0", "decode"), ("ld1", "decode")))
    f = types.SimpleNamespace(failover=True, attempt=0, tokens=0, p=p, d=d)
    assert after_prefill_failure(f, lambda: ("local", p, d), "boom") == ("move", p)
    p.down = True
    assert after_prefill_failure(f, lambda: ("local", p, d), "boom") == ("wait", None)
    f.attempt = 3
    assert after_prefill_failure(f, lambda: ("local", p, d), "boom")[0] == "fail"
    f.attempt, f.tokens = 0, 5
    assert "after 5 tokens" in reroute_decode(f, lambda: ("local", p, d2), "gone")[0]
    f.tokens = 0
    assert reroute_decode(f, lambda: ("local", p, d2), "gone") == (None, (p, d2))
    f.failover = False
    assert after_prefill_failure(f, lambda: ("local", p, d), "boom") == ("fail", "boom")


def test_the_kv_deadline_decisions():
    p, p2, d, d2 = (Instance(n, r, "local", "h20", "x") for n, r in
                    (("lp0", "prefill"), ("lp1", "prefill"), ("ld0", "decode"),
                     ("ld1", "decode")))
    f = types.SimpleNamespace(failover=True, attempt=0, tokens=0, p=p, d=d, kv_waits=0)
    # the prefill still runs on an up instance: the KV is late, not lost
    assert after_kv_timeout(f, lambda: ("local", p2, d2), "late", True) == ("wait", None)
    # it ended (or its instance is down) and no KV came: prefill again where the policy says,
    # the same decode instance allowed
    assert after_kv_timeout(f, lambda: ("local", p2, d), "late", False) == ("prefill", (p2, d))
    p.down = True
    assert after_kv_timeout(f, lambda: ("local", p2, d2), "late", True) == ("prefill", (p2, d2))
    p2.down = True
    assert after_kv_timeout(f, lambda: ("local", p2, d2), "late", True)[0] == "fail"
    p.down = p2.down = False
    f.kv_waits = MAX_ATTEMPTS - 1      # waits and attempts together are bounded
    what, why = after_kv_timeout(f, lambda: ("local", p2, d2), "late", True)
    assert what == "fail" and why.startswith("late; ")
    f.kv_waits, f.failover = 0, False
    assert after_kv_timeout(f, lambda: ("local", p2, d2), "late", True) == ("fail", "late")


# Every prefill on the one local instance, 6 requests of 4,000 tokens at once: the later ones
# wait in its queue longer than a 3 s KV deadline (1.17 s of prefill each, real-world), and
# less than the 4 deadlines (waits and attempts) a request may spend.
QUEUED = ["scheduler.policy=homogeneous", "requests=6", "workload.input={dist: fixed, tokens: "
          "4000}", "workload.arrival={process: poisson, rate: 50/s}", "run.kv_deadline=3s"]
DEADLINE_MS = 3000


def test_a_kv_deadline_in_the_prefill_queue_waits_again_in_the_sim(tmp_path):
    """Without failover the requests queued past the KV deadline fail; with it the decode
    stream waits again while their prefill is queued (`kv_wait` rows) and all complete."""
    dfs = {}
    for name, failover in (("off", "{enabled: false}"), ("on", "{enabled: true}")):
        sets = [a for kv in QUEUED + [f"scheduler.failover={failover}"] for a in ("--set", kv)]
        assert cli.main(["run", TINY, "--backend", "sim", "--out", str(tmp_path / name),
                         "--no-progress", *sets]) == 0
        dfs[name] = pd.read_parquet(tmp_path / name / "requests.parquet")
    off, on = dfs["off"], dfs["on"]
    late = off[off.status != "ok"]
    assert len(late) and late.error.str.contains("KV not complete").all()
    assert (on.status == "ok").all() and len(on) == 6
    waits = [f for _, k, f in _events(tmp_path / "on") if k == "kv_wait"]
    waited = {int(f["id"]) for f in waits}
    assert set(late.id) <= waited, (sorted(late.id), sorted(waited))
    # measured: the requests that waited are the ones whose prefill queue passed the deadline
    queued = on[on.prefill_queue_ms > DEADLINE_MS * 1.02]
    assert len(queued) and set(queued.id) <= waited and (on.attempts == 1).all()


def test_gray_failure_runs_in_the_sim(tmp_path):
    """Both PrfaaS instances frozen, or killed and restarted: detected by the health checks
    within two checks (1 s + 0.5 s each, real), the requests on them re-dispatched, up again
    after the fault's end; every request completes."""
    out = tmp_path / "g"
    assert cli.main(["run", GRAY, "--backend", "sim", "--out", str(out), "--set",
                     "requests=320", "--no-progress"]) == 0
    runs = {d.name: d for d in rundir.find_runs(out)}
    assert set(runs) == {"no-fault", "freeze-200s", "kill-restart-200s"}
    for name in ("freeze-200s", "kill-restart-200s"):
        ev = _events(runs[name])
        t_inj = next(t for t, k, _ in ev if k == "fault_inject")
        t_end = next(t for t, k, _ in ev if k == "fault_end")
        downs = {f["instance"]: t for t, k, f in ev if k == "health" and f["state"] == "down"}
        ups = {f["instance"]: t for t, k, f in ev if k == "health" and f["state"] == "up"}
        assert set(downs) == {"rp0", "rp1"} == set(ups), name
        for inst, t in downs.items():
            assert 0 <= (t - t_inj) * 10 <= 2 * 1.5 + 0.5, (name, inst)     # scale.time 10
            assert t_end <= ups[inst] <= t_end + 0.2, (name, inst)
        moves = [f for t, k, f in ev if k == "redispatch"]
        assert moves and all(f["from"].startswith("rp") for f in moves
                             if f["reason"].startswith("rp"))
        df = pd.read_parquet(runs[name] / "requests.parquet")
        assert (df.status == "ok").all() and len(df) == 320
        moved = df[df.attempts > 1]
        assert len(moved) and all(len(x) == a - 1 for x, a in zip(moved.redispatches,
                                                                 moved.attempts))
        # routed while PrfaaS was down: nothing prefilled there but the ones that waited
        during = df[(df.send_time > max(downs.values())) & (df.send_time < t_end)]
        short = during[during.input_len <= 32_000]
        assert len(short) and not short.prefill_instance.str.startswith("rp").any()
        # the decisions made while PrfaaS was down replay the same
        decisions = assert_decisions_replay(runs[name])
        assert any({"rp0", "rp1"} <= set(r.down) for r in decisions), name
        # the router's book never goes below zero: a request moved off a frozen instance is
        # not prefilled again there at the resume (each attempt's work leaves the book once)
        assert all(v >= 0 for r in decisions for v in r.inflight.values()), name
        assert all(v > -1e-9 for r in decisions for v in r.outstanding_s.values()), name
    assert "UNAVAILABLE" in next(f["reason"] for t, k, f in _events(runs["kill-restart-200s"])
                                 if k == "health")


def test_wan_failure_runs_in_the_sim(tmp_path):
    out = tmp_path / "w"
    assert cli.main(["run", WAN_FAILURE, "--backend", "sim", "--out", str(out),
                     "--no-progress"]) == 0
    runs = {d.name: d for d in rundir.find_runs(out)}
    assert not [k for _, k, _ in _events(runs["no-failover"]) if k == "health"]
    ev = _events(runs["failover-all"])
    assert {f["instance"] for _, k, f in ev if k == "health" and f["state"] == "down"} == \
        {"rp0", "rp1"}
    for d in runs.values():
        assert (pd.read_parquet(d / "requests.parquet").status == "ok").all()


DECODE = str(ROOT / "experiments" / "decode_failure.yaml")


def _decode_run(tmp_path, variants, failover=True):
    """experiments/decode_failure.yaml in the sim with `variants`: {label: run directory}."""
    out = tmp_path / "d"
    assert cli.main(["run", DECODE, "--backend", "sim", "--no-progress", "--out", str(out),
                     "--set", f"variants={variants}", "--set", "sweep=null", "--set",
                     f"scheduler.failover.enabled={str(failover).lower()}"]) == 0
    return {rundir.summary(d)["label"]: d for d in rundir.find_runs(out)}


def test_a_killed_decode_instance_loses_its_batch_and_its_requests_move(tmp_path):
    """Killed at 15 s (emulated, 1.5 s at 10x): marked down at once; a request on it without a
    token is prefilled again for ld1 (a decode re-dispatch), one with tokens fails with their
    number (its KV is gone), and ld0 makes no token after the kill."""
    run = _decode_run(tmp_path, "[{label: kill, faults: [{at: 15s, kind: kill, target: ld0}]}]")
    d = run["kill"]
    df = pd.read_parquet(d / "requests.parquet")
    ev = _events(d)
    t_kill = next(t for t, k, f in ev if k == "fault_inject")
    assert [(f["instance"], f["state"]) for _, k, f in ev if k == "health"] == [("ld0", "down")]
    failed = df[df.status != "ok"]
    assert len(failed) and failed.error.str.contains(r"decode ld0 failed \(UNAVAILABLE\) after "
                                                     r"\d+ tokens").all()
    moved = [f for _, k, f in ev if k == "redispatch" and f["role"] == "decode"]
    assert moved and {f["from"] for f in moved} == {"ld0"}
    assert set(df[df.id.isin({int(f["id"]) for f in moved})].decode_instance) == {"ld1"}
    on_ld0 = df[(df.status == "ok") & (df.decode_instance == "ld0")]
    assert (on_ld0.last_token < t_kill).all()
    assert len(df) == 60


def test_a_paused_decode_instance_holds_its_tokens_until_the_resume(tmp_path):
    """Without failover a 15 s pause delays ld0's requests: no token is stamped on ld0 inside
    the pause, a request that decoded across it has a gap of at least its length, and every
    request completes. With failover the same pause marks ld0 down after two missed checks
    and its requests move or fail as a kill's do."""
    pause = "[{label: pause, faults: [{at: 15s, kind: pause, target: ld0, duration: 15s}]}]"
    d = _decode_run(tmp_path, pause, failover=False)["pause"]
    df = pd.read_parquet(d / "requests.parquet")
    ev = _events(d)
    t0 = next(t for t, k, f in ev if k == "fault_inject")
    t1 = next(t for t, k, f in ev if k == "fault_end")
    assert (df.status == "ok").all() and len(df) == 60
    tok = pd.read_parquet(d / "tokens.parquet")
    across = 0
    for _, g in tok[tok.id.isin(df[df.decode_instance == "ld0"].id)].groupby("id"):
        times = sorted(g.decode_time)
        assert not any(t0 < t < t1 for t in times)
        gaps = [b - a for a, b in zip(times, times[1:]) if a <= t0 and b >= t1]
        across += bool(gaps)
        assert all(g >= (t1 - t0) for g in gaps)
    assert across
    d = _decode_run(tmp_path / "fo", pause)["pause"]
    ev = _events(d)
    t0 = next(t for t, k, f in ev if k == "fault_inject")
    down = [t for t, k, f in ev if k == "health" and f["instance"] == "ld0" and
            f["state"] == "down"]
    assert len(down) == 1 and 0 < down[0] - t0 <= 3 * (0.1 + 0.05)
    assert [f["state"] for _, k, f in ev if k == "health" and f["instance"] == "ld0"] == \
        ["down", "up"]


def test_a_restarted_decode_instance_comes_back_and_takes_requests(tmp_path):
    run = _decode_run(tmp_path, "[{label: r, faults: [{at: 15s, kind: restart, target: ld0, "
                                "after: 15s}]}]")
    d = run["r"]
    ev = _events(d)
    t1 = next(t for t, k, f in ev if k == "fault_end")
    up = [t for t, k, f in ev if k == "health" and f["instance"] == "ld0" and f["state"] == "up"]
    assert len(up) == 1 and up[0] >= t1
    df = pd.read_parquet(d / "requests.parquet")
    assert ((df.decode_instance == "ld0") & (df.send_time > up[0])).any()


def test_a_fault_on_a_dual_role_instance_exits_2(tmp_path, capsys):
    out = tmp_path / "x"
    assert cli.main(["run", str(ROOT / "experiments" / "shifting_mix.yaml"), "--backend", "sim",
                     "--out", str(out), "--set",
                     "faults=[{at: 10s, kind: pause, target: ld0, duration: 5s}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dual-role" in err, err
    assert not out.exists()


@pytest.mark.parametrize("fault,said", [
    ("{at: 10s, kind: blackhole, duration: 5s}", "a blackhole fault acts on packets"),
    ("{at: 10s, kind: link, direction: kv, mtu: 1280, duration: 5s}", "network.wan mtu")])
def test_a_packet_level_wan_fault_exits_2_and_a_flap_runs(tmp_path, capsys, fault, said):
    """The flow-level WAN cannot refuse, reset or blackhole a connection, or drop packets over
    an MTU: exit 2 with one line (a flap is cuts and returns: it runs)."""
    out = tmp_path / "e"
    assert cli.main(["run", GRAY, "--backend", "sim", "--out", str(out), "--set",
                     f"variants=[{{label: x, faults: [{fault}]}}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert not out.exists()
    flap = config.load_experiment(GRAY, ["variants=[{label: f, faults: [{at: 10s, kind: flap, "
                                         "down_for: 1s, up_for: 1s, duration: 4s}]}]"])[0]
    assert sim.unsupported(flap) is None
