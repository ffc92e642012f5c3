"""Clock offsets across hosts (testbed/clocks.py): the min-RTT estimator against synthetic
skews and asymmetric delays, the record metadata.json keeps, the correction analysis applies,
and the test-only skew's reach (a host's, never a run's)."""

import json
import pathlib
import random
import subprocess
import sys

import pytest

from testbed import clocks, tokentimes
from testbed.records import EventLog, RequestRecord, read_events, read_records

ROOT = str(pathlib.Path(__file__).resolve().parent.parent)


class FakeHost:
    """A host whose clock runs `skew` ahead; each call's legs take `out` and `back` seconds
    (plus jitter) on a simulated reference clock."""

    def __init__(self, skew, out, back, jitter=0.0, seed=1):
        self.skew, self.out, self.back, self.jitter = skew, out, back, jitter
        self.now = 1_000_000.0
        self.rng = random.Random(seed)

    def reference(self):
        return self.now

    def remote(self):
        self.now += self.out + self.rng.uniform(0, self.jitter)
        t = self.now + self.skew
        self.now += self.back + self.rng.uniform(0, self.jitter)
        return t


@pytest.mark.parametrize("skew, out, back", [(2.5, 0.0004, 0.0004), (-0.73, 0.002, 0.0001),
                                             (0.0, 0.0001, 0.003), (30.0, 0.01, 0.0)])
def test_estimate_recovers_the_skew_within_half_the_rtt(skew, out, back):
    host = FakeHost(skew, out, back, jitter=0.002)
    m = clocks.measure(host.remote, rounds=20, clock=host.reference)
    assert m["samples"] == 20
    assert abs(m["offset_s"] - skew) <= m["uncertainty_s"] + 1e-9
    assert m["uncertainty_s"] == pytest.approx(m["rtt_s"] / 2)
    # the asymmetry is the whole error: (out - back) / 2 for the best sample's legs
    assert m["rtt_s"] >= out + back - 1e-9
    assert m["rtt_median_s"] >= m["rtt_s"]


def test_estimate_takes_the_sample_with_the_smallest_rtt():
    s = [clocks.Sample(0.0, 10.6, 1.0), clocks.Sample(5.0, 15.051, 5.1),
         clocks.Sample(7.0, 17.4, 7.5)]
    m = clocks.estimate(s)
    assert m["rtt_s"] == pytest.approx(0.1)
    assert m["offset_s"] == pytest.approx(10.001)
    assert m["at"] == pytest.approx(5.05)
    with pytest.raises(ValueError):
        clocks.estimate([])


def test_combine_applies_the_mean_and_reports_the_drift():
    start = {"offset_s": 1.0, "uncertainty_s": 0.001}
    end = {"offset_s": 1.004, "uncertainty_s": 0.002}
    c = clocks.combine(start, end, injected_skew_s=1.0)
    assert c["offset_s"] == pytest.approx(1.002)
    assert c["drift_s"] == pytest.approx(0.004)
    assert c["uncertainty_s"] == pytest.approx(0.004)
    assert c["injected_skew_s"] == 1.0 and c["start"] is start and c["end"] is end
    only = clocks.combine(start)
    assert only["offset_s"] == 1.0 and only["drift_s"] is None
    assert "injected_skew_s" not in only


def _meta(prfaas_offset, client_offset=0.0):
    hosts = {"10.0.0.1": clocks.combine({"offset_s": client_offset, "uncertainty_s": 1e-4}),
             "10.0.0.2": clocks.combine({"offset_s": prfaas_offset, "uncertainty_s": 1e-4})}
    return {"reference": "orch", "hosts": hosts,
            "instances": {"client": "10.0.0.1", "scheduler": "10.0.0.1", "ld0": "10.0.0.1",
                          "rp0": "10.0.0.2"}}


def test_correct_records_moves_each_stamp_by_its_hosts_offset():
    raw = {"id": 1, "ev": "done", "send_time": 100.0, "first_token": 100.5, "last_token": 101.0,
           "prefill_instance": "rp0", "prefill_queued": 102.0, "prefill_start": 102.1,
           "prefill_end": 102.3, "send_start": 102.1, "send_end": 102.35,
           "decode_instance": "ld0", "kv_recv_start": 100.2, "kv_recv_end": 100.4,
           "decode_join": 100.41, "redispatches": [{"time": 100.05, "role": "prefill"}],
           **tokentimes.compact([100.45, 100.9], [[0, 100.5], [1, 101.0]])}
    rec = RequestRecord.from_line(json.loads(json.dumps(raw)))
    out = rec.on_reference_clock(clocks.instance_offsets(_meta(2.0)))
    assert out.prefill_start == pytest.approx(100.1)      # the PrfaaS host ran 2 s ahead
    assert out.send_end == pytest.approx(100.35)
    assert out.send_time == 100.0 and out.kv_recv_end == 100.4     # on the reference
    assert out.token_times == rec.token_times
    # now the phases are in order across hosts: prefill, KV arrival, first token
    assert out.send_time < out.prefill_start < out.prefill_end < out.kv_recv_end
    assert out.kv_recv_end < out.token_times[0] < out.first_token
    assert rec.prefill_start == 102.1            # the raw record is left as it was
    # the client's own differences (TTFT) are kept exactly when the client's host is off too
    moved = rec.on_reference_clock(clocks.instance_offsets(_meta(2.0, client_offset=-0.5)))
    assert moved.first_token - moved.send_time == rec.first_token - rec.send_time
    assert moved.redispatches[0]["time"] == pytest.approx(100.55)
    assert moved.client_times == [pytest.approx(t + 0.5) for t in rec.client_times]


def test_one_clock_is_zero_and_changes_nothing(tmp_path):
    meta = clocks.one_clock("box", ["client", "rp0"])
    assert clocks.instance_offsets(meta) == {"client": 0.0, "rp0": 0.0}
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"ev": "done", "id": 1, "send_time": 1.0,
                                "prefill_instance": "rp0", "prefill_start": 2.0}) + "\n")
    raw = read_records(path)
    assert read_records(path, meta) == raw
    assert raw[1][1].send_time == 1.0 and raw[1][1].prefill_start == 2.0
    assert clocks.warnings(meta) == []


def test_the_test_skew_belongs_to_a_host_and_is_on_record():
    assert clocks.test_skew_s({}) == 0.0
    assert clocks.test_skew_s({clocks.SKEW_ENV: "1.5"}) == 1.5
    with pytest.raises(ValueError, match=clocks.SKEW_ENV):
        clocks.test_skew_s({clocks.SKEW_ENV: "soon"})
    # the orchestrator's setting never reaches a worker; the node's own does
    env = {"PATH": "/bin", clocks.SKEW_ENV: "9"}
    assert clocks.SKEW_ENV not in clocks.worker_env(env, node_environ={})
    assert clocks.worker_env(env, node_environ={clocks.SKEW_ENV: "2"})[clocks.SKEW_ENV] == "2"
    meta = _meta(2.0)
    meta["hosts"]["10.0.0.2"]["injected_skew_s"] = 2.0
    assert "test-only clock skew" in clocks.warnings(meta)[0]


def test_a_worker_process_runs_its_clock_skewed_only_with_the_env():
    code = ("import time; t = time.time(); import workers; "
            "print(time.time() - t)")
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert abs(float(plain.stdout)) < 1.0
    skewed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin",
                                             clocks.SKEW_ENV: "100"})
    assert 99.0 < float(skewed.stdout) < 101.0


def test_worker_event_rows_say_who_wrote_them_and_are_read_on_the_reference_clock(tmp_path):
    path = tmp_path / "events.csv"
    runner = EventLog(path)
    runner("fault_inject", fault=0, occurrence=0)
    EventLog(path, fresh=False, by="rp0")("kv_discarded", id=3)
    runner.close()
    raw = read_events(path)
    assert [f.get("by") for _, _, f in raw] == [None, "rp0"]
    raw, fixed = ({k: t for t, k, _ in rows} for rows in (raw, read_events(path, _meta(2.0))))
    assert fixed["fault_inject"] == raw["fault_inject"]      # the runner's own: as it was
    assert fixed["kv_discarded"] == pytest.approx(raw["kv_discarded"] - 2.0)   # 2 s ahead
