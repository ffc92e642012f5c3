"""`testbed clean`: remove what killed runs left behind, from their recorded state only.

Reads every state file in /run/prfaas-testbed/ (written by `testbed.lifecycle.Registry` as a run
creates things) and removes exactly the processes (PID + start time checked), interfaces,
namespaces and firewall rules recorded there. Never `mn -c`, never a kill by name. A record whose
owner is still running (same PID and start time) is left alone unless `--all`. A state file that
cannot be read is left in place and reported, one line each, and the exit code is 1.

`--backend ray [--address HOST:PORT]` does the same on every host of a Ray cluster for the
records of the shaping agents (testbed/backend/agents.py) whose agent died without undoing:
qdiscs, filters, iptables rules, addresses and routes on the hosts' NICs, delay lines.
"""

import os
import sys

from testbed import lifecycle
from testbed.backend.raycluster import clean
from testbed.errors import PrivilegeError


def register(sub):
    p = sub.add_parser("clean", help="remove leftovers of killed runs (root)")
    p.add_argument("--all", action="store_true",
                   help="also runs whose owning process is still alive")
    p.add_argument("--backend", choices=("mininet", "ray"), default="mininet",
                   help="ray: clean every host of the Ray cluster (docs/cluster.md)")
    p.add_argument("--address", default="auto", metavar="HOST:PORT",
                   help="ray: the Ray head (default: auto)")
    p.set_defaults(func=main)


def main(args):
    if os.geteuid() != 0:
        raise PrivilegeError("testbed clean removes namespaces and interfaces: use sudo")
    code = _clean_ray(args.address) if args.backend == "ray" else 0
    # ray too: this host's record of a killed orchestrator (the driver's run)
    report, corrupt = lifecycle.cleanup_all(include_live=args.all)
    for line in report:
        print(line)
    for line in corrupt:
        print(f"testbed clean: {line}", file=sys.stderr)
    if not report and not corrupt:
        print("nothing to clean")
    return 1 if corrupt or code else 0


def _clean_ray(address):
    code = 0
    for host, report, corrupt in clean(address):
        for line in report or ["nothing to clean"]:
            print(f"{host}: {line}")
        for line in corrupt:
            print(f"testbed clean: {host}: {line}", file=sys.stderr)
            code = 1
    return code
