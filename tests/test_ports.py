"""Ports for the servers the testbed starts on loopback come from outside the kernel's
ephemeral range (testbed/ports.py): one found free by binding port 0 was once taken by another
vLLM server's engine before its own server bound it."""

import random
import socket

from testbed import ports


def test_ports_are_distinct_free_and_outside_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    got = ports.free_ports(6)
    assert len(set(got)) == 6 and all(not lo <= p <= hi for p in got), (got, lo, hi)
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))         # free


def test_a_bound_port_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (busy + 1, 60999))
        monkeypatch.setattr(ports, "LOWEST", busy - 99)      # 100 ports, one of them taken
        got = ports.free_ports(50, rng=random.Random(1))
    assert busy not in got and len(set(got)) == 50


def test_without_room_outside_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    got = ports.free_ports(3)
    assert len(set(got)) == 3
