"""Speed figures that transfer between machines (issue 22, item 4): the CPU a `testbed run`
cost per emulated request and per instance-second, beside its wall time.

Wall time says how long one machine, as loaded as it was, took; CPU seconds per request and per
instance-second say what the work costs, so that a figure measured on one machine predicts
another (divide by the cores it can give). The CPU is the `testbed run` process tree's, as the
kernel accounted it to the benchmark that started and reaped it (`getrusage(RUSAGE_CHILDREN)`:
user + system of every descendant reaped; set-up, link probe and analysis included). An
instance-second is one prefill or decode instance held for one second of a variant's run
(metadata.json start to end).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

from testbed import rundir


def children_cpu_s() -> float:
    """User + system CPU seconds of every child this process started and reaped so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def processes_cpu(procs) -> dict:
    """{cpu_s, measured, processes}: CPU seconds (user + system) of a run's processes that
    their launcher reaped and measured (`testbed.net.zygote.ZygoteProc.cpu_s`: the Mininet
    backend's profile workers, scheduler and client), how many it measured, and how many the
    run had (others, e.g. vLLM's servers or a Ray node's workers, are not counted)."""
    procs = list(procs)
    got = [p.cpu_s for p in procs if getattr(p, "cpu_s", None) is not None]
    return {"cpu_s": round(sum(got), 3), "measured": len(got), "processes": len(procs)}


def measured_cpu_s(meta):
    """A run's processes' CPU seconds from its metadata (`processes_cpu`), where the launcher
    measured every one of them, else None."""
    cpu = meta.get("processes_cpu") or {}
    return cpu["cpu_s"] if cpu.get("processes") and cpu["measured"] == cpu["processes"] else None


def pilot_cost(top):
    """(pilot s, runs s, probes s) of the `scale.time: auto` runs at or below `top`: their
    pilots' `pilot_s` and the runs' wall time (metadata.json start to end), a link check probe
    that a run took as its own (its `link_fidelity.measured_at`) moved from the pilot to the
    runs (it is that run's probe, made early; `probes s` says how much); None without one."""
    pilot, runs, metas = 0.0, 0.0, []
    for vdir in rundir.find_runs(top):
        meta = rundir.metadata(vdir)
        if meta.get("scale_auto") and meta.get("end_time"):
            metas.append(meta)
            pilot += meta["scale_auto"].get("pilot_s", 0.0)
            runs += meta["end_time"] - meta["start_time"]
    checks = {p.get("measured_at"): p.get("wall_s") or 0.0 for m in metas
              for p in (m["scale_auto"].get("link_check") or {}).get("probes", ())
              if p.get("measured_at") is not None}
    taken = sum(checks[at] for at in {(m.get("link_fidelity") or {}).get("measured_at")
                                      for m in metas} if at in checks)
    return (pilot - taken, runs + taken, taken) if runs else None


def run_cost(cpu_s, top) -> dict:
    """{cpu_s, requests, instance_s, cpu_ms_per_request, cpu_ms_per_instance_s} of the
    variants found at or below `top` (`rundir.find_runs`), for `cpu_s` CPU seconds."""
    requests, instance_s = 0, 0.0
    for vdir in rundir.find_runs(top):
        summary, meta, rt = rundir.summary(vdir), rundir.metadata(vdir), rundir.runtime(vdir)
        requests += int(summary.get("requests") or 0)
        n = sum(1 for i in (rt or {}).get("instances", {}).values()
                if i["role"] in ("prefill", "decode"))
        if meta.get("end_time") and meta.get("start_time"):
            instance_s += n * (meta["end_time"] - meta["start_time"])
    return {"cpu_s": cpu_s, "requests": requests, "instance_s": instance_s,
            "cpu_ms_per_request": 1e3 * cpu_s / requests if requests else None,
            "cpu_ms_per_instance_s": 1e3 * cpu_s / instance_s if instance_s else None}


def reference_ms(trials=5) -> float:
    """CPU milliseconds of a fixed piece of Python work (building, encoding and decoding
    20,000 small records, the kind of work the control plane does per message), the least of
    `trials` (as timeit takes it: the trial least disturbed): how fast this machine is now. The same code costs more CPU per request on a
    slower occasion of a shared VM (neighbours, a lower clock) while the load average inside it
    says nothing; printed beside a benchmark's CPU figures, it tells such an occasion apart
    from a change in the code (docs/performance.md)."""
    times = []
    for _ in range(trials):
        t0 = time.process_time()
        for i in range(20000):
            json.loads(json.dumps({"id": i, "t": i * 0.5, "tokens": [i, i + 1, i + 2]}))
        times.append(1e3 * (time.process_time() - t0))
    return min(times)


def fmt_cost(cost: dict) -> str:
    """One line: CPU seconds, per emulated request and per instance-second."""
    per_req, per_inst = cost["cpu_ms_per_request"], cost["cpu_ms_per_instance_s"]
    return (f"CPU {cost['cpu_s']:.1f} s: "
            f"{'-' if per_req is None else format(per_req, '.0f')} ms per emulated request "
            f"({cost['requests']}), "
            f"{'-' if per_inst is None else format(per_inst, '.1f')} ms per instance-second "
            f"({cost['instance_s']:.0f})")


def timed_run(experiment, out, sets, cwd, probe=True):
    """`testbed run experiment --out out --set S...` (this interpreter, no progress bar, its
    output discarded; an error raises), to its end: (wall seconds, `run_cost` of its process
    tree over the variants under `out`). `probe`: False adds --no-probe."""
    argv = [sys.executable, "-m", "testbed.cli", "run", str(experiment), "--out", str(out),
            "--no-progress", *(a for s in sets for a in ("--set", s))]
    if not probe:
        argv.append("--no-probe")
    cpu0, t0 = children_cpu_s(), time.monotonic()
    subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    return wall, run_cost(children_cpu_s() - cpu0, out)
