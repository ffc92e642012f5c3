"""The simulator against the emulation: the same experiment, the same seed, both backends.

For each variant it prints sim / emulation ratios of request throughput (steady, and completed
over the span), TTFT p50/p90/p99, mean TPOT and mean KV egress, TTFT p50/p90 against the
emulation's own figures less the excess its analysis measured (the control plane's latency,
which the sim does not model), and the difference of the cache hit shares (issue 25's table;
docs/sim.md keeps it); for a variant with faults, each fault's detection and recovery seconds
and re-dispatched requests in both; for a cached variant, how many of the sim's placements
with a hit change when chosen again (testbed/sim/replay.py) with the pool fetch time the
emulation's placement had learned (its RPCs' latency, which the sim does not model). The emulation needs root and minutes: run it under the shared lock,

    flock /tmp/heavy.lock python benchmarks/sim_vs_emulation.py experiments/quickstart.yaml

or compare against an emulated run directory made before (`--emulated DIR`, the top of a
`testbed run` of the same file and seed). `--same-phase` starts the sim's periodic controllers
(adaptive threshold, re-plan) at the emulated run's phase: the emulation's start with the
scheduler, seconds before arrival 0. `--off TERM ...` turns link model terms off in the
sim (testbed.sim.wan.Terms: share, propagation, jitter, queue, loss_cap) to show what each
contributes. `--loop-cost` times the event loop against simpy (if installed) on the same
callback chain. `--cost REQUESTS INSTANCES` times one sim run of the quickstart grown to that
many instances (a third per role) at the quickstart's load per instance (0.2 req/s and 50
Gbit/s of WAN per PrfaaS instance, scale.bytes 1e-5, less past 1,000 instances so the WAN
passes deploy's rate check), per-request records only: the simulation's wall and CPU seconds,
both with analysis, events, peak memory (run one point per process: the peak is the process's;
`--csv FILE` appends the point to FILE). `--cost-figure CSV PNG` draws the cost curve from such
a file (docs/sim.md). `--smoke` (seconds, no root): quickstart at 30 requests, sim against sim with
the same seed: the comparison's path end to end, and every ratio 1.000 to 1e-6 (the sim is
deterministic; stamps are Unix times from each run's own start, to the microsecond).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import dataclasses
import datetime
import json
import pathlib
import resource
import sys
import tempfile
import time
import types

import pandas as pd

from testbed import config, figstyle, rundir
from testbed import run as runner
from testbed.records import read_decisions, read_events
from testbed.sim import replay
from testbed.sim.run import SimRun
from testbed.sim.wan import Terms

METRICS = (("steady_throughput", "thr (steady)"), ("request_throughput", "thr"),
           ("median_ttft_ms", "TTFT p50"), ("p90_ttft_ms", "TTFT p90"),
           ("p99_ttft_ms", "TTFT p99"), ("mean_tpot_ms", "TPOT"),
           ("egress_mean_gbps", "egress"))


def sim_runs(path, overrides, top, terms, phases=None):
    """Run every variant of `path` in the sim under `top`; {label: summary}. `phases`:
    {label: emulated seconds the emulation's controllers ran before arrival 0}."""
    runs = config.load_experiment(path, [*overrides, "backend.kind=sim"])
    out = {}
    for exp in runs:
        d = runner.run_path(top, exp, len(runs))
        out[exp.label] = SimRun(exp, d, terms=terms,
                                controllers_since_s=(phases or {}).get(exp.label, 0.0)
                                ).execute()
    return out


def controller_phases(top):
    """{label: emulated seconds from the emulation's workers being ready (the scheduler's
    controllers start then) to arrival 0}, from each run's events.csv and metadata.json."""
    out = {}
    for d in rundir.find_runs(top):
        meta = json.loads((d / rundir.RunDir.METADATA).read_text())
        ready = [e[0] for e in read_events(d / rundir.RunDir.EVENTS, meta.get("clocks"))
                 if e[1] == "workers_ready"]
        if ready and meta.get("client_start_at"):
            label = json.loads((d / rundir.RunDir.SUMMARY).read_text())["label"]
            out[label] = max(0.0, meta["client_start_at"] - ready[0])
    return out


def emulated_runs(path, overrides, top):
    runner.execute(path, overrides, out=top, probe=False, progress=False)
    return summaries(top)


def summaries(top):
    return {json.loads((d / rundir.RunDir.SUMMARY).read_text())["label"]:
            json.loads((d / rundir.RunDir.SUMMARY).read_text())
            for d in rundir.find_runs(top)}


def ratio(a, b):
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else float("inf")
    return a / b


# Issue 25's bar below saturation: throughput within 3%, TTFT p50 and p90 within 10%.
BAR = (("steady_throughput", 0.03), ("median_ttft_ms", 0.10), ("p90_ttft_ms", 0.10))


def within_bar(s, e):
    rs = [(ratio(s.get(k), e.get(k)), tol) for k, tol in BAR]
    return all(r is not None and abs(r - 1) <= tol for r, tol in rs)


def cache_hit_difference(s, e):
    """sim - emulation cache hit share (input tokens prefilled from cache), "-" without a
    cache on either side."""
    if not (s.get("cache_enabled") or e.get("cache_enabled")):
        return "-"
    a, b = s.get("cache_hit_share"), e.get("cache_hit_share")
    return "-" if a is None or b is None else f"{a - b:+.3f}"


def less_excess(s, e):
    """sim / emulation TTFT p50 and p90 with the emulation's own excess taken out (its
    analysis's `emulation.ttft_excess_ms`: control-plane and wake-up lateness the sim does not
    model, testbed/excess.py), "-" where the run has none."""
    x = (e.get("emulation") or {}).get("ttft_excess_ms") or {}
    r = [ratio(s.get(k), x.get(f"ttft_corrected_{q}"))
         for k, q in (("median_ttft_ms", "p50"), ("p90_ttft_ms", "p90"))]
    return "-" if None in r else f"{r[0]:.3f}, {r[1]:.3f}"


def table(sim, emu, name):
    head = (["experiment", "variant"] + [m[1] for m in METRICS]
            + ["TTFT p50, p90 (emulation less its excess)", "cache hit share, sim - emulation",
               "within bar"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in sim:
        if label not in emu:
            continue
        cells = [name, label]
        for key, _ in METRICS:
            r = ratio(sim[label].get(key), emu[label].get(key))
            cells.append("-" if r is None else f"{r:.3f}")
        cells.append(less_excess(sim[label], emu[label]))
        cells.append(cache_hit_difference(sim[label], emu[label]))
        cells.append("yes" if within_bar(sim[label], emu[label]) else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seconds(x):
    return "-" if x is None else f"{x:.1f}"


def fault_table(sim, emu, name):
    """Per fault of each variant (analysis's `faults`, testbed/faults.py): detection and
    recovery seconds and the requests re-dispatched, sim against emulation; "" if none."""
    head = ["experiment", "variant", "fault", "detect s (sim / emulation)",
            "detect difference s", "recover s (sim / emulation)", "re-dispatched (sim / emulation)"]
    lines = []
    for label in sim:
        for fs, fe in zip(sim[label].get("faults") or [], (emu.get(label) or {}).get("faults")
                          or []):
            d = (None if fs.get("detect_s") is None or fe.get("detect_s") is None
                 else fs["detect_s"] - fe["detect_s"])
            lines.append("| " + " | ".join([
                name, label, f"{fs['kind']} {fs['target']}",
                f"{_seconds(fs.get('detect_s'))} / {_seconds(fe.get('detect_s'))}",
                "-" if d is None else f"{d:+.1f}",
                f"{_seconds(fs.get('recover_s'))} / {_seconds(fe.get('recover_s'))}",
                f"{fs.get('redispatched')} / {fe.get('redispatched')}"]) + " |")
    if not lines:
        return ""
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines])


def learned_fetch_s(placer, emu_dir):
    """[(seconds after the first send, fetch s per byte)]: what the emulation's placement had
    learned, `placer.observe` fed its prefill replies (requests.parquet) in reply order."""
    df = pd.read_parquet(pathlib.Path(emu_dir) / "requests.parquet").sort_values("prefill_end")
    t0, out = df.send_time.min(), []
    for t, nbytes, s in zip(df.prefill_end, df.cache_fetch_bytes.fillna(0),
                            df.cache_fetch_s.fillna(0)):
        placer.observe(types.SimpleNamespace(cache_fetch_bytes=nbytes, cache_fetch_s=s))
        if placer.fetch_s_per_byte is not None:
            out.append((t - t0, placer.fetch_s_per_byte))
    return out


def fetch_term(sim_dir, emu_dir):
    """The sim's placements (decisions.jsonl) chosen again with the fetch time the emulation's
    placement had learned at the same moment: (placements with a hit, those that change)."""
    recs = read_decisions(rundir.RunDir(sim_dir).decisions)
    _, placer, clock = replay.deciders_of(sim_dir)
    learned = learned_fetch_s(placer, emu_dir) if placer is not None else []
    if not learned or not recs or not recs[0].cache:
        return None
    t0 = min(r.time for r in recs)
    times = [t for t, _ in learned]
    hits = changed = 0
    for r in recs:
        if not (r.cache["plan"] and r.cache["plan"][1] > 0):
            continue
        hits += 1
        i = bisect.bisect_right(times, r.time - t0) - 1
        rec = dataclasses.replace(r, cache={**r.cache, "fetch_s_per_byte":
                                            learned[i][1] if i >= 0 else None})
        changed += replay.place(placer, clock, rec) != replay.outcome(r)
    return hits, changed


def absolute(sim, emu):
    """Both backends' values side by side (real-world units)."""
    lines = []
    for label in sim:
        if label not in emu:
            continue
        parts = [f"{m[1]} {sim[label].get(m[0]) or 0:.4g}/{emu[label].get(m[0]) or 0:.4g}"
                 for m in (*METRICS, ("cache_hit_share", "cache hit share"))]
        lines.append(f"  {label}: sim/emulation  " + ", ".join(parts))
    return "\n".join(lines)


def loop_cost(n=200_000):
    """Seconds per event: the heap loop vs simpy on a chain of `n` timed callbacks."""
    from testbed.sim.loop import Loop
    loop = Loop()
    left = [n]

    def tick():
        left[0] -= 1
        if left[0]:
            loop.after(0.001, tick)
    loop.at(0.0, tick)
    t = time.perf_counter()
    loop.run()
    heap_s = (time.perf_counter() - t) / n
    print(f"heap loop: {heap_s * 1e6:.2f} us/event ({n} events)")
    try:
        import simpy
    except ImportError:
        print("simpy: not installed (pip install simpy to compare)")
        return
    env = simpy.Environment()

    def proc():
        for _ in range(n):
            yield env.timeout(0.001)
    env.process(proc())
    t = time.perf_counter()
    env.run()
    proc_s = (time.perf_counter() - t) / n
    env = simpy.Environment()
    left = [n]

    def cb(_):
        left[0] -= 1
        if left[0]:
            env.timeout(0.001).callbacks.append(cb)
    env.timeout(0.0).callbacks.append(cb)
    t = time.perf_counter()
    env.run()
    cb_s = (time.perf_counter() - t) / n
    print(f"simpy {simpy.__version__}: process {proc_s * 1e6:.2f} us/event "
          f"({proc_s / heap_s:.1f}x), callbacks {cb_s * 1e6:.2f} us/event ({cb_s / heap_s:.1f}x)")


def cost_scale_bytes(instances):
    """1e-5 up to 1,000 instances; below it past that, so the WAN's emulated rate stays
    within what deploy checks a machine can shape (the model's times do not depend on it)."""
    return 1e-5 * min(1.0, 1000 / instances)


COST_COLUMNS = ("requests", "instances", "sim_wall_s", "sim_cpu_s", "wall_s", "cpu_s",
                "events", "sim_peak_rss_mb", "peak_rss_mb", "completed", "date")


def cost(requests, instances, top, csv_path=None):
    n = instances // 3
    overrides = [f"requests={requests}", f"clusters.prfaas.instances={n}",
                 f"clusters.local.instances={instances - n}", f"clusters.local.prefill={n}",
                 f"clusters.local.decode={instances - 2 * n}",
                 f"workload.arrival.rate={0.2 * instances:g}/s",
                 f"network.wan.rate={50 * n}Gbit", f"scale.bytes={cost_scale_bytes(instances):g}",
                 "variants=[]", f"run.max_requests={max(requests, 100_000)}",
                 "backend.kind=sim"]
    exp = config.load_experiment("experiments/quickstart.yaml", overrides)[0]
    t0, c0 = time.monotonic(), time.process_time()
    summary = SimRun(exp, top, tokens=False).execute()
    total, total_cpu = time.monotonic() - t0, time.process_time() - c0
    meta = json.loads((top / rundir.RunDir.METADATA).read_text())["sim"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| {requests} | {instances} | {meta['wall_s']:.1f} | {meta['cpu_s']:.1f} | {total:.1f} | "
          f"{total_cpu:.1f} | "
          f"{meta['requests_per_wall_s']:.0f} | {meta['events']} | {meta['peak_rss_mb']:.0f} | "
          f"{rss:.0f} | {summary['completed']} |")
    if csv_path:
        row = (requests, instances, meta["wall_s"], meta["cpu_s"], round(total, 3),
               round(total_cpu, 3), meta["events"], meta["peak_rss_mb"], round(rss, 1),
               summary["completed"], datetime.date.today().isoformat())
        new = not pathlib.Path(csv_path).exists()
        with open(csv_path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(COST_COLUMNS)
            w.writerow(row)


def cost_figure(csv_path, out):
    """The cost curve from `--cost ... --csv` points: wall and CPU seconds and peak memory
    against requests (at the most instances measured) and against instances (at the number of
    requests measured at most instance counts)."""
    import matplotlib   # reason: heavy, and only this option draws
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt     # reason: as above
    with open(csv_path) as f:
        rows = [{k: float(v) for k, v in r.items() if k != "date"} for r in csv.DictReader(f)]
    top = max(r["instances"] for r in rows)
    by_req = sorted((r for r in rows if r["instances"] == top), key=lambda r: r["requests"])
    fixed = max({r["requests"] for r in rows},
                key=lambda n: (sum(r["requests"] == n for r in rows), -n))
    by_inst = sorted((r for r in rows if r["requests"] == fixed), key=lambda r: r["instances"])
    with figstyle.paper():
        fig, ax = plt.subplots(2, 2, figsize=(figstyle.DOUBLE_IN, 4.4))
        _cost_panels(ax[:, 0], by_req, "requests", f"requests ({top:.0f} instances)")
        _cost_panels(ax[:, 1], by_inst, "instances", f"instances ({fixed:.0f} requests)")
        ref = by_req[-1]["cpu_s"] / by_req[-1]["requests"]
        x = [r["requests"] for r in by_req]
        ax[0, 0].plot(x, [ref * n for n in x], ":", color="0.5", label="linear")
        ax[0, 0].axhline(600, color="k", lw=0.6, ls="--", label="10 min")
        ax[0, 0].set(yscale="log")
        ax[1, 0].axhline(8e9 / 2**30, color="k", lw=0.6, ls="--", label="8 GB")
        ax[1, 0].set(ylim=(0, 8.5))
        for a, loc in zip(ax.flat, ("upper left", "upper left", "center left", "lower right")):
            a.legend(frameon=False, loc=loc)
        fig.tight_layout()
        fig.savefig(out, dpi=200)
    print(out)


def _cost_panels(ax, rows, key, xlabel):
    """Seconds (top) and peak RSS (bottom) of `rows` against their `key`."""
    c, x = figstyle.FALLBACK, [r[key] for r in rows]
    for col, label, color, marker in (("wall_s", "wall, with analysis", c[1], "s"),
                                      ("cpu_s", "CPU, with analysis", c[2], "o"),
                                      ("sim_cpu_s", "CPU, simulation", c[0], "^")):
        ax[0].plot(x, [r[col] for r in rows], marker=marker, color=color, label=label)
    for col, label, color, marker in (("peak_rss_mb", "process, with analysis", c[2], "o"),
                                      ("sim_peak_rss_mb", "simulation", c[0], "^")):
        ax[1].plot(x, [r[col] / 1024 for r in rows], marker=marker, color=color, label=label)
    ax[0].set(xscale="log", xlabel=xlabel, ylabel="seconds")
    ax[1].set(xscale="log", xlabel=xlabel, ylabel="peak RSS (GiB)", ylim=(0, None))


def smoke(overrides, top, terms):
    """Quickstart at 30 requests, sim against sim with the same seed: 0 when deterministic."""
    overrides = [*overrides, "requests=30"]
    path = "experiments/quickstart.yaml"
    a = sim_runs(path, overrides, top / "sim-a", terms)
    b = sim_runs(path, overrides, top / "sim-b", terms)
    print(table(a, b, "quickstart (smoke: sim/sim)"))
    # Stamps are Unix times from each run's start, written to the microsecond: equal to
    # about 1e-7 (egress is a difference of such stamps)
    same = all(ratio(a[k].get(m), b[k].get(m)) is None
               or abs(ratio(a[k].get(m), b[k].get(m)) - 1) < 1e-6
               for k in a for m, _ in METRICS)
    print("deterministic" if same else "NOT deterministic")
    return 0 if same else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("experiments", nargs="*", default=["experiments/quickstart.yaml"])
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--emulated", help="an emulated run directory of the (one) experiment")
    p.add_argument("--off", nargs="*", default=[], help="link model terms to turn off (sim)")
    p.add_argument("--same-phase", action="store_true",
                   help="start the sim's periodic controllers (adaptive, re-plan) as long "
                        "before arrival 0 as the emulation's started (measured in its run)")
    p.add_argument("--out", help="keep the run directories here")
    p.add_argument("--loop-cost", action="store_true")
    p.add_argument("--cost", nargs=2, type=int, metavar=("REQUESTS", "INSTANCES"))
    p.add_argument("--csv", help="--cost: append the point to this CSV file")
    p.add_argument("--cost-figure", nargs=2, metavar=("CSV", "PNG"))
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.cost:
        cost(*args.cost, pathlib.Path(args.out or tempfile.mkdtemp(prefix="sim-cost-")),
             args.csv)
        return 0
    if args.cost_figure:
        cost_figure(*args.cost_figure)
        return 0
    if args.loop_cost:
        loop_cost(20_000 if args.smoke else 200_000)
        return 0
    terms = Terms.parse(args.off)
    top = pathlib.Path(args.out or tempfile.mkdtemp(prefix="sim-vs-emu-"))
    if args.smoke:
        return smoke(args.overrides, top, terms)
    for path in args.experiments:
        name = pathlib.Path(path).stem
        emu_top = pathlib.Path(args.emulated) if args.emulated else top / name / "emulation"
        emu = summaries(emu_top) if args.emulated else emulated_runs(path, args.overrides, emu_top)
        phases = controller_phases(emu_top) if args.same_phase else None
        sim = sim_runs(path, args.overrides, top / name / "sim", terms, phases)
        print(f"sim / emulation, {name}, terms off: {', '.join(args.off) or 'none'}")
        print(table(sim, emu, name))
        faults = fault_table(sim, emu, name)
        if faults:
            print(faults)
        for label in sim:
            term = fetch_term(sim[label]["run_dir"], emu[label]["run_dir"]) if label in emu \
                else None
            if term and term[0]:
                print(f"  {label}: of the sim's {term[0]} placements with a hit, {term[1]} "
                      "change with the fetch time the emulation's placement had learned")
        print(absolute(sim, emu))
    print(top, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
