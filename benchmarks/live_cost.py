"""What the live metrics cost a run, and whether they change what it measures (docs/live.md).

Runs one experiment twice through benchmarks/profile_run.py (`--no-pyspy`: CPU per process
only), each with `replicates` seeds: first without the live exporter, then with `--metrics PORT`
while a real Prometheus server (Debian's package, loopback only, dashboards/prometheus.yml's
2 s scrape) scrapes it. Then it prints:

- the exporter's CPU (live.json) as a share of the run tree's CPU (the reaped `testbed run`'s
  rusage), and the run tree's CPU with and without, side by side;
- for every variant, `testbed compare WITHOUT:variant WITH:variant`: each headline metric's
  difference with its 95% CI over the replicates, and whether it is distinguishable from run
  noise;
- the same seed's runs paired: with / without per seed, for TTFT p50 and p90, TPOT and
  throughput (the seeds' own spread, which the intervals above include, cancels there).

Needs root (it runs `testbed run`):

    sudo .venv/bin/python benchmarks/live_cost.py experiments/quickstart.yaml --replicates 3

`--smoke`: benchmarks/smoke.yaml with 2 replicates (about two minutes).
"""

import argparse
import datetime
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed.live import promserver  # noqa: E402

SMOKE_EXPERIMENT = REPO / "benchmarks" / "smoke.yaml"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", nargs="?", help="experiment file")
    ap.add_argument("--replicates", type=int, default=3, help="seeds per variant and side")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="directory (new); default results/live_cost/<time>")
    ap.add_argument("--smoke", action="store_true", help="benchmarks/smoke.yaml, 2 replicates")
    args = ap.parse_args(argv)
    if args.smoke:
        args.experiment = args.experiment or str(SMOKE_EXPERIMENT)
        args.replicates = 2
    elif args.experiment is None:
        ap.error("an experiment file is needed")
    if args.replicates < 2:
        ap.error("--replicates must be at least 2 (run noise needs a spread)")
    return args


def profiled_run(args, out, metrics_port=None):
    """benchmarks/profile_run.py of the experiment into `out`; its processes.json."""
    argv = [sys.executable, str(REPO / "benchmarks" / "profile_run.py"), args.experiment,
            "--out", str(out), "--no-pyspy", "--no-probe",
            "--set", f"replicates={args.replicates}"]
    for s in args.set:
        argv += ["--set", s]
    if metrics_port:
        argv += ["--metrics", str(metrics_port)]
    print(f"# {' '.join(argv[1:])}", flush=True)
    r = subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SystemExit(f"profile_run.py exited with {r.returncode} (see {out}/profiles/)")
    return json.loads((out / "profiles" / "processes.json").read_text())


PAIRED = ("median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "request_throughput")


def paired(sa, sb):
    """{metric: [with / without for each seed both sides ran]}."""
    a = {s["seed"]: s for s in sa}
    return {k: [s[k] / a[s["seed"]][k] for s in sb if s["seed"] in a and a[s["seed"]].get(k)]
            for k in PAIRED}


def summaries(top, variant=None):
    """Every analysed run's summary at or below `top` (of `variant`, when given)."""
    out = [json.loads(p.read_text()) for p in sorted(top.rglob("summary.json"))]
    return [s for s in out if variant is None or str(s.get("variant") or s["label"]) == variant]


def compare(top, variant, json_path):
    """`testbed compare` of the two sides (printed); the metrics it finds distinguishable."""
    subprocess.run([sys.executable, "-m", "testbed.cli", "compare",
                    f"{top / 'without'}:{variant}", f"{top / 'with'}:{variant}",
                    "--json", str(json_path)], cwd=REPO, check=True)
    rows = json.loads(json_path.read_text())["metrics"]
    return [r["metric"] for r in rows if r["difference"]["distinguishable"]
            and r["difference"]["method"] != "single"]


def main(argv=None):
    args = parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    top = pathlib.Path(args.out) if args.out else REPO / "results" / "live_cost" / stamp
    top.mkdir(parents=True, exist_ok=False)
    without = profiled_run(args, top / "without")
    port = promserver.free_port()
    with promserver.running(top, port):
        with_ = profiled_run(args, top / "with", port)
    live = json.loads((top / "with" / "live.json").read_text())
    share = live["cpu_s"] / with_["tree_cpu_s"]
    print(f"\nrun tree CPU: without {without['tree_cpu_s']:.1f} s over {without['wall_s']:.1f} s;"
          f" with {with_['tree_cpu_s']:.1f} s over {with_['wall_s']:.1f} s "
          f"(with/without {with_['tree_cpu_s'] / without['tree_cpu_s']:.3f})")
    print(f"the exporter: {live['cpu_s']:.2f} CPU-s, {100 * share:.1f}% of the run tree's CPU")
    distinguishable, paired_all = [], {}
    for v in sorted({str(s.get("variant") or s["label"]) for s in summaries(top / "without")}):
        print(f"\n## {v}: A without the exporter, B with it\n", flush=True)
        distinguishable += [f"{v} {m}" for m in compare(top, v, top / f"compare-{v}.json")]
        ratios = paired(summaries(top / "without", v), summaries(top / "with", v))
        print("paired by seed, with / without: " + "; ".join(
            f"{k} " + " ".join(f"{x:.3f}" for x in xs) for k, xs in ratios.items()))
        paired_all[v] = ratios
    print(f"\nmetrics distinguishable from run noise: {', '.join(distinguishable) or 'none'}")
    (top / "live_cost.json").write_text(json.dumps({
        "experiment": args.experiment, "replicates": args.replicates, "sets": args.set,
        "tree_cpu_s": {"without": without["tree_cpu_s"], "with": with_["tree_cpu_s"]},
        "exporter_cpu_s": live["cpu_s"], "exporter_share": share,
        "distinguishable": distinguishable, "paired": paired_all}, indent=1))
    print(top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
