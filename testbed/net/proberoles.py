"""The link probe's roles: what runs inside a namespace (or on a Ray host) as
`python -m testbed.net.proberoles ROLE ARGS...`, each printing one JSON line.

Place in the architecture: the far ends of `testbed.net.probe` (the orchestration: it starts
these roles on the two ends of a link, bounds every wait on them and turns their counts into
`link_fidelity`). This module only sends, receives and counts; it imports nothing of the testbed
but `testbed.net.tcp` (the congestion control of the TCP senders), so it starts fast inside
the namespace it measures.

- `udp-server PORT TIMEOUT_S` / `udp-client IP PORT PROBES INTERVAL_S TRAIN TRAIN_PPS`: RTT
  probes echoed with the receiver's time (one-way delay, reordering), then a paced train counted
  at the receiver (loss, loss runs);
- `tcp-sink PORT DURATION_S [GAP_S]` / `tcp-source IP PORT DURATION_S`: a bulk transfer whose
  goodput is the slope of the sender's `tcpi_delivered`, and the receiver's read pauses;
- `tcp-replier PORT SIZE TRIALS TIMEOUT_S` / `tcp-requests IP PORT SIZE TRIALS SETTLE_S`: one
  message per fresh connection, timed from the first write to the receiver's answer;
- `mtu-sink PORT TIMEOUT_S` / `mtu-probe IP PORT LO HI WAIT_S TRIES`: the path MTU, the largest
  datagram with DF set that arrives (a binary search between LO and HI bytes, each size answered
  by the sink with the size it got), and the MTU the sender's kernel learned meanwhile from ICMP
  "fragmentation needed" (HI when none came: a PMTU blackhole, or no limit).
"""

import json
import select
import signal
import socket
import struct
import sys
import time

from testbed.net.tcp import set_congestion_control

WARMUP_S = 0.5                  # slow start at 40 ms RTT reaches 1 Gbit/s well within this
HDR = struct.Struct("!cIq")     # kind ('p' probe, 't' train, 'e' end), seq, send time ns
TRAIN_PAYLOAD = 100
REORDER_EXAMPLES = 20
SAMPLE_S = 0.01                 # goodput: the sender samples tcpi_delivered every 10 ms
# <linux/in.h>: DF on every datagram whatever PMTU the kernel has learned (PROBE), the PMTU
IP_MTU_DISCOVER, IP_PMTUDISC_PROBE, IP_MTU = 10, 3, 14
MTU_ACK = struct.Struct("!I")   # the IP size the mtu sink received
UDP_IP_HEADERS = 28


def _udp_server(port, timeout_s):
    """Echo probes (adding our receive time), count train packets; report at 'e' or timeout."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("0.0.0.0", port))
    csum0 = _udp_csum_errors()
    print("ready", flush=True)
    got = {"p": 0, "t": 0}
    reordered = {"p": 0, "t": 0}
    top = {"p": -1, "t": -1}
    owd_ns = []
    train_seqs = []
    examples = []   # (kind, seq, highest seq seen, ns after the highest one arrived)
    top_at = {"p": 0, "t": 0}
    deadline = time.monotonic() + timeout_s
    stop = []
    # SIGTERM: the client is done but 'e' never came (link down); report what arrived
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while time.monotonic() < deadline and not stop:
        try:
            r, _, _ = select.select([s], [], [], 0.5)
        except InterruptedError:
            continue
        if not r:
            continue
        data, addr = s.recvfrom(2048)
        now = time.monotonic_ns()
        kind, seq, sent = HDR.unpack_from(data)
        kind = kind.decode()
        if kind == "e":
            break
        got[kind] += 1
        if kind == "t":
            train_seqs.append(seq)
        if seq < top[kind]:
            reordered[kind] += 1
            if len(examples) < REORDER_EXAMPLES:
                examples.append((kind, seq, top[kind], now - top_at[kind]))
        elif seq > top[kind]:
            top[kind], top_at[kind] = seq, now
        if kind == "p":
            owd_ns.append(now - sent)
            s.sendto(data[:HDR.size] + struct.pack("!q", now), addr)
    print(json.dumps({"got": got, "reordered": reordered, "owd_ns": owd_ns,
                      "reorder_examples": examples, "loss_runs": _loss_runs(train_seqs),
                      "train_unique": len(set(train_seqs)),
                      "train_early": _early(train_seqs),
                      "csum_errors": _udp_csum_errors() - csum0}),
          flush=True)


def _udp_csum_errors():
    """This namespace's UDP InCsumErrors (datagrams the kernel dropped for a bad checksum)."""
    with open("/proc/net/snmp") as f:
        rows = [ln.split() for ln in f if ln.startswith("Udp:")]
    return int(dict(zip(rows[0][1:], rows[1][1:])).get("InCsumErrors", 0))


def _early(seqs):
    """Packets (first arrivals) that arrived before one sent earlier than them: those a
    reorder sent ahead (netem's reorder), not those left behind."""
    first, seen = [], set()
    for q in seqs:
        if q not in seen:
            seen.add(q)
            first.append(q)
    early, low = 0, float("inf")
    for q in reversed(first):
        early += q > low
        low = min(low, q)
    return early


def _loss_runs(seqs):
    """Runs of consecutive missing sequence numbers below the highest one received."""
    seen = sorted(set(seqs))
    runs, expect = 0, 0
    for q in seen:
        runs += q > expect
        expect = q + 1
    return runs


def _udp_client(ip, port, probes, interval_s, train, train_pps):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.connect((ip, port))
    rtt_ns, rev_ns = [], []
    t0 = time.monotonic()
    for seq in range(probes):
        # wait for echoes until the next probe is due, so each is timed when it arrives
        _drain_echoes(s, rtt_ns, rev_ns, t0 + seq * interval_s - time.monotonic())
        s.send(HDR.pack(b"p", seq, time.monotonic_ns()))
    _drain_echoes(s, rtt_ns, rev_ns, 1.0, stop_at=probes)   # the last echoes: at most 1 s late
    pad = b"\0" * TRAIN_PAYLOAD
    t0 = time.monotonic()
    for seq in range(train):
        if seq % 16 == 0:
            pace(t0 + seq / train_pps)
        s.send(HDR.pack(b"t", seq, time.monotonic_ns()) + pad)
    time.sleep(0.05)
    for _ in range(5):   # 'e' may itself be lost; once it arrives the server is gone (ICMP)
        try:
            s.send(HDR.pack(b"e", 0, 0))
        except ConnectionRefusedError:
            break
        time.sleep(0.01)
    print(json.dumps({"rtt_ns": rtt_ns, "rev_ns": rev_ns, "sent": {"p": probes, "t": train}}),
          flush=True)


def pace(at):
    delay = at - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _drain_echoes(s, rtt_ns, rev_ns, wait_s, stop_at=None):
    end = time.monotonic() + wait_s
    while stop_at is None or len(rtt_ns) < stop_at:
        r, _, _ = select.select([s], [], [], max(0.0, end - time.monotonic()))
        if not r:
            return
        data = s.recv(2048)
        now = time.monotonic_ns()
        _, _, sent = HDR.unpack_from(data)
        (echoed,) = struct.unpack_from("!q", data, HDR.size)
        rtt_ns.append(now - sent)
        rev_ns.append(now - echoed)


def _tcp_sink(port, duration_s, gap_s=0.0):
    """Accept one connection, read it to the end; report the payload bytes received, and with
    `gap_s` > 0 every pause between two reads longer than it ([monotonic start, length])."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("ready", flush=True)
    srv.settimeout(10)
    conn, _ = srv.accept()
    conn.settimeout(5)
    buf = bytearray(1 << 20)
    total, gaps, last = 0, [], None
    try:
        while True:
            n = conn.recv_into(buf)
            now = time.monotonic()
            if gap_s > 0 and last is not None and now - last > gap_s:
                gaps.append([last, now - last])
            last = now
            if n == 0:
                break
            total += n
    except socket.timeout:
        pass
    print(json.dumps({"bytes": total, "bytes_received": _tcp_info(conn)["bytes_received"],
                      "gaps": gaps}), flush=True)


def _tcp_info(conn):
    """The struct tcp_info fields the probe uses (offsets of Linux's uapi linux/tcp.h)."""
    info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    out = {"snd_mss": struct.unpack_from("I", info, 16)[0],
           "bytes_received": struct.unpack_from("Q", info, 128)[0]}
    if len(info) >= 196:   # tcpi_delivered: Linux >= 4.18
        out["delivered"] = struct.unpack_from("I", info, 192)[0]
    return out


def _delivered_sample(conn):
    """(monotonic time, payload bytes the receiver has got: delivered segments x MSS). The time
    is the middle of the read: stamped before it alone, a sender descheduled inside the read
    (tens of ms on shared cores) counts bytes delivered after its stamp, and the slope reads
    high (a policed 40 Mbit/s link measured 41.1 Mbit/s of payload, above what its bucket
    can pass, 2026-12-03)."""
    t0 = time.monotonic()
    info = _tcp_info(conn)
    t1 = time.monotonic()
    if "delivered" not in info:
        raise SystemExit("tcp_info has no tcpi_delivered (Linux < 4.18): cannot measure goodput")
    return (t0 + t1) / 2, info["delivered"] * info["snd_mss"]


def _tcp_source(ip, port, duration_s):
    """Keep the socket's send buffer full for WARMUP_S + duration_s; report the delivered rate.

    Samples of (time, delivered bytes) are taken every SAMPLE_S by the sender while it still has
    data queued, so the link is saturated over the whole window (no start-up, no drain at the
    end). The rate is their least-squares slope: delivered grows in steps (one per ACK, one
    HTB burst at a time), and two end points alone misread a 1 s window at 10 Mbit/s by
    up to 0.3%."""
    s = socket.socket()
    set_congestion_control(s)              # $TESTBED_TCP_CC, as the KV senders of a run
    s.settimeout(5)
    s.connect((ip, port))
    s.setblocking(False)
    chunk = memoryview(b"\0" * (1 << 20))
    t0 = time.monotonic()
    t_next, t_end = t0 + WARMUP_S, t0 + WARMUP_S + duration_s
    samples, sent = [], 0
    while True:
        now = time.monotonic()
        if now >= t_next:
            samples.append(_delivered_sample(s))
            t_next += SAMPLE_S
        if now >= t_end:
            break
        # wake up when writable, or at the next sample time at the latest
        _, w, _ = select.select([], [s], [], max(0.0, min(t_next, t_end) - now))
        if w:
            try:
                sent += s.send(chunk)
            except BlockingIOError:
                pass
    samples.append(_delivered_sample(s))
    s.setblocking(True)
    s.close()
    print(json.dumps({"sent": sent, "window_bytes": samples[-1][1] - samples[0][1],
                      "window_s": samples[-1][0] - samples[0][0],
                      "rate_Bps": _slope(samples), "samples": len(samples)}), flush=True)


def _tcp_replier(port, size, trials, timeout_s):
    """Accept `trials` connections one after another; on each read `size` bytes, answer one byte
    and read on to the sender's close."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(4)
    print("ready", flush=True)
    srv.settimeout(timeout_s)
    for _ in range(trials):
        conn, _ = srv.accept()
        conn.settimeout(timeout_s)
        got = 0
        while got < size:
            n = len(conn.recv(size - got))
            if n == 0:
                break
            got += n
        conn.sendall(b"k")
        while conn.recv(4096):
            pass
        conn.close()
    print(json.dumps({"served": trials}), flush=True)


def _tcp_requests(ip, port, size, trials, settle_s):
    """`trials` fresh connections, one message of `size` bytes each; per message the time from
    the first write to the receiver's one-byte answer, and the sender's retransmissions."""
    times, retrans, rto_us = [], [], []
    msg = b"\0" * size
    for _ in range(trials):
        s = socket.socket()
        set_congestion_control(s)
        s.settimeout(10)
        s.connect((ip, port))
        time.sleep(settle_s)               # the handshake's last ACK is out; nothing in flight
        t0 = time.monotonic()
        s.sendall(msg)
        if s.recv(1) != b"k":
            raise SystemExit("tcp requests: the receiver closed before answering")
        times.append(time.monotonic() - t0)
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        retrans.append(struct.unpack_from("I", info, 100)[0])     # tcpi_total_retrans
        rto_us.append(struct.unpack_from("I", info, 8)[0])        # tcpi_rto
        s.close()
        time.sleep(settle_s)
    print(json.dumps({"times": times, "retrans": retrans, "rto_us": rto_us}), flush=True)


def _mtu_sink(port, timeout_s):
    """Answer each datagram with its IP size until an empty one comes or `timeout_s` passes."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    print("ready", flush=True)
    answered, deadline = 0, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r, _, _ = select.select([s], [], [], 0.5)
        if not r:
            continue
        data, addr = s.recvfrom(65535)
        if not data:
            break
        s.sendto(MTU_ACK.pack(len(data) + UDP_IP_HEADERS), addr)
        answered += 1
    print(json.dumps({"answered": answered}), flush=True)


def _mtu_probe(ip, port, lo, hi, wait_s, tries):
    """The largest IP size in [lo, hi] that crosses with DF set (None when not even `lo`
    does), by binary search; each size is sent up to `tries` times, `wait_s` for its answer.
    Unconnected, so an ICMP error is not reported to the socket; the kernel still learns the
    PMTU from it, which a connected socket's IP_MTU then reads (`learned_mtu`)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)

    def passes(size):
        for _ in range(tries):
            s.sendto(b"\0" * (size - UDP_IP_HEADERS), (ip, port))
            end = time.monotonic() + wait_s
            while (left := end - time.monotonic()) > 0:
                if not select.select([s], [], [], left)[0]:
                    break
                data = s.recv(64)
                if len(data) == MTU_ACK.size and MTU_ACK.unpack(data)[0] == size:
                    return True
        return False

    mtu, sent = None, 0
    if passes(lo):
        mtu = hi if passes(hi) else None
        top = hi
        while mtu is None:      # lo crosses, top does not
            mid = (lo + top) // 2
            lo, top = (mid, top) if passes(mid) else (lo, mid)
            sent += 1
            if top - lo <= 1:
                mtu = lo
    c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c.connect((ip, port))
    learned = c.getsockopt(socket.IPPROTO_IP, IP_MTU)
    s.sendto(b"", (ip, port))   # ends the sink
    print(json.dumps({"mtu": mtu, "learned_mtu": learned, "steps": sent}), flush=True)


def _slope(points):
    """Least-squares slope of y over x for [(x, y), ...]; 0.0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0


def main(argv):
    role, args = argv[0], argv[1:]
    if role == "udp-server":
        _udp_server(int(args[0]), float(args[1]))
    elif role == "udp-client":
        _udp_client(args[0], int(args[1]), int(args[2]), float(args[3]), int(args[4]),
                    float(args[5]))
    elif role == "tcp-sink":
        _tcp_sink(int(args[0]), float(args[1]), *map(float, args[2:3]))
    elif role == "tcp-source":
        _tcp_source(args[0], int(args[1]), float(args[2]))
    elif role == "tcp-replier":
        _tcp_replier(int(args[0]), int(args[1]), int(args[2]), float(args[3]))
    elif role == "mtu-sink":
        _mtu_sink(int(args[0]), float(args[1]))
    elif role == "mtu-probe":
        _mtu_probe(args[0], int(args[1]), int(args[2]), int(args[3]), float(args[4]),
                   int(args[5]))
    elif role == "tcp-requests":
        _tcp_requests(args[0], int(args[1]), int(args[2]), int(args[3]), float(args[4]))
    else:
        raise SystemExit(f"unknown probe role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
