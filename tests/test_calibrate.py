"""`testbed calibrate` (issue 20 item 5): measurements -> a profile file the profile engine
runs. The fitting side is checked on synthetic measurements of a known engine (no vLLM); the
command against a real vLLM server is in tests/test_vllm.py, on the servers that module starts
(`calibrate --url`: one vLLM start-up fewer)."""

import csv
import random

import pytest
import yaml

from conftest import SMALL_EXPERIMENT
from testbed import calibfit, calibrun, cli, config, rundir
from testbed import profile as profiles
from testbed.calibfit import Measurements, Sample


def t_prefill(l):
    return 0.012 + 2.0e-5 * l + 1.5e-9 * l * l


def t_step(b, c):
    return 0.004 + 0.0011 * b + 1.8e-7 * c


def synthetic(noise=0.0, seed=0):
    rng = random.Random(seed)
    m = Measurements(kv_bytes_per_token=4096, kv_blocks=4096, block_tokens=16,
                     weights_bytes=24e6, layers=4, bs_max=8, info={"model": "synthetic"})
    jitter = (lambda: 1 + rng.uniform(-noise, noise))
    for rep in range(3):
        for l in (256, 512, 1024, 2048, 4096):
            m.samples.append(Sample("prefill", length=l, seconds=t_prefill(l) * jitter(),
                                    repeat=rep))
            p = l // 2
            m.samples.append(Sample("prefill", length=l, cached=p, repeat=rep,
                                    seconds=(t_prefill(l) - t_prefill(p) + t_prefill(0))
                                    * jitter()))
    for b in (1, 2, 4, 8):
        for c in (128, 1024, 2048):
            ctx = b * (c + 12)
            m.samples.append(Sample("step", batch=b, context=ctx, seconds=t_step(b, ctx)
                                    * jitter()))
    return m


def test_the_fit_recovers_a_known_engine_in_the_profile_engines_form(tmp_path):
    out, raw, errors = calibfit.write(synthetic(), tmp_path / "eng.yaml")
    prof = profiles.load(str(out))
    for l in (300, 1500, 4000):
        assert prof.t_prefill("cpu", l) == pytest.approx(t_prefill(l), rel=1e-6)
        assert prof.t_prefill_cached("cpu", l, l // 2) == pytest.approx(
            t_prefill(l) - t_prefill(l // 2) + t_prefill(0), rel=1e-6)
    for b, c in ((1, 100), (3, 5000), (8, 20000)):
        assert prof.decode.step_time(b, c) == pytest.approx(t_step(b, c), rel=1e-6)
    assert prof.s_kv(1000) == pytest.approx(4096 * 1000)
    assert prof.decode.kv_capacity == 4096 * 16 * 4096 and prof.bs_max == 8
    assert all(v < 1e-3 for v in errors.values()), errors
    rows = list(csv.DictReader(raw.open()))
    assert len(rows) == 42 and set(rows[0]) == set(calibfit.RAW_FIELDS)


def test_the_step_fit_keeps_every_share_non_negative():
    pts = [(b, c, 0.01 + 0.002 * b - 1e-8 * c) for b in (1, 2, 4, 8) for c in (100, 5000)]
    alpha, beta, gamma = calibfit.fit_step(pts)
    assert min(alpha, beta, gamma) >= 0
    assert beta == pytest.approx(0.002, rel=0.05)


def test_a_calibrated_profile_runs_the_profile_engine(tmp_path):
    """model.profile: the file; the simulator runs it (the emulation reads it the same way)."""
    calibfit.write(synthetic(noise=0.05), tmp_path / "eng.yaml")
    p = tmp_path / "exp.yaml"
    p.write_text(SMALL_EXPERIMENT.replace("name: t", "name: t\nmodel: {profile: eng.yaml}")
                 .replace("prfaas: {instances: 1}", "prfaas: {instances: 1, accelerator: cpu}")
                 .replace("local: {instances: 2,", "local: {accelerator: cpu, instances: 2,"))
    (exp,) = config.load_experiment(p)
    assert exp.decode_model().bs_max == 8
    out = tmp_path / "out"
    assert cli.main(["run", str(p), "--backend", "sim", "--out", str(out), "--no-progress"]) == 0
    (run,) = rundir.find_runs(out)
    assert '"completed": 10' in (run / "summary.json").read_text()


def test_cache_blocks_read_from_vllms_metrics():
    text = ('# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size="16",'
            'cache_dtype="auto",engine="0",num_gpu_blocks="4096"} 1.0\n')
    assert calibrun.cache_blocks(text) == (4096, 16)
    assert calibrun.cache_blocks("") == (0, 16)


def test_calibrate_refuses_bad_input_with_one_line(tmp_path, capsys):
    assert cli.main(["calibrate", "--model", str(tmp_path), "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "config.json" in err
    assert cli.main(["calibrate", "--model", str(tmp_path), "--out", str(tmp_path / "p.txt")]) == 2
    assert ".yaml" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    # a prompt as long as the model's window leaves no room for the one token a prefill makes
    assert cli.main(["calibrate", "--model", str(tmp_path), "--out", str(tmp_path / "p.yaml"),
                     "--lengths", "256,512,4096", "--max-model-len", "4096"]) == 2
    assert "4097 tokens" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()


def test_the_pull_fit_recovers_a_connectors_fixed_cost_beside_one_decode_step(tmp_path):
    """`--pair`'s hand-offs (the KV pull, then one decode step) of a known connector: 23 ms a
    transfer + 1.5 us a token; the profile gets kv_transfer: pull and the 23 ms."""
    m = synthetic()
    for rep in range(3):
        for l in (256, 1024, 3072):
            m.samples.append(Sample("pull", length=l, repeat=rep,
                                    seconds=0.023 + 1.5e-6 * l + t_step(1, l)))
    out, raw, _ = calibfit.write(m, tmp_path / "eng.yaml")
    prof = profiles.load(str(out))
    assert prof.kv_transfer == "pull"
    assert prof.kv_pull_latency_s == pytest.approx(0.023, rel=1e-3)
    fit = yaml.safe_load(out.read_text())["calibration"]["pull_fit_s"]
    assert fit["per_token_s"] == pytest.approx(1.5e-6, rel=1e-3)
    assert profiles.load(str(calibfit.write(synthetic(), tmp_path / "one.yaml")[0])
                         ).kv_transfer == "stream"


def test_calibrate_refuses_a_bad_pair_with_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    for bad in (["--pair", "second"], ["--pair", "1", "--url", "http://127.0.0.1:1"]):
        assert cli.main(["calibrate", "--model", str(tmp_path), "--out",
                         str(tmp_path / "p.yaml"), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--pair" in err, err
