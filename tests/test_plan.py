"""Unit tests of the planner (testbed.plan, `testbed plan`): no root, no network, a few seconds."""

import contextlib
import io
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml
from scipy import stats

from testbed import deploy
from testbed import plan as P
from testbed import profile as profiles
from testbed.cli import main as cli_main
from testbed.config import load_experiment
from testbed.workload.spec import LengthSpec

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASE = ROOT / "experiments" / "paper_case_study.yaml"


# ---------------------------------------------------------------- helpers

def toy_inputs(values=(1000, 3000), probs=(0.5, 0.5), b_out_Bps=1e9, wan_bps=8e9):
    """A hand-checkable model: T_remote = 1e-4 l, T_local = 2e-4 l, S_kv = 1e4 l bytes."""
    prof = profiles.Profile(
        name="toy", kv_size=profiles.Fit((0.0, 1e4)),
        prefill={"fast": profiles.Fit((0.0, 1e-4)), "slow": profiles.Fit((0.0, 2e-4))},
        kv_points=(), prefill_points={}, decode_step_s=0.01, bs_max=10, stream_chunks=1)
    return P.Inputs(profile=prof, remote="fast", local="slow",
                    lengths=P.LengthDistribution.from_pmf(values, probs, "toy"),
                    l_out=100.0, t_decode_s=0.01, bs_max=10, b_out_Bps=b_out_Bps,
                    wan_rate_bps=wan_bps)


def truncated_lognormal_moments(mu, s, a, b, t=None):
    """Continuous truncated log-normal: (mean) or (P(L > t), E[L | L > t], E[L | L <= t])."""
    z = lambda x: (math.log(x) - mu) / s                        # noqa: E731
    Phi = stats.norm.cdf
    mass = lambda lo, hi: Phi(z(hi)) - Phi(z(lo))               # noqa: E731
    first = lambda lo, hi: math.exp(mu + s * s / 2) * (Phi(z(hi) - s) - Phi(z(lo) - s))  # noqa
    if t is None:
        return first(a, b) / mass(a, b)
    return (mass(t, b) / mass(a, b), first(t, b) / mass(t, b), first(a, t) / mass(a, t))


@pytest.fixture(scope="module")
def case_runs():
    return load_experiment(CASE)


@pytest.fixture(scope="module")
def case_plan(case_runs):
    return P.plan_runs(case_runs)


# ---------------------------------------------------------------- each equation by hand

def test_phi_kv_and_b_out_min_by_hand():
    assert P.Phi_kv(1e9, 2.0) == pytest.approx(5e8)
    # 4 instances each producing 1 GB/s of KV need 4 GB/s of egress.
    assert P.B_out_min(4, 1e9) == pytest.approx(4e9)


def test_theta_prfaas_takes_the_lower_of_compute_and_bandwidth():
    # 4 instances, 2 s per prefill: 2 req/s of compute; 1 GB per request over 12.5 GB/s: 12.5.
    assert P.Theta_prfaas(4, 2.0, 1e9, 12.5e9) == pytest.approx(2.0)
    # The same cluster behind 1 GB/s of egress sends 1 request's KV per second.
    assert P.Theta_prfaas(4, 2.0, 1e9, 1e9) == pytest.approx(1.0)


def test_theta_pdp_and_theta_pdd_by_hand():
    assert P.Theta_pdp(3, 1.5) == pytest.approx(2.0)
    # 5 decode instances x 20 slots / (25 ms x 1024 tokens) = 100 / 25.6 = 3.90625 req/s.
    assert P.Theta_pdd(5, 20, 0.025, 1024) == pytest.approx(3.90625)


def test_lambda_max_by_hand():
    assert P.Lambda_max(2.0, 2.0, 3.90625, 0.5) == pytest.approx(3.90625)
    assert P.Lambda_max(2.0, 2.0, 9.0, 0.5) == pytest.approx(4.0)
    assert P.Lambda_max(1.0, 3.0, 9.0, 0.25) == pytest.approx(4.0)      # 1/0.25 = 3/0.75 = 4
    # A stage without traffic is no bound, whatever its Theta.
    assert P.Lambda_max(0.0, 2.0, 9.0, 0.0) == pytest.approx(2.0)
    assert P.Lambda_max(2.5, 0.0, 9.0, 1.0) == pytest.approx(2.5)


def test_evaluate_on_a_toy_model_by_hand():
    inp = toy_inputs()
    p, l_long, l_short = inp.lengths.split(2000)
    assert (float(p), float(l_long), float(l_short)) == (0.5, 3000.0, 1000.0)
    q = P.evaluate(inp, 2, 1, 2, p, l_long, l_short)
    # Theta_prfaas = min(2 / 0.3, 1e9 / 3e7) = 6.667; Theta_pdp = 1 / 0.2 = 5;
    # Theta_pdd = 2 * 10 / (0.01 * 100) = 20; Lambda = min(13.33, 10, 20) = 10.
    assert float(q["theta_prfaas"]) == pytest.approx(2 / 0.3)
    assert float(q["theta_pdp"]) == pytest.approx(5.0)
    assert float(q["theta_pdd"]) == pytest.approx(20.0)
    assert float(q["lambda_max"]) == pytest.approx(10.0)
    # Egress: 10 req/s x 0.5 offloaded x 3e7 bytes = 1.5e8 B/s.
    assert float(q["egress_Bps"]) == pytest.approx(1.5e8)
    assert not bool(q["prfaas_bandwidth_bound"])


def test_bandwidth_bound_prfaas_on_a_toy_model():
    inp = toy_inputs(b_out_Bps=6e7)                 # 2 requests of 3e7 bytes per second
    p, l_long, l_short = inp.lengths.split(2000)
    q = P.evaluate(inp, 2, 1, 2, p, l_long, l_short)
    assert float(q["theta_prfaas"]) == pytest.approx(2.0)
    assert bool(q["prfaas_bandwidth_bound"])
    # B_out needed to stay compute-bound: 2 instances x Phi_kv(3000) = 2 x 3e7 / 0.3 = 2e8 B/s.
    assert float(q["b_out_min_Bps"]) == pytest.approx(2e8)
    assert float(q["lambda_max"]) == pytest.approx(4.0)           # 2 / 0.5


def test_best_prfaas_on_the_toy_matches_brute_force():
    inp = toy_inputs()
    row = P.best_prfaas(inp, n_prfaas=2, n_local=3)
    # Thresholds below 1000 offload everything, [1000, 3000) offload the 3000s.
    best = 0.0
    for n_p in (1, 2):
        for t in (500, 2000):
            p, ll, ls = inp.lengths.split(t)
            best = max(best, float(P.evaluate(inp, 2, n_p, 3 - n_p, p, ll, ls)["lambda_max"]))
    assert row["lambda_max"] == pytest.approx(best)


# ---------------------------------------------------------------- the length distribution

SPEC = LengthSpec(dist="lognormal", mu=9.90, sigma=1.00, min=128, max=131072)


def test_truncated_lognormal_moments_match_the_closed_form():
    d = P.distribution_from_spec(SPEC)
    assert d.probs.sum() == pytest.approx(1.0)
    assert d.mean == pytest.approx(truncated_lognormal_moments(9.9, 1.0, 128, 131072), rel=1e-3)
    assert d.mean == pytest.approx(27.5 * 1024, rel=0.03)          # PRFAAS.md: mean ~27.5K
    for t in (1024, 8192, 19136, 65536):
        p, ll, ls = (float(v) for v in d.split(t))
        p0, ll0, ls0 = truncated_lognormal_moments(9.9, 1.0, 128, 131072, t + 0.5)
        assert p == pytest.approx(p0, rel=1e-3)
        assert ll == pytest.approx(ll0, rel=1e-3)
        assert ls == pytest.approx(ls0, rel=1e-3)


def test_truncated_lognormal_moments_match_monte_carlo():
    # Rejection sampling (a different method from the planner's CDF differences), rounded to
    # whole tokens as requests are.
    rng = np.random.default_rng(7)
    x = rng.lognormal(9.9, 1.0, size=600_000)
    x = np.rint(x[(x >= 128) & (x <= 131072)])
    d = P.distribution_from_spec(SPEC)
    t = 19136
    long, short = x[x > t], x[x <= t]
    p, ll, ls = (float(v) for v in d.split(t))
    se = lambda v: v.std() / math.sqrt(len(v))                  # noqa: E731
    assert abs(d.mean - x.mean()) < 4 * se(x)
    assert abs(p - len(long) / len(x)) < 4 * math.sqrt(p * (1 - p) / len(x))
    assert abs(ll - long.mean()) < 4 * se(long)
    assert abs(ls - short.mean()) < 4 * se(short)


def test_fixed_uniform_and_empirical_distributions():
    f = P.distribution_from_spec(LengthSpec(dist="fixed", tokens=1024))
    assert f.mean == 1024 and float(f.split(1023)[0]) == 1.0 and float(f.split(1024)[0]) == 0.0
    u = P.distribution_from_spec(LengthSpec(dist="uniform", min=1, max=100))
    p, ll, ls = (float(v) for v in u.split(60))
    assert (u.mean, p, ll, ls) == (pytest.approx(50.5), pytest.approx(0.4),
                                   pytest.approx(80.5), pytest.approx(30.5))
    e = P.LengthDistribution.from_lengths([1000, 3000, 3000, 5000])
    p, ll, ls = (float(v) for v in e.split(3000))
    assert (e.mean, p, ll, ls) == (3000.0, 0.25, 5000.0, pytest.approx(7000 / 3))


def test_split_is_vectorised_and_handles_empty_sides():
    d = P.distribution_from_spec(SPEC)
    p, ll, ls = d.split(np.array([0, 128, 131072]))
    assert p[0] == 1.0 and np.isnan(ls[0]) and ll[0] == pytest.approx(d.mean)
    assert p[2] == 0.0 and np.isnan(ll[2]) and ls[2] == pytest.approx(d.mean)


# ---------------------------------------------------------------- the case study

def test_case_study_file_validates_and_is_runnable_here(case_runs):
    by = {r.scheduler.policy: r for r in case_runs}
    assert set(by) == {"prfaas", "homogeneous", "naive"}
    assert by["prfaas"].clusters.prfaas.instances == 4
    assert by["prfaas"].clusters.local.instances == 8
    assert by["homogeneous"].clusters.local.instances == 12
    assert by["homogeneous"].clusters.prfaas.instances == 0
    assert by["naive"].clusters.local.decode == 8
    for r in case_runs:
        assert r.network.wan.rate == 100e9
        assert deploy.compile(r).links["kv"].rate_bps <= deploy.MAX_EMULATED_RATE_BPS
        assert r.model.decode_step == 0.025 and r.model.bs_max == 20
        assert (r.workload.input.mu, r.workload.input.sigma) == (9.9, 1.0)
        assert (r.workload.input.min, r.workload.input.max) == (128, 131072)
        assert r.workload.output.tokens == 1024


def test_case_study_reproduces_the_papers_headline(case_plan):
    pol, ratios = case_plan["policies"], case_plan["ratios"]
    # PRFAAS.md: ~1.54x homogeneous, ~1.32x naive, egress ~13 Gbps (13% of the link).
    assert ratios["prfaas/homogeneous"] == pytest.approx(1.54, abs=0.05)
    assert ratios["prfaas/naive"] == pytest.approx(1.32, abs=0.03)
    assert pol["prfaas"]["egress_gbps"] == pytest.approx(13, abs=1.0)
    assert (pol["homogeneous"]["n_p"], pol["homogeneous"]["n_d"]) == (9, 3)
    assert (pol["naive"]["n_p"], pol["naive"]["n_d"]) == (0, 8)
    assert pol["prfaas"]["n_p"] + pol["prfaas"]["n_d"] == 8
    assert case_plan["warnings"] == []


def test_at_the_optimum_the_two_prefill_bounds_meet_within_the_grid(case_runs, case_plan):
    row = case_plan["policies"]["prfaas"]
    step = case_plan["inputs"]["threshold_step"]
    assert row["binding"] in ("prfaas", "pdp")
    inp = P.inputs_for(case_runs[0])
    ts = np.array([row["threshold"] - step, row["threshold"], row["threshold"] + step])
    p, ll, ls = inp.lengths.split(ts)
    q = P.evaluate(inp, row["n_prfaas"], row["n_p"], row["n_d"], p, ll, ls)
    gap = q["bound_prfaas"] - q["bound_pdp"]
    # The bounds cross inside [t - step, t + step] ...
    assert gap[0] * gap[2] < 0
    # ... and at t they differ by no more than either one moves over one grid step.
    moves = max(abs(np.diff(q["bound_prfaas"])).max(), abs(np.diff(q["bound_pdp"])).max())
    assert abs(gap[1]) <= moves
    assert row["bound_prfaas"] == pytest.approx(row["bound_pdp"], rel=0.01)


def test_grid_optimum_is_not_beaten_by_a_brute_force_loop(case_runs, case_plan):
    row = case_plan["policies"]["prfaas"]
    inp = P.inputs_for(case_runs[0])
    best = 0.0
    for n_p in range(1, 8):
        for t in range(128, 131072, 997):
            p, ll, ls = inp.lengths.split(t)
            best = max(best, float(P.evaluate(inp, 4, n_p, 8 - n_p, p, ll, ls)["lambda_max"]))
    assert row["lambda_max"] >= best - 1e-9
    assert row["lambda_max"] == pytest.approx(best, rel=0.01)


def test_predict_matches_the_plan_for_the_configured_optimum(case_runs, case_plan):
    preds = {r.scheduler.policy: P.predict(r) for r in case_runs}
    for pol, pred in preds.items():
        assert set(P.ROW_KEYS) <= set(pred)
        assert pred["warnings"] == []
        assert pred["lambda_max"] == pytest.approx(case_plan["policies"][pol]["lambda_max"],
                                                   rel=1e-6)


def test_predict_never_raises_for_valid_experiments(case_runs):
    from dataclasses import replace
    exp = case_runs[0]
    beyond = replace(exp, scheduler=replace(exp.scheduler, threshold=200_000))
    pred = P.predict(beyond)
    assert pred["offload_fraction"] == 0.0 and pred["l_long"] is None
    assert pred["binding"] == "pdp" and pred["lambda_max"] > 0
    everything = replace(exp, scheduler=replace(exp.scheduler, threshold=0))
    pred = P.predict(everything)
    assert pred["offload_fraction"] == 1.0 and pred["l_short"] is None
    assert pred["lambda_max"] > 0


# ---------------------------------------------------------------- B_out rule and warnings

def test_b_out_is_the_wan_kv_rate_and_egress_warnings(case_runs):
    slow = load_experiment(CASE, ["network.wan.rate=10Gbit"])
    report = P.plan_runs(slow)
    assert report["b_out_gbps"] == pytest.approx(10.0)
    assert report["policies"]["prfaas"]["egress_gbps"] <= 10.0 + 1e-9
    assert report["policies"]["naive"]["prfaas_limit"] == "bandwidth"
    assert any("bandwidth-bound" in w for w in report["warnings"])
    # B_out set above the link: the model lets egress exceed the WAN, and says so.
    over = P.plan_runs(slow, b_out_bps=1e12)
    assert over["policies"]["naive"]["egress_gbps"] > 10.0
    assert any("exceeds the WAN rate" in w for w in over["warnings"])


def test_policies_are_derived_from_the_base_run_when_no_variant(tmp_path):
    raw = yaml.safe_load(CASE.read_text())
    raw.pop("variants")
    path = tmp_path / "base_only.yaml"
    path.write_text(yaml.safe_dump(raw))
    from testbed.commands.plan import plan_file
    report = plan_file(path)
    pol = report["policies"]
    assert pol["homogeneous"]["n_p"] + pol["homogeneous"]["n_d"] == 12     # 4 + 8 local H20
    assert pol["homogeneous"]["n_prfaas"] == 0
    assert (pol["naive"]["n_prfaas"], pol["naive"]["n_d"]) == (4, 8)
    assert "derived" in pol["homogeneous"]["origin"]
    assert report["ratios"]["prfaas/homogeneous"] == pytest.approx(1.57, abs=0.02)


def test_empirical_lengths_replace_the_spec(case_runs):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1000, 60000, size=5000)
    report = P.plan_runs(case_runs, lengths=lengths)
    assert report["inputs"]["mean_input"] == pytest.approx(lengths.mean())
    assert report["policies"]["prfaas"]["lambda_max"] > 0


# ---------------------------------------------------------------- the command

REQUIRED = {"threshold", "n_p", "n_d", "lambda_max", "theta_prfaas", "theta_pdp", "theta_pdd",
            "offload_fraction", "l_long", "l_short", "egress_gbps", "binding"}


def test_plan_json_schema():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["plan", str(CASE), "--json"]) == 0
    out = json.loads(buf.getvalue())
    assert set(out["policies"]) == {"prfaas", "homogeneous", "naive"}
    for name, row in out["policies"].items():
        assert REQUIRED <= set(row), name
        assert isinstance(row["lambda_max"], float) and row["lambda_max"] > 0
        assert isinstance(row["n_p"], int) and isinstance(row["n_d"], int)
        assert row["binding"] in P.STAGES
        assert 0.0 <= row["offload_fraction"] <= 1.0
    assert isinstance(out["policies"]["prfaas"]["threshold"], int)
    assert out["policies"]["homogeneous"]["threshold"] is None
    assert out["b_out_gbps"] == pytest.approx(100.0)
    assert set(out["phi_kv"]["by_accelerator"]) == {"h200", "h20"}
    assert isinstance(out["warnings"], list)


def test_plan_cli_prints_the_ratios():
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "plan", str(CASE)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prfaas / homogeneous" in proc.stdout and "prfaas / naive" in proc.stdout


def test_plan_cli_bad_input_is_exit_2(tmp_path, capsys):
    assert cli_main(["plan", str(tmp_path / "missing.yaml")]) == 2
    assert cli_main(["plan", str(CASE), "--step", "500"]) == 2
    assert "step" in capsys.readouterr().err


def test_plan_figures_are_written(tmp_path):
    from testbed import plan_figures
    paths = plan_figures.draw_all(load_experiment(CASE), tmp_path)
    names = {p.name for p in paths}
    for stem in ("lambda_vs_np", "lambda_vs_threshold", "phi_kv_vs_length"):
        assert {f"{stem}.png", f"{stem}.pdf"} <= names
    assert all(p.stat().st_size > 1000 for p in paths)


# ---------------------------------------------------------------- latency modes (Jensen)

def quadratic_inputs(values=(1000, 3000), probs=(0.5, 0.5)):
    """The toy model with convex latencies: T_remote = 1e-8 l^2, T_local = 2e-8 l^2."""
    prof = profiles.Profile(
        name="toy-quadratic", kv_size=profiles.Fit((0.0, 1e4)),
        prefill={"fast": profiles.Fit((0.0, 0.0, 1e-8)), "slow": profiles.Fit((0.0, 0.0, 2e-8))},
        kv_points=(), prefill_points={}, decode_step_s=0.01, bs_max=10, stream_chunks=1)
    return P.Inputs(profile=prof, remote="fast", local="slow",
                    lengths=P.LengthDistribution.from_pmf(values, probs, "toy"),
                    l_out=100.0, t_decode_s=0.01, bs_max=10, b_out_Bps=1e12, wan_rate_bps=8e12)


def test_expected_latency_by_hand():
    inp = quadratic_inputs(values=(1000, 2000, 4000), probs=(0.5, 0.25, 0.25))
    # t = 1500: long side {2000, 4000} equally likely, l_long = 3000.
    paper, expected = (P.split(inp, 1500, mode) for mode in P.LATENCY_MODES)
    assert float(paper["t_remote"]) == pytest.approx(1e-8 * 3000**2)            # 0.09 s
    assert float(expected["t_remote"]) == pytest.approx(1e-8 * (2000**2 + 4000**2) / 2)  # 0.10
    # The short side is one length: both forms agree; S_kv is linear: both forms agree.
    assert float(expected["t_local"]) == pytest.approx(float(paper["t_local"]))
    assert float(expected["s_kv_long"]) == pytest.approx(float(paper["s_kv_long"]))
    # Naive (everything offloaded): 2 instances / E[T_remote(L)] = 2 / 0.0575.
    row = P.naive(inp, 2, 4, latency="expected")
    assert row["theta_prfaas"] == pytest.approx(2 / (1e-8 * (0.5e6 + 0.25 * 4e6 + 0.25 * 16e6)))
    assert row["lambda_max"] == pytest.approx(row["theta_prfaas"])


def test_expected_latency_matches_monte_carlo(case_runs):
    # E[T(L) | side] from rejection-sampled lengths, rounded to whole tokens as requests are,
    # against the planner's prefix sums over the exact probability mass.
    inp = P.inputs_for(case_runs[0])
    rng = np.random.default_rng(11)
    x = rng.lognormal(9.9, 1.0, size=2_400_000)
    x = np.rint(x[(x >= 128) & (x <= 131072)])
    for t in (4096, 19136, 65536):
        sp = P.split(inp, t, "expected")
        for f, side, got in ((inp.t_remote, x[x > t], sp["t_remote"]),
                             (inp.t_local, x[x <= t], sp["t_local"]),
                             (inp.s_kv, x[x > t], sp["s_kv_long"])):
            y = f(side)
            assert float(got) == pytest.approx(y.mean(), rel=0.005), (t, f)
            assert abs(float(got) - y.mean()) < 4 * y.std() / math.sqrt(len(y)), (t, f)
    # Homogeneous (9 H20 prefill instances): Theta_pdp = 9 / E[T_local(L)], ~1.763 req/s.
    row = P.best_homogeneous(inp, 12, latency="expected")
    assert row["n_p"] == 9
    assert row["theta_pdp"] == pytest.approx(9 / inp.t_local(x).mean(), rel=0.005)
    assert row["lambda_max"] == pytest.approx(1.763, abs=0.002)


def test_expected_is_at_most_paper_for_a_convex_latency(case_runs):
    inp = P.inputs_for(case_runs[0])
    ts = P.threshold_grid(inp.lengths, 64)
    paper, expected = (P.split(inp, ts, mode) for mode in P.LATENCY_MODES)
    # Jensen: T(E[L | side]) <= E[T(L) | side] for the quadratic fits, at every threshold ...
    assert np.all(expected["t_remote"] >= paper["t_remote"] * (1 - 1e-12))
    assert np.all(expected["t_local"] >= paper["t_local"] * (1 - 1e-12))
    # ... while the linear S_kv gives the same bytes either way.
    np.testing.assert_allclose(expected["s_kv_long"], paper["s_kv_long"], rtol=1e-9)
    # So every stage throughput, and Lambda_max at each mode's optimum, is lower or equal.
    for exp in case_runs:
        pred = P.predict(exp)
        for key in ("lambda_max", "theta_prfaas", "theta_pdp", "theta_pdd"):
            if pred["paper"][key] is not None:
                assert pred["expected"][key] <= pred["paper"][key] * (1 + 1e-12), key
        assert pred["lambda_max_expected"] < pred["lambda_max_paper"]
    report = P.plan_runs(case_runs)
    for pol in P.POLICIES:
        assert report["by_latency"]["expected"]["policies"][pol]["lambda_max"] < \
            report["by_latency"]["paper"]["policies"][pol]["lambda_max"]


def test_linear_latency_makes_both_modes_equal():
    # T and S_kv linear in l (the toy profile): E[T(L) | side] = T(E[L | side]) exactly.
    rng = np.random.default_rng(3)
    values = np.arange(500, 8000, 250)
    inp = toy_inputs(values=values, probs=rng.random(values.size))
    ts = P.threshold_grid(inp.lengths, 50)
    paper, expected = (P.split(inp, ts, mode) for mode in P.LATENCY_MODES)
    for key in ("t_remote", "t_local", "s_kv_long"):
        np.testing.assert_allclose(expected[key], paper[key], rtol=1e-9)
    rows = {mode: P.best_prfaas(inp, 2, 5, step=50, latency=mode) for mode in P.LATENCY_MODES}
    assert rows["expected"]["lambda_max"] == pytest.approx(rows["paper"]["lambda_max"], rel=1e-9)
    assert rows["expected"]["threshold"] == rows["paper"]["threshold"]
    assert P.naive(inp, 2, 3, latency="expected")["lambda_max"] == \
        pytest.approx(P.naive(inp, 2, 3)["lambda_max"], rel=1e-9)


def test_expected_optimum_is_not_beaten_by_a_brute_force_loop(case_runs):
    report = P.plan_runs(case_runs, latency="expected")
    row = report["policies"]["prfaas"]
    assert row["latency"] == "expected" and row["lambda_max"] == row["lambda_max_expected"]
    inp = P.inputs_for(case_runs[0])
    best = 0.0
    for n_p in range(1, 8):
        for t in range(128, 131072, 997):
            sp = P.split(inp, t, "expected")
            q = P.evaluate(inp, 4, n_p, 8 - n_p, sp["p"], sp["l_long"], sp["l_short"], sp)
            best = max(best, float(q["lambda_max"]))
    assert row["lambda_max"] >= best - 1e-9
    assert row["lambda_max"] == pytest.approx(best, rel=0.01)
    assert row["bound_prfaas"] == pytest.approx(row["bound_pdp"], rel=0.01)


MODE_KEYS = {"lambda_max", "theta_prfaas", "theta_pdp", "theta_pdd", "binding"}


def test_predict_carries_both_latency_modes(case_runs):
    for exp in case_runs:
        pred = P.predict(exp)
        assert pred["latency"] == "paper"
        assert pred["lambda_max"] == pred["lambda_max_paper"] == pred["paper"]["lambda_max"]
        assert pred["lambda_max_expected"] == pred["expected"]["lambda_max"]
        assert MODE_KEYS <= set(pred["paper"]) and MODE_KEYS <= set(pred["expected"])
        other = P.predict(exp, latency="expected")
        assert other["latency"] == "expected"
        assert other["lambda_max"] == pytest.approx(pred["lambda_max_expected"], rel=1e-12)
        assert other["lambda_max_paper"] == pytest.approx(pred["lambda_max"], rel=1e-12)
    by = {exp.scheduler.policy: P.predict(exp)["lambda_max_expected"] for exp in case_runs}
    # 2M-sample estimates for the file's configurations: 1.763, 2.428 and 3.225 req/s.
    assert by == {"homogeneous": pytest.approx(1.763, abs=0.002),
                  "naive": pytest.approx(2.428, abs=0.002),
                  "prfaas": pytest.approx(3.225, abs=0.003)}
    with pytest.raises(P.ConfigError):
        P.predict(case_runs[0], latency="median")


def test_predict_failure_keeps_both_mode_keys(case_runs):
    from dataclasses import replace
    exp = case_runs[0]
    pred = P.predict(replace(exp, model=replace(exp.model, profile="no-such-profile")))
    assert pred["lambda_max"] is None and "no-such-profile" in pred["warnings"][0]
    for mode in P.LATENCY_MODES:
        assert f"lambda_max_{mode}" in pred and set(P.MODE_KEYS) == set(pred[mode])


def test_plan_json_carries_the_latency_mode():
    out = {}
    for mode in P.LATENCY_MODES:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli_main(["plan", str(CASE), "--json", "--latency", mode]) == 0
        out[mode] = json.loads(buf.getvalue())
    for mode, rep in out.items():
        assert rep["latency"] == mode
        assert set(rep["by_latency"]) == set(P.LATENCY_MODES)
        for name, row in rep["policies"].items():
            assert REQUIRED <= set(row), name
            assert row["latency"] == mode
            assert row["lambda_max"] == row[f"lambda_max_{mode}"]
            for m in P.LATENCY_MODES:
                assert MODE_KEYS <= set(row[m])
            assert rep["by_latency"][mode]["policies"][name]["lambda_max"] == row["lambda_max"]
        assert rep["ratios"] == rep["by_latency"][mode]["ratios"]
        assert all(c["latency"] == mode for c in rep["configured"])
    # Both reports hold both modes' optima, whichever mode the tables use.
    assert out["paper"]["by_latency"] == out["expected"]["by_latency"]
    assert out["expected"]["ratios"]["prfaas/homogeneous"] > \
        out["paper"]["ratios"]["prfaas/homogeneous"]


def test_plan_cli_prints_both_modes():
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "plan", str(CASE),
                           "--latency", "expected"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "headline, paper" in proc.stdout and "headline, expected" in proc.stdout
    assert proc.stdout.count("prfaas / homogeneous") == 2
    assert proc.stdout.count("prfaas / naive") == 2


def test_plan_cli_rejects_an_unknown_latency_mode(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", str(CASE), "--latency", "median"])
    assert e.value.code == 2
    assert "latency" in capsys.readouterr().err
