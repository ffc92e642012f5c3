"""Measure a built link between two namespaces: the `link_fidelity` of a run.

Place in the architecture: after the network is built and before workers start, the run calls
`measure_link` across the WAN; `testbed linktest` and `benchmarks/link_fidelity.py` call it on a
link built alone. It measures, it never reads back what the shaper was told:

- RTT percentiles and one-way delay jitter from >= 100 UDP probes echoed by the far side. The
  RTT is timed on the sender's clock alone. Jitter is the standard deviation of the one-way
  delays (receiver's CLOCK_MONOTONIC at arrival minus the sender's at sending), taken above
  their minimum: a constant offset between the two clocks cancels, so it holds between two
  machines as between two namespaces of one (where the clock is the same); two clocks' rate
  difference (NTP keeps it under ~100 ppm) adds at most 0.1 ms across the 1 s of probes.
  Every other figure is counted on one side (loss, reordering: receiver; goodput: sender), so
  the probe needs no clock shared by its two ends (`testbed.backend.rayprobe`).
- goodput: TCP payload bits/s of a bulk transfer over `duration_s` after a warm-up: segments the
  receiver got (acknowledged or SACKed; `tcpi_delivered` x MSS of the sender's socket), sampled by
  the sender every 10 ms while its send buffer keeps the link saturated; the rate is the slope.
  The TCP payload of a 1514-byte frame is 1448 bytes, so at most 0.956 of the link rate.
  Not the receiver's in-order counter: after a loss, data already received waits in the
  out-of-order queue until the hole is filled, so a window that opens during a recovery counts
  bytes that crossed the link before it (measured: 0.97-0.99 of the rate while the router's HTB
  counters showed exactly 1.000 of it).
- loss: when loss is configured, a paced UDP train of `loss_packets` one way (below half the link
  rate, so the bottleneck queue never drops), counted at the receiver; also the mean length of
  the runs of consecutive missing packets (`loss_burst`, 1 / (1 - loss) for independent loss).
- loss recovery (`measure_requests`, not part of `measure_link`): message completion times
  with chosen segments dropped, against the same message without the drop.
- reordering: forward probes and train packets arriving below the highest sequence seen; the
  first few are kept with how late they came (`reorder_examples`), to tell a delay-line reorder
  (milliseconds) from one of the kernel's per-CPU receive queues (microseconds).

Each side runs as `nsenter --net=PATH python -m testbed.net.probe ROLE ...` (`testbed.net.ns`), a
child of this process that prints one JSON line (`ProbeProcess`); every wait on it is bounded.
A side can also be another host's (an object with `spawn`: `testbed.backend.rayprobe`).
"""

import json
import math
import os
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time

from testbed.errors import NetworkError
from testbed.net.ns import disable_offloads, ns_argv, ns_run, sysctl

TCP_PORT, UDP_PORT, REQ_PORT = 47001, 47002, 47003
MSS_PAYLOAD = 1448                # TCP payload of a 1500-byte MTU frame with timestamps
WARMUP_S = 0.5                  # slow start at 40 ms RTT reaches 1 Gbit/s well within this
PROBES, PROBE_INTERVAL_S = 200, 0.005
HDR = struct.Struct("!cIq")     # kind ('p' probe, 't' train, 'e' end), seq, send time ns
TRAIN_PAYLOAD = 100
DEVIATION_WARN = 0.10
REORDER_EXAMPLES = 20
SAMPLE_S = 0.01                 # goodput: the sender samples tcpi_delivered every 10 ms
GOODPUT_BASIS = ("TCP payload delivered (ACKed or SACKed) per second: slope of tcpi_delivered "
                 "x MSS sampled by the sender every 10 ms; at most 1448/1514 = 0.956 of the "
                 "layer-2 rate")


# ---------------------------------------------------------------- roles run inside a namespace

def _udp_server(port, timeout_s):
    """Echo probes (adding our receive time), count train packets; report at 'e' or timeout."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("0.0.0.0", port))
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
                      "reorder_examples": examples, "loss_runs": _loss_runs(train_seqs)}),
          flush=True)


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
            _pace(t0 + seq / train_pps)
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


def _pace(at):
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
    """(monotonic time, payload bytes the receiver has got: delivered segments x MSS)."""
    t = time.monotonic()
    info = _tcp_info(conn)
    if "delivered" not in info:
        raise SystemExit("tcp_info has no tcpi_delivered (Linux < 4.18): cannot measure goodput")
    return t, info["delivered"] * info["snd_mss"]


def _tcp_source(ip, port, duration_s):
    """Keep the socket's send buffer full for WARMUP_S + duration_s; report the delivered rate.

    Samples of (time, delivered bytes) are taken every SAMPLE_S by the sender while it still has
    data queued, so the link is saturated over the whole window (no start-up, no drain at the
    end). The rate is their least-squares slope: delivered grows in steps (one per ACK, one
    HTB burst at a time), and two end points alone misread a 1 s window at 10 Mbit/s by
    up to 0.3%."""
    from testbed.net.tcp import set_congestion_control
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
    from testbed.net.tcp import set_congestion_control
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


def _slope(points):
    """Least-squares slope of y over x for [(x, y), ...]; 0.0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0


# ---------------------------------------------------------------- orchestration

class ProbeProcess:
    """One probe role (`python -m testbed.net.probe ROLE ...`), a child of this process, run
    inside the namespace `ns_path` (None: this process's own, as on a Ray host where
    `testbed.backend.rayprobe.ProbeHost` runs it). `env`: variables added to its environment
    ($TESTBED_TCP_CC for the TCP source). Every wait on it is bounded."""

    def __init__(self, ns_path, *args, env=None):
        argv = ns_argv(ns_path, [sys.executable, "-m", "testbed.net.probe", *args])
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, **(env or {}),
                   PYTHONPATH=os.pathsep.join([repo] + os.environ.get("PYTHONPATH", "")
                                              .split(os.pathsep)))
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)

    def ready(self, what, timeout_s=5.0):
        """Wait for its 'ready' line; NetworkError (and the process killed) otherwise."""
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().strip() if r else ""
        if line != "ready":
            self.proc.kill()
            raise NetworkError(f"probe {what} did not start: "
                               f"{line or self.proc.stderr.read().strip()}")

    def result(self, what, timeout_s):
        """Its JSON result line, once it exits; NetworkError if none within `timeout_s`."""
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise NetworkError(f"probe {what} gave no result within {timeout_s:.0f} s") from None
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if self.proc.returncode != 0 or not lines:
            raise NetworkError(f"probe {what} failed: "
                               f"{err.strip().splitlines()[-1:] or self.proc.returncode}")
        return json.loads(lines[-1])

    def exited(self, timeout_s):
        """True once it has exited, waiting at most `timeout_s`."""
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def terminate(self):
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self):
        """Kill it if it still runs and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def _spawn(side, *args):
    """A probe role on `side`: a namespace path (or None) of this machine, or an object with
    `spawn(*args)` returning a ProbeProcess-like handle (another host's; `rayprobe`)."""
    if hasattr(side, "spawn"):
        return side.spawn(*args)
    return ProbeProcess(side, *args)


def _percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def measure_udp(src, dst, dst_ip, probes=PROBES, train=0, train_pps=1000.0):
    server = _spawn(dst, "udp-server", UDP_PORT, 60)
    try:
        server.ready("udp server")
        client = _spawn(src, "udp-client", dst_ip, UDP_PORT, probes, PROBE_INTERVAL_S, train,
                        train_pps)
        c = client.result("udp client", probes * PROBE_INTERVAL_S + train / train_pps + 15)
        if not server.exited(1.0):     # it stops at the client's 'e' packet
            server.terminate()         # 'e' was lost (link down): SIGTERM makes it report
        s = server.result("udp server", 5)
    finally:
        server.close()
    return c, s


def measure_goodput(src, dst, dst_ip, duration_s):
    """TCP payload goodput (bit/s) of src -> dst; see GOODPUT_BASIS and the module docstring."""
    sink = _spawn(dst, "tcp-sink", TCP_PORT, duration_s)
    try:
        sink.ready("tcp sink")
        source = _spawn(src, "tcp-source", dst_ip, TCP_PORT, duration_s)
        r = source.result("tcp source", duration_s + WARMUP_S + 15)
        rx = sink.result("tcp sink", 30)   # it reads what the source's buffer still held
    finally:
        sink.close()
    if rx["bytes"] < r["window_bytes"]:
        raise NetworkError(f"probe tcp sink read {rx['bytes']} bytes, fewer than the "
                           f"{r['window_bytes']} the sender counted as delivered")
    return 8 * r["rate_Bps"]


def measure_stalls(link, cuts, cut_s, period_s, warmup_s):
    """Receiver stalls of a bulk TCP flow across `link` (a `testbed.net.pair.routed_pair`) cut `cuts` times.

    After `warmup_s`, the kv direction goes down for `cut_s` every `period_s`
    (`Wan.set("kv", up=False)`; ACKs still flow). For each cut, the stall is the pause in the receiver's reads that spans the
    restore: from the last data before the cut to the first after it, so the cut itself plus
    however long TCP took to notice the link was back (its retransmission timeout and backoff).
    Returns the stalls in seconds of this link's (emulated) time, one per cut, None where the
    receiver showed no pause across a restore.
    """
    duration_s = warmup_s + cuts * period_s
    sink = _spawn(link.dst, "tcp-sink", TCP_PORT, duration_s, cut_s / 2)
    windows = []
    try:
        sink.ready("tcp sink")
        source = _spawn(link.src, "tcp-source", link.dst_ip, TCP_PORT, duration_s - WARMUP_S)
        t0 = time.monotonic()
        for k in range(cuts):
            _pace(t0 + warmup_s + k * period_s)         # on schedule: the cuts are the experiment
            down = time.monotonic()
            link.wan.set("kv", up=False)
            _pace(down + cut_s)
            up = time.monotonic()
            link.wan.set("kv", up=True)
            windows.append((up, time.monotonic()))
        source.result("tcp source", duration_s + 15)
        gaps = sink.result("tcp sink", 30)["gaps"]
    finally:
        sink.close()
    # The restore takes effect somewhere within its set() call (an iptables-restore, 5-30 ms
    # here): the stall is the longest pause overlapping that call.
    return [max((length for start, length in gaps if start <= end and start + length >= begin),
                default=None) for begin, end in windows]


def _drop_rules(op, port, packets):
    """iptables argv lists adding (-A) or deleting (-D) a DROP of the connection's packets
    numbered `packets` (conntrack's count in the original direction, 1 = the SYN)."""
    return [["iptables", "-w", op, "INPUT", "-p", "tcp", "--dport", str(port), "-m",
             "connbytes", "--connbytes", f"{n}:{n}", "--connbytes-dir", "original",
             "--connbytes-mode", "packets", "-j", "DROP"] for n in packets]


def _iptables(ns, rules, check=True):
    for argv in rules:
        r = ns_run(ns, argv, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise NetworkError(f"{' '.join(argv[:4])} in {ns}: {r.stderr.strip() or r.returncode}")


def measure_requests(link, segments, drop=(), trials=20, settle_s=0.05):
    """Message completion times over `link` (a `testbed.net.pair.routed_pair`), one fresh
    connection per message, with chosen segments dropped as they reach the receiver (iptables in
    its namespace, before TCP sees them: lost on the way, to the sender; a drop in the sender's
    own OUTPUT chain would fail the send instead, and TCP would just send again).

    Each message is `segments` full segments (MSS_PAYLOAD bytes each: the src host sends single
    frames, its segmentation offload off); its time runs from the first write to the receiver's
    one-byte answer once it has read the whole message. `drop` numbers the packets to drop:
    1 is the message's first segment, `segments` its last, `segments + 1` the first packet after
    it (the last segment's retransmission, when nothing else is sent in between); every trial
    loses the same packets. The hosts keep no TCP metrics between connections, so each trial
    starts alike. Returns {"times": [s], "retrans": [segments retransmitted], "rto_us": [the
    sender's RTO at the end]} in this link's (emulated) time; `settle_s` is the pause after the
    handshake and after each message."""
    src_if = f"{link.names[0]}0"
    disable_offloads(link.src, src_if)
    for end in (link.src, link.dst):
        sysctl(end, "net.ipv4.tcp_no_metrics_save=1")
    size = segments * MSS_PAYLOAD
    packets = [n + 2 for n in drop]          # conntrack counts the SYN and the handshake's ACK
    sink = _spawn(link.dst, "tcp-replier", REQ_PORT, size, trials, 30)
    _iptables(link.dst, _drop_rules("-A", REQ_PORT, packets))
    try:
        sink.ready("tcp replier")
        source = _spawn(link.src, "tcp-requests", link.dst_ip, REQ_PORT, size, trials, settle_s)
        out = source.result("tcp requests", 60 + trials * (1 + 2 * settle_s))
        sink.result("tcp replier", 10)
    finally:
        _iptables(link.dst, _drop_rules("-D", REQ_PORT, packets), check=False)
        sink.close()
    return out


def _expected(configured):
    fwd = configured
    rev = configured.get("reverse", configured)
    return {"goodput_bps": fwd["rate"],
            "rtt_ms": 1e3 * (fwd.get("delay", 0.0) + rev.get("delay", 0.0)),
            "jitter_ms": 1e3 * fwd.get("jitter", 0.0),
            "loss": fwd.get("loss", 0.0),
            "loss_burst": fwd.get("loss_burst") if fwd.get("loss", 0.0) > 0 else None}


def measure_link(src_ns_path, dst_ns_path, dst_ip, configured, duration_s=2.0,
                 loss_packets=20000, probes=PROBES):
    """Configured vs measured for the src -> dst direction of a built link.

    src_ns_path, dst_ns_path: the two ends, namespace paths of this machine or other hosts'
    sides (`_spawn`).

    configured: the forward direction's emulated parameters {rate (bit/s), delay (s), jitter (s),
    loss}, optionally with a "reverse" dict of the same keys (else the link is symmetric).
    Returns {"configured", "measured": {goodput_bps, rtt_p50_ms, rtt_p99_ms, jitter_ms, loss,
    loss_burst, reordered, ...}, "deviation", "warnings"}. `goodput_bps` is TCP payload delivered
    (GOODPUT_BASIS); `jitter_ms` is the standard deviation of the one-way delay; `loss` and
    `loss_burst` (mean run of consecutive losses) are None unless loss is configured.
    """
    exp = _expected(configured)
    want_loss = exp["loss"] > 0
    train = loss_packets if want_loss else 0
    # the train stays under half the link rate so only the configured loss drops it
    train_pps = max(200.0, min(20000.0, 0.5 * configured["rate"] / (8 * (TRAIN_PAYLOAD + 70))))
    c, s = measure_udp(src_ns_path, dst_ns_path, dst_ip, probes, train, train_pps)
    goodput = measure_goodput(src_ns_path, dst_ns_path, dst_ip, duration_s)
    rtt_ms = [x / 1e6 for x in c["rtt_ns"]]
    # one-way delays above the smallest: a constant offset between the two ends' clocks cancels
    owd_ms = [(x - min(s["owd_ns"])) / 1e6 for x in s["owd_ns"]]
    measured = {
        "goodput_bps": goodput,
        "rtt_p50_ms": _percentile(rtt_ms, 0.5),
        "rtt_p99_ms": _percentile(rtt_ms, 0.99),
        "jitter_ms": statistics.pstdev(owd_ms) if len(owd_ms) > 1 else float("nan"),
        "loss": (1 - s["got"]["t"] / train) if want_loss else None,
        "loss_burst": _mean_burst(train, s["got"]["t"], s.get("loss_runs", 0)) if want_loss
        else None,
        "reordered": s["reordered"]["p"] + s["reordered"]["t"],
        "reorder_examples": [{"kind": "probe" if k == "p" else "train", "seq": q,
                              "after_seq": top, "late_us": round(ns / 1e3, 1)}
                             for k, q, top, ns in s.get("reorder_examples", [])],
        "goodput_basis": GOODPUT_BASIS,
        "probes": len(rtt_ms),
        "loss_packets": train,
    }
    deviation, warnings = compare(exp, measured)
    return {"configured": {**{k: configured.get(k) for k in
                              ("rate", "delay", "jitter", "loss", "loss_burst", "queue")},
                           "expected": exp},
            "measured": measured, "deviation": deviation, "warnings": warnings}


def _mean_burst(sent, got, runs):
    """Mean run of consecutive lost train packets (losses after the last received one count in
    the last run), or None when nothing was lost."""
    lost = sent - got
    return lost / max(runs, 1) if lost > 0 else None


def compare(exp, measured):
    """Relative deviations measured vs expected, and a warning for each above 10%.

    Goodput is compared with the TCP payload share (0.956) of the rate; RTT with an
    absolute floor (0.3 ms is 10% of 3 ms) so that a 0 ms link is not "infinitely" off."""
    dev, warn = {}, []
    payload_rate = exp["goodput_bps"] * 1448 / 1514
    dev["goodput"] = measured["goodput_bps"] / payload_rate - 1
    dev["rtt_p50"] = (measured["rtt_p50_ms"] - exp["rtt_ms"]) / max(exp["rtt_ms"], 3.0)
    if exp["jitter_ms"] > 0:
        dev["jitter"] = measured["jitter_ms"] / exp["jitter_ms"] - 1
    if exp["loss"] > 0 and measured["loss"] is not None:
        dev["loss"] = measured["loss"] / exp["loss"] - 1
    if exp.get("loss_burst") and measured.get("loss_burst"):
        dev["loss_burst"] = measured["loss_burst"] / exp["loss_burst"] - 1
    limit = dict.fromkeys(dev, DEVIATION_WARN)
    if "loss" in dev and measured.get("loss_packets"):
        # a loss count is binomial: three standard errors of the count, at least 10%
        limit["loss"] = max(DEVIATION_WARN, 3 / math.sqrt(measured["loss_packets"] * exp["loss"]))
    for k, v in dev.items():
        if k == "goodput" and exp["loss"] > 0:
            continue        # under random loss TCP goodput is the congestion control's, no target
        if abs(v) > limit[k]:
            warn.append(f"{k} deviates {v:+.0%} from configured")
    if measured["reordered"]:
        warn.append(f"{measured['reordered']} packets arrived out of order")
    return {k: round(v, 4) for k, v in dev.items()}, warn


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
    elif role == "tcp-requests":
        _tcp_requests(args[0], int(args[1]), int(args[2]), int(args[3]), float(args[4]))
    else:
        raise SystemExit(f"unknown probe role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
