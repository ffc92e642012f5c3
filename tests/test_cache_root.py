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
