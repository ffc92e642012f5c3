"""`vllm bench serve` against a held `testbed up`, from the root namespace (docs/vllm.md).

What a user does with their own load generator: `testbed up FILE` builds the deployment
(vLLM engines with `model.engine: vllm`) and forwards its OpenAI front door to 127.0.0.1; vLLM's
own `bench serve` (workers/vllm_bench.py, the vLLM venv's Python) then drives that URL with the
experiment's workload shape (its request count, mean lengths and mean rate, as
`workload.client: vllm-bench` runs it); then Ctrl-C. It prints bench serve's TTFT and TPOT
percentiles beside the testbed's own records of the same requests, and the per-request
differences paired in start order (`testbed.loadstats.vllm_bench_summary`, the analysis
`workload.client: vllm-bench` uses).

    sudo .venv/bin/python benchmarks/vllm_bench_up.py experiments/vllm_small.yaml \\
        --set variants=null

`--smoke`: tests/data/vllm_tiny.yaml (two small vLLM servers, 8 requests; minutes of start-up).
"""

import argparse
import datetime
import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

from testbed import loadrun, rundir  # noqa: E402
from testbed.loadstats import vllm_bench_summary  # noqa: E402
from testbed.records import RunDir  # noqa: E402
from testbed.runtime import WorkerRuntime  # noqa: E402

SMOKE_EXPERIMENT = REPO / "tests" / "data" / "vllm_tiny.yaml"
UP_TIMEOUT_S = 900          # vLLM servers start in minutes on 2 cores


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", nargs="?", help="experiment file (one run: no variants)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="run directory (new); default results/vllm_bench_up/<time>")
    ap.add_argument("--smoke", action="store_true", help=f"{SMOKE_EXPERIMENT.name}")
    args = ap.parse_args(argv)
    if args.smoke:
        args.experiment = args.experiment or str(SMOKE_EXPERIMENT)
    elif args.experiment is None:
        ap.error("an experiment file is needed")
    return args


def _lines(stream):
    q = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in stream], daemon=True).start()
    return q


def _wait_for(q, pattern, proc, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            m = re.search(pattern, q.get(timeout=1))
        except queue.Empty:
            if proc.poll() is not None:
                raise SystemExit(f"testbed up exited with {proc.returncode}")
            continue
        if m:
            return m
    raise SystemExit(f"testbed up printed no {pattern!r} within {timeout_s}s")


def bench_argv(out, url):
    """workers/vllm_bench.py with the run's workload shape, pointed at the forwarded `url`."""
    run = rundir.load_run(out)
    rt = WorkerRuntime.load(RunDir(out).runtime)
    shape = loadrun.workload_of_trace(json.loads((out / "up.json").read_text())["trace"])
    argv = loadrun.vllm_bench_argv(run.experiment, rt, out, shape)
    argv[argv.index("--base-url") + 1] = url
    return argv


def main(argv=None):
    args = parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(args.out) if args.out else REPO / "results" / "vllm_bench_up" / stamp
    up = [sys.executable, "-m", "testbed.cli", "up", args.experiment, "--out", str(out),
          "--no-probe", *[a for s in args.set for a in ("--set", s)]]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(up, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    try:
        q = _lines(proc.stdout)
        url = _wait_for(q, r"forwarded:\s+(http://127\.0\.0\.1:\d+)", proc, UP_TIMEOUT_S)[1]
        _wait_for(q, r"^up: ", proc, 30)
        RunDir(out).vllm_bench.mkdir(exist_ok=True)
        bench = bench_argv(out, url)
        print(f"# {' '.join(bench[1:])}", flush=True)
        benv = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the vLLM venv's
        with open(out / "bench.log", "w") as log:
            rc = subprocess.run(bench, stdout=log, stderr=subprocess.STDOUT, env=benv).returncode
        if rc != 0:
            raise SystemExit(f"vllm bench serve exited with {rc}; see {out}/bench.log")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
    df = pd.read_parquet(out / "requests.parquet")
    summary = json.loads((out / "summary.json").read_text())
    b = vllm_bench_summary(out, df, rundir.scale(out))
    rep, cmp_ = b.get("reported", {}), b.get("compare", {})
    print(f"requests: bench serve {b.get('completed')} completed, {b.get('failed')} failed; "
          f"the testbed's records {summary['completed']} of {summary['requests']}")
    print(f"TTFT p50: bench serve {rep.get('median_ttft_ms', float('nan')):.1f} ms, records "
          f"{summary['median_ttft_ms']:.1f} ms (ratio "
          f"{rep.get('median_ttft_ms', float('nan')) / summary['median_ttft_ms']:.3f})")
    print(f"TTFT p90: bench serve {rep.get('p90_ttft_ms', float('nan')):.1f} ms, records "
          f"{summary['p90_ttft_ms']:.1f} ms")
    print(f"paired by start order: {json.dumps(cmp_)}")
    (out / "bench_up.json").write_text(json.dumps({"bench": b, "records": {
        k: summary[k] for k in ("completed", "requests", "median_ttft_ms", "p90_ttft_ms",
                                "mean_tpot_ms")}}, indent=1))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
