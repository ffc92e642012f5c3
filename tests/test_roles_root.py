"""One role conversion end to end (root): the long timescale turns a local prefill instance into
a decode instance mid-run, with requests in flight, and no request is lost."""

import json
import pathlib
import subprocess
import sys

import pandas as pd
import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_prefill_instance_becomes_decode_and_no_request_is_lost(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run",
                        str(ROOT / "tests" / "data" / "roles.yaml"), "--out", str(out),
                        "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
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
    # The router stopped sending it prefill work when the drain began, and its prefills
    # (measured by the worker) all started before then ...
    mine = df[df.prefill_instance == name]
    assert len(mine) > 0 and (mine.prefill_queued < t_drain).all()
    # ... and it decoded requests after the conversion (joined the batch on its own clock).
    decoded = df[df.decode_instance == name]
    assert len(decoded) > 0 and (decoded.decode_join > t_done).all()
    assert (ev.kind == "replan").sum() >= 1
