"""`workload.client: vllm-bench` (root): vLLM's `bench serve`, from the vLLM venv, drives the
front door of a small profile-engine run (tests/data/tiny.yaml), and its own per-request TTFT
and TPOT agree with the testbed's records of the same requests. Skipped without the vLLM venv
(`make vllm`; `make test` installs it)."""

import json
import subprocess

import pandas as pd
import pytest

from test_run_root import ROOT, TINY, leftovers, tb_cmd
from testbed import vllmenv

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.skipif(vllmenv.find_python() is None,
                                 reason="no vLLM venv (`make vllm`)")]


def test_vllm_bench_serve_drives_the_front_door_and_agrees_with_the_records(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(tb_cmd("run", str(TINY), "--out", str(out), "--no-progress",
                              "--set", "workload.client=vllm-bench"),
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    vb = summary["vllm_bench"]
    cmp = vb["compare"]
    assert vb["completed"] == 12 and vb["failed"] == 0, vb
    assert cmp["paired"] == 12 and cmp["completed_testbed"] == 12, cmp
    df = pd.read_parquet(out / "requests.parquet")
    ours_p50 = df.ttft_ms.median()
    # The client's TTFT includes bench serve's and the front door's HTTP path, which runs in
    # host time and so counts scale.time (20) times over in real-world ms: measured 19.4 ms
    # emulated (388 ms real-world, 15.5% of a 2.5 s p50) on a loaded 2-core machine.
    assert 0 <= cmp["ttft_diff_emulated_ms_median"] <= 40, (cmp, ours_p50)
    # bench's own median (real-world ms) against ours: the same 40 ms of host time, x 20 (a
    # relative bound failed in a clean-clone run: 670 ms over 2,629 ms, 33.5 ms emulated)
    assert summary["scale"]["time"] == 20
    assert abs(vb["reported"]["median_ttft_ms"] - ours_p50) <= 40 * summary["scale"]["time"], vb
    assert cmp["tpot_diff_ms_median"] is not None
    assert summary["frontdoor"]["client_minus_testbed_ttft_ms"] == cmp["ttft_diff_ms_median"]
    assert leftovers(out) == []
