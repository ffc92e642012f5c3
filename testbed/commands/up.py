"""`testbed up FILE`: build and start an experiment's deployment, serve it, until Ctrl-C/SIGTERM.

The network, the workers, the scheduler and the OpenAI front door start as for `testbed run`,
but no load generator: the front door listens on the client host's address inside the emulated
local datacenter, and a relay (testbed/net/forward.py) forwards 127.0.0.1:PORT of the machine
(root namespace, loopback only; `--port`, default a free port) to it, so any tool on the machine
can drive the deployment. With `--load` the built-in client also replays the experiment's
workload once, from the moment the deployment is up (a background load, or a known one to watch
on a dashboard), and the deployment stays up after it. The link schedule and the faults start
when the deployment is up (with `--load`: at the workload's arrival 0).
Ctrl-C or SIGTERM tears everything down as `run` does (the relay first); the requests that
arrived are analysed from the run directory (`testbed analyse DIR` works on it later too). The
addresses are printed on standard output as soon as the deployment is up, and written to
`up.json` in the run directory; the run directory is the last line printed.
"""

import sys

from testbed import analysis, lifecycle, run
from testbed.errors import ConfigError


def register(sub):
    p = sub.add_parser("up", help="start an experiment's deployment with the OpenAI front door "
                                  "forwarded to 127.0.0.1, until Ctrl-C (root)")
    p.add_argument("file", help="experiment YAML (one run: no variants/sweep)")
    p.add_argument("--out", help="run directory (default results/<name>/<timestamp>-<id>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set scheduler.threshold=32K (repeatable)")
    p.add_argument("--port", type=int, default=0,
                   help="loopback port of the forward (default: a free one)")
    p.add_argument("--no-probe", action="store_true", help="skip the WAN probe at start")
    p.add_argument("--load", action="store_true",
                   help="also replay the experiment's workload once with the built-in client "
                        "(arrival 0 when it is up), then keep serving until Ctrl-C")
    p.add_argument("--metrics", type=int, metavar="PORT",
                   help="serve Prometheus metrics on 127.0.0.1:PORT while it runs (docs/live.md)")
    p.set_defaults(func=main)


def announce(info):
    print(f"front door: {info['frontdoor_url']}/v1 (client host, inside the emulated network)")
    print(f"forwarded:  {info['url']}/v1 (127.0.0.1 of this machine only)")
    print(f"model:      {info['model']}")
    print(f"trace:      {info['trace']} (the workload as a mooncake trace, emulated ms)")
    print(f"run dir:    {info['run_dir']}")
    if info["load"]:
        print(f"load:       the built-in client replays {info['load']} requests now")
    print("up: link schedule and faults started now; Ctrl-C or SIGTERM tears it down",
          flush=True)


def main(args):
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}", key="--port")
    lifecycle.sigterm_unwinds()
    top, summaries = run.execute(args.file, args.overrides, out=args.out,
                                 probe=not args.no_probe, progress=False,
                                 hold=run.Hold(port=args.port, announce=announce,
                                               load=args.load),
                                 metrics_port=args.metrics)
    served = [s for s in summaries if s.get("requests")]
    if served:
        print()
        print(analysis.table(served))
    for s in summaries:
        fd = s.get("frontdoor") or {}
        print(f"front door: {fd.get('http_requests', 0)} HTTP requests, {fd.get('outcomes')}",
              file=sys.stderr)
    print(top)
    return 0
