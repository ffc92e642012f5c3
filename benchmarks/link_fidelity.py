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

`--rate-sweep` instead measures how fast the delay line itself carries
(`testbed.net.ratesweep.delayline_sweep`, also run by benchmarks/emulation_speed.py): per
configured rate (1, 2, 5, 8 Gbit/s, 5 ms each way), with no loss and with a small loss (0.1%,
which turns segmentation offload off, so every 1514-byte frame is one delay-line packet), the
TCP goodput over the rate and over the raw veth goodput of the same topology without shaping
(measured in the same run, same offload setting); the idle RTT's error (p50 - 2 x delay; the raw
veth's idle RTT, printed above the table, is the stack's share of it); the one-way delay of
probes on the reverse (ACK) direction while the bulk flow runs, so through a delay line under
load with an empty bottleneck queue; reordering seen by the probes and by TCP (the sender's
reordering counters); and how late the forward delay line released packets by its own clock, and
its CPU share.

    sudo .venv/bin/python benchmarks/link_fidelity.py --rate-sweep [--json F]
"""

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from testbed import lifecycle  # noqa: E402
from testbed.net import ratesweep  # noqa: E402
from testbed.net.linkmodel import check_params  # noqa: E402
from testbed.net.pair import routed_pair  # noqa: E402
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


def burst_rows(backend, duration_s, burst_points=BURST_POINTS, packets=BURST_PACKETS):
    """The burst-loss points: (row text, misses, result)."""
    for rate, delay, loss, burst in burst_points:
        r = run_point((rate, delay, 0.0, loss), backend, duration_s, packets, burst)
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

def run_rate_sweep(duration_s, results, rates=ratesweep.SWEEP_RATES,
                   losses=ratesweep.SWEEP_LOSSES):
    """Print the sweep as it is measured; append each point's fields to `results`."""
    print(f"delay-line rate sweep: {ratesweep.SWEEP_DELAY_S * 1e3:g} ms each way, "
          f"{duration_s:g} s bulk TCP per point; load average at start "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n")
    raw_shown = False
    for raw, p in ratesweep.delayline_sweep(rates, losses, duration_s):
        if not raw_shown:
            for r in raw.values():
                print(ratesweep.fmt_raw(r))
                results.append({"raw_veth": True, **dataclasses.asdict(r)})
            print("\n" + ratesweep.SWEEP_HEADER)
            raw_shown = True
        print(ratesweep.fmt_sweep_row(p), flush=True)
        results.append({"sweep_point": True, **dataclasses.asdict(p)})
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


HEADER = ("| rate | delay ms | jitter ms | loss | goodput/rate | 2xdelay ms | RTT p50 ms "
          "| RTT p99 ms | jitter sd meas/conf | loss meas/conf | reordered |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def print_saved(results):
    """The tables of a saved run, from its JSON alone."""
    sweep = [ratesweep.SweepPoint(**{k: v for k, v in r.items() if k != "sweep_point"})
             for r in results if r.get("sweep_point")]
    if sweep:
        for r in results:
            if r.get("raw_veth"):
                raw = ratesweep.RawVeth(**{k: v for k, v in r.items() if k != "raw_veth"})
                print(ratesweep.fmt_raw(raw))
        print("\n" + ratesweep.SWEEP_HEADER)
        for p in sweep:
            print(ratesweep.fmt_sweep_row(p))
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


def run_sweep(args, plan):
    """The configured-vs-measured sweep (and the burst-loss points): its results."""
    duration_s, loss_packets = plan["duration_s"], plan["loss_packets"]
    print(f"backend {args.backend}; {duration_s:g} s bulk TCP per point; {loss_packets} UDP "
          f"packets where loss is set; load average at start {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs")
    print(f"goodput: {GOODPUT_BASIS}; * = misses its target\n")
    print(HEADER)
    results, misses = [], 0
    t0 = time.monotonic()
    for cfg in plan["points"]:
        r = run_point(cfg, args.backend, duration_s, loss_packets)
        v = verdicts(cfg, r["measured"])
        misses += sum(1 for x in v.values() if x is False)
        print(fmt_row(cfg, r["measured"], v) + fmt_reorder(r["measured"]), flush=True)
        results.append({"rate": cfg[0], "delay": cfg[1], "jitter": cfg[2], "loss": cfg[3],
                        **r, "verdicts": v})
    print(f"\n{len(results)} points, {misses} target misses, {time.monotonic() - t0:.0f} s, "
          f"load average at end {os.getloadavg()[0]:.2f}")
    if plan["burst_points"]:
        results += run_bursts(args.backend, duration_s, plan)
    return results


def run_bursts(backend, duration_s, plan):
    print(f"\nburst loss (Gilbert chain in the delay line), {plan['burst_packets']} UDP packets "
          f"per point; burst = mean run of consecutive losses; targets 25% for both\n")
    print(BURST_HEADER)
    results, bmiss = [], 0
    for row, miss, r in burst_rows(backend, duration_s, plan["burst_points"],
                                   plan["burst_packets"]):
        bmiss += miss
        print(row, flush=True)
        results.append({"burst_point": True, **r})
    print(f"\n{len(plan['burst_points'])} burst points, {bmiss} target misses, load average "
          f"at end {os.getloadavg()[0]:.2f}")
    return results


# --smoke: one point without and one with jitter and loss, one burst point, one sweep rate;
# every code path of the full sweep, in seconds (the numbers are too short to mean much).
SMOKE = {"points": [(100e6, 0.005, 0.0, 0.0), (100e6, 0.005, 0.002, 0.01)],
         "duration_s": 0.5, "loss_packets": 2000, "burst_points": [(100e6, 0.005, 0.05, 4.0)],
         "burst_packets": 2000, "sweep_rates": (1e9,), "sweep_losses": (0.0,)}


def plan_of(args):
    if args.smoke:
        return SMOKE
    duration_s, loss_packets = (1.0, 5000) if args.quick else (2.0, 20000)
    return {"points": points(args.quick), "duration_s": duration_s,
            "loss_packets": loss_packets, "burst_points": () if args.no_burst else BURST_POINTS,
            "burst_packets": BURST_PACKETS}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rates x delays, plus jitter/loss at "
                                                         "100M 5ms; 1 s of TCP, 5000 loss packets")
    ap.add_argument("--smoke", action="store_true", help="two points, one burst point and one "
                    "delay-line sweep rate, short: every code path in seconds")
    ap.add_argument("--backend", default="userspace", choices=("userspace", "netem", "auto"))
    ap.add_argument("--json", help="also write every result to this file")
    ap.add_argument("--no-burst", action="store_true", help="skip the burst-loss points")
    ap.add_argument("--rate-sweep", action="store_true", help="only the delay-line rate sweep "
                                                              "(see above)")
    ap.add_argument("--table", metavar="JSON", help="print the tables of a saved --json run "
                                                    "again (no root, measures nothing)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        return print_saved(json.loads(pathlib.Path(args.table).read_text()))
    if os.geteuid() != 0:
        sys.exit("link_fidelity: needs root (namespaces, tc)")
    # SIGTERM unwinds like Ctrl-C, so the current link's `finally` removes its namespaces
    lifecycle.sigterm_unwinds()
    results = []
    try:
        if args.rate_sweep:
            run_rate_sweep(1.5 if args.quick else ratesweep.SWEEP_S, results)
            return 0
        results += run_sweep(args, plan_of(args))
        if args.smoke:
            print()
            run_rate_sweep(SMOKE["duration_s"], results, SMOKE["sweep_rates"],
                           SMOKE["sweep_losses"])
    finally:
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
