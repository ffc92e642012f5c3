"""The `testbed` command: one verb per pipeline stage, one shutdown path, one exit code.

Each verb lives in `testbed/commands/<verb>.py` and exposes `register(subparsers)` (adds its
parser and sets `func`) . `main` runs the verb and maps `TestbedError` to a one-line message and
its exit code (2 for bad input), Ctrl-C to 130.
"""

import argparse
import importlib
import sys

from testbed import __version__
from testbed.errors import TestbedError, one_line

# Verbs in the order `--help` lists them.
VERBS = ["run", "up", "clean", "workload", "plan", "models", "calibrate", "linktest", "doctor", "selfcheck",
         "analyse", "compare", "plot", "report", "keys"]


def parser():
    p = argparse.ArgumentParser(
        prog="testbed",
        description="Emulate Prefill-as-a-Service across two datacenters and measure it.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        try:
            mod = importlib.import_module(f"testbed.commands.{verb}")
        except ModuleNotFoundError as e:
            if e.name != f"testbed.commands.{verb}":
                raise
            continue
        mod.register(sub)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
    except TestbedError as e:
        print(f"testbed {args.verb}: {one_line(str(e), 1000)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"testbed {args.verb}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
