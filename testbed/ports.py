"""Free TCP ports for servers the testbed starts on this host's loopback (the vLLM servers of
`testbed calibrate`, Prometheus, the tests' own), chosen outside the kernel's ephemeral range.

A port found free by binding port 0 is an ephemeral port: any process that binds port 0 or
connects out before the server binds it may be given the same one. vLLM does both while it
starts (its engine's ZMQ sockets), and on 2026-12-03 a test's prefill server lost its NIXL side
channel port (41791, found free a moment before) to its decode server's engine: the handshake
thread died, and the server never became healthy. No port below the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range) is handed out that way, so a port chosen there and
found free stays free unless something binds it by number.
"""

import random
import socket

RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10000          # under it: well-known and registered services
TRIES = 1000


def ephemeral_range():
    """(first, last) port the kernel hands to port-0 binds and outgoing connections."""
    try:
        with open(RANGE_FILE) as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999         # Linux's default


def _free(host, port):
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n, host="127.0.0.1", rng=random):
    """`n` distinct TCP ports free on `host` now, outside the ephemeral range; ports from the
    ephemeral range (binding port 0) only when there is no room outside it."""
    lo, hi = ephemeral_range()
    ranges = [r for r in (range(LOWEST, lo), range(hi + 1, 65536)) if len(r) >= 100]
    out = []
    for _ in range(TRIES if ranges else 0):
        if len(out) == n:
            return out
        r = ranges[0] if len(ranges) == 1 else rng.choice(ranges)
        port = rng.choice(r)
        if port not in out and _free(host, port):
            out.append(port)
    while len(out) < n:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in out:
            out.append(port)
    return out
