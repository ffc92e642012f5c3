"""The same experiment on the ray backend (namespace hosts) and on Mininet, seed by seed.

Issue 14's acceptance: the quickstart with `backend: ray` on namespace hosts matches the Mininet
backend on the same seed: steady throughput within 5%, TTFT p50 and p90 within 10%, kernel-counted
WAN bytes within 5% of the KV sent. This runs `testbed run EXPERIMENT --set seed=S` for each seed
on both backends (`--no-probe`, one after the other), the ray runs from the local namespace host of
`testbed.net.nshosts` (router fabric, one host per datacenter, as tests/test_ray_root.py), and
prints each variant's numbers and the ray / Mininet differences per seed with their median and
range. `--storage own` gives each Ray node its own run directory (TESTBED_NODE_DIR: the run
directory reaches the orchestrator by collection only) and `--skew S` runs the PrfaaS node's clock
S seconds ahead (test-only TESTBED_CLOCK_SKEW_S, corrected by the measured offset).

Root. Each `testbed run`, and the hosts' setup and teardown, holds the shared lock
(`--lock`, default /tmp/prfaas-root.lock) for itself only, so other users of the lock get turns:

    python benchmarks/ray_vs_mininet.py --seeds 1 2 3 --out /tmp/rvm
    python benchmarks/ray_vs_mininet.py --smoke    # one seed of benchmarks/smoke.yaml
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from testbed import rundir  # noqa: E402
from testbed.net import nshosts  # noqa: E402
from testbed.net.ns import ns_run  # noqa: E402

ROOT = nshosts.ROOT
METRICS = (("steady_throughput", "steady req/s", 0.05), ("median_ttft_ms", "TTFT p50", 0.10),
           ("p90_ttft_ms", "TTFT p90", 0.10))
# --smoke: one seed of the smallest full run (one variant, 12 requests) on both backends
SMOKE_SEEDS = [1]
SMOKE_EXPERIMENT = ROOT / "benchmarks" / "smoke.yaml"


def run_testbed(argv, out, ns=None, env=None, lock=nshosts.ROOT_LOCK):
    """One `testbed run` into `out` under the lock; exits with its output on failure."""
    with nshosts.root_lock(lock):
        r = ns_run(ns, [sys.executable, "-m", "testbed.cli", "run", *argv, "--out", str(out),
                        "--no-probe", "--no-progress"],
                   capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"ray_vs_mininet: testbed run {' '.join(argv)} failed:\n"
                 f"{r.stdout[-2000:]}{r.stderr[-3000:]}")


def summaries(out):
    """{variant label: summary} of one run directory."""
    found = {}
    for d in rundir.find_runs(out):
        s = rundir.summary(d)
        if "label" in s:
            found[s["label"]] = s
    return found


def node_env(args, tmp):
    """Each Ray node's environment: its own run directory (`--storage own`), the PrfaaS
    node's clock skew (`--skew`)."""
    def env_of(h):
        extra = {}
        if args.storage == "own":
            extra["TESTBED_NODE_DIR"] = str(tmp / f"node-{h.dc}")
        if args.skew and h.dc == "prfaas":
            extra["TESTBED_CLOCK_SKEW_S"] = repr(args.skew)
        return nshosts.ray_env(**extra)
    return env_of


def sets_argv(args):
    return [x for kv in args.set for x in ("--set", kv)]


def measure(args):
    """{backend: {seed: {variant: summary}}}."""
    results = {"ray": {}, "mininet": {}}
    out = pathlib.Path(args.out)
    if args.backend in ("both", "ray"):
        with tempfile.TemporaryDirectory(prefix="raybench-") as tmp, \
                nshosts.running(pathlib.Path(tmp), node_env(args, pathlib.Path(tmp)),
                                lambda: nshosts.root_lock(args.lock)) as (hosts, head):
            local = next(h.name for h in hosts if h.dc == "local")
            for seed in args.seeds:
                d = out / f"ray-seed{seed}"
                run_testbed([args.experiment, "--backend", "ray", "--address", head,
                             "--set", f"seed={seed}", *sets_argv(args)], d, ns=local,
                            env=nshosts.ray_env(), lock=args.lock)
                results["ray"][seed] = summaries(d)
                print_run("ray", seed, results["ray"][seed], d)
    if args.backend in ("both", "mininet"):
        for seed in args.seeds:
            d = out / f"mininet-seed{seed}"
            run_testbed([args.experiment, "--set", f"seed={seed}", *sets_argv(args)], d,
                        lock=args.lock)
            results["mininet"][seed] = summaries(d)
            print_run("mininet", seed, results["mininet"][seed], d)
    return results


def wan_bytes(s):
    """The kernel's count of the KV direction's class over the run, and the KV bytes sent."""
    counted = s.get("wan_bytes_counted")
    return (counted if counted is not None else s.get("wan_bytes_measured", 0),
            s.get("kv_bytes_sent_remote", 0))


def print_run(backend, seed, by_variant, d):
    print(f"# {backend} seed {seed}: {d}", flush=True)
    for label, s in by_variant.items():
        wan, kv = wan_bytes(s)
        ratio = f"{wan / kv:.3f}" if kv else "-"
        print(f"| {label} | {backend} | {seed} | {s['steady_throughput']:.3f} | "
              f"{s['median_ttft_ms']:,.0f} | {s['p90_ttft_ms']:,.0f} | {wan:,} | {kv:,} | "
              f"{ratio} | {s['completed']}/{s['requests']} |", flush=True)


def compare(results):
    """Per variant and metric: ray / Mininet - 1 for each seed both ran, median and range."""
    seeds = sorted(set(results["ray"]) & set(results["mininet"]))
    if not seeds:
        return
    print("\n| variant | metric | per-seed ray/Mininet - 1 | median | range | limit |")
    print("|---|---|---|---|---|---|")
    for label in results["mininet"][seeds[0]]:
        for key, name, limit in METRICS:
            d = [results["ray"][s][label][key] / results["mininet"][s][label][key] - 1
                 for s in seeds if results["mininet"][s][label][key]]
            if d:
                print(f"| {label} | {name} | {', '.join(f'{x:+.1%}' for x in d)} | "
                      f"{statistics.median(d):+.1%} | {max(d) - min(d):.1%} | {limit:.0%} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default=str(ROOT / "experiments" / "quickstart.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--backend", choices=("both", "ray", "mininet"), default="both")
    ap.add_argument("--storage", choices=("shared", "own"), default="shared",
                    help="own: each Ray node keeps its own run directory (TESTBED_NODE_DIR)")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="seconds the PrfaaS node's clock runs ahead (test-only)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra testbed run --set, for every run")
    ap.add_argument("--out", help="directory for the run directories (--smoke: a temporary "
                                  "one by default)")
    ap.add_argument("--lock", default=nshosts.ROOT_LOCK)
    ap.add_argument("--smoke", action="store_true",
                    help=f"seeds {SMOKE_SEEDS} of benchmarks/smoke.yaml (one variant)")
    args = ap.parse_args(argv)
    if args.out is None and not args.smoke:
        ap.error("--out is required (or --smoke)")
    if args.smoke:
        args.seeds, args.experiment = SMOKE_SEEDS, str(SMOKE_EXPERIMENT)
    print("| variant | backend | seed | steady req/s | TTFT p50 ms | TTFT p90 ms | "
          "WAN bytes (kernel) | KV bytes sent | WAN / KV | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="ray_vs_mininet-") as tmp:
        args.out = args.out or tmp
        compare(measure(args))


if __name__ == "__main__":
    main()
