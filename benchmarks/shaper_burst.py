"""Where a bulk probe's goodput goes on a shared machine: the bottleneck's HTB burst, side by side.

The run's link probe (`testbed.net.probe.measure_link`) on this project's 2-vCPU machines
measured the case study's kv link (no delay, 1.8-4.9 Gbit/s wall clock) -0.2% to -31% from
one minute to the next, with its RTTs steady. This alternates the bottleneck's HTB burst
(`linkmodel.BURST_S`, 1 ms of line rate in every run) with a larger one on the same link,
built alone (`testbed.net.pair.routed_pair`), and prints each probe's goodput deviation and
the bottleneck's own counters (packets sent, drops). Where the larger burst carries the rate
and the 1 ms one does not, the shortfall is tokens HTB lost while its dequeue ran late (the
bucket holds at most one burst of them), not the senders and not the queue. Not a test; not
part of the suite.

    sudo .venv/bin/python benchmarks/shaper_burst.py [--rate 1.8Gbit] [--bursts 0.001,0.005]
        [--pairs 3] [--probes 3] [--json F] [--smoke]
"""

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from testbed import units  # noqa: E402
from testbed.net import linkmodel, probe  # noqa: E402
from testbed.net.linkmodel import check_params  # noqa: E402
from testbed.net.pair import routed_pair  # noqa: E402


def measure(rate_bps, burst_s, probes):
    """[{goodput deviation, packets, drops}] of `probes` link probes over one link whose HTB
    burst is `burst_s` of its rate."""
    linkmodel.BURST_S = burst_s          # read when the shaper is built (htb_burst_bytes)
    link = check_params({"rate": rate_bps}, "kv")
    rows = []
    with routed_pair({"kv": link, "request": link}, backend="userspace") as pair:
        for _ in range(probes):
            before = pair.wan.stats()["kv"]
            out = probe.measure_link(pair.src, pair.dst, pair.dst_ip,
                                     {**link.params(), "reverse": link.params()}, duration_s=2.0)
            after = pair.wan.stats()["kv"]
            rows.append({"burst_s": burst_s, "goodput": out["deviation"].get("goodput"),
                         "packets": after["tx_packets"] - before["tx_packets"],
                         "drops": after["drops"] - before["drops"]})
            print(f"burst {1e3 * burst_s:g} ms: goodput {rows[-1]['goodput']:+.1%}, "
                  f"{rows[-1]['packets']} packets, {rows[-1]['drops']} dropped", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1.8Gbit", help="the link's rate, wall clock")
    ap.add_argument("--bursts", default="0.001,0.005", help="HTB bursts to alternate, seconds")
    ap.add_argument("--pairs", type=int, default=3, help="rounds of every burst, alternated")
    ap.add_argument("--probes", type=int, default=3, help="probes per link built")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny: 100 Mbit/s, one probe per burst (the path, not the machine)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rate, a.pairs, a.probes = "100Mbit", 1, 1
    rate, bursts = units.rate_bps(a.rate), [float(b) for b in a.bursts.split(",")]
    rows = [r for _ in range(a.pairs) for b in bursts for r in measure(rate, b, a.probes)]
    for b in bursts:
        g = [r["goodput"] for r in rows if r["burst_s"] == b]
        print(f"burst {1e3 * b:g} ms: goodput median {statistics.median(g):+.1%}, worst "
              f"{min(g):+.1%}, best {max(g):+.1%} ({len(g)} probes)")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
