"""The steady link faults and path limits on paper: checked keys, netem's reorder arithmetic,
the probe's count of packets sent ahead, the policer's nftables rules, the probe's MTU and
policer verdicts, and how deploy scales a policer."""

import json

import pytest

from conftest import SMALL_EXPERIMENT
from testbed import deploy, sim
from testbed.backend.rayplacement import _check_path_limits
from testbed.errors import ConfigError
from testbed.net import probe
from testbed.net.linkmodel import (check_params, default_police_burst, needs_checksums,
                                   needs_per_frame_packets)
from testbed.net.pathlimit import _drops, police_rules
from testbed.net.probe import _reorder_share
from testbed.net.proberoles import _early


def test_keys_are_checked_and_kept():
    lk = check_params({"rate": 1e9, "corrupt": "1%", "duplicate": 0.002, "reorder_prob": "5%",
                       "reorder_gap": 3}, "kv")
    assert (lk.corrupt, lk.duplicate, lk.reorder_prob, lk.reorder_gap) == (0.01, 0.002, 0.05, 3)
    assert lk.changed("kv", corrupt=0.0).corrupt == 0.0
    assert needs_checksums({"kv": lk}) and needs_per_frame_packets({"kv": lk})
    for bad in ({"corrupt": 1.5}, {"duplicate": -0.1}, {"reorder_gap": 0}, {"reorder_gap": 2.5}):
        with pytest.raises(ConfigError):
            check_params({"rate": 1e9, **bad}, "kv")


def test_reorder_share_is_one_per_cycle_of_gap_minus_one_plus_one_over_p():
    assert _reorder_share(0.01, 1) == 0.01
    assert _reorder_share(0.5, 3) == pytest.approx(1 / (2 + 2))
    assert _reorder_share(0.0, 5) == 0.0


def test_early_counts_the_packets_sent_ahead_not_those_left_behind():
    assert _early([0, 1, 2, 3]) == 0
    assert _early([0, 3, 1, 2, 4]) == 1          # 3 jumped ahead of 1 and 2
    assert _early([2, 0, 1, 5, 3, 4, 3]) == 2    # 2 and 5; the repeated 3 is a duplicate


# ---------------------------------------------------------------- path limits (mtu, police)

def test_path_limits_are_checked_and_the_policer_gets_a_default_bucket():
    lk = check_params({"rate": 1e9, "mtu": 1280, "mtu_icmp": False, "police": "400Mbit"}, "kv")
    assert (lk.mtu, lk.mtu_icmp, lk.police) == (1280, False, 400e6)
    assert lk.police_burst == default_police_burst(400e6) == 500_000      # 10 ms of 400 Mbit/s
    assert needs_per_frame_packets({"kv": lk})          # a policer drops single frames
    assert lk.changed("kv", mtu=0, police=0).params()["police_burst"] == 0
    for bad in ({"mtu": 9000}, {"mtu": 551}, {"mtu": 1280.5}, {"mtu_icmp": "no"},
                {"police": "fast"}, {"police": 1e3}, {"police": 1e6, "police_burst": 1000}):
        with pytest.raises(ConfigError):
            check_params({"rate": 1e9, **bad}, "kv")


def test_policer_table_has_one_rule_per_policed_direction():
    script = police_rules({"kv": (80e6, 100_000)}, {"kv": "r-b", "request": "r-a"})
    assert 'oifname "r-b" limit rate over 10000000 bytes/second burst 100000 bytes' in script
    assert "r-a" not in script and script.count("drop") == 1
    listing = json.dumps({"nftables": [
        {"table": {"name": "testbed_police"}},
        {"rule": {"comment": "kv", "expr": [{"match": {}}, {"counter": {"packets": 7,
                                                                          "bytes": 10500}},
                                             {"drop": None}]}}]})
    assert _drops(listing) == {"kv": 7}


def test_probe_warns_on_a_wrong_mtu_and_on_goodput_above_a_policer():
    exp = probe._expected({"rate": 1e8, "delay": 0.005, "mtu": 1280, "mtu_icmp": True})
    ok = {"goodput_bps": 1e8 * 1228 / 1294, "rtt_p50_ms": 10.0, "reordered": 0,
          "mtu": 1280, "learned_mtu": 1280}
    assert probe.compare(exp, ok)[1] == []
    assert probe.compare(exp, {**ok, "mtu": 1500, "learned_mtu": 1500})[1] == [
        "path MTU measured 1500, configured 1280",
        "the sender learned a path MTU of 1500 from ICMP, configured 1280"]
    hole = probe._expected({"rate": 1e8, "mtu": 1280, "mtu_icmp": False})
    assert probe.pmtu_blackhole(hole)
    assert "mtu_icmp is false" in probe.compare(hole, {**ok, "goodput_bps": None})[1][0]
    police = probe._expected({"rate": 1e8, "police": 4e7})
    under = {"goodput_bps": 0.7 * 4e7, "rtt_p50_ms": 0.0, "reordered": 0}
    assert probe.compare(police, under)[1] == []            # TCP under a policer: no target
    assert probe.compare(police, {**under, "goodput_bps": 4.5e7})[1][0].startswith(
        "goodput +17% above the policer's rate")


def test_deploy_scales_the_policer_like_a_rate_and_its_bucket_like_bytes(tmp_path):
    text = SMALL_EXPERIMENT.replace("{rate: 100Gbit", "{rate: 100Gbit, police: 40Gbit")
    assert text != SMALL_EXPERIMENT
    p = tmp_path / "e.yaml"
    p.write_text(text + "faults: [{at: 2s, kind: link, direction: kv, police: 10Gbit, "
                        "police_burst: 20MB, duration: 2s}]\n")
    ((exp, dep),) = deploy.load(p)
    sc = dep.scale
    assert dep.links["kv"].police == pytest.approx(sc.emulated_rate(40e9))
    assert dep.links["kv"].police_burst == int(sc.emulated_bytes(40e9 / 8 * 0.010))
    assert dep.per_frame
    inject, end = [c for c in dep.link_changes if c.source == "fault"]
    assert inject.changes == {"police": pytest.approx(sc.emulated_rate(10e9)),
                              "police_burst": int(sc.emulated_bytes(20e6))}
    assert end.changes["police"] == dep.links["kv"].police           # back to the file's
    assert sim.unsupported(exp).startswith("network.wan police: ")
    with pytest.raises(ConfigError, match="ray backend"):
        _check_path_limits(dep)
