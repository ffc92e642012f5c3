"""`testbed report` and `testbed plot` on a hand-made run directory (no root)."""

import json

import pandas as pd

from testbed import cli


def make_run(d, label, start, ttft):
    d.mkdir(parents=True)
    (d / "metadata.json").write_text(json.dumps({"name": "exp", "start_time": start,
                                                 "link_fidelity": {"skipped": "--no-probe"}}))
    (d / "summary.json").write_text(json.dumps({
        "label": label, "policy": label, "completed": 2, "failed": 0, "request_throughput": 1.0,
        "mean_ttft_ms": ttft, "scale_time": 10, "scale_bytes": 1e-3,
        "prediction": {"lambda_max": 2.0, "lambda_max_expected": 1.5}}))
    pd.DataFrame({"id": [0, 1], "status": ["ok", "ok"], "ttft_ms": [ttft, ttft * 2],
                  "arrival_s": [0.0, 1.0]}).to_parquet(d / "requests.parquet")


def test_report_lists_runs_in_the_order_they_ran(tmp_path, capsys):
    make_run(tmp_path / "zeta", "prfaas", 100.0, 10.0)
    make_run(tmp_path / "alpha", "naive", 200.0, 20.0)
    assert cli.main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert text.index("### prfaas") < text.index("### naive")
    assert "2.000" in text and "1.500" in text            # both predictions
    assert (tmp_path / "figures" / "ttft_cdf.png").exists()
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.md")


def test_report_of_a_non_run_directory_is_bad_input(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
