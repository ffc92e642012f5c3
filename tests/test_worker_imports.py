"""A profile worker stays small: its modules, and what its profile engine evaluates per request,
load neither torch nor numpy nor pandas (measured in a fresh interpreter; docs/performance.md)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from testbed import profile as profiles

HEAVY = ("torch", "numpy", "pandas", "scipy")

PROBE = """
import json, sys
import workers.prefill, workers.decode, workers.scheduler, workers.engine_profile
from testbed import profile
p = profile.load("kimi-linear-1t")
acc = sorted(p.prefill)[0]
vals = [p.t_prefill_cached(acc, 32768, 8192), p.s_kv(32768), p.t_prefill(acc, 1000)]
print(json.dumps({"loaded": sorted(m for m in %r if m in sys.modules), "vals": vals}))
""" % (HEAVY,)


def test_profile_worker_path_imports_no_heavy_modules():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == []
    assert all(isinstance(v, float) and v > 0 for v in got["vals"])


@pytest.mark.parametrize("name", profiles.available())
def test_plain_python_fit_matches_numpy_least_squares(name):
    prof = profiles.load(name)
    series = [(prof.kv_points, 1)] + [(pts, 2) for pts in prof.prefill_points.values()]
    for pts, degree in series:
        xs = [x for x, _ in pts]
        ref = np.polynomial.polynomial.polyfit(xs, [y for _, y in pts], degree)
        got = profiles.fit(pts, degree)
        for l in xs + [128, 131072]:
            want = float(np.polynomial.polynomial.polyval(l, ref))
            assert got(l) == pytest.approx(want, rel=1e-9)


def test_fit_evaluates_arrays_like_scalars():
    prof = profiles.load(profiles.available()[0])
    acc = sorted(prof.prefill)[0]
    ls = np.array([128.0, 4096.0, 65536.0])
    cached = np.array([0.0, 1024.0, 70000.0])
    arr = prof.t_prefill_cached(acc, ls, cached)
    assert list(arr) == pytest.approx([prof.t_prefill_cached(acc, l, c)
                                       for l, c in zip(ls, cached)], rel=1e-12)
    assert list(prof.s_kv(ls)) == pytest.approx([prof.s_kv(float(l)) for l in ls], rel=1e-12)
