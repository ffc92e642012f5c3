"""What one loss costs in real-world time at several `scale.time`: deterministic drops.

A link built alone (`testbed.net.pair.routed_pair`, default 100 Mbit/s, 5 ms one way, real-world),
emulated at each scale, the hosts' TCP timers as a run sets them (`testbed.net.timers`) or the
kernel's (`--kernel-timers`). Each trial is one message of SEGMENTS full segments on a fresh
connection, timed from the first write to the receiver's answer (`probe.measure_requests`).
Every scenario drops the same segments in every trial; its cost is the median time with the
drop minus the median time of the same message without it, in real-world ms:

- mid: segment 5 of 20. Fifteen segments SACKed after it: RACK marks it lost at once
  (dupthresh), recovery takes round trips only.
- near-tail: segment 19 of 20. One segment SACKed after it: RACK's reordering timer.
- tail-two: segments 19 and 20: the loss probe with two packets out (2 srtt + 2 ms).
- tail: segment 20 of 20, nothing after it: the loss probe with one packet out (2 srtt + RTO
  floor) or the RTO, whichever is first.
- tail-twice: segment 20 and its first retransmission: the RTO, then the RTO backed off.

    sudo .venv/bin/python benchmarks/loss_recovery.py [--trials 30] [--scales 1,10]
    sudo .venv/bin/python benchmarks/loss_recovery.py --smoke    # 10x, three scenarios, 3 trials
"""

import argparse
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from testbed import lifecycle  # noqa: E402
from testbed.net import probe, timers  # noqa: E402
from testbed.net.linkmodel import check_params  # noqa: E402
from testbed.net.ns import sysctl  # noqa: E402
from testbed.net.pair import routed_pair  # noqa: E402
from testbed.scale import Scale  # noqa: E402

SEGMENTS = 20
SCENARIOS = {"none": (), "mid": (5,), "near-tail": (19,), "tail-two": (19, 20), "tail": (20,),
             "tail-twice": (20, 21)}
SMOKE = {"trials": 3, "scales": "10", "scenarios": "none,mid,tail"}   # --smoke: seconds


def _quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else xs * 3
    return q[0], q[2]


def measure(time_scale, scaled_timers, trials, rate_bps, delay_s, scenarios, extra=()):
    """{scenario: [message times in real-world s]} at `time_scale`."""
    s = Scale(time=time_scale)
    d = check_params({"rate": s.emulated_rate(rate_bps), "delay": s.emulated_s(delay_s)}, "b")
    reg = lifecycle.Registry("lossrec", kind="benchmark", state_dir=tempfile.mkdtemp())
    out = {}
    try:
        with routed_pair({"kv": d, "request": d}, registry=reg) as link:
            tcp = timers.TcpTimers.for_scale(s if scaled_timers else Scale())
            for ns in (link.src, link.dst):
                timers.apply(ns, tcp)
                if extra and time_scale > 1:
                    sysctl(ns, *extra)
            for name in scenarios:
                r = probe.measure_requests(link, SEGMENTS, SCENARIOS[name], trials=trials,
                                           settle_s=s.emulated_s(4 * delay_s))
                out[name] = {"times": [s.real_s(t) for t in r["times"]],
                             "retrans": r["retrans"],
                             "rto_ms": [s.real_s(u / 1e6) * 1e3 for u in r["rto_us"]]}
    finally:
        reg.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--scales", default="1,10")
    ap.add_argument("--rate", type=float, default=100e6, help="bit/s, real-world")
    ap.add_argument("--delay", type=float, default=0.005, help="one way, s, real-world")
    ap.add_argument("--kernel-timers", action="store_true",
                    help="leave the kernel's TCP timers (200 ms RTO floor, delayed ACKs)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--sysctl", action="append", default=[],
                    help="name=value also set in the hosts at scales above 1 (to try one)")
    ap.add_argument("--smoke", action="store_true", help=f"{SMOKE}: seconds")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    names = args.scenarios.split(",")
    if "none" not in names:
        names.insert(0, "none")
    bad = [n for n in names if n not in SCENARIOS]
    if bad or args.trials < 3:
        print(f"unknown scenario {bad} or --trials < 3", file=sys.stderr)
        sys.exit(2)
    base = {}
    print("scale  scenario    median ms  q1-q3 ms      cost ms  cost/1x  retrans  rto ms"
          "   (real-world)")
    for k in (float(x) for x in args.scales.split(",")):
        res = measure(k, not args.kernel_timers, args.trials, args.rate, args.delay, names,
                      args.sysctl)
        clean = statistics.median(res["none"]["times"])
        for name in names:
            r = res[name]
            med = statistics.median(r["times"])
            q1, q3 = _quartiles(r["times"])
            cost = med - clean
            base.setdefault(name, cost)
            ratio = cost / base[name] if base[name] > 0 else float("nan")
            print(f"{k:5g}  {name:10}  {med * 1e3:9.1f}  {q1 * 1e3:6.1f}-{q3 * 1e3:6.1f}  "
                  f"{cost * 1e3:8.1f}  {ratio:7.2f}  {statistics.median(r['retrans']):7g}  "
                  f"{statistics.median(r['rto_ms']):6.0f}", flush=True)


if __name__ == "__main__":
    main()
