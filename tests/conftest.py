"""Test layout (pyroute2 habit): unit tests need nothing; tests marked `root` build real
namespaces and are skipped, with the reason, when not run as root."""

import os
import pathlib
import textwrap

import pytest
import yaml

from testbed.records import RunDir, read_decisions, read_records
from testbed.sim.replay import replay

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The smallest valid experiment; unit tests edit it with str.replace and write it to tmp_path.
SMALL_EXPERIMENT = textwrap.dedent("""\
    name: t
    requests: 10
    scale: {time: 10, bytes: 1e-3}
    clusters:
      prfaas: {instances: 1}
      local: {instances: 2, prefill: 1, decode: 1}
    network:
      wan: {rate: 100Gbit, delay: 5ms}
    workload:
      arrival: {process: poisson, rate: 1/s}
      input: {dist: fixed, tokens: 1Ki}
      output: {dist: fixed, tokens: 16}
    """)
TRACES = ROOT / "experiments" / "traces"   # vendored public traces


def assert_remote_kv_crossed_the_wan(df, summary):
    """What every finished run with remote prefill shows, whatever the backend: TTFT (client
    clock) includes the prefill (prefill worker's clock), and every KV byte a remote prefill
    sent crossed the shaped WAN: the kernel counted at least that many in the KV direction,
    plus headers and control traffic (within 15%). Returns the remote requests."""
    assert (df.ttft_ms > df.prefill_ms).all()
    remote = df[df.route == "remote"]
    assert len(remote) > 0
    sent = remote.kv_bytes_sent.sum()
    counted = summary["wan_bytes_measured"]
    assert sent <= counted <= 1.15 * sent, (sent, counted)
    return remote


def cache_failover_experiment(tmp_path):
    """tests/data/cache_tiny.yaml with two PrfaaS instances sharing the PrfaaS pool, failover
    on and rp0 killed at 3 s (one run: tests/test_cache_root.py, tests/test_sim_cache.py);
    the path of its YAML."""
    exp = yaml.safe_load((ROOT / "tests" / "data" / "cache_tiny.yaml").read_text())
    exp.pop("variants")
    exp["clusters"]["prfaas"]["instances"] = 2
    exp["scale"]["time"] = 5
    # Slow health checks: the requests placed on rp0 after the kill find it dead themselves.
    exp["scheduler"]["failover"] = {"enabled": True, "interval": "5s", "timeout": "1s"}
    exp["faults"] = [{"at": "3s", "kind": "kill", "target": "rp0"}]
    path = tmp_path / "cache_failover.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def assert_decisions_replay(run_dir):
    """What every run directory shows, whatever the backend: each request sent has its first
    routing decision in decisions.jsonl; the decision is what served the request by its own
    record (when it was not moved); and the simulator's decision path, a fresh router of the
    run set to each recorded book (testbed.sim.replay), decides every one the same. Returns
    the records."""
    d = RunDir(run_dir)
    recs = read_decisions(d.decisions)
    sent, done = read_records(d.records)
    assert len(recs) == len(sent) > 0 and {r.id for r in recs} == set(sent)
    for r in recs:
        rec = done.get(r.id)
        if rec is not None and rec.attempts == 1 and rec.route:
            assert (rec.route, rec.prefill_instance, rec.decode_instance) == \
                (r.kind, r.prefill, r.decode), r.id
    result = replay(d)
    assert result.decisions == len(recs) and result.mismatches == []
    return recs


def pytest_collection_modifyitems(config, items):
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (network namespaces, tc): run `sudo make test`")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def traces_dir():
    """The public traces vendored under experiments/traces/."""
    return TRACES


@pytest.fixture
def small_experiment():
    """SMALL_EXPERIMENT's YAML text."""
    return SMALL_EXPERIMENT
