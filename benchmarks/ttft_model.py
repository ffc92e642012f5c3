"""The TTFT model against measured runs: predicted and measured TTFT mean, p50 and p90 of every
analysed run below the directories given, with the relative error and each stage's utilisation.

The prediction is `testbed.plan.ttft.predict_for` at the run's own request list (its arrival
rate and burstiness), its uncached lengths and its configuration, computed from the run
directory alone (a run analysed before the model existed gets one too). Runs with faults are
listed but marked and not counted: the model knows no faults, phases, adaptive threshold or
role conversion. Its numbers are not part of the test suite's
pass/fail.

    .venv/bin/python benchmarks/ttft_model.py RUN_DIR [RUN_DIR ...] [--max-load 0.8]
    .venv/bin/python benchmarks/ttft_model.py --curve TOP [--max-load 0.8]
    .venv/bin/python benchmarks/ttft_model.py --smoke     # the fixture run in tests/data

`--curve TOP`: a load sweep (`sweep: {load: [...]}`, experiments/load_curve.yaml) with
replicates, one point per policy and load: the median over the replicates of the model and of
the measurement, the error, and how many points at or below `--max-load` (a fraction of the
policy's predicted Lambda_max, the sweep's own `load`) have p50 and p90 within 15%. Then the
capacity at the sweep's 1.3 point: steady throughput and its ratio to the Lambda_max (E[T]) of
each replicate's own lengths, median and 95% interval over the replicates
(`testbed.plot_load.capacity_table`).
"""

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import analysis, plan, plot_load, rundir  # noqa: E402
from testbed.plan import ttft  # noqa: E402

SMOKE_RUN = ROOT / "tests" / "data" / "quickstart_run"
KEYS = (("mean_ttft_ms", "mean"), ("median_ttft_ms", "p50"), ("p90_ttft_ms", "p90"))


def rows(top):
    """(run, prediction, summary) for every analysed run at or below `top`."""
    for d in rundir.find_runs(top):
        exp, s = rundir.experiment(d), rundir.summary(d)
        req, work = rundir.requests(d), rundir.workload(d)
        lengths = (req.input_len - req.cached_len.fillna(0)).to_numpy()
        inp = plan.inputs_for(exp, lengths, output_lengths=req.output_len.to_numpy())
        yield d, ttft.predict_for(exp, inp, work.arrival_s.to_numpy()), s, _unmodelled(exp)


def _unmodelled(exp):
    """What the run has that the model does not (it then does not count), or ''."""
    what = [name for name, on in (("faults", exp.faults), ("phases", exp.workload.phases),
                                  ("adaptive threshold", exp.scheduler.adaptive.enabled),
                                  ("role conversion", exp.scheduler.roles.enabled)) if on]
    return ", ".join(what)


def _err(p, m):
    return "-" if p is None or not m else f"{(p / m - 1) * 100:+.0f}%"


def report(tops, max_load):
    print("run | load | C_a^2 | " + " | ".join(f"{n} model/measured (err)" for _, n in KEYS))
    hits = total = 0
    for top in tops:
        for d, p, s, faulted in rows(top):
            load = max((st["utilisation"] for st in p["stages"].values()), default=0.0)
            cells = []
            for key, _ in KEYS:
                pv, mv = p.get(key), s.get(key)
                cells.append(f"{'-' if pv is None else f'{pv:.0f}'}/{mv:.0f} ({_err(pv, mv)})")
            note = f" ({faulted}: not modelled)" if faulted else ""
            print(f"{d.parent.name}/{d.name} | {load:.2f} | {p['arrival_scv']:.2f} | "
                  + " | ".join(cells) + note)
            if not faulted and load < max_load and p.get("p90_ttft_ms") is not None:
                total += 1
                hits += all(abs(p[k] / s[k] - 1) <= 0.15 for k in ("median_ttft_ms",
                                                                     "p90_ttft_ms"))
    if total:
        print(f"below {max_load:g} load without faults: {hits} of {total} runs have p50 and "
              f"p90 within 15% ({hits / total:.0%})")


def curve_report(top, max_load):
    """Per policy and load of a sweep: model and measured TTFT (medians over replicates)."""
    points = {}
    for d, p, s, faulted in rows(top):
        if s.get("load") is None or faulted:
            continue
        key = (str(s["label"]).split(",load=")[0], float(s["load"]))
        points.setdefault(key, []).append((p, s))
    print("policy | load (of Lambda_max) | n | " + " | ".join(
        f"{n} model/measured (err)" for _, n in KEYS))
    hits = total = 0
    for (series, load), runs in sorted(points.items()):
        cells, errs = [], {}
        for key, _ in KEYS:
            pv = _median([p.get(key) for p, _ in runs])
            mv = _median([s.get(key) for _, s in runs])
            errs[key] = None if pv is None or not mv else pv / mv - 1
            cells.append(f"{'-' if pv is None else f'{pv:.0f}'}/{mv:.0f} ({_err(pv, mv)})")
        print(f"{series} | {load:g} | {len(runs)} | " + " | ".join(cells))
        if load <= max_load + 1e-9 and errs["p90_ttft_ms"] is not None:
            total += 1
            hits += all(abs(errs[k]) <= 0.15 for k in ("median_ttft_ms", "p90_ttft_ms"))
    if total:
        print(f"at or below {max_load:g} Lambda_max: {hits} of {total} points have p50 and p90 "
              f"within 15% ({hits / total:.0%})")


def capacity_report(top):
    """Measured capacity against the prediction, per policy (paired per replicate)."""
    cap = plot_load.capacity_table(plot_load.load_table(plot_load.curve_frame(top)))
    if cap.empty:
        return
    print(f"capacity (offered {plot_load.CAPACITY_LOAD:g} x Lambda_max) | n | Lambda_max | "
          "steady req/s [95% CI] | steady / own Lambda_max [95% CI]")
    for r in cap.itertuples():
        print(f"{r.series} | {r.n} | {r.lambda_max:.3f} | {r.steady_throughput:.3f} "
              f"[{r.steady_throughput_lo:.3f}, {r.steady_throughput_hi:.3f}] | "
              f"{r.capacity_ratio:.3f} [{r.capacity_ratio_lo:.3f}, {r.capacity_ratio_hi:.3f}] "
              f"({r.capacity_ratio_method})")


def _median(values):
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=pathlib.Path, help="run directories (or tops)")
    ap.add_argument("--max-load", type=float, default=0.8,
                    help="count runs whose busiest stage is below this utilisation")
    ap.add_argument("--smoke", action="store_true", help="the fixture run in tests/data")
    ap.add_argument("--curve", type=pathlib.Path, metavar="TOP",
                    help="a load sweep with replicates: one point per policy and load")
    args = ap.parse_args(argv)
    if args.curve:
        curve_report(args.curve, args.max_load)
        capacity_report(args.curve)
        return 0
    if args.smoke:      # the fixture holds raw records: analyse a copy first
        with tempfile.TemporaryDirectory() as tmp:
            top = pathlib.Path(tmp) / SMOKE_RUN.name
            shutil.copytree(SMOKE_RUN, top)
            for d in rundir.find_recorded_runs(top):
                analysis.analyse(d)
            report([top], args.max_load)
        return 0
    if not args.runs:
        ap.error("give run directories, or --smoke")
    report(args.runs, args.max_load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
