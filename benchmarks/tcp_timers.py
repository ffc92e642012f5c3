"""Loss recovery in real-world time at several `scale.time`, with and without scaled TCP timers.

A link built alone (`testbed.commands.linktest.two_host_link`): 20 Mbit/s, 5 ms real-world,
emulated at each scale; the hosts' routes carry the timers a run would set
(`testbed.net.timers`), or the kernel's (200 ms RTO floor, delayed ACKs). A bulk TCP flow has its
KV direction cut for 450 ms every 2 s (`probe.measure_stalls`); the receiver's stall across each
cut is printed in real-world ms with its median, side by side. Not part of the test suite.

    sudo .venv/bin/python benchmarks/tcp_timers.py [--cuts 7]
"""

import argparse
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from testbed import lifecycle  # noqa: E402
from testbed.commands.linktest import two_host_link  # noqa: E402
from testbed.net import probe, shaping, timers  # noqa: E402

POINTS = ((1.0, True), (10.0, True), (10.0, False), (40.0, True))
RATE_BPS, DELAY_S, CUT_S, PERIOD_S, WARMUP_S = 20e6, 0.005, 0.45, 2.0, 1.0


def stalls_real_ms(time_scale, scaled, cuts):
    d = shaping.check_params({"rate": RATE_BPS * time_scale, "delay": DELAY_S / time_scale}, "b")
    reg = lifecycle.Registry("tcptimers", kind="benchmark", state_dir=tempfile.mkdtemp())
    try:
        with two_host_link({"kv": d, "request": d}, registry=reg) as link:
            tcp = timers.TcpTimers.for_scale(time_scale if scaled else 1.0)
            for ns in (link.src, link.dst):
                timers.apply(ns, tcp)
            stalls = probe.measure_stalls(link, cuts, CUT_S / time_scale,
                                          PERIOD_S / time_scale, WARMUP_S / time_scale)
    finally:
        reg.close()
    return [round(s * time_scale * 1e3) for s in stalls if s is not None]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuts", type=int, default=7)
    args = ap.parse_args()
    base = None
    print("scale.time  timers   median stall ms  / 1x   stalls ms (real-world)")
    for time_scale, scaled in POINTS:
        ms = stalls_real_ms(time_scale, scaled, args.cuts)
        med = statistics.median(ms) if ms else float("nan")
        base = base or med
        print(f"{time_scale:10g}  {'scaled' if scaled else 'kernel':7}  {med:15.0f}  "
              f"{med / base:5.2f}   {ms}", flush=True)


if __name__ == "__main__":
    main()
