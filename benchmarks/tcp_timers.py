"""Loss recovery in real-world time at several `scale.time`, with and without scaled TCP timers.

A link built alone (`testbed.net.pair.routed_pair`): 20 Mbit/s, 5 ms real-world, emulated at
each scale; the hosts' routes carry the timers a run would set (`testbed.net.timers`), or the
kernel's (200 ms RTO floor, delayed ACKs). A bulk TCP flow has its KV direction cut for 450 ms
every 2 s (`probe.measure_stalls`); the receiver's stall across each cut is printed in real-
world ms with its median, side by side. Its numbers are not part of the test suite's pass/fail
(its `--smoke` run is). The cut is made and undone by an iptables-restore that takes 5-30 ms of
real time to act, so above 20x (a 450 ms cut is 11 ms at 40x) the cut itself is not what was
asked and no stall is found; what one loss costs at each scale is benchmarks/loss_recovery.py.

    sudo .venv/bin/python benchmarks/tcp_timers.py [--cuts 7]
    sudo .venv/bin/python benchmarks/tcp_timers.py --smoke     # 10x scaled and kernel, 2 cuts
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
from testbed.net.pair import routed_pair  # noqa: E402
from testbed.scale import Scale  # noqa: E402

POINTS = ((1.0, True), (10.0, True), (10.0, False), (20.0, True))
SMOKE_POINTS, SMOKE_CUTS = ((10.0, True), (10.0, False)), 2     # --smoke: seconds
RATE_BPS, DELAY_S, CUT_S, PERIOD_S, WARMUP_S = 20e6, 0.005, 0.45, 2.0, 1.0


def stalls_real_ms(time_scale, scaled, cuts):
    s = Scale(time=time_scale)
    d = check_params({"rate": s.emulated_rate(RATE_BPS), "delay": s.emulated_s(DELAY_S)},
                     "b")
    reg = lifecycle.Registry("tcptimers", kind="benchmark", state_dir=tempfile.mkdtemp())
    try:
        with routed_pair({"kv": d, "request": d}, registry=reg) as link:
            tcp = timers.TcpTimers.for_scale(s if scaled else Scale())
            for ns in (link.src, link.dst):
                timers.apply(ns, tcp)
            stalls = probe.measure_stalls(link, cuts, s.emulated_s(CUT_S),
                                          s.emulated_s(PERIOD_S), s.emulated_s(WARMUP_S))
    finally:
        reg.close()
    return [round(s.real_ms(x)) for x in stalls if x is not None]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuts", type=int, default=7)
    ap.add_argument("--smoke", action="store_true",
                    help=f"only {SMOKE_POINTS} (scale.time, scaled timers), {SMOKE_CUTS} cuts")
    args = ap.parse_args()
    points, cuts = (SMOKE_POINTS, SMOKE_CUTS) if args.smoke else (POINTS, args.cuts)
    base = None
    print(f"scale.time  timers   median stall ms  / {points[0][0]:g}x   stalls ms (real-world)")
    for time_scale, scaled in points:
        ms = stalls_real_ms(time_scale, scaled, cuts)
        med = statistics.median(ms) if ms else float("nan")
        base = base or med
        print(f"{time_scale:10g}  {'scaled' if scaled else 'kernel':7}  {med:15.0f}  "
              f"{med / base:5.2f}   {ms}", flush=True)


if __name__ == "__main__":
    main()
