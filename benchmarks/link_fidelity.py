"""Link fidelity sweep: configured vs measured WAN, side by side, on one backend.

Sweeps rate {10M, 100M, 1G} x delay {0, 5, 20 ms} x jitter {0, 2 ms} x loss {0, 1%} over a link
built alone (`testbed.net.pair.routed_pair`, the same `Wan` a run uses) and measures
each with `testbed.net.probe.measure_link`. Prints one row per point with the ratios the issue's
targets are stated in; not part of the test suite's pass/fail.

    sudo .venv/bin/python benchmarks/link_fidelity.py [--quick] [--backend userspace] [--json F]

Targets: goodput / rate >= 0.93 at 0 loss (TCP payload delivered, tcpi_delivered x MSS at the
sender: `probe.GOODPUT_BASIS`; its share of a 1514-byte frame is 0.956);
RTT p50 within max(0.3 ms, 5%) of 2 x delay; one-way jitter sd within 30% of configured;
loss within 25% relative over >= 20,000 packets; no reordering. After the sweep, a few burst-loss
points (Gilbert chain in the delay line) compare measured loss and mean burst length with the
configured ones (--no-burst skips them).

`--rate-sweep` instead measures how fast the delay line itself carries (`delayline_sweep`, also
for benchmarks/emulation_speed.py): per configured rate (1, 2, 5, 8 Gbit/s, 5 ms each way), with
no loss and with a small loss (0.1%, which turns segmentation offload off, so every 1514-byte
frame is one delay-line packet), the TCP goodput over the rate and over the raw veth goodput of
the same topology without shaping (measured in the same run, same offload setting); the idle
RTT's error (p50 - 2 x delay; the raw veth's idle RTT, printed above the table, is the stack's
share of it); the one-way delay of probes on the reverse (ACK) direction while the bulk flow runs,
so through a delay line under load with an empty bottleneck queue; reordering seen by the probes
and by TCP (the sender's reordering counters); and how late the forward delay line released
packets by its own clock, and its CPU share.

    sudo .venv/bin/python benchmarks/link_fidelity.py --rate-sweep [--json F]
"""

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from testbed import lifecycle  # noqa: E402
from testbed.net.pair import routed_pair  # noqa: E402
from testbed.net.linkmodel import check_params  # noqa: E402
from testbed.net import probe  # noqa: E402
from testbed.net.probe import GOODPUT_BASIS, measure_link  # noqa: E402

RATES = (10e6, 100e6, 1e9)
DELAYS = (0.0, 0.005, 0.020)
JITTERS = (0.0, 0.002)
LOSSES = (0.0, 0.01)
# (rate, delay, loss, mean burst): burst loss from the delay line's Gilbert chain
BURST_POINTS = ((100e6, 0.005, 0.01, 1.0), (100e6, 0.005, 0.01, 4.0), (100e6, 0.005, 0.05, 4.0),
                (100e6, 0.020, 0.02, 8.0))
BURST_PACKETS = 100_000   # >= 250 bursts per point: ~9% sampling sd on loss, ~6% on burst length


def points(quick):
    if quick:
        return [(r, d, j, l) for r, d, j, l in itertools.product(RATES, DELAYS, JITTERS, LOSSES)
                if (j == 0 and l == 0) or (r == 100e6 and d == 0.005)]
    return list(itertools.product(RATES, DELAYS, JITTERS, LOSSES))


def verdicts(cfg, m):
    """Which targets a point meets (None = not applicable)."""
    rate, delay, jitter, loss = cfg
    rtt = 2 * delay * 1e3
    return {
        "goodput": (m["goodput_bps"] / rate >= 0.93) if loss == 0 else None,
        "rtt": abs(m["rtt_p50_ms"] - rtt) <= max(0.3, 0.05 * rtt),
        "jitter": (abs(m["jitter_ms"] / (jitter * 1e3) - 1) <= 0.30) if jitter else None,
        "loss": (abs(m["loss"] / loss - 1) <= 0.25) if loss else None,
        "order": m["reordered"] == 0,
    }


def run_point(cfg, backend, duration_s, loss_packets, loss_burst=None):
    rate, delay, jitter, loss = cfg
    d = check_params({"rate": rate, "delay": delay, "jitter": jitter, "loss": loss,
                      "loss_burst": loss_burst}, "bench")
    with routed_pair({"kv": d, "request": d}, backend=backend) as link:
        r = measure_link(link.src, link.dst, link.dst_ip, d.params(), duration_s=duration_s,
                         loss_packets=loss_packets)
        r["backend"] = link.wan.backend
    return r


def fmt_row(cfg, m, v):
    rate, delay, jitter, loss = cfg
    mark = {True: " ", False: "*", None: " "}
    jit = f"{m['jitter_ms'] / (jitter * 1e3):.2f}" if jitter else f"({m['jitter_ms']:.2f}ms)"
    lss = f"{m['loss'] / loss:.2f}" if loss else "-"
    return (f"| {rate / 1e6:>5g}M | {delay * 1e3:>3g} | {jitter * 1e3:>1g} | {loss:>4.0%} "
            f"| {m['goodput_bps'] / rate:.4f}{mark[v['goodput']]} "
            f"| {2 * delay * 1e3:>5.1f} | {m['rtt_p50_ms']:>6.2f}{mark[v['rtt']]} "
            f"| {m['rtt_p99_ms']:>6.2f} | {jit:>8}{mark[v['jitter']]} "
            f"| {lss:>5}{mark[v['loss']]} | {m['reordered']:>3}{mark[v['order']]} |")


def fmt_reorder(m):
    """Where reordered packets came from: kind, and how long after the overtaking one."""
    ex = m.get("reorder_examples") or []
    late = [e["late_us"] for e in ex]
    kinds = sorted({e["kind"] for e in ex})
    return (f"  reordered {m['reordered']}: {'/'.join(kinds)}, late by "
            f"{min(late):.0f}-{max(late):.0f} us" if late else "")


BURST_HEADER = ("| rate | delay ms | loss | burst pkts | loss meas/conf | burst meas | "
                "goodput/rate | reordered |\n|---:|---:|---:|---:|---:|---:|---:|---:|")


def burst_rows(backend, duration_s):
    """The burst-loss points: (row text, misses, result)."""
    for rate, delay, loss, burst in BURST_POINTS:
        r = run_point((rate, delay, 0.0, loss), backend, duration_s, BURST_PACKETS, burst)
        row, miss = fmt_burst(rate, delay, loss, burst, r["measured"])
        yield row, miss, {"loss_burst": burst, **r}


def fmt_burst(rate, delay, loss, burst, m):
    """(row, misses) of one burst-loss point."""
    ok_loss = abs(m["loss"] / loss - 1) <= 0.25
    ok_burst = m["loss_burst"] is not None and abs(m["loss_burst"] / burst - 1) <= 0.25
    mark = {True: " ", False: "*"}
    row = (f"| {rate / 1e6:>5g}M | {delay * 1e3:>3g} | {loss:>4.0%} | {burst:>4g} "
           f"| {m['loss'] / loss:.2f}{mark[ok_loss]} | {m['loss_burst'] or 0:.2f}"
           f"{mark[ok_burst]} | {m['goodput_bps'] / rate:.4f} | {m['reordered']:>3} |")
    return row, (not ok_loss) + (not ok_burst)


# ---------------------------------------------------------------- delay-line rate sweep

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


def run_rate_sweep(duration_s, results):
    """Print the sweep as it is measured; append each point's fields to `results`."""
    print(f"delay-line rate sweep: {SWEEP_DELAY_S * 1e3:g} ms each way, {duration_s:g} s bulk "
          f"TCP per point; load average at start {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs\n")
    raw_shown = False
    for raw, p in delayline_sweep(duration_s=duration_s):
        if not raw_shown:
            for r in raw.values():
                print(fmt_raw(r))
                results.append({"raw_veth": True, **dataclasses.asdict(r)})
            print("\n" + SWEEP_HEADER)
            raw_shown = True
        print(fmt_sweep_row(p), flush=True)
        results.append({"sweep_point": True, **dataclasses.asdict(p)})
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


HEADER = ("| rate | delay ms | jitter ms | loss | goodput/rate | 2xdelay ms | RTT p50 ms "
          "| RTT p99 ms | jitter sd meas/conf | loss meas/conf | reordered |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def print_saved(results):
    """The tables of a saved run, from its JSON alone."""
    sweep = [SweepPoint(**{k: v for k, v in r.items() if k != "sweep_point"})
             for r in results if r.get("sweep_point")]
    if sweep:
        for r in results:
            if r.get("raw_veth"):
                print(fmt_raw(RawVeth(**{k: v for k, v in r.items() if k != "raw_veth"})))
        print("\n" + SWEEP_HEADER)
        for p in sweep:
            print(fmt_sweep_row(p))
        return 0
    print(HEADER)
    for r in results:
        if r.get("burst_point"):
            continue
        cfg = (r["rate"], r["delay"], r["jitter"], r["loss"])
        print(fmt_row(cfg, r["measured"], verdicts(cfg, r["measured"]))
              + fmt_reorder(r["measured"]))
    bursts = [r for r in results if r.get("burst_point")]
    if bursts:
        print("\n" + BURST_HEADER)
        for r in bursts:
            print(fmt_burst(r["configured"]["rate"], r["configured"]["delay"],
                            r["configured"]["loss"], r["loss_burst"], r["measured"])[0])
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rates x delays, plus jitter/loss at "
                                                         "100M 5ms; 1 s of TCP, 5000 loss packets")
    ap.add_argument("--backend", default="userspace", choices=("userspace", "netem", "auto"))
    ap.add_argument("--json", help="also write every result to this file")
    ap.add_argument("--no-burst", action="store_true", help="skip the burst-loss points")
    ap.add_argument("--rate-sweep", action="store_true", help="only the delay-line rate sweep "
                                                              "(see above)")
    ap.add_argument("--table", metavar="JSON", help="print the tables of a saved --json run "
                                                    "again (no root, measures nothing)")
    args = ap.parse_args(argv)
    if args.table:
        return print_saved(json.loads(pathlib.Path(args.table).read_text()))
    if os.geteuid() != 0:
        sys.exit("link_fidelity: needs root (namespaces, tc)")
    # SIGTERM unwinds like Ctrl-C, so the current link's `finally` removes its namespaces
    lifecycle.sigterm_unwinds()
    if args.rate_sweep:
        results = []
        try:
            run_rate_sweep(1.5 if args.quick else SWEEP_S, results)
        finally:
            if args.json:
                pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
        return 0
    duration_s, loss_packets = (1.0, 5000) if args.quick else (2.0, 20000)
    print(f"backend {args.backend}; {duration_s:g} s bulk TCP per point; {loss_packets} UDP "
          f"packets where loss is set; load average at start {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    print(f"goodput: {GOODPUT_BASIS}; * = misses its target\n")
    print(HEADER)
    results, misses = [], 0
    t0 = time.monotonic()
    for cfg in points(args.quick):
        r = run_point(cfg, args.backend, duration_s, loss_packets)
        v = verdicts(cfg, r["measured"])
        misses += sum(1 for x in v.values() if x is False)
        print(fmt_row(cfg, r["measured"], v) + fmt_reorder(r["measured"]), flush=True)
        results.append({"rate": cfg[0], "delay": cfg[1], "jitter": cfg[2], "loss": cfg[3],
                        **r, "verdicts": v})
    print(f"\n{len(results)} points, {misses} target misses, {time.monotonic() - t0:.0f} s, "
          f"load average at end {os.getloadavg()[0]:.2f}")
    if not args.no_burst:
        print(f"\nburst loss (Gilbert chain in the delay line), {BURST_PACKETS} UDP packets per "
              f"point; burst = mean run of consecutive losses; targets 25% for both\n")
        print(BURST_HEADER)
        bmiss = 0
        for row, miss, r in burst_rows(args.backend, duration_s):
            bmiss += miss
            print(row, flush=True)
            results.append({"burst_point": True, **r})
        print(f"\n{len(BURST_POINTS)} burst points, {bmiss} target misses, load average at end "
              f"{os.getloadavg()[0]:.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
