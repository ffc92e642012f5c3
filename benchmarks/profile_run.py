"""Profile one `testbed run`: CPU per process, thread and role, and where the time goes inside
the Python processes (py-spy), in one table (docs/performance.md shows one and how to read it).

Needs root (it starts `testbed run` and attaches py-spy to that run's processes), so on a shared
machine run it under the root lock, e.g. the 40x case study:

    flock /tmp/prfaas-root.lock .venv/bin/python benchmarks/profile_run.py \\
        experiments/paper_case_study.yaml --set scale.time=40 --set scale.bytes=2.5e-4 \\
        --set workload.arrival.rate=4/s

How: `testbed run FILE --out DIR` runs as a child of this script. A sampler thread walks that
child's process tree (and nothing else) every `--interval` seconds and reads each process's CPU
time (user, system), threads and command line from /proc, and each Python process's per-thread
CPU. Once a worker has written its ready file, one instance per role and variant (`--every`: all)
and the run's own process get a `py-spy record --threads` of their own (non-blocking; `--native
ROLE` adds native frames and pauses that role's processes per sample), writing collapsed stacks
to DIR/profiles/<variant>/<name>.txt. py-spy only ever attaches to PIDs found in the run's tree.

After the run it reads each variant's `metadata.json` (start/end), `events.csv` (phases),
`summary.json` (steady throughput, the planner's prediction, the emulation's own fidelity
warnings) and `requests.jsonl` (token chunks), and prints per variant: fidelity, phases, the
cores the run used while requests ran; per process: CPU seconds in the variant, % of its wall,
system CPU, start-up CPU, idle CPU %, threads, the top functions by estimated own CPU (each
thread's measured CPU split over its py-spy samples, see `attribute`) and the busiest threads;
per role; and per role over every variant. The machine line gives the load average before and
after, the busy share of all cores, the run tree's CPU (rusage of the reaped `testbed run`, a
check on the sampled sum) and py-spy's own CPU.

`--no-pyspy` measures CPU only (no sampling overhead); run both to see what profiling costs.
DIR/profiles/ keeps processes.json (every sample; `--report DIR` prints the report again) and
profile.json (the report). `--smoke` profiles
benchmarks/smoke.yaml (three workers, 12 requests, no link probe): the whole path in well under
a minute.

The sampler, the py-spy side and the report are library code in testbed/profiling/; this file
is the command line and the child `testbed run`.
"""

import argparse
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.profiling import pyspy, report  # noqa: E402
from testbed.profiling.sampler import Sampler  # noqa: E402

# --smoke: the smallest full run (3 workers, 12 requests), no link probe
SMOKE_EXPERIMENT = REPO / "benchmarks" / "smoke.yaml"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", nargs="?",
                    help="experiment file, or with --report a profiled run dir")
    ap.add_argument("--report", action="store_true",
                    help="only rebuild and print the report of an earlier profiled run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="run directory (new or empty); default results/profile/<time>")
    ap.add_argument("--no-pyspy", action="store_true", help="CPU per process only")
    ap.add_argument("--no-probe", action="store_true", help="testbed run --no-probe")
    ap.add_argument("--metrics", type=int, metavar="PORT",
                    help="testbed run --metrics PORT (the live exporter, docs/live.md)")
    ap.add_argument("--rate", type=int, default=25, help="py-spy samples per second")
    ap.add_argument("--every", action="store_true",
                    help="py-spy on every worker (default: one per role and variant)")
    ap.add_argument("--native", action="append", default=[], metavar="ROLE",
                    help="also sample native frames (gRPC core, syscalls) of this role's "
                         "processes; pauses them at each sample")
    ap.add_argument("--interval", type=float, default=0.25, help="/proc sampling period, s")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--smoke", action="store_true",
                    help="benchmarks/smoke.yaml (3 workers, 12 requests), --no-probe: seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.experiment = args.experiment or str(SMOKE_EXPERIMENT)
        args.no_probe = True
    elif args.experiment is None:
        ap.error("an experiment file (or with --report a profiled run dir) is needed")
    return args


def run_argv(args, out):
    argv = [sys.executable, "-m", "testbed.cli", "run", args.experiment, "--out", str(out)]
    for s in args.set:
        argv += ["--set", s]
    if args.no_probe:
        argv.append("--no-probe")
    if args.metrics:
        argv += ["--metrics", str(args.metrics)]
    return argv


def profile(args, out):
    """Run `testbed run` as a child under the sampler; save what it saw; the exit code."""
    profiles = report.profiles_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f".{out.name}.testbed-run.log"
    load0 = os.getloadavg()
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=str(REPO), TQDM_DISABLE="1")
    with open(log_path, "wb") as log:
        run = subprocess.Popen(run_argv(args, out), cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT, env=env)
    sampler = Sampler(run.pid, profiles, args.interval, not args.no_pyspy, args.rate,
                      args.every, args.native).start()
    try:
        _, status, usage = os.wait4(run.pid, 0)
    except KeyboardInterrupt:
        run.terminate()
        _, status, usage = os.wait4(run.pid, 0)
    returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - t0
    sampler.finish()
    tree_cpu = usage.ru_utime + usage.ru_stime
    spy_cpu = _children_cpu() - tree_cpu      # what is left of our reaped children: py-spy
    load1 = os.getloadavg()
    profiles.mkdir(parents=True, exist_ok=True)
    shutil.move(str(log_path), profiles / "testbed-run.log")
    if returncode != 0:
        print(f"testbed run exited with {returncode}; see {profiles / 'testbed-run.log'}",
              file=sys.stderr)
    report.save_processes(out, {
        "argv": sys.argv, "wall_s": wall, "tree_cpu_s": tree_cpu, "spy_cpu_s": spy_cpu,
        "load0": [round(x, 2) for x in load0], "load1": [round(x, 2) for x in load1],
        "interval_s": sampler.interval_s, "busy0": sampler.busy0, "busy1": sampler.busy1,
        "returncode": returncode, "processes": [p.to_json() for p in sampler.procs.values()]})
    return returncode


def _children_cpu():
    """CPU seconds of every child this script started and reaped (the run's tree, py-spy)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        report.report(pathlib.Path(args.experiment).resolve(), args.top)
        return 0
    if os.geteuid() != 0:
        raise SystemExit("profile_run: needs root (testbed run and py-spy); run it under sudo")
    if not args.no_pyspy:
        pyspy.pyspy_binary()
    with tempfile.TemporaryDirectory(prefix="profile_run-") as tmp:
        # --smoke keeps nothing unless told --out
        default = pathlib.Path(tmp) / "run" if args.smoke else \
            REPO / "results" / "profile" / time.strftime("%Y%m%d-%H%M%S")
        out = pathlib.Path(args.out or default).resolve()
        returncode = profile(args, out)
        report.report(out, args.top)
    return 0 if returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
