"""The long-timescale re-plan on synthetic measured mixes (no root)."""

import dataclasses

import numpy as np
import pytest

from testbed import profile as profiles
from testbed.errors import ConfigError
from testbed.runtime import RolesRuntime, WorkerRuntime
from workers.roles import planner_inputs, replan


def runtime(wan_bps=100e9):
    prof = profiles.load("kimi-linear-1t")
    roles = RolesRuntime(interval_s=1.0, window_s=1.0, min_requests=2, cost_s=0.0, gain=0.05,
                         retune=True, wan_rate_real_bps=wan_bps)
    return WorkerRuntime.from_dict({
        "profile": "kimi-linear-1t",
        "decode": {"model_real": dataclasses.asdict(prof.decode)},
        "scheduler": {"roles": dataclasses.asdict(roles)},
        "instances": {"rp0": {"role": "prefill", "dc": "prfaas", "accelerator": "h200"},
                      "lp0": {"role": "prefill", "dc": "local", "accelerator": "h20"},
                      "ld0": {"role": "decode", "dc": "local", "accelerator": "h20"}}})


def mix(mu, out, n=200, seed=0):
    rng = np.random.default_rng(seed)
    lens = np.clip(np.rint(np.exp(rng.normal(mu, 1.0, n))), 128, 131072)
    return lens, np.full(n, out)


def test_short_prompts_long_outputs_move_instances_to_decode():
    inp = planner_inputs(runtime(), *mix(7.0, 2048))
    d = replan(inp, 2, 4, 3, 0.05)
    assert d["n_p_best"] < 3 and d["target"] < 3
    assert d["lambda_best"] > d["lambda_now"] * 1.05
    assert d["binding_now"] == "pdd"


def test_long_prompts_short_outputs_move_instances_to_prefill():
    inp = planner_inputs(runtime(), *mix(10.5, 128))
    d = replan(inp, 2, 4, 1, 0.05)
    assert d["n_p_best"] > 1 and d["target"] > 1
    assert d["binding_now"] == "prefill"


def test_hysteresis_keeps_the_split_when_the_gain_is_small():
    inp = planner_inputs(runtime(), *mix(9.9, 1024))
    d = replan(inp, 2, 4, 2, 0.05)
    best = d["n_p_best"]
    held = replan(inp, 2, 4, best, 0.05)
    assert held["target"] == best                      # already at the best: stay
    assert replan(inp, 2, 4, 2, 10.0)["target"] == 2   # a huge margin: never move


def test_threshold_is_retuned_per_split():
    inp = planner_inputs(runtime(), *mix(9.9, 1024))
    d = replan(inp, 2, 4, 2, 0.05)
    assert set(d["threshold"]) == {1, 2, 3}
    assert all(inp.lengths.min <= t <= inp.lengths.max for t in d["threshold"].values())


def test_roles_config_is_validated(tmp_path):
    from testbed.config import load_experiment
    base = ("name: x\nrequests: 10\nscale: {bytes: 1e-3}\nworkload: {arrival: {rate: 1/s}, input: {dist: fixed, "
            "tokens: 1000}, output: {dist: fixed, tokens: 10}}\n")
    p = tmp_path / "a.yaml"
    p.write_text(base + "scheduler: {policy: naive, roles: {enabled: true}}\n"
                 "clusters: {prfaas: {instances: 1}, local: {instances: 2, prefill: 0, decode: 2}}\n")
    with pytest.raises(ConfigError, match="scheduler.roles needs policy prfaas"):
        load_experiment(p)
    p.write_text(base + "scheduler: {roles: {enabled: true, gain: 2}}\n"
                 "clusters: {prfaas: {instances: 1}, local: {instances: 2, prefill: 1, decode: 1}}\n")
    with pytest.raises(ConfigError, match="scheduler.roles.gain"):
        load_experiment(p)
    p.write_text(base + "scheduler: {roles: {enabled: true, cost: 3s}}\n"
                 "clusters: {prfaas: {instances: 1}, local: {instances: 2, prefill: 1, decode: 1}}\n")
    assert load_experiment(p)[0].scheduler.roles.cost == 3.0
