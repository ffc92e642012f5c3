"""The WAN conformance matrix, small (root): `testbed run tests/data/conformance_small.yaml`
(the fault-free run, flap, reject and reset; PrfaaS-PD, failover on) writes conformance.csv,
.md and figures/conformance.png, and every cell has 0 lost and 0 hung requests, each failed
one with its reason, and success back after the fault (a request sent after it completed)."""

import pathlib
import subprocess
import sys

import pandas as pd
import pytest

from tests.test_run_root import leftovers

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ROOT / "tests" / "data" / "conformance_small.yaml"


def test_small_conformance_matrix_loses_nothing_and_hangs_nothing(tmp_path):
    out = tmp_path / "matrix"
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(SMALL), "--out", str(out),
                        "--no-progress", "--no-probe"], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    m = pd.read_csv(out / "conformance.csv")
    assert list(m.case) == ["none", "flap", "reject", "reset"], m
    assert (m.lost == 0).all() and (m.hung == 0).all(), m.to_string()
    assert (m.completed + m.failed == 24).all(), m.to_string()
    faulted = m[m.case != "none"]
    assert faulted.success_after_end_s.notna().all(), m.to_string()     # success came back
    assert (out / "conformance.md").read_text().startswith("| case |")
    assert (out / "figures" / "conformance.png").exists()
    for d in out.iterdir():
        if d.is_dir() and (d / "requests.parquet").exists():
            df = pd.read_parquet(d / "requests.parquet")
            assert df[df.status != "ok"].error.str.len().gt(0).all()       # each with a reason
            assert leftovers(d) == []
