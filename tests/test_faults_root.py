"""Failure injection end to end (root): each fault kind injected into a small run.

Every test runs `testbed run` on tests/data/tiny.yaml with a `faults:` list and asserts on what
was measured: the client's request records (every request completed or failed with a reason,
none lost), events.csv (injections, health transitions, re-dispatches, rows appended by the
scheduler and the decode workers) and the machine afterwards (nothing left behind).
"""

import json
import pathlib
import subprocess
import sys

import pandas as pd
import pytest

from conftest import assert_decisions_replay
from tests.test_run_root import leftovers

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "tiny.yaml"
FAILOVER = "scheduler.failover={enabled: true, interval: 1s, timeout: 1s}"
NAIVE_2RP = ("scheduler.policy=naive", "clusters.prfaas.instances=2", "clusters.local.prefill=0",
             "clusters.local.decode=2")


def run(tmp_path, faults, *sets, requests=30):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "testbed.cli", "run", str(TINY), "--out", str(out),
            "--no-progress", "--no-probe", "--set", "scale.time=5",
            "--set", f"requests={requests}", "--set", f"faults={faults}"]
    for s in sets:
        argv += ["--set", s]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_parquet(out / "requests.parquet")
    summary = json.loads((out / "summary.json").read_text())
    events = pd.read_csv(out / "events.csv").sort_values("time")
    assert summary["accounting"]["lost"] == 0, df[df.status != "ok"].error.tolist()
    assert summary["accounting"]["sent"] == requests
    assert leftovers(out) == []
    return out, df, summary, events


def _moves(df, role=None):
    return [(rid, m) for rid, lst in zip(df.id, df.redispatches) for m in (lst if lst is not None else [])
            if role is None or m["role"] == role]


def _injected(events, i=0):
    rows = events[(events.kind == "fault_inject") & events.detail.str.contains(f"fault={i} ")]
    assert len(rows) == 1, events.kind.tolist()
    return float(rows.time.iloc[0])


def test_pause_prefill_requeued_requests_are_redispatched(tmp_path):
    out, df, s, ev = run(tmp_path, "[{at: 4s, kind: pause, target: rp0, duration: 10s}]",
                         FAILOVER, *NAIVE_2RP)
    f = s["faults"][0]
    assert (df.status == "ok").all(), df.error.tolist()
    assert f["detect_s"] is not None and f["detect_s"] <= s["detection_window_s"] + 1
    moves = _moves(df, "prefill")
    assert moves and f["redispatched"] == len(moves)
    assert all(m["from"] == "rp0" and m["to"] == "rp1" for _, m in moves)
    # Re-dispatched at detection, not when the instance came back.
    t_inj = _injected(ev)
    assert max(m["time"] for _, m in moves) - t_inj <= (s["detection_window_s"] + 1) / 5
    health = ev[ev.kind == "health"].detail
    assert health.str.contains("instance=rp0 role=prefill state=down").any()
    assert health.str.contains("instance=rp0 role=prefill state=up").any()


def test_kill_prefill_requests_move_to_the_survivor(tmp_path):
    out, df, s, ev = run(tmp_path, "[{at: 4s, kind: kill, target: rp0}]", FAILOVER, *NAIVE_2RP)
    f = s["faults"][0]
    assert (df.status == "ok").all(), df.error.tolist()
    assert f["detect_s"] is not None and f["redispatched"] > 0
    down = ev[(ev.kind == "health") & ev.detail.str.contains("instance=rp0 role=prefill state=down")]
    after = df[df.send_time > float(down.time.iloc[0])]
    assert len(after) and (after.prefill_instance == "rp1").all()
    assert ev.kind.eq("worker_died").any()
    # The scheduler's decisions, rp0 down in some, replayed by the simulator's path: the same.
    decisions = assert_decisions_replay(out)
    assert len(decisions) == 30 and any("rp0" in r.down for r in decisions)


def test_restart_prefill_rejoins_and_serves_again(tmp_path):
    out, df, s, ev = run(tmp_path, "[{at: 3s, kind: restart, target: rp0, after: 2s}]",
                         FAILOVER, *NAIVE_2RP, requests=40)
    assert (df.status == "ok").all(), df.error.tolist()
    assert s["faults"][0]["detect_s"] is not None
    restarted = float(ev[ev.kind == "worker_restarted"].time.iloc[0])
    up = ev[(ev.kind == "health") & ev.detail.str.contains("instance=rp0 role=prefill state=up")]
    assert len(up) and float(up.time.iloc[-1]) > restarted
    # The restarted worker prefilled requests again.
    assert ((df.prefill_start > restarted) & (df.prefill_instance == "rp0")).sum() > 0
    assert _moves(df, "prefill")
    # Both of rp0's lives were measured: one process more than the run's logs name.
    cpu = json.loads((out / "metadata.json").read_text())["processes_cpu"]
    assert cpu["measured"] == cpu["processes"] == len(list((out / "logs").glob("*.log"))) + 1


def test_paused_decode_requests_fail_fast_or_reroute(tmp_path):
    out, df, s, ev = run(tmp_path, "[{at: 4s, kind: pause, target: ld0, duration: 60s}]",
                         FAILOVER, "clusters.local.instances=3", "clusters.local.decode=2")
    t_inj = _injected(ev)
    window = (s["detection_window_s"] + 1) / 5        # emulated seconds
    assert s["faults"][0]["detect_s"] is not None
    rerouted = _moves(df, "decode")
    for _, m in rerouted:
        assert m["from"] == "ld0" and m["time"] - t_inj <= window
    failed = df[df.status != "ok"]
    assert failed.error.str.contains("ld0").all(), failed.error.tolist()
    assert ((failed.end_time - t_inj) <= window).all()
    assert len(rerouted) + len(failed) > 0
    # Nothing waited for the pause to end (60 s) or the request timeout.
    assert (df.end_time - t_inj).max() < 40 / 5


def test_link_cut_is_detected_and_recovered(tmp_path):
    out, df, s, ev = run(tmp_path, "[{at: 4s, kind: link, direction: both, up: false, "
                         "duration: 8s}]", FAILOVER)
    f = s["faults"][0]
    assert f["target"] == "wan:both" and f["detect_s"] is not None
    assert (df.status == "ok").all(), df.error.tolist()
    ts = pd.read_csv(out / "timeseries.csv")
    assert (ts.kv_up == 0).any() and ts.kv_up.iloc[-1] == 1        # the shaper cut and restored
    assert ev.kind.eq("fault_end").any()


def test_slow_prefill_runs_its_clock_slower(tmp_path):
    from testbed import profile
    out, df, s, ev = run(tmp_path, "[{at: 2s, kind: slow, target: rp0, factor: 4, "
                         "duration: 10s}]", "scheduler.policy=naive", "clusters.local.prefill=0",
                         "clusters.local.decode=2")
    assert (df.status == "ok").all(), df.error.tolist()
    t_inj, t_end = _injected(ev), float(ev[ev.kind == "fault_end"].time.iloc[0])
    prof = profile.load("kimi-linear-1t")
    ratio = df.prefill_ms / (df.input_len.map(lambda n: prof.t_prefill("h200", n)) * 1e3)
    # Prefills started while slowed (a piece runs at the factor in force when it starts).
    during = ratio[(df.prefill_start > t_inj) & (df.prefill_start < t_end)]
    after = ratio[df.prefill_start > t_end]
    assert len(during) and during.median() > 2.5, during.tolist()
    assert len(after) and after.median() < 1.5, after.tolist()


def test_kv_connections_reset_are_retried_and_every_request_completes(tmp_path):
    # resets for 3 s: every KV connection that carries data meanwhile is reset, its retries too
    out, df, s, ev = run(tmp_path, "[{at: 3s, kind: reset, duration: 3s}]", FAILOVER)
    assert (df.status == "ok").all(), df.error.tolist()
    assert s["kv_retries"] + s["kv_reprefills"] > 0, s
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["faults"][0]["kind"] == "reset"
    assert sum(meta["link_event_packets"].values()) > 0, meta["link_event_packets"]


def test_blackhole_and_reject_leave_nothing_hung(tmp_path):
    # (tiny's 30 requests arrive within ~8 s: both faults inside that)
    out, df, s, ev = run(tmp_path, "[{at: 1.5s, kind: blackhole, duration: 2.5s}, "
                         "{at: 5s, kind: reject, duration: 1.5s}]", FAILOVER)
    assert (df.status == "ok").all(), df.error.tolist()
    meta = json.loads((out / "metadata.json").read_text())
    assert [f["kind"] for f in meta["faults"]] == ["blackhole", "reject"]
    assert sum(meta["link_event_packets"].values()) > 0
    # success came back after the last fault: the requests sent after it all completed
    end = _injected(ev, 1) + 1.5 / 5      # emulated seconds (scale.time 5)
    assert (df[df.send_time > end + 1].status == "ok").all()


def test_a_kv_deadline_in_the_prefill_queue_waits_again_and_loses_nothing(tmp_path):
    """Every prefill on lp0, 6 requests of 4,000 tokens at once (1.17 s of prefill each), a 3 s
    KV deadline: the later requests' decode streams reach the deadline while their prefill is
    still queued. With failover the scheduler opens each again on the same instance (`kv_wait`
    rows), the KV goes on into it, and every request completes on its first prefill attempt
    (tests/test_sim_faults.py: the same case in the simulator, and without failover)."""
    out, df, s, ev = run(tmp_path, "[]", FAILOVER, "scheduler.policy=homogeneous",
                         "workload.input={dist: fixed, tokens: 4000}",
                         "workload.arrival={process: poisson, rate: 50/s}",
                         "run.kv_deadline=3s", requests=6)
    assert (df.status == "ok").all(), df.error.tolist()
    waited = set(ev[ev.kind == "kv_wait"].detail.str.extract(r"id=(\d+)")[0].astype(int))
    queued = df[df.prefill_queue_ms > 3000 * 1.02]      # measured: queued past the deadline
    assert len(queued) and set(queued.id) <= waited, (df.prefill_queue_ms.tolist(), waited)
    assert (df.attempts == 1).all() and s["kv_deadline_waits"] >= len(queued)
