"""Workload generation: arrival processes and length distributions against theory, trace
parsing (Mooncake, Azure, malformed files), the prefix-hit statistic, determinism, and the
`testbed workload` command. Unit tests: no root; the real traces are used when present."""

import importlib
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import integrate, stats

from testbed import cli
from testbed.config import load_experiment
from testbed.errors import ConfigError
from testbed.schema import build
from testbed.workload import SUMMARY_KEYS, fingerprint, generate, summarize
from testbed.workload import prefix, traces
from testbed.workload.spec import ArrivalSpec, LengthSpec, WorkloadSpec

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The module, not the function of the same name that testbed.workload exports.
gen = importlib.import_module("testbed.workload.generate")


def workload(**sections):
    return build(WorkloadSpec, sections, "workload")


def measured(t):
    gaps = np.diff(t)
    return (len(t) - 1) / (t[-1] - t[0]), gaps.std() / gaps.mean()


# ---- arrival processes: mean rate and CV against theory ----

N = 200_000


@pytest.mark.parametrize("process,extra,cv", [
    ("poisson", {}, 1.0),
    ("gamma", {"burstiness": 0.25}, 2.0),   # vllm: CV = 1/sqrt(burstiness)
    ("gamma", {"burstiness": 4}, 0.5),
    ("constant", {}, 0.0),
])
def test_renewal_rate_and_cv(process, extra, cv):
    spec = build(ArrivalSpec, {"process": process, "rate": "3/s", **extra})
    t = gen.arrivals(spec, np.random.default_rng(7), n=N)
    rate, got_cv = measured(t)
    # The rate estimate's relative standard error is CV/sqrt(N); allow 5 sigma (and float noise).
    assert rate == pytest.approx(3.0, rel=5 * cv / math.sqrt(N) + 1e-9)
    # The sample CV's standard error for gamma gaps is below 2*CV/sqrt(N) for these shapes.
    assert got_cv == pytest.approx(cv, rel=0.03, abs=1e-9)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)


def mmpp_theory(on_rate, off_rate, on_s, off_s):
    """Mean rate and inter-arrival CV of a two-state MMPP (stationary interval, phase type).

    The interval after an arrival is phase-type with initial vector pi_a = pi Lambda / lambda
    and sub-generator D0 = Q - Lambda: E[X^k] = k! pi_a (-D0)^-k 1.
    """
    q = np.array([[-1 / on_s, 1 / on_s], [1 / off_s, -1 / off_s]])
    lam = np.diag([on_rate, off_rate])
    pi = np.array([on_s, off_s]) / (on_s + off_s)
    mean_rate = pi @ np.diag(lam)
    pi_a = pi @ lam / mean_rate
    m = np.linalg.inv(-(q - lam))
    one = np.ones(2)
    ex, ex2 = pi_a @ m @ one, 2 * pi_a @ m @ m @ one
    return mean_rate, math.sqrt(ex2 - ex**2) / ex


@pytest.mark.parametrize("on_rate,off_rate,on_s,off_s", [(10, 0, 5, 20), (8, 1, 2, 3)])
def test_onoff_rate_and_cv(on_rate, off_rate, on_s, off_s):
    spec = build(ArrivalSpec, {"process": "onoff", "on_rate": on_rate, "off_rate": off_rate,
                               "on_duration": on_s, "off_duration": off_s})
    rate_th, cv_th = mmpp_theory(on_rate, off_rate, on_s, off_s)
    assert spec.mean_rate == pytest.approx(rate_th)
    t = gen.arrivals(spec, np.random.default_rng(3), n=N)
    rate, cv = measured(t)
    # Gaps are correlated (periods hold many arrivals): a looser bound than renewal processes.
    assert rate == pytest.approx(rate_th, rel=0.05)
    assert cv == pytest.approx(cv_th, rel=0.05)
    assert cv > 1.2  # bursty indeed


def test_arrivals_until_duration():
    for proc in ({"process": "poisson", "rate": 5}, {"process": "gamma", "rate": 5,
                                                      "burstiness": 0.2},
                 {"process": "onoff", "on_rate": 20, "on_duration": 1, "off_duration": 3}):
        t = gen.arrivals(build(ArrivalSpec, proc), np.random.default_rng(1), until_s=20000.0)
        assert t.max() < 20000.0 and t[-1] > 19000.0
        # on/off counts over 20000 s vary by ~3% (one standard deviation).
        assert len(t) / 20000.0 == pytest.approx(5.0, rel=0.12)


# ---- lengths ----

def test_truncated_lognormal_mean_matches_integration():
    spec = build(LengthSpec, {"dist": "lognormal", "mu": 9.9, "sigma": 1.0, "min": 128,
                              "max": "128Ki"})
    x = gen.lengths(spec, 400_000, np.random.default_rng(11))
    assert x.min() >= 128 and x.max() <= 131072
    dist = stats.lognorm(s=1.0, scale=math.exp(9.9))
    mass = dist.cdf(131072) - dist.cdf(128)
    mean, _ = integrate.quad(lambda v: v * dist.pdf(v), 128, 131072, limit=200)
    mean /= mass
    se = x.std() / math.sqrt(len(x))
    assert abs(x.mean() - mean) < 5 * se + 0.5  # rounding to whole tokens is unbiased
    assert mean == pytest.approx(27.5e3, rel=0.02)  # the paper's ~27.5K


def test_uniform_and_fixed_lengths():
    u = gen.lengths(build(LengthSpec, {"dist": "uniform", "min": 100, "max": 200}), 100_000,
                    np.random.default_rng(2))
    assert u.min() == 100 and u.max() == 200
    assert u.mean() == pytest.approx(150, abs=0.5)
    f = gen.lengths(build(LengthSpec, {"dist": "fixed", "tokens": "2Ki"}), 10, np.random.default_rng(2))
    assert set(f.tolist()) == {2048}


# ---- traces: small hand-made files ----

def mooncake_file(tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def mc(t_ms, inp, out, ids):
    return {"timestamp": t_ms, "input_length": inp, "output_length": out, "hash_ids": ids}


# Hand-made: every case of the hit rule (leading run only, partial last block, cap at length).
HAND = [mc(0, 1024, 10, [1, 2]),        # cold: 0
        mc(500, 1500, 20, [1, 2, 3]),   # first two blocks cached: 1024
        mc(500, 700, 30, [1, 4]),       # first block only: 512
        mc(1000, 1024, 40, [5, 2]),     # 2 is cached but not leading: 0
        mc(2500, 300, 50, [1])]         # cached block longer than the input: 300
HAND_HITS = [0, 1024, 512, 0, 300]


def test_mooncake_parse(tmp_path):
    tr = traces.read(mooncake_file(tmp_path, HAND), "mooncake")
    assert tr.time_s.tolist() == [0, 0.5, 0.5, 1.0, 2.5]
    assert tr.input_len.tolist() == [1024, 1500, 700, 1024, 300]
    assert tr.output_len.tolist() == [10, 20, 30, 40, 50]
    assert [b.tolist() for b in tr.blocks] == [r["hash_ids"] for r in HAND]
    assert tr.line.tolist() == [1, 2, 3, 4, 5]


def test_prefix_hit_statistic_on_hand_made_trace(tmp_path):
    p = mooncake_file(tmp_path, HAND)
    assert prefix.hit_tokens([np.array(r["hash_ids"]) for r in HAND],
                             [r["input_length"] for r in HAND]).tolist() == HAND_HITS
    df = generate(workload(trace={"path": str(p), "format": "mooncake"}), seed=1)
    s = summarize(df)
    assert s["prefix_hit_share"] == pytest.approx(sum(HAND_HITS) / (1024 + 1500 + 700 + 1024 + 300))
    assert s["count"] == 5 and s["rate_per_s"] == pytest.approx(4 / 2.5)
    assert df.source_line.tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad,why", [
    ('{"timestamp": 600, "input_length": 10', "not valid JSON"),
    (mc(600, -3, 1, []), "input_length must be an integer in"),
    (mc(600, 1000, 1, [9]), "hash_ids has 1 ids but input_length 1000 needs 2"),
    (mc(100, 300, 1, [9]), "earlier than the previous"),
    ({"timestamp": 600, "input_length": 300, "output_length": 2}, "missing hash_ids"),
])
def test_mooncake_malformed_line_is_named(tmp_path, bad, why):
    p = mooncake_file(tmp_path, HAND[:3] + [bad] + HAND[3:])
    with pytest.raises(ConfigError, match=rf"{p.name}: line 4: .*{why}"):
        traces.read(p, "mooncake")
    tr = traces.read(p, "mooncake", on_error="skip")
    assert len(tr) == 5 and tr.skipped == 1 and tr.rows_read == 6
    assert tr.skip_examples[0].startswith("line 4:")
    assert tr.line.tolist() == [1, 2, 3, 5, 6]


def azure_file(tmp_path, lines, name="a.csv"):
    p = tmp_path / name
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(l + "\n" for l in lines))
    return p


AZ = ["2023-11-16 23:59:59.7500000,374,44",
      "2023-11-17 00:00:00.2500000,396,109",
      "2023-11-17 00:00:02.2500000,879,55"]


def test_azure_parse(tmp_path):
    tr = traces.read(azure_file(tmp_path, AZ), "azure")
    assert tr.time_s.tolist() == pytest.approx([0, 0.5, 2.5])
    assert tr.input_len.tolist() == [374, 396, 879]
    assert tr.output_len.tolist() == [44, 109, 55]
    assert tr.blocks is None and tr.line.tolist() == [2, 3, 4]
    df = generate(workload(trace={"path": str(azure_file(tmp_path, AZ)), "format": "azure"}), 1)
    assert [len(b) for b in df.prefix_blocks] == [0, 0, 0]
    assert summarize(df)["prefix_hit_share"] == 0


@pytest.mark.parametrize("bad,why", [
    ("2023-11-17 00:00:01.0,12", "expected 3 fields, got 2"),
    ("yesterday,12,3", "TIMESTAMP 'yesterday'"),
    ("2023-11-17 00:00:01.0,12,x", "GeneratedTokens must be an integer in"),
    ("2023-11-16 23:00:00.0,12,3", "earlier than the previous"),
])
def test_azure_malformed_line_is_named(tmp_path, bad, why):
    p = azure_file(tmp_path, AZ[:2] + [bad] + AZ[2:])
    with pytest.raises(ConfigError, match=rf"line 4: .*{why}"):
        traces.read(p, "azure")
    tr = traces.read(p, "azure", on_error="skip")
    assert len(tr) == 3 and tr.skipped == 1 and tr.line.tolist() == [2, 3, 5]


def test_azure_bad_header(tmp_path):
    p = tmp_path / "h.csv"
    p.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(ConfigError, match="line 1: the header lacks TIMESTAMP"):
        traces.read(p, "azure")


def test_window_speedup_and_limits(tmp_path):
    rows = [mc(1000 * i, 600, 5, [10 * i, 10 * i + 1]) for i in range(20)]
    p = str(mooncake_file(tmp_path, rows))
    df = generate(workload(trace={"path": p, "format": "mooncake", "start": "5s",
                                  "duration": "10s", "speedup": 2}), 1)
    assert df.source_line.tolist() == list(range(6, 16))
    assert df.arrival_s.tolist() == pytest.approx([0.5 * i for i in range(10)])
    df = generate(workload(trace={"path": p, "format": "mooncake", "max_requests": 4}), 1,
                  duration_s=2.5)
    assert len(df) == 3  # the top-level duration limits the replay too
    assert len(generate(workload(trace={"path": p, "format": "mooncake"}), 1, requests=7)) == 7
    with pytest.raises(ConfigError, match="20 rows"):
        generate(workload(trace={"path": p, "format": "mooncake"}), 1, requests=21)
    with pytest.raises(ConfigError, match="selects no rows"):
        generate(workload(trace={"path": p, "format": "mooncake", "start": "1h"}), 1)


def test_max_input_clips_and_counts(tmp_path):
    rows = [mc(0, 2000, 5, [1, 2, 3, 4]), mc(10, 700, 5, [1, 5]), mc(20, 2000, 5, [1, 2, 3, 6])]
    p = str(mooncake_file(tmp_path, rows))
    df = generate(workload(trace={"path": p, "format": "mooncake", "max_input": 1300}), 1)
    assert df.input_len.tolist() == [1300, 700, 1300]
    assert df.attrs["trace"]["clipped"] == 2
    b = [x.tolist() for x in df.prefix_blocks]
    # Two whole blocks survive; the partial third gets a fresh id unique to its request.
    assert b[0][:2] == [1, 2] and b[2][:2] == [1, 2] and len({b[0][2], b[2][2]}) == 2
    assert min(b[0][2], b[2][2]) > 6
    assert all(len(x) == -(-n // 512) for x, n in zip(b, df.input_len))


def test_synthetic_arrivals_with_trace_lengths(tmp_path):
    p = str(mooncake_file(tmp_path, HAND))
    spec = workload(trace={"path": p, "format": "mooncake"},
                    arrival={"process": "poisson", "rate": "2/s"},
                    output={"dist": "empirical"})
    df = generate(spec, 4, requests=5)
    assert df.input_len.tolist() == [r["input_length"] for r in HAND]
    assert set(df.output_len) <= {10, 20, 30, 40, 50}
    assert summarize(df)["prefix_hit_share"] > 0  # the trace's ids came along
    with pytest.raises(ConfigError, match="selects only 5"):
        generate(spec, 4, requests=6)


# ---- synthetic prefixes ----

def test_synthetic_prefix_one_document():
    spec = workload(arrival={"rate": 1}, input={"tokens": "8Ki"}, output={"tokens": 1},
                    prefix={"documents": 1, "length": "4Ki"})
    df = generate(spec, 1, requests=50)
    assert all(len(b) == 16 for b in df.prefix_blocks)
    assert summarize(df)["prefix_hit_share"] == pytest.approx(49 * 4096 / (50 * 8192))


def test_synthetic_prefix_zipf_popularity():
    spec = workload(arrival={"rate": 1}, input={"tokens": 1024}, output={"tokens": 1},
                    prefix={"documents": 5, "zipf": 1.0, "length": 512, "share": 0.5})
    df = generate(spec, 2, requests=40_000)
    first = np.array([b[0] for b in df.prefix_blocks])
    shared = first < 5
    assert shared.mean() == pytest.approx(0.5, abs=0.015)
    freq = np.bincount(first[shared], minlength=5) / shared.sum()
    assert freq == pytest.approx(prefix.zipf_weights(5, 1.0), abs=0.015)
    # A second block is never shared; ids are unique outside the documents.
    assert len({b[1] for b in df.prefix_blocks}) == len(df)


def test_no_sharing_gives_empty_lists():
    df = generate(workload(arrival={"rate": 1}, input={"tokens": 600}, output={"tokens": 1}),
                  1, requests=3)
    assert [len(b) for b in df.prefix_blocks] == [0, 0, 0]
    assert df.source_line.tolist() == [-1, -1, -1]


# ---- determinism ----

DET_SPEC = {"arrival": {"process": "gamma", "rate": "2/s", "burstiness": 0.5},
            "input": {"dist": "lognormal", "mu": 9.9, "sigma": 1.0, "min": 128, "max": "128Ki"},
            "output": {"dist": "uniform", "min": 10, "max": 500},
            "prefix": {"documents": 20, "zipf": 1.1, "length": "2Ki", "share": 0.8}}
# Changes only when what a seed produces changes (generator, stream layout): update on purpose.
DET_HASH = "896a425f67a1ace8d447715b15f077b9e50e57c42b06a56a2b1d76b52e2e55df"


def det_hash():
    return fingerprint(generate(workload(**DET_SPEC), 42, requests=500))


def test_same_seed_same_list_other_seed_other_list():
    a, b = det_hash(), det_hash()
    assert a == b
    assert fingerprint(generate(workload(**DET_SPEC), 43, requests=500)) != a


def test_hash_is_the_recorded_one():
    # The same list on any machine: numpy's PCG64 streams and the rounding are portable.
    assert det_hash() == DET_HASH


def test_hash_is_independent_of_python_hash_seed():
    code = ("from tests.test_workload import det_hash; print(det_hash())")
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                           text=True, check=True)
        outs.add(r.stdout.strip())
    assert outs == {det_hash()}


def test_parquet_round_trip_keeps_the_list(tmp_path):
    df = generate(workload(**DET_SPEC), 42, requests=200)
    df.to_parquet(tmp_path / "workload.parquet")
    back = pd.read_parquet(tmp_path / "workload.parquet")
    assert list(back.columns) == list(df.columns)
    assert fingerprint(back) == fingerprint(df)


# ---- spec validation ----

@pytest.mark.parametrize("sections,match", [
    ({"arrival": {"process": "poisson"}, "output": {"tokens": 1}, "input": {"tokens": 1}},
     "process poisson needs 'rate'"),
    ({"arrival": {"rate": 1}, "input": {"dist": "trace"}, "output": {"tokens": 1}},
     "input.dist trace need workload.trace"),
    ({"arrival": {"process": "onoff", "on_rate": 1}, "input": {"tokens": 1},
      "output": {"tokens": 1}}, "onoff needs"),
    ({"trace": {"path": "x", "format": "mooncake"}, "prefix": {"documents": 3}},
     "brings its own prefix"),
    ({"trace": {"path": "x", "format": "mooncake"}, "arrival": {"process": "trace", "rate": 2}},
     "does not use 'rate'"),
])
def test_bad_specs_fail_at_load(sections, match):
    with pytest.raises(ConfigError, match=match):
        workload(**sections)


# ---- the real traces and the command ----

def experiment_file(tmp_path, workload_section, **top):
    exp = {"name": "t", "scale": {"bytes": 1e-3},
           "clusters": {"local": {"instances": 2, "prefill": 1, "decode": 1}},
           "scheduler": {"policy": "homogeneous"}, "workload": workload_section, **top}
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(exp))
    return p


def run_cli(capsys, *argv):
    code = cli.main(["workload", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_on_mooncake_trace(traces_dir, tmp_path, capsys):
    trace = traces_dir / "mooncake_conversation.jsonl"
    p = experiment_file(tmp_path, {"trace": {"path": str(trace), "format": "mooncake"}},
                        duration="1h")
    code, out, _ = run_cli(capsys, p, "--json")
    assert code == 0
    s = json.loads(out)
    assert tuple(s) == SUMMARY_KEYS
    # The trace's published statistics (experiments/traces/README.md).
    assert s["count"] == 12031
    assert s["input_mean"] == pytest.approx(12035, abs=1)
    assert s["input_p99"] == pytest.approx(85400, rel=1e-3)
    assert s["output_mean"] == pytest.approx(343, abs=1)
    assert s["rate_per_s"] == pytest.approx(3.40, abs=0.01)
    assert s["interarrival_cv"] == pytest.approx(3.0, abs=0.1)
    assert s["prefix_hit_share"] == pytest.approx(0.37, abs=0.01)


def test_cli_text_on_azure_trace(traces_dir, tmp_path, capsys):
    p = experiment_file(tmp_path, {"trace": {"path": str(traces_dir / "azure_conv_2023.csv"),
                                             "format": "azure"}}, duration="2h")
    code, out, _ = run_cli(capsys, p, "--json")
    s = json.loads(out)
    assert s["count"] == 19366
    assert s["rate_per_s"] == pytest.approx(5.5, abs=0.05)
    assert s["input_mean"] == pytest.approx(1155, abs=1)
    assert s["output_mean"] == pytest.approx(211, abs=1)
    code, out, _ = run_cli(capsys, p)
    assert code == 0 and "19,366" in out and "prefix hits" in out


def test_cli_relative_trace_path_resolves_against_experiment_folder(tmp_path, capsys):
    sub = tmp_path / "exps"
    sub.mkdir()
    mooncake_file(tmp_path, HAND, "hand.jsonl")
    p = experiment_file(sub, {"trace": {"path": "../hand.jsonl", "format": "mooncake"}},
                        requests=5)
    code, out, err = run_cli(capsys, p, "--json")
    assert code == 0, err
    assert json.loads(out)["count"] == 5


def test_cli_bad_input_exit_code_2(tmp_path, capsys):
    bad = mooncake_file(tmp_path, HAND[:2] + ["{not json"], "bad.jsonl")
    p = experiment_file(tmp_path, {"trace": {"path": str(bad), "format": "mooncake"}},
                        requests=2)
    code, out, err = run_cli(capsys, p, "--json")
    assert code == 2 and out == ""
    assert "bad.jsonl: line 3: not valid JSON" in err
    code, _, err = run_cli(capsys, p, "--set", "workload.trace.on_error=skip", "--json")
    assert code == 0
    code, _, err = run_cli(capsys, p, "--set", "workload.arrival.burst=2")
    assert code == 2 and "unknown key 'burst'" in err
    code, _, err = run_cli(capsys, p, "--set", "workload.trace.path=nowhere.jsonl")
    assert code == 2 and "trace file not found" in err


def test_cli_prints_each_distinct_variant(tmp_path, capsys):
    p = experiment_file(tmp_path, {"arrival": {"rate": "2/s"}, "input": {"tokens": 100},
                                   "output": {"tokens": 10}}, requests=20,
                        variants=[{"label": "a"}, {"label": "b"},
                                  {"label": "c", "workload.arrival.rate": "4/s"}])
    code, out, _ = run_cli(capsys, p, "--json")
    assert code == 0 and len(out.splitlines()) == 2
    code, out, _ = run_cli(capsys, p)
    assert "[a, b]" in out and "[c]" in out


def test_shipped_mooncake_experiment(traces_dir):
    path = ROOT / "experiments" / "mooncake_conversation.yaml"
    (exp,) = load_experiment(path)
    assert exp.workload.arrival.process == "trace" and exp.workload.input.dist == "trace"
    from testbed import deploy
    rate = deploy.compile(exp).links["kv"].rate_bps
    assert rate <= deploy.MAX_EMULATED_RATE_BPS
    df = generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration,
                  base_dir=path.parent)
    assert 300 <= len(df) <= 400
    assert df.arrival_s.max() < 300.0           # 120 s of trace at 0.4x
    assert summarize(df)["prefix_hit_share"] > 0.05


# ---- phases: a mix that shifts mid-run ----

def _phased_spec(phases, **base):
    from testbed import schema
    from testbed.workload.spec import WorkloadSpec
    data = {"arrival": {"process": "poisson", "rate": "2/s"},
            "input": {"dist": "fixed", "tokens": 1000},
            "output": {"dist": "fixed", "tokens": 10}, "phases": phases, **base}
    return schema.build(WorkloadSpec, data, "workload")


def test_phases_shift_the_mix_at_their_boundaries():
    from testbed.workload.generate import generate
    spec = _phased_spec([{"until": "30s", "input": {"dist": "fixed", "tokens": 2000}},
                         {"input": {"dist": "uniform", "min": 50000, "max": 60000},
                          "arrival": {"process": "constant", "rate": "1/s"}}])
    df = generate(spec, seed=5, duration_s=60)
    first, second = df[df.arrival_s < 30], df[df.arrival_s >= 30]
    assert (first.input_len == 2000).all() and len(first) > 30
    assert second.input_len.between(50000, 60000).all()
    assert len(second) == 30 and (df.output_len == 10).all()     # 1/s for 30 s; base output
    assert df.arrival_s.is_monotonic_increasing
    again = generate(spec, seed=5, duration_s=60)
    assert again.equals(df)                                       # deterministic


def test_phases_with_a_request_count_stop_at_the_count():
    from testbed.workload.generate import generate
    spec = _phased_spec([{"until": "10s"}, {"input": {"dist": "fixed", "tokens": 7}}])
    df = generate(spec, seed=1, requests=50)
    assert len(df) == 50 and (df[df.arrival_s >= 10].input_len == 7).all()


@pytest.mark.parametrize("phases, message", [
    ([{"input": {"dist": "fixed", "tokens": 5}}, {"until": "10s"}], "phases[0]: 'until' missing"),
    ([{"until": "10s"}, {"until": "5s"}], "phases[1]: until 5s must be after"),
    ([{"until": "10s", "input": {"dist": "lognormal", "mu": 9}}], "phases[0].input"),
    ([{"until": "10s", "bogus": 1}], "unknown key 'bogus'"),
])
def test_bad_phases_are_refused_with_the_key(phases, message):
    from testbed.errors import ConfigError
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _phased_spec(phases)
