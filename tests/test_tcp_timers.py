"""testbed.net.timers: which TCP timers a run at a given scale.time puts on its hosts (no root),
and, as root, that they land in the host's namespace."""

import os
import subprocess

import pytest

from testbed.errors import NetworkError
from testbed.net import netlink, timers
from testbed.net.timers import RTAX_RTO_MIN, TcpTimers
from testbed.scale import Scale


def test_nothing_changes_at_1x():
    t = TcpTimers.for_scale(Scale(time=1.0), hz=250)
    assert not t.active and t.metrics() == {} and t.sysctls() == []


def test_10x_floor_counts_the_jiffy_the_rto_timer_overshoots_by():
    # (200 + 4) / 10 - 1.5 * 4 = 14.4 ms: 4 jiffies at HZ=250, 19 ms at HZ=1000
    t = TcpTimers.for_scale(Scale(time=10.0), hz=250)
    assert t.rto_min_ms == 16 and t.quickack
    assert t.metrics() == {"RTAX_LOCK": 1 << RTAX_RTO_MIN, "RTAX_RTO_MIN": 16, "RTAX_QUICKACK": 1}
    assert TcpTimers.for_scale(Scale(time=10.0), hz=1000).rto_min_ms == 19


def test_floor_is_whole_jiffies_at_least_one():
    assert TcpTimers.for_scale(Scale(time=5.0), hz=250).rto_min_ms == 36
    assert TcpTimers.for_scale(Scale(time=40.0), hz=250).rto_min_ms == 4
    assert TcpTimers.for_scale(Scale(time=40.0), hz=300).rto_min_ms == 3    # 1 jiffy = 3.3 ms
    assert TcpTimers.for_scale(Scale(time=10.0), hz=0).rto_min_ms == 20     # tick unknown


def test_sack_compression_scaled():
    t = TcpTimers.for_scale(Scale(time=10.0), hz=250)
    assert t.sysctls() == ["net.ipv4.tcp_comp_sack_delay_ns=100000",
                           "net.ipv4.tcp_comp_sack_slack_ns=10000"]


def test_describe_in_real_world_time():
    d = TcpTimers.for_scale(Scale(time=10.0), hz=250).describe(Scale(time=10.0), hz=250)
    assert d["rto_min_emu_ms"] == 16 and d["rto_min_real_ms"] == 160
    assert d["delayed_ack_real_ms"] == 0.0 and d["sack_delay_ns"] == 100000


@pytest.mark.root
def test_the_timers_land_in_the_hosts_namespace_only():
    """`apply` writes the SACK compression sysctls from a thread inside the namespace (no
    `nsenter sysctl` exec): the namespace reads them, this one keeps its own."""
    name = f"tbtimers{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        t = TcpTimers.for_scale(Scale(time=10.0))
        mine = _read("net.ipv4.tcp_comp_sack_delay_ns")
        timers.apply(f"/run/netns/{name}", t)
        got = {s.split("=")[0]: _read(s.split("=")[0], name) for s in t.sysctls()}
        assert got == {k: v for k, v in (s.split("=") for s in t.sysctls())}
        assert _read("net.ipv4.tcp_comp_sack_delay_ns") == mine
        with pytest.raises(NetworkError, match="no_such_key"):
            netlink.sysctl_here(f"/run/netns/{name}", "net.ipv4.no_such_key=1")
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def _read(key, netns=None):
    pre = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run([*pre, "sysctl", "-n", key], capture_output=True, text=True,
                          check=True).stdout.strip()
