"""Decode memory as vLLM treats it (issue 20 item 6): a request whose KV (S_kv(input + output))
is larger than an instance's whole decode memory fails with that reason instead of running in
a batch of one, the run goes on; a workload none of whose requests can fit is refused before
anything is built. The profile engine (workers) and the simulator apply the same rule."""

import json

import pandas as pd
from conftest import SMALL_EXPERIMENT
from testbed import cli, config, deploy, rundir
from testbed import profile as profiles
from workers.engine_profile import ProfileDecodeEngine

MIXED = SMALL_EXPERIMENT.replace("requests: 10", "requests: 40").replace(
    "input: {dist: fixed, tokens: 1Ki}", "input: {dist: uniform, min: 1Ki, max: 32Ki}")


def _engine(tmp_path, capacity):
    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT)
    (exp,) = config.load_experiment(p, [f"model.decode_kv_capacity={capacity}"])
    rt = deploy.compile(exp).runtime
    return ProfileDecodeEngine(rt, rt.instance("ld0"))


def test_a_request_larger_than_the_decode_memory_is_refused_not_run_alone(tmp_path):
    eng = _engine(tmp_path, "300MB")
    small, big = eng.kv_need(1024, 16), eng.kv_need(32768, 16)
    assert small < 300e6 < big
    assert eng.refusal(small) == "" and eng.fits(small)
    assert "model.decode_kv_capacity" in eng.refusal(big)
    assert not eng.fits(big)                    # not even into an empty batch
    eng.reserve(small)
    assert not eng.fits(small)                  # two do not fit: the second waits
    eng.free(small)
    assert eng.fits(small)


def test_unbounded_decode_memory_refuses_nothing(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT.replace("name: t", "name: t\nmodel: {profile: kimi-linear-1t}"))
    (exp,) = config.load_experiment(p)
    rt = deploy.compile(exp).runtime
    eng = ProfileDecodeEngine(rt, rt.instance("ld0"))
    eng.model = eng.model.with_step()           # the profile's 200GB
    assert eng.refusal(eng.kv_need(131072, 1024)) == ""


def test_a_workload_no_request_of_which_fits_is_refused_before_anything_is_built(
        tmp_path, capsys):
    p = tmp_path / "exp.yaml"
    p.write_text(MIXED)
    out = tmp_path / "out"
    assert cli.main(["run", str(p), "--backend", "sim", "--out", str(out), "--no-progress",
                     "--set", "model.decode_kv_capacity=150MB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.decode_kv_capacity" in err, err
    assert not out.exists()
    # one request that fits is enough to run
    (exp,) = config.load_experiment(p, ["model.decode_kv_capacity=250MB"])
    assert exp.decode_model().kv_capacity == 250e6


def test_the_simulator_fails_exactly_the_requests_that_cannot_fit_and_runs_the_rest(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text(MIXED)
    out = tmp_path / "out"
    assert cli.main(["run", str(p), "--backend", "sim", "--out", str(out), "--no-progress",
                     "--set", "model.decode_kv_capacity=400MB"]) == 0
    (run,) = rundir.find_runs(out)
    summary = json.loads((run / "summary.json").read_text())
    df = pd.read_parquet(run / "requests.parquet")
    prof = profiles.load("kimi-linear-1t")
    need = prof.s_kv(df.input_len + df.output_len)
    cap = 400e6
    failed = df[df.status != "ok"]
    assert len(df) == 40 and 0 < len(failed) < 40
    assert (need[df.status != "ok"] > cap).all() and (need[df.status == "ok"] <= cap).all()
    assert failed.error.str.contains("decode memory").all()
    assert summary["failed"] == len(failed) and summary["completed"] == 40 - len(failed)
    assert sum(v for k, v in summary["failure_reasons"].items()
               if "decode memory" in k) == len(failed)
