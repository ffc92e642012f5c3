"""Peak memory and start-up time of every worker process of one `testbed run`, per role.

Runs `testbed run <experiment> --out <dir> [--set ...]` as a child and, while it runs, reads
`/proc/<pid>/status` of every process whose command line names that run's runtime.json: the
peak resident set (VmHWM) and the thread count. Start-up time is the worker's ready file
(`ready/<name>`, written with time.time()) minus the process's start time (/proc/<pid>/stat,
in clock ticks since boot). Prints one row per role (max and median over the role's
processes) and the run's build / workers-ready / teardown phases from metadata.json. Needs root
(it is a full run); not part of the test suite.

    sudo python -m benchmarks.worker_rss experiments/many_instances.yaml --out /tmp/many
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

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
    runtime = run_dir / "runtime.json"
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
    meta = json.loads((run_dir / "metadata.json").read_text())
    wall = meta["end_time"] - meta["start_time"]
    print(f"\nphases (s): {meta.get('phases_s')}; wall {wall:.1f} s")
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("emulation", "fidelity", "warnings"):
        if key in summary:
            print(f"{key}: {json.dumps(summary[key])}")
    logged = [line for f in sorted((run_dir / "logs").glob("*.log"))
              for line in f.read_text(errors="replace").splitlines() if " WARNING " in line]
    print(f"worker log warnings: {len(logged)}" + (f"; first: {logged[0]}" if logged else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("experiment")
    p.add_argument("--out", required=True, help="run directory (new)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    run_dir = pathlib.Path(a.out).resolve()
    cmd = [sys.executable, "-m", "testbed.cli", "run", a.experiment, "--out", str(run_dir),
           "--no-progress", *[x for kv in a.set for x in ("--set", kv)]]
    report(watch(cmd, run_dir), run_dir)


if __name__ == "__main__":
    main()
