"""The steady link faults on a built link (issue 24): corrupt, duplicate and reorder measured by
the probe within 25% relative at 1% (binomial counts of a 40,000-packet train: 5 standard
errors), corrupted packets dropped by the receiver's checksum (offload off), and a one-way
partition (`up: false` on one direction) that leaves the other direction working. The netem
path is skipped where the kernel has no netem."""

import pytest

from testbed.net import probe
from testbed.net.linkmodel import check_params
from testbed.net.pair import routed_pair
from testbed.net.wan import probe_backend

pytestmark = pytest.mark.root
TRAIN = 40_000


def _link(**kw):
    return check_params({"rate": 100e6, "delay": 0.005, **kw}, "kv")


def _measure(backend, **kw):
    fwd = _link(**kw)
    with routed_pair({"kv": fwd, "request": _link()}, backend=backend) as link:
        return probe.measure_link(link.src, link.dst, link.dst_ip,
                                  {**fwd.params(), "reverse": _link().params()},
                                  duration_s=1.0, loss_packets=TRAIN)


@pytest.mark.parametrize("key,measured", [("corrupt", "corrupt"), ("duplicate", "duplicate"),
                                          ("reorder_prob", "reorder_share")])
def test_steady_fault_measured_within_25_percent_on_the_delay_line(key, measured):
    out = _measure("userspace", **{key: 0.01})
    m = out["measured"]
    assert m["loss_packets"] == TRAIN
    assert m[measured] is not None and abs(m[measured] / 0.01 - 1) <= 0.25, m
    assert not [w for w in out["warnings"] if w.startswith(f"{measured} deviates")], out


def test_corrupted_packets_do_not_reach_the_receiver():
    """Each corrupted train packet is one the receiver's UDP checksum dropped: none is
    delivered as good (checksum offload is off on the hosts)."""
    fwd = _link(corrupt=0.02)
    with routed_pair({"kv": fwd, "request": _link()}) as link:
        # the calibration's echoes crossed (and were corrupted) before: 200-1000 of them, as
        # many rounds as its slow-spell check measured; count this measurement's alone
        before = link.wan.delayline_counters()["kv"]
        c, s = probe.measure_udp(link.src, link.dst, link.dst_ip, 20, 10_000, 5000)
        counters = {k: v - before[k] for k, v in link.wan.delayline_counters()["kv"].items()}
    missing = 10_000 - s["train_unique"]
    assert missing > 100, s                         # 2% of 10,000, loosely
    # every packet the delay line corrupted is one the receiver's checksum dropped (a busy CPU
    # may drop a few more on the way, so missing is only an upper bound)
    assert 0.95 * counters["corrupted"] <= s["csum_errors"] <= counters["corrupted"], counters
    # the 20 UDP echo probes cross the corrupting direction too (2% of them: one in three
    # runs loses one), and the receiver's checksum counter counts them with the train's
    lost = missing + 20 - s["got"]["p"]
    assert s["csum_errors"] <= lost, (missing, s["got"], s["csum_errors"])


def test_one_way_partition_leaves_the_other_direction_up():
    """`up: false` on kv only: nothing crosses src -> dst, everything crosses dst -> src."""
    with routed_pair({"kv": _link(up=False), "request": _link()}) as link:
        _, down = probe.measure_udp(link.src, link.dst, link.dst_ip, 10, 2000, 2000)
        c, up = probe.measure_udp(link.dst, link.src, link.src_ip, 10, 2000, 2000)
    assert down["got"] == {"p": 0, "t": 0}, down
    assert up["got"] == {"p": 10, "t": 2000}, up
    assert c["rtt_ns"] == []                        # the echoes would cross kv: none back


def test_steady_faults_on_netem():
    backend, reason = probe_backend()
    if backend != "netem":
        pytest.skip(f"no netem here ({reason}); the userspace delay line is tested above")
    for key, measured in (("corrupt", "corrupt"), ("duplicate", "duplicate"),
                          ("reorder_prob", "reorder_share")):
        m = _measure("netem", **{key: 0.01})["measured"]
        assert abs(m[measured] / 0.01 - 1) <= 0.25, (key, m)
