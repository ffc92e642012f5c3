"""The TTFT decomposition (testbed/excess.py) on synthetic stamps (no root): queueing the
emulated system would have is no excess, lateness is counted once, in its leg, real-world."""

import pandas as pd
import pytest

from testbed import config, deploy, excess
from testbed.rundir import RunInfo

QUICK = "experiments/quickstart.yaml"


@pytest.fixture
def run():
    return RunInfo.of(config.load_experiment(QUICK)[2])   # prfaas at scale.time 10


def _request(rid, links, t0, *, route="remote", prefill="p0", queue=0.0, late=None,
             held=None, step=0.01, model=0.1):
    """Stamps (emulated s) of one request that took exactly what the model allows, plus the
    `late` seconds given per leg."""
    late = late or {}
    one_way = links["request"].delay_s if route == "remote" else 0.0
    rtt = links["kv"].delay_s + links["request"].delay_s
    t = {"send_time": t0}
    t["sched_received"] = t0 + late.get("send", 0.0)
    t["prefill_queued"] = t["sched_received"] + one_way + late.get("route", 0.0)
    t["prefill_start"] = t["prefill_queued"] + queue + late.get("prefill_queue", 0.0)
    t["prefill_end"] = t["prefill_start"] + model + late.get("prefill", 0.0)
    # the bytes were sent while it computed: the last one arrives a round trip after the end
    t["kv_recv_end"] = t["prefill_end"] + rtt + late.get("kv_transfer", 0.0)
    wait = step + late.get("decode_admission", 0.0) + (held or 0.0)   # a whole step in progress
    t["decode_join"] = t["kv_recv_end"] + wait
    first = t["decode_join"] + step + late.get("first_step", 0.0)
    t["first_token"] = first + late.get("delivery", 0.0)
    return {"id": rid, "status": "ok", "route": route, "prefill_instance": prefill,
            "send_start": t["prefill_start"], "send_end": t["prefill_end"], "kv_bytes": 1000,
            "prefill_model_s": model, "first_step_s": step, "token_times": [first],
            "decode_held": (t["kv_recv_end"] + step + late.get("decode_admission", 0.0)
                            if held else None),
            "ttft_ms": (t["first_token"] - t0) * 1e4, **t}       # x 10 x 1e3: real-world ms


def _decompose(run, rows):
    links = deploy.compile(run.experiment).links
    return excess.decompose(pd.DataFrame(rows), run, None, links)


def test_a_faithful_run_with_queues_has_no_excess(run):
    links = deploy.compile(run.experiment).links
    rows = [_request(0, links, 0.0),
            _request(1, links, 0.01, queue=0.09),                 # behind request 0 on p0
            _request(2, links, 0.02, route="local", prefill="l0", held=0.3)]   # batch full
    df = _decompose(run, rows)
    assert df.excess_ms.max() < 1e-6
    assert df.leg_prefill_queue_ms[1] == pytest.approx(900.0)     # measured, all of it natural
    assert df.leg_decode_admission_ms[2] > 3000.0
    out, warn = excess.summarize(df, 10)
    assert out["p90"] < 1e-6 and not warn
    legs_sum = sum(df[f"leg_{leg}_ms"] for leg in excess.LEGS)
    assert legs_sum.to_numpy() == pytest.approx(df.ttft_ms.to_numpy())


def test_lateness_is_counted_once_in_its_leg_and_warned_about(run):
    links = deploy.compile(run.experiment).links
    late = {"send": 0.002, "prefill": 0.02, "kv_transfer": 0.003, "decode_admission": 0.004,
            "first_step": 0.005, "delivery": 0.03}
    rows = [_request(0, links, 0.0, late=late),
            _request(1, links, 0.01, queue=0.092 + 0.02, late={"delivery": 0.03})]
    df = _decompose(run, rows)
    for leg, s in late.items():     # real-world ms: emulated s x 10 x 1000
        assert df[f"excess_{leg}_ms"][0] == pytest.approx(s * 1e4, abs=0.1), leg
    # request 1 waited behind request 0 (sent 2 ms late), whose prefill ended 20 ms late
    assert df.excess_prefill_queue_ms[1] == pytest.approx(200.0, abs=1e-3)
    assert df.excess_ms[0] == pytest.approx(sum(late.values()) * 1e4, abs=0.5)
    out, warn = excess.summarize(df, 10)
    assert out["share_p90"] > excess.WARN_SHARE
    assert len(warn) == 1 and "delivery" in warn[0] and "prefill" in warn[0]
    assert "route" not in warn[0]


def test_runs_without_the_stamps_have_no_decomposition(run):
    links = deploy.compile(run.experiment).links
    row = _request(0, links, 0.0)
    for k in ("sched_received", "prefill_model_s", "first_step_s", "decode_held"):
        del row[k]
    df = _decompose(run, [row])
    assert df.excess_ms.isna().all()
    assert excess.summarize(df, 10) == (None, [])


def test_a_real_engines_own_legs_are_no_excess(run):
    """engine vllm: a prefill or first step longer than any model is the engine's own time;
    a late delivery is still the testbed's."""
    import dataclasses
    exp = run.experiment
    vllm = RunInfo.of(dataclasses.replace(exp, model=dataclasses.replace(exp.model,
                                                                         engine="vllm")))
    links = deploy.compile(exp).links
    late = {"prefill": 0.5, "first_step": 0.3, "delivery": 0.03}
    df = _decompose(vllm, [_request(0, links, 0.0, late=late)])
    assert df.excess_prefill_ms[0] == 0 and df.excess_first_step_ms[0] == 0
    assert df.excess_delivery_ms[0] == pytest.approx(300.0, abs=0.1)
    assert df.leg_prefill_ms[0] == pytest.approx((0.1 + 0.5) * 1e4)


def test_what_a_wan_fault_held_up_is_the_faults_not_the_emulations(run):
    """A KV transfer or a Prefill call that overlapped a WAN fault's window (TCP's recovery,
    which the fluid model has not) and the queue after a failover move (attempts no record
    holds) carry no excess; the same lateness outside the window does."""
    from testbed.records import Event
    links = deploy.compile(run.experiment).links
    late = {"kv_transfer": 0.2, "route": 0.05}
    rows = [_request(0, links, 0.0, late=late), _request(1, links, 1.0, late=late)]
    events = [Event(0.02, "fault_inject", {"fault": "0", "occurrence": "0", "fault_kind":
                                          "blackhole"}, ""),
              Event(0.2, "fault_end", {"fault": "0", "occurrence": "0"}, ""),
              Event(0.5, "fault_inject", {"fault": "1", "occurrence": "0", "fault_kind": "kill"},
                    "")]                                 # not a WAN fault: no window
    df = excess.decompose(pd.DataFrame(rows), run, None, links, events)
    assert list(df.wan_fault_overlap) == [True, False]
    assert df.excess_kv_transfer_ms[0] == 0 and df.excess_route_ms[0] == 0
    assert df.excess_kv_transfer_ms[1] == pytest.approx(2000.0, abs=0.1)
    # failover moved a prefill from p0 at 0.05: p0's later queue is taken as measured
    moved = [_request(0, links, 0.0), _request(1, links, 0.01, queue=0.3)]
    moved[0]["redispatches"] = [{"time": 0.05, "role": "prefill", "from": "p0", "to": "p1"}]
    moved[1]["redispatches"] = []
    df = _decompose(run, moved)
    assert df.excess_prefill_queue_ms[1] == 0
    assert _decompose(run, [{**r, "redispatches": []} for r in moved]).excess_prefill_queue_ms[
        1] == pytest.approx(3000.0 - 900.0, abs=1.0)
