"""testbed.net.pair on real namespaces (root): the veth pair carries traffic the kernel counts,
commands run where `testbed.net.ns` says, and nothing is left behind."""

import os
import subprocess

import pytest

from testbed import lifecycle
from testbed.net import ns, pair

pytestmark = pytest.mark.root


def _netns_list():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_veth_pair_carries_packets_and_is_removed(tmp_path):
    reg = lifecycle.Registry(f"p{os.getpid()}", kind="test", state_dir=tmp_path)
    try:
        with pair.veth_pair(reg) as link:
            addrs = ns.ns_run(link.a, ["ip", "-o", "-4", "addr", "show", link.if_a],
                              capture_output=True, text=True, check=True).stdout
            assert link.ip_a in addrs                   # the command ran inside `a`
            before = pair.rx_bytes(link.b, link.if_b)
            r = ns.ns_run(link.a, ["ping", "-c", "3", "-i", "0.2", "-W", "2", link.ip_b],
                          capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            assert pair.rx_bytes(link.b, link.if_b) - before >= 3 * 84   # 3 echo requests
            names = (link.a, link.b)
            assert all(n in _netns_list() for n in names)
    finally:
        reg.close()
    assert not any(n in _netns_list() for n in names)


def test_routed_pair_forwards_through_the_router(tmp_path):
    from testbed.net.linkmodel import check_params
    d = check_params({"rate": 50e6, "delay": 0.002}, "test")
    reg = lifecycle.Registry(f"q{os.getpid()}", kind="test", state_dir=tmp_path)
    try:
        with pair.routed_pair({"kv": d, "request": d}, backend="userspace",
                              registry=reg) as link:
            r = ns.ns_run(link.src, ["ping", "-c", "3", "-i", "0.2", "-W", "2", link.dst_ip],
                          capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            assert link.wan.stats()["kv"]["tx_packets"] >= 3   # echo requests left the router
            names = link.names
    finally:
        reg.close()
    assert not any(n in _netns_list() for n in names)


def test_wan_counters_read_from_netlink_match_pyroute2(tmp_path):
    """`Wan.stats()` reads the router's qdisc counters with its own netlink dump
    (testbed.net.qstats); after traffic, idle, they equal what pyroute2 decodes."""
    from testbed.net import netlink
    from testbed.net.linkmodel import check_params
    from testbed.net.wan import HTB_HANDLE
    d = check_params({"rate": 50e6, "delay": 0.002}, "test")
    reg = lifecycle.Registry(f"c{os.getpid()}", kind="test", state_dir=tmp_path)
    try:
        with pair.routed_pair({"kv": d, "request": d}, backend="userspace",
                              registry=reg) as link:
            r = ns.ns_run(link.src, ["ping", "-c", "5", "-i", "0.2", "-s", "1000", "-W", "2",
                                     link.dst_ip], capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
            ours = link.wan.stats()
            with netlink.open_netns(link.wan.netns_path) as nsock:
                for direction in ("kv", "request"):
                    msgs = list(nsock.tc("dump", index=link.wan._index[direction]))
                    root = next(m.get_attr("TCA_STATS") for m in msgs
                                if m["handle"] == HTB_HANDLE)
                    got = ours[direction]
                    assert got["tx_bytes"] == root["bytes"] >= 5 * 1028, direction
                    assert got["tx_packets"] == root["packets"] >= 5
                    assert (got["drops"], got["backlog_bytes"], got["backlog_packets"]) == (
                        root["drop"], root["backlog"], root["qlen"])
    finally:
        reg.close()
