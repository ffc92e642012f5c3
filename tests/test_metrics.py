"""Analyse: metric definitions on hand-made records (no root)."""

import json

import numpy as np
import pandas as pd
import pytest

from testbed import analysis, config, metrics
from testbed.records import RequestRecord, SentRecord, read_records
from testbed.rundir import RunInfo
from testbed.scale import Scale

QUICK = "experiments/quickstart.yaml"


@pytest.fixture
def exp():
    return config.load_experiment(QUICK)[2]          # prfaas, scale.time = 10


def workload(n):
    return pd.DataFrame({"id": np.arange(n), "arrival_s": np.arange(n, dtype=float),
                         "input_len": [1000] * n, "output_len": [5] * n})


def done(rid, send, first, last, n=5, route="remote", kv=1000, status="ok"):
    return RequestRecord.from_line({
            "ev": "done", "id": rid, "send_time": send, "first_token": first, "last_token": last,
            "n_tokens": n, "status": status, "error": "" if status == "ok" else "boom",
            "route": route, "kv_bytes": kv, "kv_bytes_sent": kv, "prefill_start": send + 0.01,
            "prefill_end": send + 0.05, "kv_recv_start": send + 0.02, "kv_recv_end": send + 0.06,
            "token_times": list(np.linspace(first, last, n))})


def sent_record(rid, send, lateness_s=None):
    return SentRecord(id=rid, send_time=send, scheduled=None, lateness_s=lateness_s)


def test_ttft_tpot_e2el_follow_vllm_definitions(exp):
    sent = {0: sent_record(0, 100.0, lateness_s=0.001)}
    d = {0: done(0, 100.0, 100.2, 100.6)}
    df = metrics.build_requests(workload(1), sent, d, scale=Scale(10, 1e-3))
    r = df.iloc[0]
    assert r.ttft_ms == pytest.approx(2000.0)                 # 0.2 s emulated x 10
    assert r.e2el_ms == pytest.approx(6000.0)
    assert r.tpot_ms == pytest.approx((6000 - 2000) / 4)      # (E2EL - TTFT) / (n - 1)
    assert r.mean_itl_ms == pytest.approx(1000.0)
    assert r.prefill_ms == pytest.approx(400.0)


def test_missing_requests_are_kept_as_failed(exp):
    sent = {0: sent_record(0, 1.0), 1: sent_record(1, 2.0)}
    d = {0: done(0, 1.0, 1.1, 1.2)}
    df = metrics.build_requests(workload(3), sent, d, scale=Scale(10, 1e-3))
    assert list(df.status) == ["ok", "failed", "failed"]
    assert "no reply" in df.error[1] and "never sent" in df.error[2]


def test_request_table_is_the_table_of_its_rows():
    """build_requests collects columns, not row dicts (memory): the table is still the one
    pandas makes of the rows, column order and NaN for a key a row lacks included."""
    sent = {0: sent_record(0, 1.0), 2: sent_record(2, 3.0, lateness_s=0.5)}
    d = {2: done(2, 3.0, 3.1, 3.2), 3: done(3, 4.0, 4.1, 4.2)}
    d[3].extra = {"later": "x"}
    df = metrics.build_requests(workload(5), sent, d, scale=Scale(10, 1e-3))
    rows = [{"id": 0, "arrival_s": 0.0, "input_len": 1000, "output_len": 5, "send_time": 1.0,
             "status": "failed", "error": "no reply recorded before the run ended",
             "lateness_s": None}]
    rows += [{"id": i, "arrival_s": float(i), "input_len": 1000, "output_len": 5,
              "status": "failed", "error": "never sent (the run ended first)"} for i in (1, 4)]
    rows.insert(2, {"id": 2, "arrival_s": 2.0, "input_len": 1000, "output_len": 5,
                    **d[2].columns(), "lateness_s": 0.5})
    rows.insert(3, {"id": 3, "arrival_s": 3.0, "input_len": 1000, "output_len": 5,
                    **d[3].columns()})
    want = pd.DataFrame(rows)
    assert list(df.columns[:len(want.columns)]) == list(want.columns)
    assert df.later.isna().tolist() == [True, True, True, False, True]
    assert df.route.isna().tolist() == want.route.isna().tolist()
    assert [type(x) for x in df.route] == [type(x) for x in want.route]
    assert df.lateness_s.tolist()[2] == 0.5 and np.isnan(df.lateness_s[3])


def test_summary(exp):
    d = {i: done(i, 10.0 + i, 10.0 + i + 0.1 * (i + 1), 10.0 + i + 1.0,
                 route="remote" if i % 2 else "local") for i in range(4)}
    d[3].status = "failed"
    sent = {i: sent_record(i, 10.0 + i) for i in range(4)}
    df = metrics.build_requests(workload(4), sent, d, scale=Scale(10, 1e-3))
    ts = pd.DataFrame({"time": [9.0, 11.0, 13.0, 15.0], "kv_tx_bytes": [0, 1000, 3000, 4000],
                       "request_tx_bytes": [0, 10, 20, 30]})
    s = metrics.summarize(df, RunInfo.of(exp), ts)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["mean_ttft_ms"] == pytest.approx(np.mean([1000, 2000, 3000]))
    assert s["median_ttft_ms"] == pytest.approx(2000)
    assert s["duration_s"] == pytest.approx((13.0 - 10.0) * 10)
    assert s["request_throughput"] == pytest.approx(3 / 30.0)
    assert s["offload_fraction"] == pytest.approx(0.5)
    # Kernel counters between the first send (t=10 -> sample 9) and last completion (13).
    assert s["wan_bytes_measured"] == 3000
    real_gbps = 3000 * 8 / (13.0 - 9.0) / (1e-3 * 10) / 1e9
    assert s["egress_mean_gbps"] == pytest.approx(real_gbps)
    assert s["kv_bytes_sent_remote"] == 2000
    json.dumps(s)          # summary.json must serialise


def test_records_survive_a_cut_line(tmp_path):
    p = tmp_path / "requests.jsonl"
    p.write_text(json.dumps({"ev": "sent", "id": 0, "send_time": 1.0}) + "\n"
                 + '{"ev":"done","id":0,"sta')
    sent, d = read_records(p)
    assert 0 in sent and not d


def test_table_prints_every_run(exp):
    s = {"label": "prfaas", "completed": 3, "failed": 0, "request_throughput": 1.0,
         "mean_ttft_ms": 10.0, "prediction": {"lambda_max": 1.5}}
    out = analysis.table([s, dict(s, label="naive", prediction=None)])
    assert "prfaas" in out and "naive" in out and "1.500" in out


def test_tokens_table_has_both_clocks(exp):
    d = done(0, 100.0, 100.2, 100.6)
    d.client_times = [100.2, 100.45, 100.45, 100.45, 100.6]
    df = metrics.build_requests(workload(1), {}, {0: d}, scale=Scale(10, 1e-3))
    t = metrics.tokens_table(df, Scale(10, 1e-3))
    assert list(t["index"]) == [0, 1, 2, 3, 4]
    assert t.itl_decode_ms.iloc[1:].tolist() == pytest.approx([1000.0] * 4)
    assert t.itl_client_ms.iloc[1:].tolist() == pytest.approx([2500.0, 0.0, 0.0, 1500.0])


def test_goodput_follows_vllm_definition(exp):
    """vllm bench serve --goodput: good = completed and within every objective; goodput = good
    requests / benchmark duration; a failed request is never good."""
    import dataclasses

    d = {i: done(i, 10.0 + i, 10.0 + i + 0.1 * (i + 1), 10.0 + i + 1.0) for i in range(4)}
    d[3].status = "failed"
    sent = {i: sent_record(i, 10.0 + i) for i in range(4)}
    df = metrics.build_requests(workload(4), sent, d, scale=Scale(10, 1e-3))
    # TTFT 1000, 2000, 3000 ms; TPOT (10000 - TTFT) / 4 = 2250, 2000, 1750 ms; span 30 s.
    both = dataclasses.replace(exp, slo=config.SloSpec(ttft=2.5, tpot=2.1))
    s = metrics.summarize(df, RunInfo.of(both))
    assert s["slo"]["good"] == 1                               # only request 1 meets both
    assert s["request_goodput"] == pytest.approx(1 / 30.0)
    assert s["slo"]["attainment"] == pytest.approx({"ttft": 2 / 3, "tpot": 2 / 3, "all": 1 / 3})
    assert s["slo"]["attainment_of_sent"] == pytest.approx(1 / 4)
    assert list(metrics.meets_slo(df, both.slo.objectives_ms())) == [False, True, False, False]
    assert metrics.summarize(df, RunInfo.of(exp))["request_goodput"] is None   # no objectives: no goodput
    assert "goodput" in analysis.table([s]) and "0.033" in analysis.table([s])


def test_slo_keys_parse_real_world_durations(tmp_path, small_experiment):
    p = tmp_path / "e.yaml"
    p.write_text(small_experiment + "slo: {ttft: 10s, tpot: 25ms}\n")
    (e,) = config.load_experiment(p)
    assert e.slo.objectives_ms() == {"ttft": 10000.0, "tpot": 25.0}
    p.write_text(small_experiment + "slo: {ttft: -1s}\n")
    with pytest.raises(config.ConfigError):
        config.load_experiment(p)


def test_decode_steps_rebuilt_from_token_stamps(exp):
    """Steps are the shared time stamps of an instance's tokens; a step's measured time counts
    only when a request continued from the previous step (no idle gap)."""
    from testbed.profile import DecodeModel

    model = DecodeModel(step_s=0.025, bs_max=20, base=0.5, per_request=0.3, context=0.2,
                        reference_context=1000)
    d = {0: done(0, 0.0, 1.0, 1.3, n=4), 1: done(1, 0.0, 1.1, 1.2, n=2),
         2: done(2, 0.0, 5.0, 5.1, n=2)}
    d[0].token_times = [1.0, 1.1, 1.2, 1.3]
    d[1].token_times = [1.1, 1.2]
    d[2].token_times = [5.0, 5.1]
    for r in d.values():
        r.decode_instance = "ld0"
    df = metrics.build_requests(workload(3), {}, d, scale=Scale(10, 1e-3))
    steps = metrics.decode_steps(df, model, scale=Scale(10, 1e-3))
    assert list(steps.batch) == [1, 2, 2, 1, 1, 1]
    # 1.0 and 5.0 start after idle: not measured. The others are 0.1 s emulated = 1000 ms.
    assert steps.measured_ms.isna().tolist() == [True, False, False, False, True, False]
    assert steps.measured_ms.dropna().tolist() == pytest.approx([1000.0] * 4)
    # The step at 1.1 ran two requests holding 1001 + 1000 tokens before it.
    assert steps.expected_ms[1] == pytest.approx(model.step_time(2, 2001) * 1e3)


def test_a_pilot_steps_fast_tail_is_left_out_of_the_step_ratio(exp):
    """After a `pilot_tail` event (testbed/inject.py `fast_tail`) an instance's steps are not
    the emulated system's: left out as a fault's are."""
    from testbed.profile import DecodeModel
    from testbed.records import Event
    model = DecodeModel(step_s=0.025, bs_max=20, base=0.5, per_request=0.3, context=0.2,
                        reference_context=1000)
    d = {0: done(0, 0.0, 1.0, 1.3, n=4), 1: done(1, 0.0, 1.0, 1.2, n=3)}
    d[0].token_times, d[1].token_times = [1.0, 1.1, 1.2, 1.3], [1.0, 1.1, 1.2]
    d[0].decode_instance, d[1].decode_instance = "ld0", "ld1"
    scale = Scale(10, 1e-3)
    steps = metrics.decode_steps(metrics.build_requests(workload(2), {}, d, scale=scale), model,
                                 scale=scale)
    tail = [Event(1.15, "pilot_tail", {"fault": "pilot_tail", "occurrence": "0",
                                       "fault_kind": "slow", "target": "ld0,ld1"})]
    out = metrics._in_instance_faults(steps, tail, scale)
    assert out.tolist() == (steps.time > 1.15).tolist() and out.sum() == 3


def test_decode_model_full_batch_at_reference_is_t_decode():
    from testbed import profile

    m = profile.load("kimi-linear-1t").decode
    assert m.step_time(m.bs_max, m.bs_max * m.reference_context) == pytest.approx(m.step_s)
    assert m.step_time(1, 1000) < m.step_s < m.step_time(m.bs_max, m.bs_max * 128_000)
    assert m.constant().step_time(1, 0) == m.step_s


def test_role_conversions_are_counted_from_events_in_real_world_seconds(tmp_path):
    from testbed import rundir
    from testbed.scale import Scale
    (tmp_path / "events.csv").write_text(
        "time,kind,detail\n"
        "1.0,role,instance=lp0 state=draining from=prefill to=decode\n"
        "2.0,role,instance=lp0 state=done from=prefill to=decode drain_s=0.1000 convert_s=0.0500\n"
        "3.0,role,instance=lp1 state=failed from=prefill to=decode reason=x\n"
        "4.0,role,instance=ld0 state=done from=decode to=prefill drain_s=0.3000 convert_s=0.0500\n")
    r = metrics.role_conversions(rundir.read_events(rundir.RunDir(tmp_path).events),
                                 Scale(time=10))
    assert r == {"done": 2, "failed": 1, "to_decode": 1, "to_prefill": 1,
                 "drain_s_median": pytest.approx(2.0), "convert_s_median": pytest.approx(0.5)}
