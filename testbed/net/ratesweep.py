"""The delay line's own rate sweep: how fast the userspace delay line carries TCP, against the
raw veth rate of the same topology measured in the same run.

Per configured rate (default 1, 2, 5, 8 Gbit/s, 5 ms each way), with no loss and with a small
loss (0.1%, which turns segmentation offload off, so every 1514-byte frame is one delay-line
packet): the TCP goodput over the rate and over the raw veth goodput (`raw_veth`: the link built
as for the sweep, then its `Wan` removed; same offload setting); the idle RTT's error (p50 - 2 x
delay); the one-way delay of probes on the reverse (ACK) direction while the bulk flow runs, so
through a delay line under load with an empty bottleneck queue; reordering seen by the probes and
by TCP (the sender's reordering counters); how late the forward delay line released packets by
its own clock, and its CPU share.

Measurement only (root: it builds `testbed.net.pair.routed_pair` links); benchmarks print it
(benchmarks/link_fidelity.py --rate-sweep, benchmarks/emulation_speed.py --sweep), and
docs/performance.md quotes their tables.
"""

import dataclasses
import os
import pathlib
import subprocess
import threading
import time

from testbed.net import probe
from testbed.net.linkmodel import check_params
from testbed.net.pair import routed_pair

SWEEP_RATES = (1e9, 2e9, 5e9, 8e9)
SWEEP_DELAY_S = 0.005
SWEEP_LOSSES = (0.0, 0.001)   # 0.1%: small enough for TCP to keep the rate, turns TSO/GSO off
SWEEP_S = 3.0                 # bulk TCP per point, after probe.WARMUP_S
SWEEP_IDLE_PROBES = 100
SWEEP_LOADED_PROBES = 300     # 1.5 s of reverse probes inside the bulk transfer


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One configured rate through the delay line, next to the raw veth goodput of the run."""
    rate_bps: float
    loss: float
    delay_s: float
    goodput_bps: float
    raw_bps: float                 # unshaped veth goodput, same run, same offload setting
    rtt_p50_ms: float              # idle, both directions through a delay line
    owd_loaded_p50_ms: float       # reverse direction while the bulk flow runs
    owd_loaded_p99_ms: float
    probes_reordered: int          # idle and loaded probes
    tcp_reorder_events: int        # the bulk sender's TcpExt *Reorder counters
    late_mean_us: float | None     # the forward delay line's release - due time (its own clock)
    late_max_us: float | None
    delayline_cpu: float           # forward delay line, share of one core during the bulk flow
    queue_drops: int               # the forward bottleneck queue (HTB + bfifo)

    @property
    def rtt_error_ms(self):
        return self.rtt_p50_ms - 2e3 * self.delay_s

    @property
    def owd_error_ms(self):
        return self.owd_loaded_p50_ms - 1e3 * self.delay_s

    @property
    def reordered(self):
        return self.probes_reordered + self.tcp_reorder_events


def _tcp_reorder_events(ns_path):
    """Sum of the TcpExt *Reorder counters (reordering TCP detected) in a namespace."""
    text = subprocess.run(["nsenter", f"--net={ns_path}", "cat", "/proc/net/netstat"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    for names, values in zip(text[::2], text[1::2]):
        if names.startswith("TcpExt:"):
            return sum(int(v) for k, v in zip(names.split()[1:], values.split()[1:])
                       if k.endswith("Reorder"))
    return 0


def _cpu_s(pid):
    """User + system CPU seconds of a process so far."""
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True)
class RawVeth:
    """The same src - router - dst namespaces with no shaping at all: what the veths carry."""
    per_frame: bool                # segmentation offload off on the end hosts, as with loss
    goodput_bps: float
    tcp_reorder_events: int        # the kernel's own reordering (per-CPU receive queues)
    rtt_p50_ms: float              # idle probes: the stack's own RTT, no delay line


def raw_veth(per_frame, duration_s=SWEEP_S):
    """Measure RawVeth: the link is built as for the sweep, then its `Wan` removed."""
    d = check_params({"rate": 1e9, "loss": SWEEP_LOSSES[1] if per_frame else 0.0}, "raw")
    with routed_pair({"kv": d, "request": d}) as link:
        link.wan.stop()
        c, _ = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=SWEEP_IDLE_PROBES)
        reorder0 = _tcp_reorder_events(link.src)
        goodput = probe.measure_goodput(link.src, link.dst, link.dst_ip, duration_s)
        return RawVeth(per_frame, goodput, _tcp_reorder_events(link.src) - reorder0,
                       probe._percentile([x / 1e6 for x in c["rtt_ns"]], 0.5))


def _loaded(link, duration_s):
    """Bulk TCP src -> dst while probes go dst -> src: (goodput, probe client, probe server)."""
    out = {}
    bulk = threading.Thread(target=lambda: out.setdefault(
        "goodput", probe.measure_goodput(link.src, link.dst, link.dst_ip, duration_s)))
    bulk.start()
    try:
        time.sleep(probe.WARMUP_S + 0.2)   # past slow start: the queue and the line are loaded
        c, s = probe.measure_udp(link.dst, link.src, link.src_ip, probes=SWEEP_LOADED_PROBES)
    finally:
        bulk.join()
    if "goodput" not in out:
        raise RuntimeError("bulk transfer failed (see its traceback above)")
    return out["goodput"], c, s


def sweep_point(rate, loss, raw_bps, delay_s=SWEEP_DELAY_S, duration_s=SWEEP_S):
    """Measure one configured rate (see the module docstring); returns a SweepPoint."""
    d = check_params({"rate": rate, "delay": delay_s, "loss": loss}, "sweep")
    with routed_pair({"kv": d, "request": d}) as link:
        c, s = probe.measure_udp(link.src, link.dst, link.dst_ip, probes=SWEEP_IDLE_PROBES)
        rtt_ms = [x / 1e6 for x in c["rtt_ns"]]
        forward = link.wan._delaylines["kv"]
        pid, reorder0 = forward.proc.pid, _tcp_reorder_events(link.src)
        cpu0, drops0, t0 = _cpu_s(pid), link.wan.stats()["kv"]["drops"], time.monotonic()
        goodput, lc, ls = _loaded(link, duration_s)
        cpu = (_cpu_s(pid) - cpu0) / (time.monotonic() - t0)
        drops = link.wan.stats()["kv"]["drops"] - drops0
        owd_ms = [x / 1e6 for x in ls["owd_ns"]]
        dl = forward.counters()
        late_mean = dl["late_sum_ns"] / max(dl["passed"], 1) / 1e3 if "late_sum_ns" in dl else None
        return SweepPoint(
            rate_bps=rate, loss=loss, delay_s=delay_s, goodput_bps=goodput, raw_bps=raw_bps,
            rtt_p50_ms=probe._percentile(rtt_ms, 0.5),
            owd_loaded_p50_ms=probe._percentile(owd_ms, 0.5),
            owd_loaded_p99_ms=probe._percentile(owd_ms, 0.99),
            probes_reordered=s["reordered"]["p"] + ls["reordered"]["p"],
            tcp_reorder_events=_tcp_reorder_events(link.src) - reorder0,
            late_mean_us=late_mean,
            late_max_us=dl["late_max_ns"] / 1e3 if "late_max_ns" in dl else None,
            delayline_cpu=cpu, queue_drops=drops)


def delayline_sweep(rates=SWEEP_RATES, losses=SWEEP_LOSSES, duration_s=SWEEP_S):
    """Yield ({per_frame: RawVeth}, SweepPoint) for every rate x loss; the raw veth rates are
    measured first, in the same run, with and without segmentation offload."""
    raw = {per_frame: raw_veth(per_frame, duration_s)
           for per_frame in sorted({loss > 0 for loss in losses})}
    for loss in losses:
        for rate in rates:
            yield raw, sweep_point(rate, loss, raw[loss > 0].goodput_bps,
                                   duration_s=duration_s)


SWEEP_HEADER = ("| rate | loss | goodput Gbit/s | goodput/rate | goodput/raw veth | RTT err ms "
                "| loaded OWD err p50/p99 ms | reordered (probes+TCP) | late mean/max us "
                "| delay line CPU | queue drops |\n"
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def fmt_sweep_row(p):
    late = "-" if p.late_mean_us is None else f"{p.late_mean_us:.0f}/{p.late_max_us:.0f}"
    owd_p99_error_ms = p.owd_loaded_p99_ms - 1e3 * p.delay_s
    return (f"| {p.rate_bps / 1e9:g}G | {p.loss:.1%} | {p.goodput_bps / 1e9:.2f} "
            f"| {p.goodput_bps / p.rate_bps:.3f} | {p.goodput_bps / p.raw_bps:.3f} "
            f"| {p.rtt_error_ms:+.2f} | {p.owd_error_ms:+.2f}/{owd_p99_error_ms:+.2f} "
            f"| {p.probes_reordered}+{p.tcp_reorder_events} | {late} "
            f"| {p.delayline_cpu:.2f} | {p.queue_drops} |")


def fmt_raw(r):
    return (f"raw veth (no shaping), offload {'off' if r.per_frame else 'on'}: goodput "
            f"{r.goodput_bps / 1e9:.2f} Gbit/s, TCP reorder events {r.tcp_reorder_events}, "
            f"idle RTT p50 {r.rtt_p50_ms:.3f} ms")
