"""Link events on real namespaces (root): blackhole, reject and reset, measured at the ends.

A src - router - dst pair (`testbed.net.pair.routed_pair`, userspace backend; the events are
iptables in the router either way). A TCP listener runs in dst; the sender in src says what it
saw and how long it took. Asserted: a rejected connect fails fast with ECONNREFUSED, a
blackholed one gets no answer and the router counts its SYNs dropped, and a reset window breaks
an established, busy connection: the sender gets ECONNRESET at once (its data met the RST);
the receiver, whose ACKs stopped with the data, gets it from its first keepalive probe (1 s
idle, as the KV receiver's sockets), answered by the sender's kernel with a RST.
"""

import json
import select
import subprocess
import sys
import time

import pytest

from testbed.net.ns import ns_popen, ns_run
from tests.test_link_root import link_factory  # noqa: F401  (the fixture)

pytestmark = pytest.mark.root

PORT = 50052

LISTEN = f"""
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT})); s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    # as the KV receiver does (workers/kvwire.py): a peer that is gone is noticed when idle
    c.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL):
        c.setsockopt(socket.IPPROTO_TCP, opt, 1)
    try:
        while c.recv(1 << 16):
            pass
        print(json.dumps({{"end": "eof"}}), flush=True)
    except OSError as e:
        print(json.dumps({{"end": type(e).__name__}}), flush=True)
"""

CONNECT = """
import json, socket, sys, time
t0 = time.monotonic()
s = socket.socket(); s.settimeout(float(sys.argv[2]))
try:
    s.connect((sys.argv[1], %d)); r = "connected"
except OSError as e:
    r = type(e).__name__
print(json.dumps({"result": r, "s": time.monotonic() - t0}))
""" % PORT

STREAM = """
import json, socket, sys, time
s = socket.socket(); s.connect((sys.argv[1], %d)); s.settimeout(10)
print("connected", flush=True)
t0 = time.monotonic(); sent = 0
try:
    while time.monotonic() - t0 < 20:
        sent += s.send(b"x" * 65536)
        time.sleep(0.001)
    r = "no error"
except OSError as e:
    r = type(e).__name__
print(json.dumps({"result": r, "sent": sent}), flush=True)
""" % PORT


@pytest.fixture
def listener(link_factory):  # noqa: F811
    link = link_factory(rate=50e6, delay=0.002)
    p = ns_popen(link.dst, [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    try:
        yield link, p
    finally:
        p.kill()
        p.wait()


def _connect(link, timeout_s):
    r = ns_run(link.src, [sys.executable, "-c", CONNECT, link.dst_ip, str(timeout_s)],
               capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)


def test_reject_fails_fast_and_blackhole_times_out(listener):
    link, _ = listener
    assert _connect(link, 5)["result"] == "connected"
    link.wan.event("kv", "reject")
    r = _connect(link, 5)
    assert r["result"] == "ConnectionRefusedError" and r["s"] < 1.0, r
    link.wan.event("kv", "blackhole")
    r = _connect(link, 2)
    assert r["result"] == "TimeoutError" and r["s"] >= 1.9, r
    counted = link.wan.event_counters()
    assert counted["kv"] >= 2, counted      # the rejected SYN and the blackholed ones
    link.wan.event("kv", None)
    assert _connect(link, 5)["result"] == "connected"
    assert link.wan.event_counters()["kv"] == counted["kv"]     # nothing matches once off


def test_reset_breaks_both_ends_of_a_busy_connection(listener):
    link, server = listener
    sender = ns_popen(link.src, [sys.executable, "-c", STREAM, link.dst_ip],
                      stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout.readline().strip() == "connected"
        time.sleep(0.5)
        link.wan.event(None, "reset", PORT)
        time.sleep(0.3)
        link.wan.event(None, None)
        out = json.loads(sender.stdout.readline())
        assert out["result"] in ("ConnectionResetError", "BrokenPipeError"), out
        assert out["sent"] > 0
        ready, _, _ = select.select([server.stdout], [], [], 15)
        assert ready, "the receiver never saw its connection end"
        end = json.loads(server.stdout.readline())
        assert end["end"] == "ConnectionResetError", end
        assert sum(link.wan.event_counters().values()) >= 2
    finally:
        sender.kill()
        sender.wait()
    assert _connect(link, 5)["result"] == "connected"       # new connections pass again
