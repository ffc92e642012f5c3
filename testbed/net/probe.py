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

This module orchestrates; what runs on the two ends is `testbed.net.proberoles`. Each side runs
as `nsenter --net=PATH python -m testbed.net.proberoles ROLE ...` (`testbed.net.ns`), a child of
this process that prints one JSON line (`ProbeProcess`); every wait on it is bounded. A side can
also be another host's (an object with `spawn`: `testbed.backend.rayprobe`).
"""

import json
import math
import os
import select
import statistics
import subprocess
import sys
import time

from testbed.errors import NetworkError
from testbed.net.ns import disable_offloads, ns_argv, ns_run, sysctl
from testbed.net.proberoles import TRAIN_PAYLOAD, WARMUP_S, pace

TCP_PORT, UDP_PORT, REQ_PORT, MTU_PORT = 47001, 47002, 47003, 47004
HOST_MTU = 1500                   # the end hosts' interfaces (linkmodel.MTU_RANGE's top)
MTU_FLOOR = 552                   # the search's bottom: Linux's smallest path MTU
POLICE_PAYLOAD = 1448 / 1500      # TCP payload per IP byte, what the policer counts
MSS_PAYLOAD = 1448                # TCP payload of a 1500-byte MTU frame with timestamps
PROBES, PROBE_INTERVAL_S = 200, 0.005
DEVIATION_WARN = 0.10
# RTT p50 warns beyond max(0.05 ms, 5% of configured) on a calibrated path (its fixed cost
# subtracted, testbed.net.calibrate); an uncalibrated one (Ray's host shaping) keeps the 10%
# of the other keys, with a 0.3 ms floor (the machine's own cost, docs/link.md)
RTT_WARN, RTT_WARN_FLOOR_MS = 0.05, 0.05
RTT_UNCALIBRATED_FLOOR_MS = 0.3
GOODPUT_BASIS = ("TCP payload delivered (ACKed or SACKed) per second: slope of tcpi_delivered "
                 "x MSS sampled by the sender every 10 ms; at most 1448/1514 = 0.956 of the "
                 "layer-2 rate")


class ProbeProcess:
    """One probe role (`python -m testbed.net.proberoles ROLE ...`), a child of this process, run
    inside the namespace `ns_path` (None: this process's own, as on a Ray host where
    `testbed.backend.rayprobe.ProbeHost` runs it). `env`: variables added to its environment
    ($TESTBED_TCP_CC for the TCP source). Every wait on it is bounded."""

    def __init__(self, ns_path, *args, env=None):
        argv = ns_argv(ns_path, [sys.executable, "-m", "testbed.net.proberoles", *args])
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


def measure_rtt_ms(src, dst, dst_ip, probes=PROBES, q=0.5):
    """The `q` quantile (default: the median) of the RTTs (ms) of `probes` UDP echoes
    src -> dst, as `measure_link` times them; a list of them when `q` is a list."""
    c, _ = measure_udp(src, dst, dst_ip, probes)
    if not c["rtt_ns"]:
        raise NetworkError(f"no UDP echo came back from {dst_ip} (is the link up?)")
    rtts = [x / 1e6 for x in c["rtt_ns"]]
    return [_percentile(rtts, x) for x in q] if isinstance(q, list) else _percentile(rtts, q)


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


def measure_mtu(src, dst, dst_ip, wait_s, tries=3):
    """{'mtu': the largest IP packet that crosses src -> dst with DF set (None: not even
    MTU_FLOOR bytes), 'learned_mtu': the path MTU src's kernel learned from ICMP meanwhile
    (HOST_MTU when none came)}: a binary search of DF datagrams, each answered by the far side."""
    sink = _spawn(dst, "mtu-sink", MTU_PORT, 60)
    try:
        sink.ready("mtu sink")
        probe = _spawn(src, "mtu-probe", dst_ip, MTU_PORT, MTU_FLOOR, HOST_MTU, wait_s, tries)
        out = probe.result("mtu probe", 12 * tries * wait_s + 15)
        if not sink.exited(1.0):
            sink.terminate()
    finally:
        sink.close()
    return {"mtu": out["mtu"], "learned_mtu": out["learned_mtu"]}


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
            pace(t0 + warmup_s + k * period_s)         # on schedule: the cuts are the experiment
            down = time.monotonic()
            link.wan.set("kv", up=False)
            pace(down + cut_s)
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


def deviation_warning(key, value):
    """The probe's warning for measured `key` off its configured value by `value` (a share)."""
    return f"{key} deviates {value:+.0%} from configured"


def round_trip_ms(configured):
    """The configured RTT (ms) of a link's parameters: both directions' delay."""
    return 1e3 * (configured.get("delay", 0.0)
                  + configured.get("reverse", configured).get("delay", 0.0))


def _expected(configured):
    fwd = configured
    return {"goodput_bps": fwd["rate"],
            "rtt_ms": round_trip_ms(configured),
            "jitter_ms": 1e3 * fwd.get("jitter", 0.0),
            "loss": fwd.get("loss", 0.0),
            "loss_burst": fwd.get("loss_burst") if fwd.get("loss", 0.0) > 0 else None,
            **{k: fwd.get(k, 0.0) for k in ("corrupt", "duplicate")},
            "reorder_share": _reorder_share(fwd.get("reorder_prob", 0.0),
                                            fwd.get("reorder_gap", 1)),
            "mtu": fwd.get("mtu") or None, "mtu_icmp": fwd.get("mtu_icmp", True),
            "police_bps": fwd.get("police") or None}


def pmtu_blackhole(exp):
    """True when the expected path drops the hosts' full-size packets without telling them:
    TCP with the hosts' MSS then moves nothing (no goodput to measure)."""
    return bool(exp["mtu"]) and exp["mtu"] < HOST_MTU and not exp["mtu_icmp"]


def _reorder_share(p, gap):
    """Share of packets netem's reorder P gap G sends ahead: one per G - 1 + 1/P packets."""
    return p / (1 + (gap - 1) * p) if p > 0 else 0.0


def measure_link(src_ns_path, dst_ns_path, dst_ip, configured, duration_s=2.0,
                 loss_packets=20000, probes=PROBES, calibrated=False):
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
    steady = exp["corrupt"] > 0 or exp["duplicate"] > 0 or exp["reorder_share"] > 0
    train = loss_packets if want_loss or steady else 0
    # the train stays under half the link rate so only the configured loss drops it
    train_pps = max(200.0, min(20000.0, 0.5 * configured["rate"] / (8 * (TRAIN_PAYLOAD + 70))))
    c, s = measure_udp(src_ns_path, dst_ns_path, dst_ip, probes, train, train_pps)
    rtt_ms = [x / 1e6 for x in c["rtt_ns"]]
    path = dict.fromkeys(("mtu", "learned_mtu"))
    if exp["mtu"]:
        path = measure_mtu(src_ns_path, dst_ns_path, dst_ip,
                           wait_s=2 * max(rtt_ms, default=100.0) / 1e3 + 0.02)
    goodput = (None if pmtu_blackhole(exp) else
               measure_goodput(src_ns_path, dst_ns_path, dst_ip, duration_s))
    # one-way delays above the smallest: a constant offset between the two ends' clocks cancels
    owd_ms = [(x - min(s["owd_ns"])) / 1e6 for x in s["owd_ns"]]
    measured = {
        "goodput_bps": goodput,
        "rtt_p10_ms": _percentile(rtt_ms, 0.1),
        "rtt_p50_ms": _percentile(rtt_ms, 0.5),
        "rtt_p99_ms": _percentile(rtt_ms, 0.99),
        "jitter_ms": statistics.pstdev(owd_ms) if len(owd_ms) > 1 else float("nan"),
        "loss": (1 - s["train_unique"] / train) if want_loss else None,
        "loss_burst": _mean_burst(train, s["train_unique"], s.get("loss_runs", 0)) if want_loss
        else None,
        **_steady_measured(exp, s, train, probes),
        **path,
        "reordered": s["reordered"]["p"] + s["reordered"]["t"],
        "reorder_examples": [{"kind": "probe" if k == "p" else "train", "seq": q,
                              "after_seq": top, "late_us": round(ns / 1e3, 1)}
                             for k, q, top, ns in s.get("reorder_examples", [])],
        "goodput_basis": GOODPUT_BASIS,
        "probes": len(rtt_ms),
        "loss_packets": train,
    }
    deviation, warnings = compare(exp, measured, calibrated)
    return {"configured": {**{k: configured.get(k) for k in
                              ("rate", "delay", "jitter", "loss", "loss_burst", "queue",
                               "corrupt", "duplicate", "reorder_prob", "reorder_gap", "mtu",
                               "mtu_icmp", "police", "police_burst")},
                           "expected": exp},
            "measured": measured, "deviation": deviation, "warnings": warnings,
            "calibrated": calibrated}


def _steady_measured(exp, s, train, probes):
    """Corruption (the receiver's UDP checksum drops per datagram sent to it), duplication
    (train packets received twice) and the reorder share (train packets that arrived ahead of
    one sent before them), measured when configured; None otherwise."""
    out = dict.fromkeys(("corrupt", "duplicate", "reorder_share"))
    if exp["corrupt"] > 0 and train:
        out["corrupt"] = s["csum_errors"] / (train + probes)
    if exp["duplicate"] > 0 and s["train_unique"]:
        out["duplicate"] = (s["got"]["t"] - s["train_unique"]) / s["train_unique"]
    if exp["reorder_share"] > 0 and s["train_unique"]:
        out["reorder_share"] = s["train_early"] / s["train_unique"]
    return out


def _mtu_warnings(exp, m):
    """The path MTU is exact: the largest DF packet that crossed, and what the sender learned
    from ICMP (the configured MTU, or nothing under `mtu_icmp: false`)."""
    out = []
    if m.get("mtu") != exp["mtu"]:
        out.append(f"path MTU measured {m.get('mtu')}, configured {exp['mtu']}")
    learned = m.get("learned_mtu")
    if exp["mtu"] < HOST_MTU and exp["mtu_icmp"] and learned != exp["mtu"]:
        out.append(f"the sender learned a path MTU of {learned} from ICMP, configured "
                   f"{exp['mtu']}")
    if not exp["mtu_icmp"] and learned is not None and learned < HOST_MTU:
        out.append(f"ICMP fragmentation-needed reached the sender (it learned {learned}) though "
                   "mtu_icmp is false")
    return out


def _mean_burst(sent, got, runs):
    """Mean run of consecutive lost train packets (losses after the last received one count in
    the last run), or None when nothing was lost."""
    lost = sent - got
    return lost / max(runs, 1) if lost > 0 else None


def rtt_limit(calibrated=True):
    """(share, ms): the RTT p50 warns beyond max(ms, share of the configured RTT)."""
    return ((RTT_WARN, RTT_WARN_FLOOR_MS) if calibrated else
            (DEVIATION_WARN, RTT_UNCALIBRATED_FLOOR_MS))


def compare(exp, measured, calibrated=True):
    """Relative deviations measured vs expected, and a warning for each above 10%.

    Goodput is compared with the TCP payload share (0.956) of the rate. The RTT deviation is
    relative to the configured RTT itself and warns beyond max(0.05 ms, 5%) of it where the
    path was `calibrated`, else beyond max(0.3 ms, 10%); a 0 ms link has no relative deviation
    (its RTT is the hosts' own stack, docs/link.md)."""
    dev, warn = {}, []
    mtu = exp.get("mtu") or HOST_MTU    # TCP payload: MTU - 52 (headers, timestamps) a frame
    payload_rate = exp["goodput_bps"] * (mtu - 52) / (mtu + 14)
    police = exp.get("police_bps")
    if police:
        payload_rate = min(payload_rate, police * POLICE_PAYLOAD)
    if measured["goodput_bps"] is not None:
        dev["goodput"] = measured["goodput_bps"] / payload_rate - 1
    if exp["rtt_ms"] > 0:
        dev["rtt_p50"] = measured["rtt_p50_ms"] / exp["rtt_ms"] - 1
    if exp["jitter_ms"] > 0:
        dev["jitter"] = measured["jitter_ms"] / exp["jitter_ms"] - 1
    if exp["loss"] > 0 and measured["loss"] is not None:
        dev["loss"] = measured["loss"] / exp["loss"] - 1
    for k in ("corrupt", "duplicate", "reorder_share"):
        if exp.get(k) and measured.get(k) is not None:
            dev[k] = measured[k] / exp[k] - 1
    if exp.get("loss_burst") and measured.get("loss_burst"):
        dev["loss_burst"] = measured["loss_burst"] / exp["loss_burst"] - 1
    limit = dict.fromkeys(dev, DEVIATION_WARN)
    if "rtt_p50" in dev:
        share, floor_ms = rtt_limit(calibrated)
        limit["rtt_p50"] = max(share, floor_ms / exp["rtt_ms"])
    if "loss" in dev and measured.get("loss_packets"):
        # a loss count is binomial: three standard errors of the count, at least 10%
        limit["loss"] = max(DEVIATION_WARN, 3 / math.sqrt(measured["loss_packets"] * exp["loss"]))
    for k in ("corrupt", "duplicate", "reorder_share"):
        if k in dev and measured.get("loss_packets"):    # counts too: binomial, as loss
            limit[k] = max(DEVIATION_WARN, 3 / math.sqrt(measured["loss_packets"] * exp[k]))
    for k, v in dev.items():
        if k == "goodput" and exp["loss"] > 0:
            continue        # under random loss TCP goodput is the congestion control's, no target
        if k == "goodput" and police:   # below a policer's rate is TCP's; above it is not
            if v > limit[k]:
                warn.append(f"goodput {v:+.0%} above the policer's rate (TCP payload)")
            continue
        if abs(v) > limit[k]:
            warn.append(deviation_warning(k, v))
    if exp.get("mtu"):
        warn += _mtu_warnings(exp, measured)
    if measured["reordered"] and not exp.get("reorder_share"):
        warn.append(f"{measured['reordered']} packets arrived out of order")
    return {k: round(v, 4) for k, v in dev.items()}, warn
