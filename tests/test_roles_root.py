"""One role conversion end to end (root): the long timescale turns a local prefill instance into
a decode instance mid-run, with requests in flight, and no request is lost."""

import json
import pathlib
import subprocess
import sys
import time

import pandas as pd
import pytest

from conftest import assert_decisions_replay
from promserver import free_port

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _watch_status(proc, status_dir, timeout_s=300):
    """Every distinct status/<name>.json a run's dual-role workers wrote (under --metrics, once
    a second), read every 0.2 s until the run exits: {name: [status, ...]}."""
    seen = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        for f in status_dir.glob("*.json") if status_dir.is_dir() else ():
            try:
                st = json.loads(f.read_text())
            except (OSError, ValueError):
                continue                    # renamed away between the glob and the read
            if not seen.get(f.stem) or seen[f.stem][-1]["time"] != st["time"]:
                seen.setdefault(f.stem, []).append(st)
        time.sleep(0.2)
    return seen


def test_a_prefill_instance_becomes_decode_and_no_request_is_lost(tmp_path):
    """Run with --metrics, so the dual-role workers also write their status files, which are
    watched while it goes."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run",
                             str(ROOT / "tests" / "data" / "roles.yaml"), "--out", str(out),
                             "--no-progress", "--metrics", str(free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        seen = _watch_status(proc, out / "status")
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert rc == 0, proc.stderr.read()[-3000:]
    df = pd.read_parquet(out / "requests.parquet")
    assert len(df) == 30 and (df.status == "ok").all(), df[df.status != "ok"].error.tolist()
    assert json.loads((out / "summary.json").read_text())["completed"] == 30
    ev = pd.read_csv(out / "events.csv")
    roles = ev[ev.kind == "role"]
    drain = roles[roles.detail.str.contains("state=draining") &
                  roles.detail.str.contains("from=prefill")]
    done = roles[roles.detail.str.contains("state=done") &
                 roles.detail.str.contains("to=decode")]
    assert len(drain) >= 1 and len(done) >= 1, roles
    name = drain.detail.iloc[0].split("instance=")[1].split()[0]
    t_drain, t_done = drain.time.iloc[0], done.time.iloc[0]
    assert t_done > t_drain
    fields = dict(kv.split("=", 1) for kv in done.detail.iloc[0].split())
    assert float(fields["convert_s"]) >= 2.0 / 10 * 0.95        # the cost, emulated, measured
    # The scheduler's decisions (decisions.jsonl), some on the converted lists, replayed through
    # the simulator's decision path: the same; none sent it prefill work after the drain began.
    decisions = assert_decisions_replay(out)
    assert len(decisions) == 30 and any(r.roles.get(name) == "decode" for r in decisions)
    assert all(r.time < t_drain for r in decisions if r.prefill == name)
    # The router stopped sending it prefill work when the drain began, and its prefills
    # (measured by the worker) all started before then ...
    mine = df[df.prefill_instance == name]
    assert len(mine) > 0 and (mine.prefill_queued < t_drain).all()
    # ... and it decoded requests after the conversion (joined the batch on its own clock).
    decoded = df[df.decode_instance == name]
    assert len(decoded) > 0 and (decoded.decode_join > t_done).all()
    assert (ev.kind == "replan").sum() >= 1
    # Its status file followed it live: prefill, then decode (after a conversion), with
    # requests in its batch and decode memory reserved by them (a 1024-token decode lasts
    # many 1 s status periods; a prefill here lasts less than one, so may fall between).
    mine = seen[name]
    roles_seen = [st["role"] for st in mine]
    assert roles_seen.index("decode") > roles_seen.index("prefill"), roles_seen
    assert all(st["roles"] == ["prefill", "decode"] for st in mine)
    dec = [st for st in mine if st["role"] == "decode"]
    assert any(st["decode"]["running"] > 0 and st["kv_reserved_real_bytes"] > 0 for st in dec)
    assert all(st["kv_capacity_real_bytes"] is None      # (None: the profile sets no bound)
               or 0 <= st["kv_reserved_real_bytes"] <= st["kv_capacity_real_bytes"] for st in mine)
    assert all(st["running"] == st["prefill"]["running"] + st["decode"]["running"]
               for st in mine)
    # Every dual-role instance wrote one.
    insts = json.loads((out / "runtime.json").read_text())["instances"]
    dual = {n for n, i in insts.items() if i["worker"] == "dualrole"}
    assert len(dual) == 3 and dual <= set(seen), (dual, set(seen))
