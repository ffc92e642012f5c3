"""`testbed calibrate --from-run` (testbed/calibinsitu.py): a real engine's prefill and decode
step refitted from what a deployment run stamped. Here on the tables of a synthetic decode
instance whose step time is known (a small continuous-batching loop), so that the recovery is
checked exactly; on a real vLLM run in tests/test_vllm_root.py."""

import random

import numpy as np
import pandas as pd
import pytest

from testbed import calibfit, calibinsitu, cli
from testbed import profile as profiles


def t_step(b, c):
    return 0.004 + 0.0011 * b + 1.8e-7 * c


def t_prefill(l):
    return 0.012 + 2.0e-5 * l + 1.5e-9 * l * l


def deployment(n=40, tokens=16, seed=0, noise=0.02):
    """(requests, tokens) tables of one decode instance batching `n` requests with arrivals
    10-60 ms apart: every step all requests in the batch emit one token, and a step takes
    t_step(B, C) (x a jitter), C the batch's inputs and tokens so far."""
    rng = random.Random(seed)
    arrive = np.cumsum([rng.uniform(0.01, 0.06) for _ in range(n)])
    lens = [rng.randint(256, 3000) for _ in range(n)]
    emitted, rows, t, nxt = {}, [], 0.0, 0
    while nxt < n or emitted:
        while nxt < n and arrive[nxt] <= t:
            emitted[nxt] = 0
            nxt += 1
        if not emitted:
            t = arrive[nxt]
            continue
        ctx = sum(lens[i] + k for i, k in emitted.items())
        t += t_step(len(emitted), ctx) * (1 + rng.uniform(-noise, noise))
        for i in list(emitted):
            rows.append((i, emitted[i], t))
            emitted[i] += 1
            if emitted[i] == tokens:
                del emitted[i]
    tok = pd.DataFrame(rows, columns=["id", "index", "decode_time"])
    start = arrive - 0.5
    req = pd.DataFrame({"id": range(n), "input_len": lens, "decode_instance": "ld0",
                        "status": "ok", "cached_len": 0, "prefill_start": start,
                        "prefill_end": start + [t_prefill(l) for l in lens]})
    return req, tok


def test_the_gaps_know_the_batch_and_its_context():
    req, tok = deployment()
    gaps = calibinsitu.step_gaps(req, tok)
    assert len(gaps) == 40 * 15
    assert gaps.batch.max() > 2 and gaps.batch.min() >= 1
    # Away from the steps where a request joins (its first step is not yet seen as its), the
    # batch and context the gaps are given are the loop's own: t_step of them is the gap.
    err = (t_step(gaps.batch, gaps.context) - gaps.seconds) / gaps.seconds
    assert (err.abs() < 0.03).mean() > 0.6, err.describe()


def test_the_refit_recovers_the_engines_step_and_prefill():
    req, tok = deployment(n=80)
    pre = calibinsitu.binned_prefill(calibinsitu.prefill_samples(req, 0))
    assert 3 <= len(pre) <= calibinsitu.PREFILL_BINS
    for s in pre:
        assert s.seconds == pytest.approx(t_prefill(s.length), rel=0.05)
    steps = calibinsitu.step_samples(calibinsitu.step_gaps(req, tok))
    alpha, beta, gamma = calibfit.fit_step([(s.batch, s.context, s.seconds) for s in steps])
    for b in (1, 2, 3, 4):
        c = b * 1700
        assert alpha + beta * b + gamma * c == pytest.approx(t_step(b, c), rel=0.1)


def test_from_run_refuses_bad_input_with_one_line(tmp_path, capsys):
    base = tmp_path / "base.yaml"
    out = str(tmp_path / "p.yaml")
    assert cli.main(["calibrate", "--out", out, "--from-run", str(tmp_path)]) == 2
    assert "--base" in capsys.readouterr().err
    base.write_text("name: x\n")
    assert cli.main(["calibrate", "--out", out, "--from-run", str(tmp_path),
                     "--base", str(base)]) == 2
    err = capsys.readouterr().err
    assert "no requests.parquet" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["calibrate", "--out", out]) == 2
    assert "--model" in capsys.readouterr().err


def test_a_run_of_one_prompt_length_scales_the_bases_prefill(tmp_path):
    """Bench serve's random dataset sends one length: no curve to fit, so the base's points
    keep their shape, scaled by the median measured / base (here the engine is 1.3x)."""
    from test_calibrate import synthetic   # reason: the synthetic engine of the fit's tests
    base, _, _ = calibfit.write(synthetic(), tmp_path / "base.yaml")
    raw = calibfit.Measurements(samples=[calibfit.Sample("prefill", length=608, seconds=s)
                                         for s in (1.2 * t_prefill(608), 1.3 * t_prefill(608),
                                                   1.4 * t_prefill(608))])
    fit = calibfit.Measurements(samples=calibinsitu.binned_prefill(raw.samples))
    points, how = calibinsitu.prefill_section({512: "1s", 1024: "2s"},
                                              profiles.load(str(base)), "cpu", fit, raw)
    assert how["lengths"] == [608] and how["scaled"] == pytest.approx(1.3, rel=0.02)
    assert points == {512: f"{how['scaled'] * 1:.9g}s", 1024: f"{how['scaled'] * 2:.9g}s"}
