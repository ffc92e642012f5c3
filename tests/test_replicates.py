"""Replicates: the expansion (seeds, caps, bad input), the interval table with exclusions, and
(root) a real run of two replicates written as top/<label>/r<i> with seed columns."""

import json
import os
import pathlib
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from testbed import analysis, cli, config, replicates
from testbed.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "tiny.yaml"


def _file(tmp_path, **top):
    exp = yaml.safe_load(TINY.read_text())
    exp.update(top)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def test_replicates_expand_with_their_own_seeds(tmp_path):
    runs = config.load_experiment(_file(tmp_path, replicates=3, variants=[
        {"label": "a"}, {"label": "b", "seed": 40}]))
    got = [(r.label, r.replicate, r.seed) for r in runs]
    assert got == [("a", 0, 7), ("a", 1, 8), ("a", 2, 9), ("b", 0, 40), ("b", 1, 41),
                   ("b", 2, 42)]
    runs = config.load_experiment(_file(tmp_path, seeds=[5, 50, 500]))
    assert [(r.replicate, r.seed, r.replicates) for r in runs] == [(0, 5, 3), (1, 50, 3),
                                                                   (2, 500, 3)]


@pytest.mark.parametrize("top,words", [
    ({"replicates": 0}, "replicates"),
    ({"replicates": "3"}, "replicates"),
    ({"replicates": 2, "seeds": [1, 2, 3]}, "3 seeds for 2 replicates"),
    ({"seeds": [4, 4]}, "same seed"),
    ({"replicate": 1}, "replicate"),
    ({"replicates": 50, "sweep": {"network.wan.delay": [f"{i}ms" for i in range(1, 22)]}},
     "more than 1000"),
])
def test_bad_replicates_are_refused(tmp_path, top, words):
    with pytest.raises(ConfigError) as e:
        config.load_experiment(_file(tmp_path, **top))
    assert words in str(e.value)


def _summary(label, rep, thr, **extra):
    return {"label": label, "policy": "prfaas", "replicate": rep, "seed": 7 + rep,
            "request_throughput": thr, "median_ttft_ms": 1000 / thr, "p90_ttft_ms": 2000 / thr,
            "prediction": {"lambda_max_expected": 1.5}, **extra}


def test_table_shows_intervals_and_excluded_replicates():
    sums = [_summary("a", 0, 1.0), _summary("a", 1, 1.1), _summary("a", 2, 0.9),
            _summary("b", 0, 2.0), _summary("b", 1, 2.1),
            {"label": "b", "replicate": 2, "seed": 9, "error": "WorkerError: rp0 died"},
            _summary("b", 3, 9.0, incomplete=True, incomplete_reason="interrupted")]
    text = analysis.table(sums)
    a_row = next(line for line in text.splitlines() if line.strip().startswith("a "))
    assert "3/3" in a_row and "1.000 [" in a_row
    b_row = next(line for line in text.splitlines() if line.strip().startswith("b "))
    assert "2/4" in b_row and "9.0" not in b_row
    assert "t-interval of the mean" in text
    assert "b: replicate 2 (seed 9) excluded from the intervals: failed: WorkerError" in text
    assert "replicate 3 (seed 10) excluded from the intervals: incomplete: interrupted" in text
    frame = replicates.frame(sums)
    thr = frame[(frame.label == "b") & (frame.metric == "request_throughput")].iloc[0]
    assert thr.n == 2 and thr.n_total == 4 and thr.lo < 2.05 < thr.hi


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")
def test_two_replicates_run_and_compare(tmp_path, capsys):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run",
                        str(_file(tmp_path, replicates=2, requests=8)), "--out", str(out),
                        "--no-progress", "--no-probe"],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2/2" in r.stdout and "t-interval" in r.stdout
    sweep = pd.read_csv(out / "sweep.csv")
    assert sorted(zip(sweep.replicate, sweep.seed)) == [(0, 7), (1, 8)]
    for i in (0, 1):
        s = json.loads((out / "prfaas" / f"r{i}" / "summary.json").read_text())
        assert s["completed"] == 8 and s["seed"] == 7 + i
        arrivals = pd.read_parquet(out / "prfaas" / f"r{i}" / "workload.parquet").arrival_s
        assert arrivals.iloc[-1] > 0
    w0, w1 = (pd.read_parquet(out / "prfaas" / f"r{i}" / "workload.parquet") for i in (0, 1))
    assert not w0.input_len.equals(w1.input_len)     # other seeds, other requests
    assert (out / "replicates.csv").exists()
    assert cli.main(["compare", str(out), str(out)]) == 0
    assert "n=2" in capsys.readouterr().out


def test_load_sweep_sets_each_runs_rate_from_its_own_lambda_max(tmp_path):
    from testbed import plan
    path = _file(tmp_path, sweep={"load": [0.25, 0.5]},
                 variants=[{"scheduler.policy": "prfaas"}, {"scheduler.policy": "naive"}])
    runs = config.load_experiment(path)
    assert [r.label for r in runs] == ["prfaas,load=0.25", "prfaas,load=0.5",
                                       "naive,load=0.25", "naive,load=0.5"]
    for r in runs:
        lam = plan.predict(r, latency="expected")["lambda_max"]
        assert r.workload.arrival.rate == pytest.approx(r.load * lam)
    assert runs[0].workload.arrival.rate != runs[2].workload.arrival.rate
    bad = _file(tmp_path, load=0.5, workload={"arrival": {"process": "trace"}})
    with pytest.raises(ConfigError):
        config.load_experiment(bad)


@pytest.mark.slow
def test_load_sweep_curve_and_paper_figures(tmp_path):
    """Two policies x two loads x two replicates: load_curve.csv with intervals, the figure,
    and the paper PDFs with every font embedded and none of Type 3 (pdffonts). In the sim
    backend (no root, seconds instead of a minute): what is tested is the sweep, the
    intervals and the figures, which read the same run directory from either backend;
    test_two_replicates_run_and_compare runs replicates in the emulation."""
    out = tmp_path / "run"
    path = _file(tmp_path, replicates=2, requests=8, sweep={"load": [0.3, 0.6]},
                 variants=[{"scheduler.policy": "prfaas"}, {"scheduler.policy": "naive"}])
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(path), "--out", str(out),
                        "--no-progress", "--no-probe", "--backend", "sim"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    table = pd.read_csv(out / "load_curve.csv")
    measured = table[table.kind == "measured"]
    assert sorted(zip(measured.series, measured.load)) == [
        ("naive", 0.3), ("naive", 0.6), ("prfaas", 0.3), ("prfaas", 0.6)]
    assert (measured.n == 2).all() and (measured.p90_ttft_ms_lo <= measured.p90_ttft_ms).all()
    # The offered rate doubles with the load (each policy's own Lambda_max).
    for _, g in measured.groupby("series"):
        assert g.offered_rate.iloc[1] == pytest.approx(2 * g.offered_rate.iloc[0], rel=1e-6)
    assert (out / "figures" / "load_curve.png").exists()
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "plot", str(out), "--style",
                        "paper"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    pdfs = sorted((out / "figures" / "paper").glob("*.pdf"))
    assert {p.stem for p in pdfs} == {"load_curve_single", "load_curve_double",
                                      "ttft_cdf_single", "ttft_cdf_double"}
    for pdf in pdfs:
        fonts = subprocess.run(["pdffonts", str(pdf)], capture_output=True, text=True,
                               check=True).stdout.splitlines()[2:]
        assert fonts, pdf
        for line in fonts:
            assert "Type 3" not in line, line
            assert line.split()[-5] == "yes", line       # the "emb" column
    captions = (out / "figures" / "captions.md").read_text()
    assert "load_curve_single.pdf" in captions and "2 replicate(s)" in captions
