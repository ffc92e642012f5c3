"""The report of a profiled `testbed run`: per variant, process, thread and role.

Reads what the sampler saved (profiles/processes.json: every /proc sample, the py-spy files)
and, through `testbed.rundir`, each variant's metadata.json (start/end), events.csv (phases),
summary.json (steady throughput, the planner's prediction, the emulation's own fidelity
warnings) and requests.jsonl (token chunks). `build_report` returns one JSON-able mapping
(saved as profiles/profile.json); `print_report` prints it (docs/performance.md shows one and
how to read it).

Library code for benchmarks/profile_run.py; reads only the run directory.
"""

import collections
import json
import os
import pathlib
import types

from testbed import rundir
from testbed.records import read_events
from testbed.profiling.pyspy import attribute, read_profile
from testbed.profiling.sampler import Proc
from testbed.rundir import RunDir

PROCESSES = "processes.json"    # profiles/: what the sampler saw (the report's input)
PROFILE = "profile.json"        # profiles/: the report


def profiles_dir(out):
    """Where a profiled run keeps its samples, py-spy files and report."""
    return pathlib.Path(out) / "profiles"


PHASES = (("wan_start", "network build"), ("workers_ready", "workers start"),
          ("client_started", "link probe, client start"), ("client_finished", "requests"))


def event_times(vdir):
    """{event kind: unix time of its first occurrence} from a variant's events.csv (the one
    events reader, which puts other hosts' rows on the orchestrator's clock)."""
    seen = {}
    clock = rundir.metadata(vdir).get("clocks")
    for t, kind, _ in read_events(RunDir(vdir).events, clock):
        seen.setdefault(kind, t)
    return seen


def phases(vdir, t0, t1):
    """Seconds of each phase of a variant from its events.csv: build, workers, probe, requests,
    teardown."""
    seen = event_times(vdir)
    if not seen:
        return {}
    out, last = {}, t0
    for kind, label in PHASES:
        if kind in seen:
            out[label] = seen[kind] - last
            last = seen[kind]
    out["teardown"] = t1 - last
    return out


def variant_spans(out):
    """{variant dir: (start, end, summary dict)} of each run directory the run finished."""
    spans = {}
    for vdir in rundir.find_recorded_runs(out):
        meta = rundir.metadata(vdir)
        if "start_time" not in meta:
            continue            # killed before its teardown: no span to report
        summary = rundir.summary(vdir) if RunDir(vdir).summary.exists() else {}
        spans[vdir] = (meta["start_time"], meta["end_time"], summary)
    return spans


def token_messages(vdir):
    """(requests finished, token chunks the client received): a chunk is one message on the
    token path; the client stamps each with its arrival, so distinct arrival times count
    them."""
    _, done = rundir.read_records(RunDir(vdir).records)
    return len(done), sum(len(set(rec.client_times or ())) for rec in done.values())


def fidelity(summary):
    emu = summary.get("emulation") or {}
    pred = summary.get("prediction") or {}
    return {"completed": summary.get("completed"), "failed": summary.get("failed"),
            "steady_rps": summary.get("steady_throughput"),
            "predicted_rps_expected": pred.get("lambda_max_expected", pred.get("lambda_max")),
            "prediction": pred,
            "first_token_lag_ms": emu.get("first_token_lag_ms"),
            "decode_step_ratio": emu.get("decode_step_ratio"),
            "prefill_ratio": emu.get("prefill_ratio"),
            "warnings": list(dict.fromkeys((summary.get("warnings") or [])
                                           + (emu.get("warnings") or []))),
            "ttft_p90_ms": summary.get("p90_ttft_ms"), "tpot_mean_ms": summary.get("mean_tpot_ms")}


def build_report(sampler, out, wall_s, tree_cpu_s, spy_cpu_s, load0, load1, top_n):
    spans = variant_spans(out)
    busy = [b - a for a, b in zip(sampler.busy0, sampler.busy1)]
    report = {"wall_s": wall_s, "load_before": load0, "load_after": load1,
              "machine_busy_share": busy[0] / busy[1] if busy[1] else None,
              "cores": os.cpu_count(), "run_tree_cpu_s": tree_cpu_s,
              "profiler_cpu_s": spy_cpu_s,
              "sampled_cpu_s": sum(p.cpu for p in sampler.procs.values()), "variants": []}
    for vdir, (t0, t1, summary) in spans.items():
        report["variants"].append(variant_report(sampler, vdir, t0, t1, summary))
    report["roles_all_variants"] = all_variants(report["variants"])
    return report


def frange(a, b, step):
    while a <= b:
        yield a
        a += step


def all_variants(variants):
    """Per role over every variant: CPU seconds and its functions (the instances of a role run
    the same code in each deployment, so their profiles add up to more samples)."""
    roles = {}
    for v in variants:
        for r in v["roles"]:
            a = roles.setdefault(r["role"], {"cpu_s": 0.0, "own": collections.Counter()})
            a["cpu_s"] += r["cpu_s"]
            a["own"].update(dict(r["own_cpu_s"]))
    out = []
    for role, a in sorted(roles.items(), key=lambda kv: -kv[1]["cpu_s"]):
        tot = sum(a["own"].values()) or 1.0
        out.append({"role": role, "cpu_s": a["cpu_s"],
                    "top_own": [(f, c / tot) for f, c in a["own"].most_common(15)]})
    return out


def process_row(p, cpu, t0, t1):
    """One process in one variant: CPU over [t0, t1], threads, and where its CPU went (from
    py-spy's attach to its end: a worker's start-up is not in its profile, and the
    orchestrator's profile covers the whole run, analysis and plots included)."""
    row = {"name": "testbed run" if p.role == "orchestrator" else p.name, "role": p.role,
           "pid": p.pid, "argv": p.argv[:6], "cpu_s": cpu, "sys_s": p.sys_s,
           "cpu_pct_of_variant": 100 * cpu / (t1 - t0), "startup_cpu_s": p.ready_cpu,
           "threads": p.threads_max}
    if p.pyspy is None:
        return row, None
    before = p.threads_at_attach
    seen = {tid: (name, user - before.get(tid, ("", 0.0, 0.0))[1],
                  sys_s - before.get(tid, ("", 0.0, 0.0))[2])
            for tid, (name, user, sys_s) in p.threads.items()}
    own, incl, threads, samples = attribute(read_profile(p.pyspy[1]), seen)
    tot = sum(own.values()) or 1.0
    row.update(profiled=True, samples=samples, thread_cpu=threads,
               top_own=[(f, c / tot) for f, c in own.most_common(12)],
               top_inclusive=[(f, c / tot) for f, c in incl.most_common(40)])
    return row, (own, incl)


def variant_report(sampler, vdir, t0, t1, summary):
    rows, roles = [], {}
    ev = event_times(vdir)
    # Workers up, no request yet (link probe, client start): the CPU floor of an idle worker.
    idle = (ev["workers_ready"] + sampler.interval_s, ev["client_started"]) \
        if "workers_ready" in ev and "client_started" in ev else None
    for p in sampler.procs.values():
        cpu = p.cpu_at(t1 + sampler.interval_s) - p.cpu_at(t0)
        if p.variant_dir not in (None, vdir) or cpu <= 0:
            continue
        row, prof = process_row(p, cpu, t0, t1)
        row["sys_s"] = p.cpu_at(t1 + sampler.interval_s, True) - p.cpu_at(t0, True)
        if idle is not None and p.samples and p.samples[0][0] < idle[0]:
            row["idle_cpu_pct"] = 100 * (p.cpu_at(idle[1]) - p.cpu_at(idle[0])) / (
                idle[1] - idle[0])
        rows.append(row)
        r = roles.setdefault(p.role, {"cpu_s": 0.0, "processes": 0, "own": collections.Counter(),
                                      "incl": collections.Counter()})
        r["cpu_s"] += cpu
        r["processes"] += 1
        if prof is not None:
            r["own"].update(prof[0])
            r["incl"].update(prof[1])
    rows.sort(key=lambda r: -r["cpu_s"])
    role_rows = []
    for role, r in sorted(roles.items(), key=lambda kv: -kv[1]["cpu_s"]):
        tot = sum(r["own"].values()) or 1.0
        role_rows.append({"role": role, "processes": r["processes"], "cpu_s": r["cpu_s"],
                          "own_cpu_s": r["own"].most_common(40),
                          "cpu_pct_of_variant": 100 * r["cpu_s"] / (t1 - t0),
                          "top_own": [(f, c / tot) for f, c in r["own"].most_common(12)],
                          "top_inclusive": [(f, c / tot) for f, c in r["incl"].most_common(40)]})
    done, chunks = token_messages(vdir)
    busy = None
    if "client_started" in ev and "client_finished" in ev:
        # The requests phase alone: how many of the machine's cores the run's processes used.
        a, b = ev["client_started"], ev["client_finished"]
        mine = [p for p in sampler.procs.values() if p.variant_dir in (None, vdir)]

        def used(x, y):
            return sum(p.cpu_at(y) - p.cpu_at(x) for p in mine)
        peak = max((used(x, x + 2.0) / 2.0 for x in frange(a, b - 2.0, 0.5)), default=None)
        busy = {"seconds": b - a, "cpu_s": used(a, b), "cores_used": used(a, b) / (b - a),
                "peak_2s_cores_used": peak}
    return {"variant": vdir.name, "dir": str(vdir), "wall_s": t1 - t0,
            "phases_s": phases(vdir, t0, t1), "requests_done": done, "token_chunks": chunks,
            "requests_phase": busy,
            "fidelity": fidelity(summary), "processes": rows, "roles": role_rows}


def fmt_top(top, n):
    return ", ".join(f"{f} {100 * s:.0f}%" for f, s in top[:n] if s >= 0.005)


def print_report(rep, top_n):
    spans = sum(v["wall_s"] for v in rep["variants"])
    print(f"wall {rep['wall_s']:.1f} s ({rep['wall_s'] - spans:.1f} s outside the variants: "
          f"imports, analysis, figures); load average before {rep['load_before']}, after "
          f"{rep['load_after']}; all {rep['cores']} cores busy "
          f"{100 * (rep['machine_busy_share'] or 0):.0f}% over the run; run tree CPU "
          f"{rep['run_tree_cpu_s']:.1f} s (sampled {rep['sampled_cpu_s']:.1f} s); py-spy's own "
          f"CPU {rep['profiler_cpu_s']:.1f} s")
    for v in rep["variants"]:
        print_variant(v, top_n)
    print(f"\n== every variant: {'role':<12} {'CPU s':>6}  top functions (profiled instances)")
    for r in rep["roles_all_variants"]:
        print(f"   {r['role']:<28} {r['cpu_s']:6.2f}  {fmt_top(r['top_own'], top_n + 3)}")


def print_variant(v, top_n):
    """One variant's block: fidelity, phases, requests phase, the process and role tables."""
    f = v["fidelity"]
    pred = f["predicted_rps_expected"]
    ratio = f"{f['steady_rps'] / pred:.3f}" if f["steady_rps"] and pred else "-"
    print(f"\n== {v['variant']}: wall {v['wall_s']:.1f} s; completed {f['completed']}, "
          f"failed {f['failed']}; steady {f['steady_rps'] or float('nan'):.3f} req/s vs "
          f"predicted (E[T]) {pred or float('nan'):.3f} ({ratio}); first-token lag "
          f"{f['first_token_lag_ms'] or float('nan'):.0f} ms; decode step "
          f"{f['decode_step_ratio'] or float('nan'):.3f}x, prefill "
          f"{f['prefill_ratio'] or float('nan'):.3f}x")
    print("   phases: " + ", ".join(f"{k} {s:.1f} s" for k, s in v["phases_s"].items()))
    rp = v["requests_phase"]
    if rp:
        print(f"   requests phase: {rp['seconds']:.1f} s, the run's processes used "
              f"{rp['cpu_s']:.1f} CPU-s = {rp['cores_used']:.2f} of {os.cpu_count()} cores "
              f"(busiest 2 s: {rp['peak_2s_cores_used'] or float('nan'):.2f})")
    print(f"   token path: {v['token_chunks']} chunks for {v['requests_done']} requests "
          f"({v['token_chunks'] / max(v['requests_done'], 1):.1f} per request)")
    for w in f["warnings"]:
        print(f"   warning: {w}")
    print(f"{'process':<12} {'role':<12} {'CPU s':>6} {'% wall':>6} {'sys':>5} {'start':>5} "
          f"{'idle%':>5} {'thr':>3}  top {top_n} functions by own CPU (py-spy share x /proc "
          f"thread CPU)")
    for r in v["processes"]:
        if r["cpu_s"] < 0.05:
            continue
        start = f"{r['startup_cpu_s']:.1f}" if r["startup_cpu_s"] is not None else "-"
        idle = f"{r['idle_cpu_pct']:.1f}" if r.get("idle_cpu_pct") is not None else "-"
        print(f"{r['name'][:12]:<12} {r['role']:<12} {r['cpu_s']:6.2f} "
              f"{r['cpu_pct_of_variant']:6.1f} {r['sys_s']:5.2f} {start:>5} {idle:>5} "
              f"{r['threads']:3d}  {fmt_top(r.get('top_own', []), top_n)}")
        for t in r.get("thread_cpu", [])[:4]:
            print(f"{'':<14}thread {t['thread'][:28]:<28} {t['cpu_s']:5.2f} s  "
                  f"{fmt_top([(f, c / (t['cpu_s'] or 1)) for f, c in t['top_own_cpu_s']], 3)}")
    print(f"{'role':<12} {'n':>3} {'CPU s':>6} {'% wall':>6}  top functions (profiled "
          f"instances)")
    for r in v["roles"]:
        print(f"{r['role']:<12} {r['processes']:3d} {r['cpu_s']:6.2f} "
              f"{r['cpu_pct_of_variant']:6.1f}  {fmt_top(r['top_own'], top_n)}")


def save_processes(out, run_info):
    """profiles/processes.json: what the sampler saw and how the run went (`report`'s input)."""
    path = profiles_dir(out) / PROCESSES
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run_info))
    return path


def report(out, top_n):
    """Build, save and print the report of a profiled run from profiles/processes.json."""
    profiles = profiles_dir(out)
    info = json.loads((profiles / PROCESSES).read_text())
    sampler = types.SimpleNamespace(
        interval_s=info["interval_s"], busy0=info["busy0"], busy1=info["busy1"],
        procs={(d["pid"], d["start"]): Proc.from_json(d) for d in info["processes"]})
    rep = build_report(sampler, out, info["wall_s"], info["tree_cpu_s"], info["spy_cpu_s"],
                       info["load0"], info["load1"], top_n)
    rep["argv"] = info["argv"]
    (profiles / PROFILE).write_text(json.dumps(rep, indent=1))
    print_report(rep, top_n)
    print(out)
