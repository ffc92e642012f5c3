"""`testbed linktest --backend ray` on namespace hosts: the link through the shaping agents.

Builds the namespace hosts and Ray nodes of tests/test_ray_root.py (`testbed.net.nshosts`,
router fabric, one host per datacenter), runs `testbed linktest --backend ray --json` from the
local host for each link given (default: the four links of docs/cluster.md), and prints one
table row per link: goodput (and its fraction of the rate), RTT p50/p99, one-way jitter, loss
(and measured / configured), reordered packets and the warnings. Root; the hosts' setup, each
linktest and the teardown hold the shared lock (`--lock`) each for itself:

    python benchmarks/ray_linktest.py
    python benchmarks/ray_linktest.py --link "--rate 1Gbit --delay 20ms"
    python benchmarks/ray_linktest.py --smoke      # one lossy link, 0.5 s: the whole path
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from testbed.net import nshosts  # noqa: E402
from testbed.net.ns import ns_run  # noqa: E402

LINKS = ("--rate 100Mbit --delay 5ms", "--rate 1Gbit --delay 20ms",
         "--rate 50Mbit --delay 5ms --jitter 1ms --loss 2%",
         "--rate 100Mbit --delay 5ms --loss 1% --loss-burst 3")
SMOKE_LINKS, SMOKE_DURATION_S = ("--rate 100Mbit --delay 5ms --loss 1%",), 0.5


def linktest(local, head, link, duration_s, lock):
    with nshosts.root_lock(lock):
        r = ns_run(local, [sys.executable, "-m", "testbed.cli", "linktest", "--backend", "ray",
                           "--address", head, "--json", "--duration", str(duration_s),
                           *shlex.split(link)],
                   capture_output=True, text=True, timeout=300, cwd=nshosts.ROOT,
                   env=nshosts.ray_env())
    if r.returncode != 0:
        sys.exit(f"ray_linktest: linktest {link} failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def row(link, out):
    m, c, e = out["measured"], out["configured"], out["configured"]["expected"]
    loss = "-"
    if m.get("loss") is not None:
        ratio = f" ({m['loss'] / e['loss']:.2f})" if e.get("loss") else ""
        loss = f"{m['loss']:.3%}{ratio}"
    warn = "; ".join(out["warnings"]) or "none"
    return (f"| {link} | {m['goodput_bps'] / 1e6:.1f} Mbit/s ({m['goodput_bps'] / c['rate']:.3f})"
            f" | {m['rtt_p50_ms']:.2f} / {m['rtt_p99_ms']:.2f} ms | {m['jitter_ms']:.2f} ms | "
            f"{loss} | {m['reordered']} | {warn} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link", action="append", help="linktest arguments (repeatable)")
    ap.add_argument("--duration", type=float, default=1.5)
    ap.add_argument("--lock", default=nshosts.ROOT_LOCK)
    ap.add_argument("--smoke", action="store_true",
                    help=f"only {SMOKE_LINKS[0]!r} for {SMOKE_DURATION_S} s".replace("%", "%%"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.link, args.duration = list(SMOKE_LINKS), SMOKE_DURATION_S
    print("| link | goodput (of rate) | RTT p50 / p99 | jitter sd | loss (of configured) | "
          "reordered | warnings |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="raylink-") as tmp, \
            nshosts.running(tmp, lambda h: nshosts.ray_env(),
                            lambda: nshosts.root_lock(args.lock)) as (hosts, head):
        local = next(h.name for h in hosts if h.dc == "local")
        for link in args.link or LINKS:
            print(row(link, linktest(local, head, link, args.duration, args.lock)), flush=True)


if __name__ == "__main__":
    main()
