"""The run-directory contract (testbed/rundir.py): loaders, the schema version, and analysis,
plots and report from a run directory alone (no root).

tests/data/quickstart_run is a recorded run, vendored without logs or analysis outputs except
the summary the run wrote itself:
    sudo testbed run experiments/quickstart.yaml --set requests=20 \
        --set workload.output.tokens=32 --out /tmp/fixture
keeping config.yaml, events.csv, metadata.json, requests.jsonl, runtime.json, timeseries.csv,
workload.parquet and summary.json of each variant.
"""

import json
import pathlib
import re
import shutil
import sys

import pytest

from testbed import analysis, cli, config, rundir
from testbed.errors import RunDirError
from testbed.scale import Scale

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "quickstart_run"
RUNS = ("homogeneous", "naive", "prfaas")


@pytest.fixture
def copied(tmp_path):
    """The recorded run, copied where no experiment file or trace is."""
    d = tmp_path / "elsewhere" / "quickstart"
    shutil.copytree(FIXTURE, d)
    return d


@pytest.fixture
def nothing_outside(monkeypatch, tmp_path):
    """Fail the test if analysis validates an experiment file or regenerates a workload."""
    def refuse(*a, **k):
        raise AssertionError("analysis read something outside the run directory")
    monkeypatch.setattr(config, "load_experiment", refuse)
    monkeypatch.setattr(config, "validate", refuse)
    monkeypatch.setattr(sys.modules["testbed.workload.generate"], "generate", refuse)
    monkeypatch.setattr(sys.modules["testbed.workload.traces"], "load", refuse)
    monkeypatch.chdir(tmp_path)


def test_analyse_plot_report_from_a_copied_run_directory(copied, nothing_outside, capsys):
    recorded = {r: json.loads((copied / r / "summary.json").read_text()) for r in RUNS}
    assert cli.main(["analyse", str(copied)]) == 0
    for r in RUNS:
        again = json.loads((copied / r / "summary.json").read_text())
        old = recorded[r]
        assert (again["completed"], again["failed"]) == (old["completed"], old["failed"])
        for key in ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "egress_mean_gbps",
                    "offload_fraction", "steady_throughput", "wan_bytes_measured"):
            assert again[key] == pytest.approx(old[key]), (r, key)
        assert again["prediction"]["lambda_max"] == pytest.approx(
            old["prediction"]["lambda_max"])
        assert again["incomplete"] is False
        assert (copied / r / rundir.RunDir.REQUESTS).exists()
    assert cli.main(["plot", str(copied)]) == 0
    figures = copied / rundir.RunDir.FIGURES
    assert {"ttft_cdf.png", "egress.png", "ttft_timeline.png"} <= {p.name for p in
                                                                   figures.iterdir()}
    capsys.readouterr()
    assert cli.main(["report", str(copied)]) == 0
    text = (copied / rundir.RunDir.REPORT).read_text()
    assert all(f"### {r}" in text for r in RUNS)
    assert f"time x{rundir.scale(copied / 'prfaas').time:.3g}" in text


def test_load_run_is_typed_and_from_the_directory(copied):
    info = rundir.load_run(copied / "prfaas")
    assert info.label == "prfaas" and info.policy == "prfaas"
    runtime = json.loads((copied / "prfaas" / "runtime.json").read_text())
    assert info.scale == Scale.from_dict(runtime["scale"])
    assert info.experiment.scale.time == info.scale.time        # config.yaml agrees
    assert info.client_start_at == info.metadata["client_start_at"]
    ts = rundir.timeseries(copied / "prfaas")
    assert len(ts) > 10 and ts.time.is_monotonic_increasing
    sent, done = rundir.read_records(rundir.RunDir(copied / "prfaas").records)
    assert set(done) <= set(sent) and len(done) == len(rundir.workload(copied / "prfaas"))


def test_runs_are_found_in_the_order_they_ran(copied):
    started = {r: json.loads((copied / r / "metadata.json").read_text())["start_time"]
               for r in RUNS}
    assert [d.name for d in rundir.find_runs(copied)] == sorted(RUNS, key=started.get)
    assert rundir.find_recorded_runs(copied) == [copied / r for r in sorted(RUNS)]


@pytest.mark.parametrize("verb", ["analyse", "plot", "report"])
def test_a_newer_schema_is_refused_in_one_line(copied, verb, capsys):
    d = copied / "naive"
    meta = json.loads((d / "metadata.json").read_text())
    meta["schema"] = rundir.SCHEMA + 1
    (d / "metadata.json").write_text(json.dumps(meta))
    assert cli.main([verb, str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"schema {rundir.SCHEMA + 1} is newer" in err and "metadata.json" in err


def test_schema_minor_versions_and_unversioned_directories_are_read(copied):
    d = copied / "naive"
    meta = json.loads((d / "metadata.json").read_text())
    meta["schema"] = f"{rundir.SCHEMA}.7"
    (d / "metadata.json").write_text(json.dumps(meta))
    assert rundir.load_run(d).metadata["schema"] == f"{rundir.SCHEMA}.7"
    del meta["schema"]                          # written before the layout had a version
    (d / "metadata.json").write_text(json.dumps(meta))
    assert analysis.analyse(d)["completed"] > 0


def test_a_shared_link_probe_is_read_from_the_run_directory_alone(copied, nothing_outside,
                                                                 tmp_path):
    """A run that recorded another run's link probe (`measure.LinkProbes`: same WAN) is
    analysed and reported from its own directory, with the sibling that measured it gone."""
    alone = tmp_path / "alone"
    shutil.copytree(copied / "naive", alone)
    meta = json.loads((alone / "metadata.json").read_text())
    meta["link_fidelity"].update(measured_in="prfaas", shared=True, measured_at=1.0,
                                 warnings=["rtt p50 1.5 ms, expected 1.0 ms"])
    (alone / "metadata.json").write_text(json.dumps(meta))
    summary = analysis.analyse(alone)
    assert summary["link_warnings"] == ["rtt p50 1.5 ms, expected 1.0 ms"]
    assert "rtt p50 1.5 ms, expected 1.0 ms" in summary["warnings"]
    assert cli.main(["report", str(alone)]) == 0
    text = (alone / rundir.RunDir.REPORT).read_text()
    assert "link as measured: goodput" in text and "(probed in run prfaas, the same WAN)" in text


def test_write_metadata_stamps_the_schema(tmp_path):
    path = rundir.write_metadata(tmp_path, {"name": "x", "start_time": 1.0})
    meta = json.loads(path.read_text())
    assert meta["schema"] == rundir.SCHEMA and meta["name"] == "x"
    assert rundir.metadata(tmp_path) == meta


def test_scale_falls_back_through_the_files_a_directory_has(tmp_path):
    assert rundir.scale(tmp_path) == Scale()
    (tmp_path / "summary.json").write_text(json.dumps({"scale_time": 40, "scale_bytes": 1e-4}))
    assert rundir.scale(tmp_path) == Scale(40, 1e-4)          # a pre-versioning summary
    (tmp_path / "config.yaml").write_text("scale: {time: 20, bytes: 0.01}\n")
    assert rundir.scale(tmp_path) == Scale(20, 0.01)
    (tmp_path / "runtime.json").write_text(json.dumps({"scale": {"time": 5, "bytes": 1}}))
    assert rundir.scale(tmp_path) == Scale(5, 1)


def test_not_a_run_directory_is_bad_input(tmp_path):
    with pytest.raises(RunDirError, match="no config.yaml") as e:
        rundir.load_run(tmp_path)
    assert e.value.exit_code == 2
    (tmp_path / "config.yaml").write_text("- a list\n")
    (tmp_path / "workload.parquet").write_bytes(b"")
    with pytest.raises(RunDirError, match="resolved configuration"):
        rundir.load_run(tmp_path)


# Real-world values become emulated ones in one module (testbed/scale.py, used by deploy.py):
# nowhere else in testbed/ or workers/ is a scale factor applied by hand.
SCALE_OWNERS = ("testbed/scale.py", "testbed/deploy.py")
HAND_CONVERSION = re.compile(
    r"scale_time|scale_bytes|scale_tokens|time_scale|bytes_scale|tokens_scale"
    r"|scale\.(time|bytes|tokens)\s*[*/]|[*/]\s*[\w.]*scale\.(time|bytes|tokens)\b"
    r"|1e3\s*\*\s*T\b")


def _code(path):
    """The file's code without comments and strings (docstrings may name the formulas)."""
    import io
    import tokenize
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return " ".join(t.string for t in toks if t.type not in (tokenize.COMMENT, tokenize.STRING))


def test_no_hand_conversion_outside_scale():
    files = [p for d in ("testbed", "workers") for p in sorted((ROOT / d).rglob("*.py"))
             if str(p.relative_to(ROOT)) not in SCALE_OWNERS and "proto" not in p.parts]
    assert len(files) > 50
    found = [(str(p.relative_to(ROOT)), m.group()) for p in files
             for m in [HAND_CONVERSION.search(_code(p))] if m]
    assert not found, found


def test_a_run_that_served_no_request_analyses_to_an_empty_summary(tmp_path):
    """`testbed up` with nobody sending: an empty workload and no records still analyse."""
    import pandas as pd

    d = tmp_path / "prfaas"
    shutil.copytree(FIXTURE / "prfaas", d)
    wl = pd.read_parquet(d / "workload.parquet")
    wl.iloc[:0].to_parquet(d / "workload.parquet", index=False)
    (d / "requests.jsonl").write_text("")
    s = analysis.analyse(d)
    assert s["completed"] == 0 and s["failed"] == 0
    assert len(pd.read_parquet(d / "requests.parquet")) == 0


def test_compact_token_times_read_back_as_lists(tmp_path):
    """The client writes token times compactly (testbed/tokentimes.py); read_records gives back
    every decode stamp to the microsecond and every token's arrival."""
    import json

    from testbed import tokentimes
    stamps = [1796104136.5481157 + 0.000625 * i + 1e-7 * (i % 3) for i in range(1024)]
    chunks = [[0, 1796104136.5486], [1, 1796104137.05], [700, 1796104137.2]]
    lines = [{"ev": "done", "id": 3, **tokentimes.compact(stamps, chunks)},
             {"ev": "done", "id": 4, **tokentimes.compact(stamps[500:], [[0, 1796104137.3]])}]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    _, done = rundir.read_records(tmp_path / "requests.jsonl")
    rec = done[3]
    # one decode step's stamp reads back as one time in every request it served
    assert done[4].token_times == rec.token_times[500:]
    assert max(abs(a - b) for a, b in zip(rec.token_times, stamps)) < 1e-6
    assert len(rec.token_times) == 1024 and "token_dus" not in rec.extra
    assert rec.client_times == [chunks[0][1]] + [chunks[1][1]] * 699 + [chunks[2][1]] * 324
