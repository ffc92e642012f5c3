"""Fidelity guards on synthetic data (no root): transfers vs the link model, kernel TCP
counters, counter samples above the link rate."""

import numpy as np
import pandas as pd
import pytest

from testbed import analysis, config, deploy, fidelity, metrics
from testbed.net import probe
from testbed.rundir import RunInfo
from testbed.scale import Scale

QUICK = "experiments/quickstart.yaml"
GBIT = 1e9


def _links(run):
    """The emulated links the run's shaper ran (deployment.json of a real run)."""
    return deploy.compile(run.experiment).links


@pytest.fixture
def exp():
    return RunInfo.of(config.load_experiment(QUICK)[2])   # prfaas: 1 Gbit/s, 0.5 ms emulated


# ---------------------------------------------------------------- rate artifacts

def test_a_rate_at_the_link_is_no_artifact_one_far_above_is():
    assert not fidelity.exceeds_link(1.0 * GBIT, GBIT, 0.05)
    assert not fidelity.exceeds_link(1.02 * GBIT, GBIT, 0.05)     # HTB burst + GSO packet
    assert fidelity.exceeds_link(1.5 * GBIT, GBIT, 0.05)
    # a counter read that took 20 ms after the sample's time stamp explains 1.4x
    assert not fidelity.exceeds_link(1.4 * GBIT, GBIT, 0.05, read_s=0.02)
    assert not fidelity.exceeds_link(5 * GBIT, 0.0, 0.05)         # no link rate: no verdict


def _timeseries(rates_bps, dt=0.05, link_gbps=1.0):
    """A CounterSampler-like frame with real = emulated units (Scale())."""
    t = 100.0 + dt * np.arange(len(rates_bps) + 1)
    tx = np.concatenate([[0.0], np.cumsum(np.asarray(rates_bps) * dt / 8)])
    rate = np.concatenate([[0.0], rates_bps])
    return pd.DataFrame({"time": t, "kv_tx_bytes": tx, "kv_rate_bps": rate,
                         "kv_egress_gbps": rate / GBIT, "kv_link_gbps": link_gbps, "kv_up": 1,
                         "request_tx_bytes": 0.0, "request_rate_bps": 0.0,
                         "request_egress_gbps": 0.0, "request_link_gbps": link_gbps,
                         "request_up": 1})


def test_flagged_samples_leave_the_egress_statistics():
    ts = _timeseries([0.9 * GBIT] * 40)
    ts.loc[21, "time"] -= 0.03      # its counter was read 30 ms after its time stamp
    ts["kv_rate_bps"] = (ts.kv_tx_bytes.diff() * 8 / ts.time.diff()).fillna(0)
    ts = fidelity.flag_artifacts(ts, Scale())
    assert ts.kv_artifact.tolist().count(1) == 1 and ts.kv_artifact[21] == 1
    assert fidelity.rate_artifacts(ts) == {"kv": 1, "request": 0, "samples": 41}
    clean = fidelity.without_artifacts(ts)
    assert len(clean) == 40 and clean.kv_rate_bps.max() <= GBIT
    e = metrics.egress(clean, 100.0, 102.0, Scale(time=20.0, bytes=0.05))   # real = emulated rates
    assert e["egress_mean_gbps"] == pytest.approx(0.9, rel=0.01)
    assert e["egress_peak_gbps"] <= 1.0


def test_a_stalled_counter_read_before_the_window_does_not_start_it():
    """A sample stamped before t0 whose read finished after it (a busy CPU) holds bytes sent
    after t0; the window starts at the last read done by t0, so they are counted."""
    ts = pd.DataFrame({"time": [0.0, 0.5, 0.95, 1.5, 2.0], "read_s": [0.001, 0.001, 0.2, 0.001,
                                                                      0.001],
                       "kv_tx_bytes": [0, 0, 1000, 3000, 3000], "request_tx_bytes": 0,
                       "kv_rate_bps": 0.0, "kv_egress_gbps": 0.0, "request_egress_gbps": 0.0})
    e = metrics.egress(ts, 1.0, 1.9, Scale())
    assert e["wan_bytes_measured"] == 3000, e


def test_a_rate_step_down_is_judged_by_the_faster_end():
    rates = [1.0 * GBIT] * 10
    ts = _timeseries(rates)
    ts.loc[5:, "kv_link_gbps"] = 0.2      # the link slowed down between samples 4 and 5
    flagged = fidelity.flag_artifacts(ts, Scale())
    assert flagged.kv_artifact[5] == 0 and flagged.kv_artifact[6:].sum() == 5


def test_sampler_flags_are_kept():
    ts = _timeseries([0.5 * GBIT] * 4)
    ts["kv_artifact"] = [0, 0, 1, 0, 0]
    assert fidelity.flag_artifacts(ts, Scale()).kv_artifact.tolist() == [0, 0, 1, 0, 0]
    assert fidelity.artifact_mask(_timeseries([1.0]), "kv").sum() == 0


# ---------------------------------------------------------------- the fluid link

def test_fluid_link_serves_at_the_rate_in_force():
    link = fidelity.FluidLink([0.0, 1.0, 2.0], [8.0, 0.0, 16.0])   # 8 bit/s, down, 16 bit/s
    assert link.served_at(0.0, 4.0) == pytest.approx(0.5)
    assert link.served_at(0.5, 8.0) == pytest.approx(2.25)    # 4 bits, wait 1 s, 4 bits at 16
    assert link.served_at(3.0, 16.0) == pytest.approx(4.0)
    assert fidelity.FluidLink([0.0], [0.0]).served_at(0.0, 1.0) == float("inf")


def _transfers(rows):
    return pd.DataFrame([{"id": i, "route": "remote", "send_start": s, "send_end": e,
                          "kv_recv_end": r, "kv_bytes": b} for i, (s, e, r, b) in enumerate(rows)])


def test_transfers_sharing_the_link_are_not_inflated(exp):
    mb = 1_000_000 / fidelity.WIRE_PER_PAYLOAD        # 1 MB on the wire: 8 ms at 1 Gbit/s
    rows = [(0.0, 0.001, 0.0170, mb), (0.001, 0.002, 0.0165, mb),   # sharing: both end ~16 ms
            (1.0, 1.040, 1.0412, mb)]                             # paced by its sender
    out, warn = fidelity.kv_transfers(_transfers(rows), exp, None, _links(exp))
    assert out["transfers"] == 3 and out["inflated"] == 0 and not warn
    assert out["max_inflation"] <= 1.1


def test_a_stalled_transfer_is_inflated_and_reported_in_real_world_time(exp):
    mb = 1_000_000 / fidelity.WIRE_PER_PAYLOAD
    rows = [(0.0, 0.001, 0.0095, mb), (1.0, 1.001, 1.0095 + 0.2, mb)]   # one RTO of 200 ms
    out, warn = fidelity.kv_transfers(_transfers(rows), exp, None, _links(exp))
    assert out["inflated"] == 1
    assert out["excess_total_s"] == pytest.approx(2.0, rel=0.02)       # 0.2 s emulated x 10
    assert "1 of 2 KV transfers" in warn[0] and "real-world" in warn[0]


def _zero_delay_40x(metadata=None):
    """The case study's naive variant at 40x: a 0 ms WAN of 1 Gbit/s emulated."""
    runs = config.load_experiment("experiments/paper_case_study.yaml",
                                  ["scale.time=40", "scale.bytes=2.5e-4"])
    return RunInfo.of(next(r for r in runs if r.label == "naive"), metadata=metadata)


def test_the_path_allowance_is_what_the_probe_measured_at_rest_when_larger():
    kb56 = 56_000 / fidelity.WIRE_PER_PAYLOAD        # 0.448 ms on the wire at 1 Gbit/s
    # handed over at once; the stack's 0.15 ms at rest, then one 2 ms late (a busy receiver)
    rows = [(0.0, 0.00005, 0.000598, kb56), (1.0, 1.00005, 1.002448, kb56)]
    run = _zero_delay_40x()
    configured, _ = fidelity.kv_transfers(_transfers(rows), run, None, _links(run))
    assert configured["inflated"] == 2 and configured["path_basis"] == "configured"
    probe = {"link_fidelity": {"measured": {"rtt_p50_ms": 0.12, "jitter_ms": 0.5}}}
    run = _zero_delay_40x(probe)
    out, warn = fidelity.kv_transfers(_transfers(rows), run, None, _links(run))
    assert out["path_basis"] == "measured"
    assert out["path_allowance_ms"] == pytest.approx(0.12 * 40)   # real-world; jitter unused
    assert out["inflated"] == 1 and "1 of 2 KV transfers" in warn[0]
    # a configured round trip longer than the probe's median stays (quickstart: 0.5 ms each way)
    quick = config.load_experiment(QUICK)[2]
    run = RunInfo.of(quick, metadata=probe)
    assert fidelity.path_allowance(run, _links(run)) == (
        pytest.approx(0.001), "configured")


def test_a_link_cut_is_allowed_for(exp):
    mb = 1_000_000 / fidelity.WIRE_PER_PAYLOAD
    ts = _timeseries([0.0] * 20, dt=0.05)
    ts["kv_link_gbps"] = 100.0                       # real-world: 1 Gbit/s emulated at 10x 1e-3
    ts.loc[ts.time < 100.5, "kv_up"] = 0               # down from 100.0 to 100.5
    rows = [(100.01, 100.011, 100.509, mb)]          # waited out the cut, then 8 ms
    out, _ = fidelity.kv_transfers(_transfers(rows), exp, ts, _links(exp))
    assert out["inflated"] == 0


# ---------------------------------------------------------------- the probe's shortfall

def _short_probe(dev):
    """metadata with a link probe whose bulk TCP carried `dev` (a share) off the rate."""
    return {"link_fidelity": {"deviation": {"goodput": dev},
                              "warnings": [probe.deviation_warning("goodput", dev)]}}


def _shortfall(rows, rates_bps, dev=-0.26):
    run = RunInfo.of(config.load_experiment(QUICK)[2], metadata=_short_probe(dev))
    ts = _timeseries(rates_bps, link_gbps=100.0)   # real-world: 1 Gbit/s emulated at 10x 1e-3
    return fidelity.link_shortfall(_transfers(rows), run, ts, _links(run), run.metadata)


def test_a_shortfall_under_transfers_paced_by_their_senders_does_not_bear():
    """1 MB (8 ms at 1 Gbit/s, 10.8 ms at 74%) handed over in 40 ms: a prefill's layers."""
    mb = 1_000_000 / fidelity.WIRE_PER_PAYLOAD
    rows = [(100.0, 100.04, 100.0405, mb), (100.5, 100.54, 100.5405, mb)]
    out = _shortfall(rows, [0.2 * GBIT] * 20)
    assert out["carried"] == pytest.approx(0.74) and out["transfers"] == 2
    assert (out["link_bound"], out["samples_above"], out["bears"]) == (0, 0, False)
    assert out["peak_share"] == pytest.approx(0.2)


def test_a_shortfall_bears_on_transfers_the_link_paces_or_on_a_busy_link():
    mb = 1_000_000 / fidelity.WIRE_PER_PAYLOAD
    # handed over in 9 ms: within 1 Gbit/s's 8 ms, not 74%'s 10.8 ms
    out = _shortfall([(100.0, 100.009, 100.0095, mb)], [0.2 * GBIT] * 20)
    assert out["link_bound"] == 1 and out["bears"]
    # two paced alone, but back to back their busy period (16 -> 21.6 ms) outlasts the first
    rows = [(100.0, 100.012, 100.0125, mb), (100.001, 100.03, 100.0305, mb)]
    assert _shortfall(rows, [0.2 * GBIT] * 20)["link_bound"] == 1
    busy = _shortfall([], [0.2 * GBIT] * 10 + [0.9 * GBIT] + [0.2 * GBIT] * 9)
    assert busy["samples_above"] == 1 and busy["bears"]


def test_no_shortfall_without_the_probes_goodput_warning():
    run = RunInfo.of(config.load_experiment(QUICK)[2], metadata={})
    within = {"link_fidelity": {"deviation": {"goodput": -0.05}, "warnings": []}}   # its 10%
    for meta in ({}, within, _short_probe(0.2)):        # none, within, above the rate
        assert fidelity.link_shortfall(_transfers([]), run, None, _links(run), meta) is None
    assert _shortfall([], [0.0] * 5)["transfers"] == 0       # a probe's warning, no transfers


def test_a_shortfall_that_does_not_bear_is_a_note_not_a_warning():
    meta = _short_probe(-0.26)
    warning = meta["link_fidelity"]["warnings"][0]
    short = {"warning": warning, "carried": 0.74, "transfers": 600, "link_bound": 0,
             "samples_above": 0, "peak_share": 0.17, "bears": False}
    warn, notes = analysis.link_judgement({"fidelity": {"link_shortfall": short}}, meta)
    assert warn == [] and len(notes) == 1
    assert warning in notes[0] and "600 KV transfers" in notes[0] and "17%" in notes[0]
    none = {"fidelity": {"link_shortfall": {**short, "transfers": 0, "peak_share": 0.0}}}
    assert "it sent no KV transfer across the WAN" in analysis.link_judgement(none, meta)[1][0]
    bears = {"fidelity": {"link_shortfall": {**short, "link_bound": 3, "bears": True}}}
    assert analysis.link_judgement(bears, meta) == ([warning], [])


# ---------------------------------------------------------------- kernel TCP counters

NETSTAT = ("TcpExt: SyncookiesSent TCPTimeouts TCPLossProbes\nTcpExt: 0 3 7\n"
           "IpExt: InNoRoutes\nIpExt: 0\n")
SNMP = ("Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        "Tcp: RtoAlgorithm ActiveOpens RetransSegs\nTcp: 1 5 42\n")


def test_proc_files_are_parsed_by_name():
    assert fidelity._parse_proc(NETSTAT, {"TcpExt": ("TCPTimeouts", "TCPLossProbes")}) == {
        "TCPTimeouts": 3, "TCPLossProbes": 7}
    assert fidelity._parse_proc(SNMP, {"Tcp": ("RetransSegs",)}) == {"RetransSegs": 42}


def test_timeouts_are_counted_over_the_run_and_warned_about():
    before = {"rp0": {"TCPTimeouts": 1, "TCPLossProbes": 2, "RetransSegs": 10},
              "ld0": {"TCPTimeouts": 0, "TCPLossProbes": 0, "RetransSegs": 0}}
    after = {"rp0": {"TCPTimeouts": 4, "TCPLossProbes": 5, "RetransSegs": 30},
             "ld0": {"TCPTimeouts": 0, "TCPLossProbes": 0, "RetransSegs": 1}}
    out, warn = fidelity.tcp_summary(fidelity.counter_delta(before, after))
    assert out["TCPTimeouts"] == 3 and out["RetransSegs"] == 21
    assert out["hosts_with_timeouts"] == {"rp0": 3}
    assert warn and "3 TCP retransmission timeouts" in warn[0] and "rp0" in warn[0]
    quiet, none = fidelity.tcp_summary(fidelity.counter_delta(before, before))
    assert quiet["TCPTimeouts"] == 0 and not none


def test_guards_collect_the_three(exp):
    ts = fidelity.flag_artifacts(_timeseries([0.5 * GBIT, 3 * GBIT]), Scale())
    meta = {"tcp_counters": {"rp0": {"TCPTimeouts": 2, "TCPLossProbes": 0, "RetransSegs": 4}}}
    out, warn = fidelity.guards(_transfers([]), exp, ts, meta, _links(exp))
    assert set(out["fidelity"]) == {"kv_transfers", "rate_artifacts", "link_shortfall", "tcp"}
    assert out["fidelity"]["link_shortfall"] is None        # no probe, no shortfall
    assert len(warn) == 2


def test_startup_warnings_counts_worker_log_warnings_before_the_client_started(tmp_path):
    import datetime
    start = datetime.datetime(2026, 1, 1, 12, 0, 0)

    def stamp(dt_s):
        t = start + datetime.timedelta(seconds=dt_s)
        return t.strftime("%Y-%m-%d %H:%M:%S,") + f"{t.microsecond // 1000:03d}"
    (tmp_path / "rp0.log").write_text(
        f"{stamp(-20)} rp0 INFO prefill worker up\n"
        f"{stamp(-5)} rp0 WARNING no KV connection to 10.2.2.1:50052 after 15s\n"
        f"{stamp(-4)} rp0 WARNING no KV connection to 10.2.2.2:50052 after 15s\n"
        f"{stamp(30)} rp0 WARNING dropping KV of unclaimed request 3\n")
    (tmp_path / "ld0.log").write_text(f"{stamp(-9)} ld0 INFO decode worker up\n")
    out, warn = fidelity.startup_warnings(tmp_path, start.timestamp())
    assert (out["warnings"], out["workers"]) == (2, 1)
    assert len(warn) == 1 and "no KV connection" in warn[0]
    assert fidelity.startup_warnings(tmp_path, start.timestamp() - 10) == (
        {"warnings": 0, "workers": 0}, [])
