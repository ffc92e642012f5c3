"""`testbed up` refuses what it cannot hold before anything is built (no root needed).

The held deployment itself is tested as root in tests/test_up_root.py.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _up(*args):
    return subprocess.run([sys.executable, "-m", "testbed.cli", "up", *args],
                          capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize("args, words", [
    (["experiments/quickstart.yaml"], "expands to 3 runs"),
    (["tests/data/tiny.yaml", "--port", "70000"], "--port must be 0..65535"),
])
def test_up_refuses_with_one_line_and_exit_2(tmp_path, args, words):
    out = tmp_path / "run"
    r = _up(*args, "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()
