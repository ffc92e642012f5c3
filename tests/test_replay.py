"""One decision code path (issue 25): the routing decisions a run recorded (decisions.jsonl, the
book each one read) replayed through the simulator's decision path (testbed/sim/replay.py) come
out the same, and a record that was tampered with does not. No root, seconds; the emulated
runs' replay is in the root tests (test_run_root.py, test_faults_root.py, test_roles_root.py)."""

import dataclasses

import pytest

from conftest import ROOT, assert_decisions_replay
from testbed import config
from testbed.records import RunDir, read_decisions
from testbed.sim.replay import replay
from testbed.sim.run import SimRun

QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory):
    """quickstart's three policies (homogeneous, naive, prfaas) in the sim, loaded (3 req/s,
    200 requests), so the book varies: {label: run directory}."""
    top = tmp_path_factory.mktemp("replay")
    out = {}
    for exp in config.load_experiment(QUICKSTART, ["requests=200", "workload.arrival.rate=3/s",
                                                   "backend.kind=sim"]):
        SimRun(exp, top / exp.label).execute()
        out[exp.label] = top / exp.label
    return out


def test_every_sim_decision_replays_the_same(quickstart_runs, capsys):
    assert set(quickstart_runs) == {"homogeneous", "naive", "prfaas"}
    for label, d in quickstart_runs.items():
        recs = assert_decisions_replay(d)
        assert len(recs) == 200 and {r.policy for r in recs} == {label}
        # The book varied: work queued on more than one instance, and the least loaded one
        # changed from decision to decision (more than one prefill and decode instance chosen).
        assert sum(len(r.outstanding_s) > 1 for r in recs) > 50, label
        assert len({r.prefill for r in recs}) > 1 and len({r.decode for r in recs}) > 1, label
        with capsys.disabled():
            print(f"\nreplay {label}: {len(recs)} decisions, "
                  f"{len({r.prefill for r in recs})} prefill instances chosen, 0 mismatches")
    kinds = {r.kind for r in read_decisions(RunDir(quickstart_runs["prfaas"]).decisions)}
    assert kinds == {"local", "remote"}         # the threshold split the requests


def _tampered(recs, i, **changes):
    return [dataclasses.replace(r, **changes) if k == i else r for k, r in enumerate(recs)]


def test_a_tampered_record_is_detected(quickstart_runs):
    """A record whose choice, book or threshold was changed replays differently: exactly that
    decision is reported."""
    d = quickstart_runs["prfaas"]
    recs = read_decisions(RunDir(d).decisions)
    assert replay(d, recs).mismatches == []
    # a remote decision made while both PrfaaS instances had work queued
    i, rec = next((k, r) for k, r in enumerate(recs) if r.kind == "remote"
                  and {"rp0", "rp1"} <= set(r.outstanding_s))
    other = ({"rp0", "rp1"} - {rec.prefill}).pop()
    cases = {
        "choice": _tampered(recs, i, prefill=other),
        # the chosen instance's queue made the longest: the other one is the least loaded
        "book": _tampered(recs, i, outstanding_s={**rec.outstanding_s,
                                                  rec.prefill: rec.outstanding_s[other] + 1}),
        # the threshold at the request's length: it is no longer longer than it
        "threshold": _tampered(recs, i, threshold=rec.uncached_len),
        "policy": _tampered(recs, i, policy="homogeneous"),
    }
    for what, tampered in cases.items():
        out = replay(d, tampered)
        assert out.decisions == 200 and [m.id for m in out.mismatches] == [rec.id], what
    m = replay(d, cases["threshold"]).mismatches[0]
    assert m.recorded[1] == "remote" and m.replayed[1] == "local"
