"""The simulation backend (testbed/sim): runs without root, writes a run directory analysis
reads unchanged, its WAN model meets the closed forms of fair sharing, it routes exactly as
the scheduler's Router does (tests/test_replay.py replays its decisions), and it is fast."""

import json
import math
import resource
import time

import pandas as pd
import pytest

from conftest import (ROOT, SMALL_EXPERIMENT, assert_decisions_replay,
                      assert_remote_kv_crossed_the_wan)
from testbed import cli, config, deploy, rundir
from testbed import profile as profiles
from testbed.sim.loop import Loop
from testbed.sim.run import SimRun
from testbed.sim.wan import FRAME_BYTES, MSS_BYTES, LinkModel, Terms, mathis_rate_bps
from testbed.net.linkmodel import Link

QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


def sim_exp(path, *overrides):
    return config.load_experiment(path, [*overrides, "backend.kind=sim"])


# ---------------------------------------------------------------- the backend end to end

def test_quickstart_runs_and_analyses_without_root(tmp_path, capsys):
    out = tmp_path / "q"
    assert cli.main(["run", QUICKSTART, "--backend", "sim", "--out", str(out),
                     "--set", "requests=40", "--no-progress"]) == 0
    runs = rundir.find_runs(out)
    assert {d.name for d in runs} == {"homogeneous", "naive", "prfaas"}
    for d in runs:
        meta = json.loads((d / "metadata.json").read_text())
        assert meta["backend"] == "sim" and meta["sim"]["not_finished"] == 0
        summary = json.loads((d / "summary.json").read_text())
        assert summary["completed"] == 40 and not summary["incomplete"]
        assert summary["median_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0
        df = pd.read_parquet(d / "requests.parquet")
        assert (df.n_tokens == df.output_len).all()
        assert (df.first_token > df.kv_recv_end - 1e-9).all()    # a token needs its KV
        if summary["offload_fraction"] > 0:
            assert_remote_kv_crossed_the_wan(df, summary)
        # analysis and the report read the directory again, unchanged
        assert cli.main(["analyse", str(d)]) == 0
        assert json.loads((d / "summary.json").read_text())["completed"] == 40
    assert cli.main(["report", str(out)]) == 0
    assert (out / "figures").is_dir()


def test_a_real_engine_exits_2_with_one_line(tmp_path, capsys):
    out = tmp_path / "t"
    assert cli.main(["run", str(ROOT / "experiments" / "torch_small.yaml"), "--backend", "sim",
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.engine torch" in err
    assert not out.exists()


def test_one_request_takes_the_closed_form_path(tmp_path):
    """prefill (T(L) / scale.time) + the last KV piece over the link + the delay + one decode
    step of a batch of one: TTFT exactly, from the profile alone (without the standing queue
    the model adds while a flow has the whole link: `Terms.queue`)."""
    path = tmp_path / "one.yaml"
    path.write_text(SMALL_EXPERIMENT.replace("requests: 10", "requests: 1")
                    + "scheduler: {policy: naive}\n")
    exp = sim_exp(path)[0]
    SimRun(exp, tmp_path / "run", terms=Terms(queue=False)).execute()
    df = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    r = df.iloc[0]
    dep = deploy.compile(exp)
    prof = profiles.load(exp.model.profile)
    scale, kv, req = dep.scale, dep.links["kv"], dep.links["request"]
    t_prefill = scale.emulated_s(prof.t_prefill(exp.clusters.prfaas.accelerator,
                                                int(r.input_len)))
    n = int(prof.stream_chunks)
    size = int(r.kv_bytes_sent)
    piece = size // n + (1 if n - 1 < size % n else 0)
    payload_bps = kv.rate_bps * MSS_BYTES / FRAME_BYTES
    assert size / n * 8 / payload_bps < t_prefill / n     # each piece leaves before the next
    step = dep.runtime.decode.model().step_time(1, int(r.input_len))
    want = (req.delay_s + t_prefill + piece * 8 / payload_bps + kv.delay_s
            + scale.emulated_s(step))
    # (Unix-time stamps near 1.8e9 s carry about 0.25 us of float resolution)
    assert r.first_token - r.send_time == pytest.approx(want, abs=1e-6)


# ---------------------------------------------------------------- the WAN model's closed forms

def link(loop, rate=1e9, delay=0.01, loss=0.0, terms=Terms(framing=False, queue=False)):
    return LinkModel(loop, Link(rate_bps=rate, delay_s=delay, loss=loss), terms=terms,
                     reverse_delay_s=delay)


def send(loop, lm, nbytes, at=0.0):
    """A flow of `nbytes` handed over at `at`; returns its (first arrival, last sent, last
    arrival) once the loop has run."""
    got = []
    flow = lm.open(lambda *t: got.extend(t))
    loop.at(at, lm.push, flow, nbytes, True)
    return got


def test_equal_flows_share_the_rate_and_finish_together():
    loop, n, size = Loop(), 5, 1_000_000
    lm = link(loop)
    flows = [send(loop, lm, size) for _ in range(n)]
    loop.run()
    for first, sent, arrived in flows:
        assert sent == pytest.approx(n * size * 8 / 1e9, rel=1e-9)
        assert arrived == pytest.approx(sent + 0.01, rel=1e-9)
        assert first == pytest.approx(0.01)
    assert lm.tx_bytes == pytest.approx(n * size)


def test_processor_sharing_of_unequal_and_late_flows():
    loop = Loop()
    lm = link(loop, delay=0.0)
    small, big = send(loop, lm, 1e6), send(loop, lm, 3e6)
    late = send(loop, lm, 1e6, at=0.016)        # small is done at 16 ms, big has 2e6 left
    loop.run()
    r = 1e9 / 8                                 # bytes/s
    assert small[1] == pytest.approx(2 * 1e6 / r, rel=1e-9)
    # from 16 ms big (2e6 left) and late (1e6) share: late ends after 2e6 bytes in total
    assert late[1] == pytest.approx(0.016 + 2 * 1e6 / r, rel=1e-9)
    assert big[1] == pytest.approx((1e6 + 3e6 + 1e6) / r, rel=1e-9)


def test_loss_caps_each_flow_at_the_mathis_rate():
    loop = Loop()
    lm = link(loop, rate=1e9, delay=0.01, loss=0.01)
    got = send(loop, lm, 1e6)
    loop.run()
    cap = 8 * MSS_BYTES / (0.02 * math.sqrt(2 * 0.01 / 3))
    assert mathis_rate_bps(0.02, 0.01) == pytest.approx(cap)
    assert cap < 1e9
    assert got[1] == pytest.approx(1e6 * 8 / cap, rel=1e-9)
    loop2 = Loop()
    lm2 = link(loop2, rate=1e9, delay=0.01, loss=0.01, terms=Terms(loss_cap=False,
                                                                   framing=False, queue=False))
    free = send(loop2, lm2, 1e6)
    loop2.run()
    assert free[1] == pytest.approx(1e6 * 8 / 1e9, rel=1e-9)


def test_framing_counts_frames_and_slows_the_payload():
    loop = Loop()
    lm = link(loop, delay=0.0, terms=Terms(queue=False))
    got = send(loop, lm, 1448 * 1000)
    loop.run()
    assert got[1] == pytest.approx(1514 * 1000 * 8 / 1e9, rel=1e-9)
    assert lm.tx_bytes == pytest.approx(1514 * 1000, rel=1e-9)


def test_a_link_that_goes_down_holds_its_flows_until_it_is_up():
    loop = Loop()
    lm = link(loop, delay=0.0)
    got = send(loop, lm, 1e6)                   # 8 ms alone
    loop.at(0.002, lambda: lm.set(up=False))
    loop.at(0.100, lambda: lm.set(up=True))
    loop.run()
    assert got[1] == pytest.approx(0.100 + 0.006, rel=1e-9)


# ---------------------------------------------------------------- cost

def test_datacenter_scale_is_thousands_of_instances_and_runs_in_the_sim(tmp_path):
    """experiments/datacenter_scale.yaml: the sim's own file (backend sim), 5,000 instances
    across PrfaaS and the local PD cluster, Mooncake lengths; a slice of it runs to the end
    (docs/sim.md times the full file)."""
    path = ROOT / "experiments" / "datacenter_scale.yaml"
    exp = config.load_experiment(str(path), ["requests=400"])[0]
    c = exp.clusters
    assert exp.backend.kind == "sim"
    assert c.prfaas.instances + c.local.instances == 5000
    assert c.local.prefill > 0 and c.local.decode > 0
    summary = SimRun(exp, tmp_path / "dc", tokens=False).execute()
    assert summary["completed"] == 400
    assert 0 < summary["offload_fraction"] < 1    # both clusters prefill


def test_a_series_runs_in_the_order_of_events_scheduled_at_once():
    """`Loop.series` keeps one of its callbacks in the heap at a time, yet they and every
    other event run in the order they would have had all been scheduled at once: by time,
    ties by the order of scheduling (the series first, then later events)."""
    times = [0.0, 1.0, 1.0, 2.0, 2.0, 3.0]
    ran = {}
    for kind in ("at once", "series"):
        loop, got = Loop(), []
        if kind == "at once":
            for i, t in enumerate(times):
                loop.at(t, got.append, f"s{i}")
        else:
            loop.series(len(times), ((t, i, got.append, (f"s{i}",))
                                     for i, t in enumerate(times)))
        for t in (1.0, 2.0, 0.5):
            loop.at(t, got.append, f"e{t}")
        loop.at(1.0, lambda: loop.at(2.0, got.append, "later"))
        loop.run()
        ran[kind] = got
    assert ran["series"] == ran["at once"]
    assert ran["series"][:5] == ["s0", "e0.5", "s1", "s2", "e1.0"]



def test_simulation_speed(tmp_path, capsys):
    """Requests per wall second on a cluster of 120 instances (printed; docs/sim.md has the
    large runs). The sim must be far faster than the emulated timeline it stands for."""
    exp = sim_exp(QUICKSTART, "requests=5000", "clusters.prfaas.instances=40",
                  "clusters.local.instances=80", "clusters.local.prefill=40",
                  "clusters.local.decode=40", "workload.arrival.rate=24/s", "variants=[]")[0]
    t0 = time.monotonic()
    summary = SimRun(exp, tmp_path / "s", tokens=False).execute()
    wall = time.monotonic() - t0
    meta = json.loads((tmp_path / "s" / "metadata.json").read_text())["sim"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with capsys.disabled():
        print(f"\nsim: 5000 requests, 120 instances: {meta['wall_s']:.2f} s simulated "
              f"({meta['requests_per_wall_s']:.0f} req/s, {meta['events']} events), "
              f"{wall:.2f} s with analysis, peak RSS {rss:.0f} MB; "
              f"{meta['virtual_s']:.0f} s emulated")
    assert summary["completed"] == 5000
    assert meta["wall_s"] < meta["virtual_s"]


def test_many_small_flows_on_a_fast_link_all_drain():
    """Tiny remainders late in a run (float rounding of the service count) must not stall the
    loop at one instant (seen at scale.bytes 1e-5)."""
    import random
    rng = random.Random(1)
    loop = Loop(start_s=30.0)
    lm = link(loop, rate=1.7e9, delay=0.0005, terms=Terms())
    done = []
    for i in range(2000):
        flow = lm.open(lambda *t: done.append(t))
        at = 30.0 + rng.random() * 2
        for j in range(16):
            loop.at(at + j * 1e-4, lm.push, flow, rng.randint(1, 700), j == 15)
    loop.run(until=100.0)
    assert len(done) == 2000 and loop.events < 200_000


def test_the_adaptive_threshold_is_the_emulations_law_on_the_simulated_link(tmp_path):
    """On the degrading WAN the law moves the threshold (scheduler.csv, as the emulation writes
    it), and every request is routed with the threshold of its own evaluation's row."""
    exp = next(e for e in sim_exp(str(ROOT / "experiments" / "wan_degradation.yaml"))
               if e.label == "prfaas-adaptive")
    SimRun(exp, tmp_path / "a").execute()
    rows = pd.read_csv(tmp_path / "a" / "scheduler.csv")
    per_request = rows[rows.trigger == "request"]
    decisions = assert_decisions_replay(tmp_path / "a")     # each with its own threshold
    assert len(per_request) == len(decisions) > 100
    assert (rows.trigger == "timer").any()
    assert per_request.threshold.nunique() > 1
    assert set(rows.reason) & {"raise:link", "raise:compute", "lower:idle"}
    assert per_request.threshold.tolist() == [r.threshold for r in decisions]


def test_roles_convert_instances_with_the_emulations_planner(tmp_path):
    """shifting_mix's dual variant: the long timescale's re-plans (RolePlanner) convert local
    instances on the measured mix, drain before converting and pay the conversion cost; the
    summary counts the conversions from events.csv as for an emulated run."""
    exp = next(e for e in sim_exp(str(ROOT / "experiments" / "shifting_mix.yaml"))
               if e.label == "dual")
    summary = SimRun(exp, tmp_path / "d").execute()
    conv = summary["role_conversions"]
    assert conv["done"] >= 1 and conv["failed"] == 0
    assert conv["convert_s_median"] == pytest.approx(exp.scheduler.roles.cost, rel=1e-6)
    events = (tmp_path / "d" / "events.csv").read_text()
    assert "replan," in events and "state=draining" in events
    assert summary["completed"] == summary["requests"]
    # routed on the lists in force: decisions made while an instance was draining or after it
    # converted (its list differs from the one it started in) replay the same
    decisions = assert_decisions_replay(tmp_path / "d")
    assert any(r.roles for r in decisions)
