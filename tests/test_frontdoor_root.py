"""The front door driven by an independent streaming client (root): `workload.client: command`.

tests/data/tiny.yaml runs with tests/data/frontdoor_probe.py as the client command: bad
requests, a client that disconnects mid-stream, then the workload's trace replayed by
scripts/openai_stream_client.py, an HTTP client with its own clock. Asserted on what was
recorded: the HTTP statuses the client received, the scheduler's and workers' health after the
disconnect, the front door's records against the client's own, and nothing left behind.
"""

import json
import subprocess
import sys

import pandas as pd
import pytest

from test_run_root import ROOT, TINY, leftovers, tb_cmd
from testbed import loadstats, rundir
from testbed.scale import Scale

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_command_client_through_the_front_door(tmp_path):
    out = tmp_path / "run"
    probe = ROOT / "tests" / "data" / "frontdoor_probe.py"
    cmd = f"{sys.executable} {probe} {{url}} {{model}} {{trace}} {{run_dir}}"
    r = subprocess.run(tb_cmd("run", str(TINY), "--out", str(out), "--no-progress",
                              "--set", "workload.client=command",
                              "--set", f"workload.command={json.dumps(cmd)}"),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "probe.json").read_text())
    # Bad requests: JSON errors with the right status, counted, never submitted.
    assert res["bad"] == [[400, None, None], [400, None, "prompt"],
                          [404, "model_not_found", "model"],
                          [400, "context_length_exceeded", "prompt"]]
    # The disconnect left nothing queued or active anywhere.
    assert res["disconnect_first_line"].startswith("data: ")
    assert all(v == [0, 0] for v in res["health_after_disconnect"].values()), res
    http = loadstats.read_http(out)
    outcomes = pd.Series([h["outcome"] for h in http]).value_counts().to_dict()
    assert outcomes == {"ok": 12, "rejected": 4, "disconnected": 1}, outcomes
    summary = json.loads((out / "summary.json").read_text())
    assert summary["frontdoor"]["outcomes"] == outcomes
    assert summary["frontdoor"]["http_status"] == {"200": 12, "400": 3, "404": 1, "499": 1}
    df = pd.read_parquet(out / "requests.parquet")
    gone = df[df.error == "client disconnected"]
    assert len(gone) == 1 and 0 < gone.n_tokens.iloc[0] < 2000
    # The client's own records agree with the front door's.
    tool = pd.DataFrame([json.loads(x) for x in
                         (out / "stream_client.jsonl").read_text().splitlines()])
    tool = pd.DataFrame({"start": tool.start, "ttft_s": tool["first"] - tool.start,
                         "ok": tool.ok, "tokens": tool.tokens})
    assert tool.ok.sum() == 12 and (tool.tokens == 64).all()
    ours = df[df.error != "client disconnected"]
    assert (ours.status == "ok").sum() == 12 == summary["completed"]
    assert sorted(ours.input_len) == sorted(pd.read_parquet(out / "workload.parquet").input_len)
    c = loadstats.compare(tool, ours, rundir.scale(out))
    assert c["paired"] == 12 and c["completed"] == c["completed_testbed"] == 12
    # Each request's times are causal across the three records (one host
    # clock): the client sends, the front door receives and submits, the decode worker's first
    # token reaches the front door, is written, and then read by the client. So the client's
    # TTFT is the testbed's plus the HTTP legs (sizes reported in summary.json, not timed here).
    # Paired exactly by the client's X-Request-Id header, which the front door records.
    t = pd.DataFrame([json.loads(x) for x in (out / "stream_client.jsonl").read_text()
                      .splitlines()]).sort_values("i").reset_index(drop=True)
    h = pd.DataFrame([x for x in http if x["outcome"] == "ok"])
    h["i"] = h.client_request_id.astype(int)
    h = h.sort_values("i").reset_index(drop=True)
    assert h.i.tolist() == t.i.tolist()
    o = ours.set_index("id").loc[h.id].reset_index()
    assert (t.start <= h.arrival).all() and (h.arrival <= o.send_time).all()
    assert (o.send_time < o.first_token).all() and (o.first_token <= h.first_token).all()
    assert (h.first_token <= t["first"]).all() and (o.last_token <= t["last"]).all()
    assert (o.input_len.to_numpy() == [x["prompt_tokens"] for x in h.to_dict("records")]).all()
    fd = summary["frontdoor"]
    assert fd["overhead_emulated_ms_median"] >= 0 and fd["client_minus_testbed_ttft_ms"] is None
    # Arrival 0 is the tool's own: the first request's arrival at the front door (minus its time
    # in the trace), measured after the tool's start-up, which is on record.
    meta = json.loads((out / "metadata.json").read_text())
    first = min(x["arrival"] for x in http)
    assert abs(meta["client_first_request_at"] - first) < 1e-5
    wl = pd.read_parquet(out / "workload.parquet")
    trace_first = Scale(time=summary["scale"]["time"]).emulated_s(wl.arrival_s.min())
    assert abs(meta["client_start_at"] - (first - trace_first)) < 1e-5
    assert meta["client_start_offset_s"] == pytest.approx(
        meta["client_start_at"] - meta["client_spawned_at"])
    assert meta["client_spawned_at"] < first
    assert leftovers(out) == []
