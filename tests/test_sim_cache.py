"""The prefix cache in the simulator (testbed/sim/cache.py), no root, seconds.

Placement is `workers.placement.CachePlacer`'s, the pools `workers.cache_core.PoolBook`s: the
tests check what the run measured against closed forms and the pools' own books.
"""

import dataclasses
import json

import pandas as pd
import pytest

from conftest import ROOT, assert_decisions_replay, cache_failover_experiment
from testbed import cli, config, deploy
from testbed import profile as profiles
from testbed.records import read_events
from testbed.sim.replay import replay
from testbed.sim.run import SimRun

EXPERIMENT = """\
name: c
seed: 1
scale: {{time: 10, bytes: 1e-3}}
model: {{profile: kimi-linear-1t}}
clusters:
  prfaas: {{instances: 1, accelerator: h200}}
  local: {{instances: 2, accelerator: h20, prefill: 1, decode: 1}}
network:
  wan: {{rate: 100Gbit, delay: 5ms}}
scheduler: {{policy: prfaas, threshold: 19.4K, placement: {placement}}}
cache: {{enabled: true, transfer: never}}
workload:
  trace: {{path: {trace}, format: mooncake}}
"""


def run_trace(tmp_path, rows, placement="cache_aware"):
    """Run a Mooncake-format trace of `rows` (arrival ms, input length, hash ids) in the sim;
    (requests table by id, summary, the experiment)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 8,
                                         "hash_ids": ids}) + "\n" for t, n, ids in rows))
    path = tmp_path / "c.yaml"
    path.write_text(EXPERIMENT.format(placement=placement, trace=trace))
    exp = config.load_experiment(path, ["backend.kind=sim"])[0]
    d = tmp_path / placement
    summary = SimRun(exp, d).execute()
    return pd.read_parquet(d / "requests.parquet").set_index("id"), summary, exp, d


def compute_s(exp, acc, L, P):
    """T(L | P) / scale.time (docs/cache.md), from the profile alone."""
    prof = profiles.load(exp.model.profile)
    return deploy.compile(exp).scale.emulated_s(prof.t_prefill_cached(acc, L, P))


def test_a_cached_prefix_on_prfaas_is_continued_from_there_in_closed_form(tmp_path):
    # The first prompt (30K > threshold) prefills on PrfaaS and leaves its blocks and snapshots
    # (every 8 blocks) in the PrfaaS pool; the second shares its first 32 blocks (16Ki).
    first = list(range(59))
    second = list(range(32)) + list(range(1000, 1027))
    df, summary, exp, _ = run_trace(tmp_path, [(0, 30000, first), (30000, 30000, second)])
    a, b = df.loc[0], df.loc[1]
    assert a.route == b.route == "remote" and a.cached_len == 0
    assert b.lookup_prfaas == b.cached_len == b.planned_cached_len == 32 * 512
    assert b.cache_source == "prfaas" and b.cache_fetch_bytes > 0
    for r, P in ((a, 0), (b, 32 * 512)):
        assert r.prefill_end - r.prefill_start == pytest.approx(
            compute_s(exp, "h200", 30000, P), abs=1e-6)
    # the local pool holds the first prompt's KV (the decode instance stored what crossed the
    # WAN) but no snapshot: the decode side takes 32 blocks from it, the prefill ships less
    assert b.lookup_local == 0 and b.decode_cached_len == 32 * 512
    assert b.kv_bytes_sent < a.kv_bytes_sent
    assert summary["cache_hit_share"] == pytest.approx(32 * 512 / 60000)


def test_cache_aware_keeps_a_long_prompt_where_its_prefix_is(tmp_path):
    # A 19K prompt (under the threshold) leaves a 37-block prefix with a snapshot after its last
    # whole block in the local pool; a 22K prompt on it is 3K uncached: cache_aware prefills it
    # locally from the prefix (T_h20(22K | 18.5K) = 1.21 s < T_h200(22K) = 1.34 s, the rule's
    # PrfaaS alternative), least_loaded (threshold on the whole input) on PrfaaS from none.
    rows = [(0, 19000, list(range(38))), (30000, 22000, list(range(37)) + list(range(900, 906)))]
    aware, s_aware, exp, _ = run_trace(tmp_path, rows, "cache_aware")
    oblivious, s_obl, _, _ = run_trace(tmp_path, rows, "least_loaded")
    b = aware.loc[1]
    assert b.route == "local" and b.cached_len == b.lookup_local == 37 * 512
    assert b.prefill_end - b.prefill_start == pytest.approx(
        compute_s(exp, "h20", 22000, 37 * 512), abs=1e-6)
    assert oblivious.loc[1].route == "remote" and oblivious.loc[1].cached_len == 0
    assert s_aware["cache_hit_share"] > s_obl["cache_hit_share"] == 0


def test_prefix_cache_experiment_runs_and_the_pools_agree_with_the_records(tmp_path, capsys):
    out = tmp_path / "pc"
    assert cli.main(["run", str(ROOT / "experiments" / "prefix_cache.yaml"), "--backend", "sim",
                     "--set", "requests=80", "--out", str(out)]) == 0
    capsys.readouterr()
    for label in ("least_loaded", "cache_aware"):
        d = out / label
        s = json.loads((d / "summary.json").read_text())
        df = pd.read_parquet(d / "requests.parquet")
        assert s["completed"] == 80 and s["cache_hit_share"] > 0
        assert s["cache_hit_share"] == pytest.approx(df.cached_len.sum() / df.input_len.sum())
        pools = s["cache_pools"]
        # every byte the pools sent went to a prefill, a decode instance or a moving prefix
        assert sum(p.get("bytes_out", 0) for p in pools.values()) == \
            s["cache_fetch_bytes"] + s["prefix_transfer_bytes"]
        assert sum(p.get("pulled_bytes", 0) for p in pools.values()) == \
            s["prefix_transfer_bytes"]
        assert sum(p["lookups"] for p in pools.values()) == 2 * 80
        hits = df[df.cached_len > 0]
        for dc, route in (("prfaas", "remote"), ("local", "local")):
            assert (hits.route == route).sum() <= pools[f"pool_{dc}"]["fetches"]
    assert cli.main(["analyse", str(out / "cache_aware")]) == 0


def test_cached_placements_replay_and_a_tampered_one_is_reported(tmp_path):
    out = tmp_path / "pc"
    assert cli.main(["run", str(ROOT / "experiments" / "prefix_cache.yaml"), "--backend", "sim",
                     "--set", "requests=80",
                     "--set", "variants=[{label: cache_aware, scheduler.placement: cache_aware}]",
                     "--out", str(out)]) == 0
    recs = assert_decisions_replay(out)
    assert all(r.cache and r.cache["placement"] == "cache_aware" for r in recs)
    moved = [r for r in recs if r.cache["plan"] and r.cache["plan"][2]]
    hit = [r for r in recs if r.cache["plan"] and r.cache["plan"][1] > 0]
    assert moved and hit
    # What the pools answered decides: the same book with the prefix in no pool plans no hit.
    tampered = dataclasses.replace(hit[0], cache={**hit[0].cache, "view": [0, 0, 0, 0]})
    assert [m.id for m in replay(out, [tampered, *hit[1:]]).mismatches] == [hit[0].id]


def test_a_killed_prfaas_instance_s_requests_stay_next_to_their_pool(tmp_path):
    """tests/test_cache_root.py's failover run in the sim: two PrfaaS instances share the PrfaaS
    pool, rp0 is killed; its requests are re-dispatched to rp1 (the cluster they were placed
    in), none is lost, hits keep coming from the pools, and the placements replay."""
    path = cache_failover_experiment(tmp_path)
    d = tmp_path / "run"
    s = SimRun(config.load_experiment(path, ["backend.kind=sim"])[0], d).execute()
    df = pd.read_parquet(d / "requests.parquet")
    assert s["accounting"]["lost"] == 0 and (df.status == "ok").all() and len(df) == 24
    moves = [m for lst in df.redispatches for m in (lst if lst is not None else [])]
    assert moves and {(m["role"], m["from"], m["to"]) for m in moves} == {("prefill", "rp0",
                                                                           "rp1")}
    killed = min(t for t, k, _ in read_events(d / "events.csv") if k == "fault_inject")
    assert not ((df.prefill_instance == "rp0") & (df.send_time > killed)).any()
    assert s["cache_hit_share"] > 0 and (df[df.cached_len > 0].cache_fetch_bytes > 0).all()
    assert_decisions_replay(d)
