"""External load generators at run time: the tool's trace, its command line and its start.

`testbed.run` calls `start_client` when `workload.client` is `command`, `aiperf` or
`vllm-bench` (`testbed.loadgen` describes them): the run's workload is written as a mooncake trace on the
emulated timeline, the tool's argv is recorded, and the tool starts on the client instance
through the run's backend; its output goes to the client's log, and the run waits for it to
exit, bounded like the built-in client's drain. `arrival_zero` times the link schedule and the
faults from the tool's first request (its own arrival 0).
"""

import json
import os
import shlex
import time

from testbed import vllmenv
from testbed.loadgen import TOKENIZER, find_aiperf, url
from testbed.records import RunDir

# An external tool's start-up (aiperf: about 20 s on a loaded 2-core machine) before it sends.
CLIENT_FIRST_REQUEST_TIMEOUT_S = 120.0


def write_trace(run_dir, workload, scale):
    """workload.parquet as a mooncake trace (JSONL) on the emulated timeline: timestamp (ms),
    input_length, output_length, hash_ids (only when the workload has prefix blocks)."""
    path = RunDir(run_dir).trace
    with open(path, "w") as f:
        for row in workload.itertuples(index=False):
            obj = {"timestamp": int(round(scale.emulated_s(row.arrival_s) * 1e3)),
                   "input_length": int(row.input_len), "output_length": int(row.output_len)}
            blocks = getattr(row, "prefix_blocks", None)
            if blocks is not None and len(blocks):
                obj["hash_ids"] = [int(b) for b in blocks]
            f.write(json.dumps(obj) + "\n")
    return path


def client_argv(exp, rt, run_dir, trace):
    """The tool's argv for `workload.client`."""
    w = exp.workload
    subst = {"{url}": url(rt), "{model}": rt.frontdoor.model, "{trace}": str(trace),
             "{run_dir}": str(run_dir)}
    if w.client == "command":
        argv = shlex.split(w.command)
        for k, v in subst.items():
            argv = [a.replace(k, v) for a in argv]
        return argv
    if w.client == "vllm-bench":
        return vllm_bench_argv(exp, rt, run_dir, workload_of_trace(trace))
    timeout = rt.request_timeout_s
    return [find_aiperf(), "profile", "--model", rt.frontdoor.model, "--url", url(rt),
            "--endpoint-type", w.aiperf.endpoint, "--streaming",
            "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
            "--fixed-schedule", "--tokenizer", str(TOKENIZER),
            "--extra-inputs", "ignore_eos:true", "--request-timeout-seconds", f"{timeout:g}",
            "--random-seed", str(exp.seed), "--ui-type", "none",
            "--artifact-dir", str(RunDir(run_dir).aiperf),
            *shlex.split(w.aiperf.args or "")]


def workload_of_trace(trace):
    """(requests, mean input, mean output, span in emulated s) of the trace written."""
    rows = [json.loads(line) for line in open(trace)]
    n = len(rows)
    ts = [r["timestamp"] / 1e3 for r in rows]
    return (n, sum(r["input_length"] for r in rows) / max(n, 1),
            sum(r["output_length"] for r in rows) / max(n, 1), max(ts) - min(ts) if ts else 0.0)


def vllm_bench_argv(exp, rt, run_dir, shape):
    """`vllm bench serve` (workers/vllm_bench.py, the vLLM venv's Python): the workload's
    count at its mean rate (Poisson, emulated), its mean lengths, streaming, every request's
    TTFT and ITLs saved (--save-detailed) in the run's vllm_bench/."""
    n, mean_in, mean_out, span = shape
    rate = (n - 1) / span if n > 1 and span > 0 else float("inf")
    rd = RunDir(run_dir)
    return [vllmenv.find_python(), str(vllmenv.REPO / "workers" / "vllm_bench.py"),
            "--clock", str(rd.vllm_bench_clock), "--",
            "--backend", "vllm", "--base-url", url(rt), "--endpoint", "/v1/completions",
            "--model", rt.frontdoor.model, "--tokenizer", str(TOKENIZER),
            "--dataset-name", "random", "--num-prompts", str(n),
            "--random-input-len", str(max(1, round(mean_in))),
            "--random-output-len", str(max(1, round(mean_out))), "--random-range-ratio", "0",
            "--request-rate", f"{rate:g}", "--seed", str(exp.seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(rd.vllm_bench),
            "--result-filename", rd.VLLM_BENCH_RESULT, "--disable-tqdm",
            *shlex.split(exp.workload.vllm_bench.args or "")]


def start_client(run, workload):
    """Start the external tool on the client instance (through the run's backend); returns its
    process (the runner waits on it as on the built-in client)."""
    trace = write_trace(run.dir, workload, run.deployment.scale)
    argv = client_argv(run.exp, run.rt, run.dir, trace)
    rd = RunDir(run.dir)
    rd.client_argv.write_text(json.dumps(argv))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if run.exp.workload.client == "vllm-bench":     # the vLLM venv's own packages, not ours
        env.pop("PYTHONPATH", None)
        rd.vllm_bench.mkdir(exist_ok=True)
    proc = run.backend.spawn("client", argv, rd.log("client"), env=env)
    run.procs["client"] = proc
    return proc


def arrival_zero(run, workload, events):
    """Arrival 0 of `run` (testbed.run.Run) with an external client: start the tool and wait
    (bounded) for its first request at the front door.

    The tool's start-up (aiperf: seconds) must not shift its requests against link changes
    and faults, so arrival 0 is the tool's own: the first request's arrival at the front
    door minus that request's time in the trace (a fixed-schedule replay sends it that long
    after its own start). If no request comes (the tool exited, or the bound passed),
    arrival 0 is the tool's start. The measured start-up offset goes to metadata.json."""
    first_file = run.rd.first_request
    spawned = time.time()
    client = start_client(run, workload)
    deadline = time.monotonic() + CLIENT_FIRST_REQUEST_TIMEOUT_S
    run.meta["client_spawned_at"] = spawned
    while not first_file.exists():
        if client.poll() is not None or time.monotonic() > deadline:
            events("client_no_first_request", code=client.poll())
            run.meta["client_start_offset_s"] = None
            return spawned
        time.sleep(0.005)     # the tool's start-up: seconds; 5 ms is the anchor's grain
    first = float(first_file.read_text()) - run.client_clock_offset()   # ours
    trace_first_s = (run.deployment.scale.emulated_s(float(workload.arrival_s.min()))
                     if len(workload) else 0.0)
    start_at = first - trace_first_s
    run.meta["client_first_request_at"] = first
    run.meta["client_start_offset_s"] = start_at - spawned
    events("client_first_request", offset_s=round(start_at - spawned, 6))
    return start_at
