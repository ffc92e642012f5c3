"""The `faults:` section (no root): what is accepted, what exits 2 before anything is built, how
targets resolve, what a link fault restores, and the accounting of a run's records."""

import math
import types

import pandas as pd
import pytest

from testbed import deploy, faults, faultspec, plot
from testbed.config import load_experiment
from testbed.errors import ConfigError

TWO_RP = "clusters: {prfaas: {instances: 2}, local: {instances: 2, prefill: 1, decode: 1}}\n"


def load(tmp_path, small_experiment, faults_yaml, extra=""):
    text = small_experiment.replace("requests: 10", "requests: 60") + extra + \
        f"faults: {faults_yaml}\n"
    p = tmp_path / "e.yaml"
    p.write_text(text)
    exp = load_experiment(p)[0]
    deploy.compile(exp, p)      # as the runner does: fault targets are the deployment's
    return exp


@pytest.mark.parametrize("spec, key, words", [
    ("[{at: 3s, kind: pause, target: rp9, duration: 2s}]", "faults[0].target", "unknown target"),
    ("[{at: 3s, kind: pause, target: rp0}]", "faults[0]", "needs 'duration'"),
    ("[{at: 3s, kind: kill, target: rp0, duration: 3s}]", "faults[0]", "takes no 'duration'"),
    ("[{at: 3s, kind: pause, target: rp0, duration: 5s}, {at: 4s, kind: slow, target: rp0, "
     "factor: 2, duration: 1s}]", "faults[1]", "overlaps faults[0]"),
    ("[{at: 3s, kind: kill, target: ld0}, {at: 9s, kind: restart, target: ld0, after: 1s}]",
     "faults[1]", "already killed"),
    ("[{at: 3s, kind: pause, target: local, duration: 5s}, {at: 4s, kind: kill, target: lp0}]",
     "faults[1]", "overlaps"),
    ("[{at: 9999s, kind: kill, target: rp0}]", "faults[0].at", "past the run's expected end"),
    ("[{at: 3s, kind: link, up: false, duration: 5s}, {at: 4s, kind: link, direction: kv, "
     "up: true, duration: 1s}]", "faults[1]", "sets up"),
    ("[{at: 3s, kind: slow, target: rp0, factor: 0.5, duration: 1s}]", "faults[0]", "> 1"),
    ("[{every: 5s, kind: pause, target: rp0, duration: 1s}]", "faults[0]", "'count'"),
    ("[{at: 3s, kind: flap, down_for: 1s, duration: 5s}]", "faults[0]", "needs 'down_for'"),
    ("[{at: 3s, kind: flap, down_for: 2s, up_for: 1s, duration: 1s}]", "faults[0]",
     "'duration' >= 'down_for'"),
    ("[{at: 3s, kind: reset, target: rp0}]", "faults[0]", "takes no 'target'"),
    ("[{at: 3s, kind: reject, up: false}]", "faults[0]", "takes no 'up'"),
    ("[{at: 3s, kind: blackhole, duration: 5s}, {at: 4s, kind: reject, direction: kv, "
     "duration: 1s}]", "faults[1]", "sets event"),
    ("[{at: 3s, kind: flap, down_for: 1s, up_for: 1s, duration: 6s}, {at: 4s, kind: link, "
     "up: false, duration: 1s}]", "faults[1]", "sets up"),
])
def test_bad_fault_specs_exit_2_naming_the_key(tmp_path, small_experiment, spec, key, words):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, small_experiment, spec)
    msg = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in msg
    assert f"{key}:" in msg and words in msg and "e.yaml" in msg


def test_link_fault_against_a_wan_change_of_the_same_key(tmp_path, small_experiment):
    extra = "network:\n  wan: {rate: 100Gbit, delay: 5ms, changes: [{at: 5s, up: true}]}\n"
    text = small_experiment.replace("network:\n  wan: {rate: 100Gbit, delay: 5ms}\n", "")
    with pytest.raises(ConfigError, match="network.wan.changes"):
        load(tmp_path, text, "[{at: 3s, kind: link, up: false, duration: 5s}]", extra)


def test_targets_groups_and_seeded_random(tmp_path, small_experiment):
    text = small_experiment.replace(
        "clusters:\n  prfaas: {instances: 1}\n  local: {instances: 2, prefill: 1, decode: 1}\n",
        TWO_RP)
    exp = load(tmp_path, text, "[{at: 2s, kind: pause, target: prfaas, duration: 1s}, "
               "{at: 4s, kind: kill, target: decode}, "
               "{every: 5s, count: 4, kind: pause, target: random(prfaas), duration: 1s}]")
    instances = deploy.compile(exp).instances
    occ = faultspec.resolve(exp, instances)
    assert occ[0].targets == ("rp0", "rp1") and occ[1].targets == ("ld0",)
    assert math.isinf(occ[1].end_s)
    rand = [o for o in occ if o.index == 2]
    assert [o.at_s for o in rand] == [5, 10, 15, 20]
    assert {o.targets[0] for o in rand} <= {"rp0", "rp1"}
    assert [o.targets for o in faultspec.resolve(exp, instances)] == [o.targets for o in occ]


def test_link_fault_restores_what_was_in_force(tmp_path, small_experiment):
    extra = "network:\n  wan: {rate: 100Gbit, delay: 5ms, changes: [{at: 1s, rate: 50Gbit}]}\n"
    text = small_experiment.replace("network:\n  wan: {rate: 100Gbit, delay: 5ms}\n", "")
    exp = load(tmp_path, text, "[{at: 3s, kind: link, direction: kv, rate: 10Gbit, loss: 1%, "
               "duration: 5s}]", extra)
    items = [c.item() for c in deploy.compile(exp).link_changes if c.source == "fault"]
    (t1, d1, ch1, n1), (t2, d2, ch2, n2) = items
    s = exp.scale
    assert (t1, d1, n1["phase"]) == (3 / s.time, "kv", "inject")
    assert ch1 == {"rate": 10e9 * s.bytes * s.time, "loss": 0.01}
    # Back to the rate of the earlier change (not the configured one) and no loss.
    assert (t2, d2, n2["phase"]) == (8 / s.time, "kv", "end")
    assert ch2 == {"rate": 50e9 * s.bytes * s.time, "loss": 0.0}


def test_accounting_tells_failed_from_lost():
    df = pd.DataFrame({
        "status": ["ok", "failed", "failed", "failed"],
        "error": ["", "decode ld0 failed (UNAVAILABLE) after 3 tokens",
                  "no reply recorded before the run ended", "never sent (the run ended first)"],
        "send_time": [1.0, 2.0, 3.0, None]})
    assert faults.accounting(df) == {"requests": 4, "sent": 3, "completed": 1, "failed": 1,
                                     "lost": 2}


def test_flap_and_events_on_the_link_schedule(tmp_path, small_experiment):
    exp = load(tmp_path, small_experiment, "[{at: 3s, kind: flap, down_for: 1s, up_for: 2s, "
               "duration: 5s}, {at: 10s, kind: reject, direction: kv, duration: 2s}, "
               "{at: 14s, kind: reset}]")
    s = exp.scale
    items = [c.item() for c in deploy.compile(exp).link_changes]
    ups = [(round(t * s.time, 6), ch["up"]) for t, _, ch, *_ in items if "up" in ch]
    # down 3-4 s, up, down 6-7 s, up, then the end of the fault restores both directions
    assert ups == [(3, False), (4, True), (6, False), (7, True), (8, True), (8, True)]
    events = [(round(t * s.time, 6), d, ch["event"]) for t, d, ch, *_ in items
              if "event" in ch]
    assert events == [(10, "kv", "reject"), (12, "kv", None), (14, None, "reset"),
                      (14 + faultspec.RESET_WINDOW_S, None, None)]
    assert all(ch["port"] == 50052 for _, _, ch, *_ in items if ch.get("event"))


def test_conformance_table_and_heatmap_from_the_runs_summaries(tmp_path):
    def exp(case, fl, fo):
        return types.SimpleNamespace(label=f"{case},enabled={fo}", faults=fl,
                                     scheduler=types.SimpleNamespace(
                                         policy="prfaas", failover=types.SimpleNamespace(
                                             enabled=fo)))
    runs, sums = [], []
    for case, fl in (("none", []), ("reset", [faultspec.FaultSpec(kind="reset", at=3.0)])):
        for fo in (False, True):
            runs.append(exp(case, fl, fo))
            s = {"accounting": {"completed": 20, "failed": 4 * len(fl), "lost": 0},
                 "p90_ttft_ms": 1000.0 + 500 * len(fl), "kv_retries": 3, "kv_reprefills": 1}
            if fl:
                s["faults"] = [{"kind": "reset", "hung": 0, "unfinished_after_end_s": 2.5,
                                "success_after_end_s": 0.3, "failed_after_end": 0}]
            sums.append(s)
    faults.write_matrix(tmp_path, runs, sums)
    m = pd.read_csv(tmp_path / "conformance.csv")
    assert list(m.columns) == faults.CONFORMANCE_COLUMNS
    assert m.p90_inflation.tolist() == [1.0, 1.0, 1.5, 1.5]
    assert m.success_after_end_s.tolist()[2:] == [0.3, 0.3]
    assert "| reset | prfaas | True | 20 | 4 | 0 | 0 | 2.5 |" in (
        tmp_path / "conformance.md").read_text()
    assert plot.conformance_heatmap(tmp_path, tmp_path / "figures").exists()
