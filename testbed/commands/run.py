"""`testbed run FILE`: run an experiment (every variant), print the comparison, then the run dir.

The run directory's path is the last line of standard output, so scripts can capture it.
"""

from testbed import analysis, lifecycle, run
from testbed.live import view


def register(sub):
    p = sub.add_parser("run", help="run an experiment YAML over the emulated network (root)")
    p.add_argument("file", help="experiment YAML")
    p.add_argument("--out", help="run directory (default results/<name>/<timestamp>-<id>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set scheduler.threshold=32K (repeatable)")
    p.add_argument("--no-probe", action="store_true", help="skip the WAN probe at start")
    p.add_argument("--metrics", type=int, metavar="PORT",
                   help="serve Prometheus metrics on 127.0.0.1:PORT while it runs (docs/live.md)")
    p.add_argument("--cli", action="store_true",
                   help="open the Mininet CLI once the network and workers are up")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--backend", choices=("mininet", "ray", "sim"),
                   help="where it runs (the experiment's backend.kind; docs/cluster.md; sim: "
                        "virtual time, docs/sim.md)")
    p.add_argument("--address", metavar="HOST:PORT",
                   help="ray: the Ray head (the experiment's backend.address)")
    p.set_defaults(func=main)


def main(args):
    lifecycle.sigterm_unwinds()
    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"backend.kind={args.backend}")
    if args.address:
        overrides.append(f"backend.address={args.address}")
    top, summaries = run.execute(args.file, overrides, out=args.out,
                                 probe=not args.no_probe, cli=args.cli,
                                 progress=view.choose(args.no_progress),
                                 metrics_port=args.metrics)
    print()
    print(analysis.table(summaries))
    for s in summaries:
        w = s.get("workload") or {}
        if w.get("prefix_hit_share"):
            print(f"workload ({s['label']}): {w['count']} requests at {w['rate_per_s']:.2f}/s, "
                  f"inter-arrival CV {w['interarrival_cv']:.2f}, input mean "
                  f"{w['input_mean']:,.0f} tokens, prefix-cache hit share "
                  f"{w['prefix_hit_share']:.1%} (unbounded cache, arrival order)")
        for w in s.get("warnings") or []:
            print(f"warning ({s['label']}): {w}")
        for n in s.get("link_notes") or []:
            print(f"note ({s['label']}): {n}")
        if s.get("failed"):
            print(f"note ({s['label']}): {s['failed']} failed: {s.get('failure_reasons')}")
    print(top)
    return 0
