"""Per-thread CPU of every process on the machine, sampled from /proc (docs/vllm.md, "Found").

Every `--interval` seconds, for every thread that ran since the last look: its time on a CPU
and its time runnable but waiting for one (`/proc/PID/task/TID/schedstat`), its name and the
CPU it last ran on (`stat`), and its voluntary and involuntary context switches (`status`).
Each process is described once (pid, ppid, name, command line) when first seen. One JSON line
each, gzipped, until SIGTERM or SIGINT:

    python3 scripts/thread_sample.py OUT.jsonl.gz --interval 0.2 &
    testbed run benchmarks/vllm_calibration.yaml --set model.vllm.cpus=auto --no-probe
    kill %1

Rows: `{"proc": pid, "ppid": .., "comm": .., "cmd": ..}` and `[time, pid, tid, thread name,
cpu, ran ms, waited ms, voluntary, involuntary]` (deltas since the thread's previous row).
Standard library only; costs 0.06-0.08 of a core at 0.2 s on a machine running two vLLM
servers and a testbed run. A diagnostic, not part of the testbed.
"""

import argparse
import gzip
import json
import os
import signal
import time


def _read(path):
    with open(path) as f:
        return f.read()


def describe(pid):
    """The process's first row, or None if it is gone."""
    try:
        cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()[:300]
        stat = _read(f"/proc/{pid}/stat")
    except OSError:
        return None
    return {"proc": int(pid), "ppid": int(stat.rsplit(")", 1)[1].split()[1]),
            "comm": stat[stat.index("(") + 1:stat.rindex(")")], "cmd": cmd}


def thread(pid, tid):
    """(ran ns, waited ns, name, cpu, voluntary, involuntary) of a thread, or None."""
    base = f"/proc/{pid}/task/{tid}/"
    try:
        ran, waited = (int(x) for x in _read(base + "schedstat").split()[:2])
        stat = _read(base + "stat")
        status = _read(base + "status").splitlines()
    except OSError:
        return None
    switches = {k: int(v) for k, v in (line.split(":") for line in status
                                       if "ctxt_switches" in line)}
    return (ran, waited, stat[stat.index("(") + 1:stat.rindex(")")],
            int(stat.rsplit(")", 1)[1].split()[36]), switches.get("voluntary_ctxt_switches", 0),
            switches.get("nonvoluntary_ctxt_switches", 0))


def sample(out, seen, prev, now):
    """One look at every thread: rows for those that ran since the previous look."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if pid not in seen and (d := describe(pid)) is not None:
            out.write(json.dumps(d) + "\n")
            seen.add(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            t = thread(pid, tid)
            if t is None or (tid in prev and prev[tid][0] == t[0]):
                continue
            p, prev[tid] = prev.get(tid), t
            if p is not None:
                out.write(json.dumps([round(now, 3), int(pid), int(tid), t[2], t[3],
                                      round((t[0] - p[0]) / 1e6, 2),
                                      round((t[1] - p[1]) / 1e6, 2), t[4] - p[4],
                                      t[5] - p[5]]) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="OUT.jsonl.gz")
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between looks")
    args = ap.parse_args()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    seen, prev = set(), {}
    with gzip.open(args.out, "wt") as out:
        while not stop:
            t0 = time.time()
            sample(out, seen, prev, t0)
            time.sleep(max(0.0, args.interval - (time.time() - t0)))


if __name__ == "__main__":
    main()
