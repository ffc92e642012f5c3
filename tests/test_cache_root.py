"""The prefix cache pool end to end over the emulated network (root): measured facts only.

tests/data/cache_tiny.yaml runs the same requests without a cache and with the pools and
cache-aware placement. Asserted: requests really continued from cached prefixes (prefill
workers report what they fetched), fewer bytes crossed the WAN router than without a cache
(kernel counters), and the prefix blocks moved pool -> pool were counted by the kernel on the
router's egress in their direction.
"""

import json
import pathlib
import subprocess
import sys

import pandas as pd
import pytest

from conftest import assert_decisions_replay, cache_failover_experiment
from tests.test_run_root import leftovers

pytestmark = [pytest.mark.root, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHED = ROOT / "tests" / "data" / "cache_tiny.yaml"


def test_cached_run_measured_facts(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(CACHED), "--out",
                        str(out), "--no-progress", "--no-probe"],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    s = {v: json.loads((out / v / "summary.json").read_text()) for v in ("no-cache",
                                                                          "cache_aware")}
    df = pd.read_parquet(out / "cache_aware" / "requests.parquet")
    assert (df.status == "ok").all(), df[df.status != "ok"].error.tolist()
    hit = df[df.cached_len > 0]
    assert s["cache_aware"]["cache_hit_share"] > 0.1 and len(hit) > 0
    # A hit was really fetched from the pool: the MLA KV of its blocks plus one snapshot.
    assert (hit.cache_fetch_bytes > 0).all()
    assert (hit.cached_len % 512 == 0).all() and (hit.cached_len < hit.input_len).all()
    assert s["no-cache"]["cache_hit_share"] == 0
    # The kernel counted fewer KV-direction bytes on the WAN router with the cache.
    assert s["cache_aware"]["wan_bytes_measured"] < s["no-cache"]["wan_bytes_measured"]
    # Prefix blocks moved PrfaaS pool -> local pool crossed the KV direction with the remote
    # prefills' KV; the kernel counted at least their sum.
    moved = df[(df.cache_source == "transfer") | (df.prefix_transfer_bytes > 0)]
    assert s["cache_aware"]["prefix_transfer_bytes"] > 0 and len(moved) > 0
    to_local = int(df.prefix_transfer_bytes[df.route == "local"].fillna(0).sum())
    to_remote = int(df.prefix_transfer_bytes[df.route == "remote"].fillna(0).sum())
    kv_remote = int(df.kv_bytes_sent[df.route == "remote"].fillna(0).sum())
    assert s["cache_aware"]["wan_bytes_measured"] >= kv_remote + to_local
    assert s["cache_aware"]["request_bytes_measured"] >= to_remote
    pools = s["cache_aware"]["cache_pools"]
    assert pools["pool_local"]["bytes_in"] > 0 and pools["pool_prfaas"]["bytes_in"] > 0
    # Each placement is in decisions.jsonl with what the pools answered; the simulator's
    # placement (workers.placement.CachePlacer.choose on the recorded book) decides the same.
    recs = assert_decisions_replay(out / "cache_aware")
    assert any(r.cache["plan"] and r.cache["plan"][2] for r in recs)    # a prefix move
    assert any(max(r.cache["view"]) > 0 for r in recs)


def test_cache_aware_failover_redispatches_within_the_placed_cluster(tmp_path):
    """Two PrfaaS prefill instances share the PrfaaS pool; rp0 is killed mid-run. With failover,
    its requests are re-dispatched to rp1 (same cluster, the pool that holds their prefixes),
    none is lost, and hits keep coming from the pools after the kill."""
    path = cache_failover_experiment(tmp_path)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "run", str(path), "--out",
                        str(out), "--no-progress", "--no-probe"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    df = pd.read_parquet(out / "requests.parquet")
    assert s["accounting"]["lost"] == 0 and s["accounting"]["sent"] == len(df)
    assert (df.status == "ok").all(), df[df.status != "ok"].error.tolist()
    moves = [m for lst in df.redispatches for m in (lst if lst is not None else [])]
    prefill_moves = [m for m in moves if m["role"] == "prefill"]
    assert prefill_moves, "rp0's requests were not re-dispatched"
    # rp1 was up the whole run: every prefill re-dispatch stayed on PrfaaS, next to its pool.
    assert {m["to"] for m in prefill_moves} == {"rp1"}, prefill_moves
    events = pd.read_csv(out / "events.csv")
    killed = float(events.time[events.kind == "fault_inject"].iloc[0])
    assert not ((df.prefill_instance == "rp0") & (df.send_time > killed)).any()
    assert s["cache_hit_share"] > 0 and (df[df.cached_len > 0].cache_fetch_bytes > 0).all()
    assert_decisions_replay(out)        # the placements replay; re-dispatches are not recorded
    assert leftovers(out) == []          # the pools' processes too
