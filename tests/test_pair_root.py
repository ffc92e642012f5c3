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
