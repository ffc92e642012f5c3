"""How well a pilot step predicts its measured run's TTFT excess: the data behind
`testbed.autojudge.ABOVE_CAPACITY_FACTOR` (issue 22, `scale.time: auto`).

A pilot step is the run's deployment and workload cut to `PILOT_REQUESTS` requests
(testbed/autoscale.py). It judges the TTFT excess of its requests after the warm-up (the steady
excess p90) against the TTFT p90 the planner expects of the whole run, times a factor for a run
offered above capacity, whose backlog keeps every instance busy for far longer than the pilot's
requests do. This benchmark measures that factor instead of assuming it: for one variant of the
paper's case study (offered at 4/s, above every policy's capacity, as
benchmarks/emulation_speed.py runs it), or any one-run experiment given with `--experiment`
(as its file says: many_instances is below capacity, its factor 1), and each scale.time asked
for, it runs a pilot-sized run and the whole run side by side (alternated, no link probe) and
prints per scale

| scale.time | pilot steady excess p90 | run excess p90 | run TTFT p90 | the planner's p90 |
pilot share x1 [90% interval] | run share | implied factor |

where a share is an excess over the planner's p90 (the pilot's, as `autojudge.judge` forms
it, factor 1) or over the run's own TTFT p90 (the run's guard, `emulation.ttft_excess_ms
.share_p90`), and the implied factor is the run's share over the pilot's: the factor at which
the pilot's judgement would have matched the run's guard at that scale. Below 1 the pilot
over-counts, above 1 it under-counts. The interval is the pilot's steady p90's 90% bootstrap
interval (`autojudge.steady_interval_ms`), which the search plans with
(`autojudge.planned_share`); the last line says in how many pairs the run's share was above
its high end. `--repeat N` runs each pair N times.

Needs root (it starts `testbed run`): on a shared machine run it under the lock, e.g.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/pilot_pairs.py --scale 14 --scale 28

`--smoke` runs the same path in well under a minute (two tiny runs, too short to mean much).
"""

import argparse
import json
import pathlib
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from testbed import autojudge, rundir  # noqa: E402
from testbed.autoscale import PILOT_REQUESTS  # noqa: E402
from testbed.profiling import cost  # noqa: E402

EXPERIMENT = REPO / "experiments" / "paper_case_study.yaml"
CAPACITY_RATE = "workload.arrival.rate=4/s"     # above every policy's capacity
VARIANT_KEY = "scheduler.policy"
SMOKE = {"scales": [10.0], "pilot": 6, "run": 12}
HEADER = ("| scale.time | pilot steady excess p90 | run excess p90 | run TTFT p90 "
          "| planner's p90 | pilot share x1 [90% interval] | run share | implied factor |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|")


def variant_set(label):
    """The --set that keeps only the case study's variant `label` (its policy)."""
    variants = yaml.safe_load(EXPERIMENT.read_text())["variants"]
    found = [v for v in variants if v[VARIANT_KEY] == label]
    if not found:
        raise SystemExit(f"no variant {label!r} in {EXPERIMENT.name}: "
                         f"{[v[VARIANT_KEY] for v in variants]}")
    return f"variants={json.dumps(found)}"


def pair(experiment, scale, sets, out, pilot_n, run_n=None):
    """The pilot-sized run and the whole run of `experiment` at `scale` under `out`: the
    table's row values."""
    common = [f"scale.time={scale:g}", *sets]
    cost.timed_run(experiment, out / "pilot", [*common, f"requests={pilot_n}"], REPO, False)
    cost.timed_run(experiment, out / "run",
                   [*common, *([f"requests={run_n}"] if run_n else [])], REPO, False)
    pdir, rdir = (rundir.find_runs(out / d)[0] for d in ("pilot", "run"))
    requests = rundir.requests(pdir)
    steady = autojudge.steady_excess_p90_ms(requests)
    interval = autojudge.steady_interval_ms(requests)
    look = autojudge.outlook(rundir.load_run(rdir).experiment)
    summary = rundir.summary(rdir)
    ex = (summary.get("emulation") or {}).get("ttft_excess_ms") or {}
    base = max(rundir.summary(pdir).get("p90_ttft_ms") or 0.0, look.ttft_p90_ms or 0.0)
    pilot_share = steady / base if steady is not None and base else None
    interval = (tuple(x / base for x in interval) if interval and pilot_share is not None
                else None)
    run_share = ex.get("share_p90")
    implied = run_share / pilot_share if run_share is not None and pilot_share else None
    return {"scale": scale, "steady_ms": steady, "run_excess_ms": ex.get("p90"),
            "run_p90_ms": summary.get("p90_ttft_ms"), "planner_p90_ms": look.ttft_p90_ms,
            "above_capacity": look.above_capacity, "pilot_share": pilot_share,
            "pilot_interval": interval,
            "run_share": run_share, "implied": implied}


def fmt(value, spec, unit=""):
    return "-" if value is None else format(value, spec) + unit


def _interval(iv):
    return f" [{100 * iv[0]:.2f}, {100 * iv[1]:.2f}]" if iv else ""


def row(r):
    return (f"| {r['scale']:g} | {fmt(r['steady_ms'], '.0f', ' ms')} "
            f"| {fmt(r['run_excess_ms'], '.0f', ' ms')} | {fmt(r['run_p90_ms'], '.0f', ' ms')} "
            f"| {fmt(r['planner_p90_ms'], '.0f', ' ms')} "
            f"| {fmt(r['pilot_share'] and 100 * r['pilot_share'], '.2f', '%')}"
            f"{_interval(r['pilot_interval'])} "
            f"| {fmt(r['run_share'] and 100 * r['run_share'], '.2f', '%')} "
            f"| {fmt(r['implied'], '.2f')} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", type=pathlib.Path, default=EXPERIMENT,
                    help="a one-run experiment file (default: the case study, one --variant "
                         "of it, offered at 4/s)")
    ap.add_argument("--variant", default="prfaas", help="the case study's policy (prfaas)")
    ap.add_argument("--scale", type=float, action="append",
                    help="scale.time of a pair (repeatable; default 14 and 28)")
    ap.add_argument("--repeat", type=int, default=1, help="pairs per scale (alternated)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra testbed run --set for both runs of every pair")
    ap.add_argument("--smoke", action="store_true", help="the same path in seconds")
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    scales = SMOKE["scales"] if args.smoke else args.scale or [14.0, 28.0]
    pilot_n, run_n = (SMOKE["pilot"], SMOKE["run"]) if args.smoke else (PILOT_REQUESTS, None)
    case = args.experiment.resolve() == EXPERIMENT
    sets = [variant_set(args.variant), CAPACITY_RATE, *args.set] if case else args.set
    name = args.variant if case else args.experiment.stem
    with tempfile.TemporaryDirectory(prefix="pilot_pairs-") as tmp:
        base, rows = pathlib.Path(args.out or tmp), []
        for i in range(args.repeat):
            for s in scales:
                rows.append(pair(args.experiment, s, sets, base / f"s{s:g}-{i + 1}", pilot_n,
                                 run_n))
                print(row(rows[-1]), file=sys.stderr, flush=True)       # progress
        print(f"{name}, pilot {pilot_n} requests{', offered at 4/s' if case else ''}:")
        print(HEADER)
        print("\n".join(row(r) for r in rows))
        implied = sorted(r["implied"] for r in rows if r["implied"] is not None)
        if implied:
            print(f"implied factor {implied[0]:.2f}-{implied[-1]:.2f} over {len(implied)} "
                  f"pairs (testbed.autojudge.ABOVE_CAPACITY_FACTOR: "
                  f"{autojudge.ABOVE_CAPACITY_FACTOR:g})")
        known = [r for r in rows if r["pilot_interval"] and r["run_share"] is not None]
        if known:
            over = sum(r["run_share"] > r["pilot_interval"][1] for r in known)
            print(f"the run's share above its pilot's interval's high end in {over} of "
                  f"{len(known)} pairs (above the pilot's share in "
                  f"{sum(r['run_share'] > r['pilot_share'] for r in known)})")


if __name__ == "__main__":
    main()
