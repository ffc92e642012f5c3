"""Replicate statistics (testbed/stats.py) and `testbed compare` (no root, no runs)."""

import json

import numpy as np
import pytest

from testbed import cli, stats
from testbed.commands import compare


def test_methods_by_count():
    assert stats.interval([3.0]).method == "single"
    assert stats.interval([1.0, 2.0, 4.0]).method == "t"
    assert stats.interval(np.arange(6.0)).method == "bootstrap"
    assert stats.interval([None, float("nan"), 2.0]).n == 1


@pytest.mark.parametrize("n", [3, 4, 8])
def test_interval_coverage(n):
    """About 95% of intervals from normal samples hold the true centre (mean = median)."""
    rng = np.random.default_rng(7)
    trials = 300 if n < 5 else 120
    hits = 0
    for _ in range(trials):
        iv = stats.interval(rng.normal(10.0, 2.0, n))
        assert iv.lo <= iv.center <= iv.hi or iv.method == "t"
        hits += iv.lo <= 10.0 <= iv.hi
    # Binomial spread around 0.95 (the bootstrap of a median from 8 values is a little narrow).
    assert 0.85 <= hits / trials <= 0.995, hits / trials


def test_difference_and_ratio_separate_and_noise():
    rng = np.random.default_rng(3)
    a = rng.normal(100, 2, 3)
    far = rng.normal(140, 2, 3)
    same = rng.normal(100, 2, 3)
    assert stats.difference(a, far).distinguishable
    assert not stats.difference(a, same).distinguishable
    r = stats.ratio(a, far)
    assert r.distinguishable and r.lo < 1.4 < r.hi * 1.05
    big_a, big_b = rng.normal(100, 2, 6), rng.normal(110, 2, 6)
    d = stats.difference(big_a, big_b)
    assert d.method == "bootstrap" and d.distinguishable and d.lo < 10 < d.hi + 3
    one = stats.difference([1.0], [2.0])
    assert one.method == "single" and not one.distinguishable


def _summaries(tmp_path, name, label, values):
    for i, v in enumerate(values):
        d = tmp_path / name / f"r{i}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(
            {"label": label, "request_throughput": v, "median_ttft_ms": 1000.0 / v,
             "failed": 0}))


def test_compare_command(tmp_path, capsys):
    _summaries(tmp_path, "a", "homogeneous", [1.0, 1.05, 0.98])
    _summaries(tmp_path, "b", "prfaas", [1.8, 1.85, 1.79])
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b") + ":prfaas",
                     "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("throughput"))
    assert line.rstrip().endswith("yes")
    assert "t-interval of the mean" in out
    got = json.loads((tmp_path / "c.json").read_text())
    thr = next(m for m in got["metrics"] if m["metric"] == "request_throughput")
    assert thr["ratio"]["lo"] > 1.6 and thr["ratio"]["distinguishable"]


def test_compare_bad_input(tmp_path, capsys):
    _summaries(tmp_path, "a", "x", [1.0])
    (tmp_path / "a" / "r9").mkdir()
    (tmp_path / "a" / "r9" / "summary.json").write_text(json.dumps({"label": "y"}))
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "a")]) == 2
    assert "several variants" in capsys.readouterr().err
    assert cli.main(["compare", str(tmp_path / "a:nope"), str(tmp_path / "a:x")]) == 2
    assert "no variant 'nope'" in capsys.readouterr().err
    assert cli.main(["compare", str(tmp_path / "missing"), str(tmp_path / "a:x")]) == 2


def test_split_side(tmp_path):
    assert compare.split_side("runs/x:prfaas") == (compare.pathlib.Path("runs/x"), "prfaas")
    assert compare.split_side(str(tmp_path)) == (tmp_path, None)


def test_a_quantile_interval_brackets_the_sample_quantile_and_needs_five_values():
    """The pilot's steps record how far 20 requests place their p90 (testbed/autojudge.py)."""
    rng = np.random.default_rng(3)
    x = rng.lognormal(3, 0.5, 20)
    lo, hi = stats.quantile_interval(x, 0.9, 0.9)
    assert lo <= np.quantile(x, 0.9) <= hi and lo >= x.min() and hi <= x.max()
    assert stats.quantile_interval(x, 0.9, 0.9) == (lo, hi)       # a fixed random state
    assert stats.quantile_interval([1.0, 2.0, None, 3.0, 4.0], 0.9) is None
