"""Peak memory and start-up time of every worker process of one `testbed run`, per role.

Runs `testbed run <experiment> --out <dir> [--set ...]` as a child and, while it runs, reads
`/proc/<pid>/status` of every process whose command line names that run's runtime.json: the
peak resident set (VmHWM) and the thread count. Start-up time is the worker's ready file
(`ready/<name>`, written with time.time()) minus the process's start time (/proc/<pid>/stat,
in clock ticks since boot). Prints one row per role (max and median over the role's
processes) and the run's build / workers-ready / teardown phases from metadata.json. Needs root
(it is a full run); its numbers are not part of the test suite's pass/fail.

    sudo python -m benchmarks.worker_rss experiments/many_instances.yaml --out /tmp/many
    sudo python benchmarks/worker_rss.py --smoke    # benchmarks/smoke.yaml: seconds
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed import rundir  # noqa: E402
from testbed.rundir import RunDir  # noqa: E402

# --smoke: the smallest full run (3 workers, 12 requests), no link probe
SMOKE_EXPERIMENT = ROOT / "benchmarks" / "smoke.yaml"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _boot_time_s():
    for line in pathlib.Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def _status(pid):
    """(VmHWM in kB, threads) of `pid`, or None once it is gone."""
    try:
        text = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if "VmHWM" not in fields:       # a zombie: its memory is gone
        return None
    return int(fields["VmHWM"].split()[0]), int(fields["Threads"])


def _stat(pid):
    """Fields 3.. of /proc/<pid>/stat (after the command name), or None once it is gone."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_s(stat, boot_s):
    return boot_s + int(stat[19]) / CLK_TCK      # field 22: starttime


def _cpu_s(stat):
    return (int(stat[11]) + int(stat[12])) / CLK_TCK     # fields 14, 15: utime, stime


def _workers(runtime):
    """{pid: (name, module)} of the live processes started with `--runtime <runtime>`."""
    out = {}
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv]
        if "--runtime" in argv and str(runtime) in argv and "--name" in argv and "-m" in argv:
            out[int(d.name)] = (argv[argv.index("--name") + 1], argv[argv.index("-m") + 1])
    return out


def watch(cmd, run_dir, interval_s=0.2):
    """Run `cmd`; returns {pid: {name, module, hwm_kb, threads, start_s}} of its workers."""
    boot_s = _boot_time_s()
    runtime = RunDir(run_dir).runtime
    seen = {}
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        for pid, (name, module) in _workers(runtime).items():
            st, stat = _status(pid), _stat(pid)
            if st is None or stat is None:
                continue
            rec = seen.get(pid)
            if rec is None:
                rec = seen[pid] = {"name": name, "module": module, "hwm_kb": 0, "threads": 0,
                                   "start_s": _start_s(stat, boot_s)}
            rec["cpu_s"] = _cpu_s(stat)
            rec["hwm_kb"] = max(rec["hwm_kb"], st[0])
            rec["threads"] = max(rec["threads"], st[1])
        time.sleep(interval_s)
    if proc.returncode:
        sys.exit(f"testbed run exited with {proc.returncode}")
    return seen


def report(seen, run_dir):
    ready = run_dir / "ready"
    roles = {}
    for rec in seen.values():
        f = ready / rec["name"]
        startup = float(f.read_text()) - rec["start_s"] if f.exists() else float("nan")
        roles.setdefault(rec["module"], []).append(
            (rec["hwm_kb"] / 1024, rec["threads"], startup, rec["cpu_s"]))
    print("| module | processes | peak RSS max (MB) | peak RSS median (MB) | threads max "
          "| start-up median (s) | start-up max (s) | CPU median (s) |\n"
          "|---|---|---|---|---|---|---|---|")
    for module, rows in sorted(roles.items()):
        rss, thr, up, cpu = zip(*rows)
        print(f"| {module} | {len(rows)} | {max(rss):.1f} | {statistics.median(rss):.1f} "
              f"| {max(thr)} | {statistics.median(up):.2f} | {max(up):.2f} "
              f"| {statistics.median(cpu):.2f} |")
    meta = rundir.metadata(run_dir)
    wall = meta["end_time"] - meta["start_time"]
    print(f"\nphases (s): {meta.get('phases_s')}; wall {wall:.1f} s")
    summary = rundir.summary(run_dir)
    for key in ("emulation", "fidelity", "warnings"):
        if key in summary:
            print(f"{key}: {json.dumps(summary[key])}")
    logged = [line for f in sorted(RunDir(run_dir).logs.glob("*.log"))
              for line in f.read_text(errors="replace").splitlines() if " WARNING " in line]
    print(f"worker log warnings: {len(logged)}" + (f"; first: {logged[0]}" if logged else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("experiment", nargs="?", help="experiment file (one variant)")
    p.add_argument("--out", help="run directory (new); --smoke: a temporary one by default")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--smoke", action="store_true",
                   help="benchmarks/smoke.yaml (3 workers, 12 requests), --no-probe: seconds")
    a = p.parse_args()
    if not a.smoke and (a.experiment is None or a.out is None):
        p.error("an experiment and --out are needed (or --smoke)")
    experiment = a.experiment or str(SMOKE_EXPERIMENT)
    sets = a.set
    with tempfile.TemporaryDirectory(prefix="worker_rss-") as tmp:
        run_dir = pathlib.Path(a.out or pathlib.Path(tmp) / "run").resolve()
        cmd = [sys.executable, "-m", "testbed.cli", "run", experiment, "--out", str(run_dir),
               "--no-progress", *[x for kv in sets for x in ("--set", kv)]]
        if a.smoke:
            cmd.append("--no-probe")
        report(watch(cmd, run_dir), run_dir)


if __name__ == "__main__":
    main()
