"""How fast the testbed emulates, and how faithfully, at each time scale (issue 15's table).

Runs the paper's case study (experiments/paper_case_study.yaml, three policies, 600 requests
offered at 4/s: its capacity measurement) as a child `testbed run` at each `scale.time` asked
for (10 and 40 by default; 40 with `scale.bytes: 2.5e-4`, since the delay line caps the
emulated WAN) and prints one table from each variant's summary.json:

| scale.time | instances | wall time | first-token lag (median, p99) | decode-step ratio |
measured / predicted capacity |

and per scale a line of the CPU figures that transfer between machines (CPU seconds of the
run's process tree, per emulated request and per instance-second: testbed/profiling/cost.py).
Wall time is the whole `testbed run` (all three variants, set-up and analysis included), per
variant the span in its metadata.json; the lag is real-world ms from the decode worker's first
token stamp to its arrival at the client; capacity is the steady throughput over the planner's
expected-latency prediction. `--sweep` also runs the delay-line rate sweep
(`testbed.net.ratesweep`, benchmarks/link_fidelity.py --rate-sweep) in the same invocation and
prints its table: goodput over the configured rate and over the raw veth rate measured
alongside, delay error (idle RTT, loaded one-way delay), reordering and the delay line's CPU,
without and with loss (about a minute).

Needs root (it starts `testbed run`): on a shared machine run it under the root lock, e.g.

    flock /tmp/prfaas-root.lock .venv/bin/python benchmarks/emulation_speed.py

`--smoke` runs the same path in well under a minute: the case study at 40x with 15 requests per
variant and no link probe, and a one-rate sweep (the numbers are too short to mean much).

`--scale auto` runs the file's `scale.time: auto` (testbed/autoscale.py): each variant's row
shows the scale its pilot chose, and a line per variant the scales tried (! warned), the
pilot's wall time (the network build it hands the run left out) against the variant's span.
`--twice` then reruns each variant alone at twice its chosen scale, to show that it warns.
"""

import argparse
import json
import pathlib
import sys
import tempfile

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from testbed import rundir  # noqa: E402
from testbed.net import ratesweep  # noqa: E402
from testbed.profiling import cost  # noqa: E402

EXPERIMENT = REPO / "experiments" / "paper_case_study.yaml"
# scale.time -> extra --set options it needs (the WAN's emulated rate stays under the cap)
SCALES = {10: [], 40: ["scale.bytes=2.5e-4"]}
# Offered above every policy's capacity, so the steady throughput is the capacity (the case
# study's capacity measurement, docs/results.md); the file's own 3.3/s is PrfaaS-PD's Lambda_max.
CAPACITY_RATE = "workload.arrival.rate=4/s"
# --smoke: scale.time 40 only, few requests, no link probe; a one-rate sweep, short
SMOKE_SCALES = [40.0]
SMOKE_SETS = ["requests=15"]
SMOKE_SWEEP = {"rates": (1e9,), "losses": (0.0,), "duration_s": 0.5}
VARIANT_KEY = "scheduler.policy"     # the case study's variants are its policies
HEADER = ("| scale.time | variant | instances | wall time | first-token lag (median, p99) "
          "| decode-step ratio | measured / predicted capacity |\n"
          "|---:|---|---:|---:|---:|---:|---:|")


def run_case_study(scale_time, sets, out, probe=True):
    """`testbed run` of the case study at `scale_time`: its wall time in seconds and the run
    tree's CPU figures (testbed/profiling/cost.py)."""
    return cost.timed_run(EXPERIMENT, out, [f"scale.time={scale_time}", CAPACITY_RATE, *sets],
                          REPO, probe)


def pilot_line(vdir):
    """One variant's `scale_auto` record in one line, or None for a fixed scale. One variant
    ran the experiment's pilot (its steps); the others took a scale from it."""
    meta = rundir.metadata(vdir)
    rec = meta.get("scale_auto")
    if not rec:
        return None
    span = meta["end_time"] - meta["start_time"]
    if "steps" not in rec:
        return (f"{vdir.name}: {rec['chosen']:g} from the pilot of {rec['piloted']} "
                f"({rec.get('pilot_base', rec['pilot_chosen'])} x {rec['factor']:.3g}, "
                f"{rec.get('factor_bound', 'its room')}); no pilot of its own; span {span:.1f} s")
    tried = ", ".join(f"{s['scale']:g}{'' if s['faithful'] else '!'}{_share(s)}"
                      for s in rec["steps"])
    return (f"{vdir.name}: pilot on {rec['piloted']}: {rec['pilot_chosen']} of {tried}; "
            f"pilot {rec['pilot_s']:.1f} s (+ network build {rec.get('network_build_s', 0):.1f}"
            f" s, reused); span {span:.1f} s; above: {rec.get('above')}")


def pilot_share(run_dir):
    """The pilot's wall time over the measured runs' (`cost.pilot_cost`), in one line."""
    got = cost.pilot_cost(run_dir)
    if got is None:
        return None
    pilot, runs, taken = got
    own = f" (less {taken:.1f} s of link probes the runs took as theirs)" if taken else ""
    return f"pilot {pilot:.1f} s{own} over the runs' {runs:.1f} s: {100 * pilot / runs:.0f}%"


def _share(step):
    """A step's steady TTFT excess as a share of the run's expected p90, in brackets."""
    share = step.get("steady_share")
    return "" if share is None else f" ({100 * share:.2g}%)"


def _variant(label):
    """The case study's variant `label` (its policy), as the file writes it."""
    variants = yaml.safe_load(EXPERIMENT.read_text())["variants"]
    return next(v for v in variants if v[VARIANT_KEY] == label)


def twice_rows(run_dir, sets, probe):
    """Each auto variant of `run_dir` rerun alone at twice its chosen scale: the table's rows
    and its warnings (the choice is near the largest faithful scale if these warn)."""
    rows, notes = [], []
    for vdir in sorted(rundir.find_runs(run_dir)):
        rec = rundir.metadata(vdir).get("scale_auto")
        if not rec:
            continue
        st = 2 * rec["chosen"]
        out = run_dir.parent / f"twice-{vdir.name}"
        one = [f"variants={json.dumps([_variant(vdir.name)])}",
               *(["scale.bytes=2.5e-4"] if st > 40 else [])]     # the WAN under the cap
        wall_s, _ = run_case_study(st, [*one, *sets], out, probe)
        rows += table_rows(st, wall_s, out)
        for w in rundir.summary(rundir.find_runs(out)[0]).get("warnings", []):
            notes.append(f"{vdir.name} at {st:g}: {w}")
    return rows, notes


def variant_row(vdir):
    """(instances, span s, lag median ms, lag p99 ms, decode-step ratio, capacity ratio)."""
    summary, meta, rt = rundir.summary(vdir), rundir.metadata(vdir), rundir.runtime(vdir)
    instances = sum(1 for i in rt["instances"].values() if i["role"] in ("prefill", "decode"))
    emu, pred = summary.get("emulation") or {}, summary.get("prediction") or {}
    predicted = pred.get("lambda_max_expected", pred.get("lambda_max"))
    measured = summary.get("steady_throughput")
    capacity = measured / predicted if measured and predicted else None
    return (instances, meta["end_time"] - meta["start_time"], emu.get("first_token_lag_ms"),
            emu.get("first_token_lag_p99_ms"), emu.get("decode_step_ratio"), capacity)


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table_rows(scale_time, wall_s, run_dir):
    rows = []
    for vdir in sorted(rundir.find_runs(run_dir)):
        n, span, lag, lag99, step, cap = variant_row(vdir)
        rec = rundir.metadata(vdir).get("scale_auto")
        st = f"auto: {rec['chosen']:g}" if rec else f"{scale_time:g}"
        rows.append(f"| {st} | {vdir.name} | {n} | {span:.1f} s (run {wall_s:.1f} s) "
                    f"| {fmt(lag, '.0f')}, {fmt(lag99, '.0f')} ms | {fmt(step, '.3f')}x "
                    f"| {fmt(cap, '.3f')} |")
    return rows


def sweep_rows(rates=ratesweep.SWEEP_RATES, losses=ratesweep.SWEEP_LOSSES,
               duration_s=ratesweep.SWEEP_S):
    """The delay-line sweep as lines (benchmarks/link_fidelity.py --rate-sweep's table): goodput
    over the configured rate and over the raw veth, delay error, reordering, the line's CPU."""
    lines, raw_seen = [], set()
    for raw, p in ratesweep.delayline_sweep(rates, losses, duration_s):
        for r in raw.values():
            if r.per_frame not in raw_seen:
                raw_seen.add(r.per_frame)
                print(ratesweep.fmt_raw(r))
        lines.append(ratesweep.fmt_sweep_row(p))
    return [ratesweep.SWEEP_HEADER, *lines]


def _scale(text):
    return "auto" if text == "auto" else float(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=_scale, action="append",
                    help=f"scale.time to run, or auto (repeatable; default {sorted(SCALES)})")
    ap.add_argument("--twice", action="store_true",
                    help="after --scale auto, each variant alone at twice its chosen scale")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra testbed run --set, for every scale")
    ap.add_argument("--sweep", action="store_true",
                    help="also the delay-line rate sweep against the raw veth rate (minutes)")
    ap.add_argument("--smoke", action="store_true", help="the same path in seconds: 40x, "
                    f"{SMOKE_SETS}, no link probe, a one-rate sweep")
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    scales = SMOKE_SCALES if args.smoke else args.scale or sorted(SCALES)
    extra = args.set + (SMOKE_SETS if args.smoke else [])
    with tempfile.TemporaryDirectory(prefix="emulation_speed-") as tmp:
        base = pathlib.Path(args.out or tmp)
        rows, costs, pilots = [], [], []
        speed = [cost.reference_ms()]
        for st in scales:
            run_dir = base / (f"time{st:g}" if st != "auto" else "auto")
            wall_s, c = run_case_study(st, SCALES.get(st, []) + extra, run_dir, not args.smoke)
            rows += table_rows(st, wall_s, run_dir)
            costs.append(f"scale.time {st}: wall {wall_s:.1f} s; {cost.fmt_cost(c)}")
            pilots += filter(None, map(pilot_line, sorted(rundir.find_runs(run_dir))))
            pilots += filter(None, [pilot_share(run_dir)])
            if st == "auto" and args.twice:
                more, notes = twice_rows(run_dir, extra, not args.smoke)
                rows, pilots = rows + more, pilots + notes
        speed.append(cost.reference_ms())
        print(HEADER)
        print("\n".join(rows))
        print("\n".join(costs + pilots))
        print(f"reference work (testbed.profiling.cost.reference_ms): {speed[0]:.1f} ms CPU "
              f"before, {speed[1]:.1f} ms after (higher: a slower machine now)")
        if args.sweep or args.smoke:
            print("\n".join(sweep_rows(**SMOKE_SWEEP) if args.smoke else sweep_rows()))


if __name__ == "__main__":
    main()
