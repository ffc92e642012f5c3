"""Does the open-loop client keep its schedule under load? Send lateness at ~300 requests/s.

Runs `workers/client.py` (the real client, unchanged) against a stand-in scheduler that answers
every request after a fixed hold time (so hundreds of streams are open at once, as in a run),
and reports the client's own `lateness_s` (send time minus scheduled time) per workload, side
by side in one run:

- poisson at 300 req/s,
- the Mooncake conversation trace sped up to 300 req/s (its bursts put dozens of requests on
  the same millisecond).

Target (issue 6): p99 lateness below 5 ms on the 2-core machine. Its numbers are not part of the
test suite's pass/fail (its `--smoke` run is).

    .venv/bin/python benchmarks/client_lateness.py [--seconds 20] [--hold 0.5]
    .venv/bin/python benchmarks/client_lateness.py --smoke    # 1 s workloads, 0.05 s hold
"""

import argparse
import asyncio
import json
import logging
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testbed.proto import testbed_pb2 as pb  # noqa: E402
from testbed.proto import testbed_pb2_grpc as pbg  # noqa: E402
from testbed.schema import build  # noqa: E402
from testbed.workload import generate  # noqa: E402
from testbed.workload.spec import WorkloadSpec  # noqa: E402
from workers import common, submit  # noqa: E402

TRACE = ROOT / "experiments" / "traces" / "mooncake_conversation.jsonl"
RATE = 300.0
TARGET_P99_S = 5e-3
SMOKE = {"seconds": 1.0, "hold": 0.05}     # --smoke: the same path in seconds


# ---- the stand-in scheduler (runs in its own process, like the real one) ----

async def _serve(port, hold_s):
    """gRPC on `port`, and the client's framed Submit (workers/submit.py) on `port` + 1, as the
    real scheduler serves both."""
    class Scheduler(pbg.SchedulerServicer):
        log = logging.getLogger("stand-in scheduler")

        async def Submit(self, request, context):
            await asyncio.sleep(hold_s)
            yield pb.TokenChunk(id=request.id, first_index=0,
                                times=[time.time()] * request.output_len, done=True,
                                status="ok")

    server = grpc.aio.server(options=common.grpc_options())
    service = Scheduler()
    pbg.add_SchedulerServicer_to_server(service, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await submit.serve(service, "127.0.0.1", port + 1)
    await server.wait_for_termination()


def _free_port():
    """A port free with the one after it (the stand-in's gRPC and submit ports)."""
    for _ in range(100):
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                t.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free ports in a row on 127.0.0.1")


def _wait_port(port, timeout_s=10.0):
    """Until the stand-in scheduler accepts connections (bounded: it starts in well under 1 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"stand-in scheduler did not listen on port {port} within {timeout_s} s")


# ---- workloads and measurement ----

def workloads(seconds):
    out = [("poisson 300/s", build(WorkloadSpec, {
        "arrival": {"process": "poisson", "rate": RATE}, "input": {"dist": "fixed", "tokens": 1000},
        "output": {"dist": "fixed", "tokens": 4}}, "workload"), {"duration_s": seconds})]
    if TRACE.is_file():
        speedup = RATE / 3.40
        out.append((f"mooncake trace x{speedup:.0f} (300/s)", build(WorkloadSpec, {
            "trace": {"path": str(TRACE), "format": "mooncake", "speedup": speedup,
                      "duration": f"{seconds * speedup}s"},
            "output": {"dist": "fixed", "tokens": 4}}, "workload"), {}))
    return out


def measure(df, port, hold_s, tmp):
    wl, out, rt = tmp / "workload.parquet", tmp / "requests.jsonl", tmp / "runtime.json"
    df.to_parquet(wl, index=False)
    out.unlink(missing_ok=True)
    rt.write_text(json.dumps({
        "instances": {"scheduler": {"role": "scheduler", "dc": "local", "ip": "127.0.0.1",
                                    "grpc_port": port, "rpc_port": port + 1}},
        "scale": {"time": 1.0}, "request_timeout_s": 60.0, "drain_timeout_s": 10 * hold_s + 30}))
    subprocess.run([sys.executable, "-m", "workers.client", "--runtime", str(rt), "--workload",
                    str(wl), "--out", str(out)], cwd=ROOT, check=True,
                   timeout=float(df.arrival_s.max()) + 10 * hold_s + 60)
    events = [json.loads(line) for line in out.read_text().splitlines()]
    late = np.array([e["lateness_s"] for e in events if e["ev"] == "sent"])
    ok = sum(1 for e in events if e["ev"] == "done" and e["status"] == "ok")
    return late, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each workload")
    ap.add_argument("--hold", type=float, default=0.5, help="stand-in scheduler's reply delay (s)")
    ap.add_argument("--smoke", action="store_true", help=f"{SMOKE}: seconds")
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    port = _free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--hold",
                               str(args.hold)], cwd=ROOT)
    try:
        _wait_port(port)
        _wait_port(port + 1)
        print(f"{'workload':<30} {'sent':>6} {'ok':>6} {'rate/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'max ms':>7} {'p99 vs 5 ms':>11}")
        with tempfile.TemporaryDirectory() as tmp:
            for name, spec, limits in workloads(args.seconds):
                df = generate(spec, 1, **limits)
                late, ok = measure(df, port, args.hold, pathlib.Path(tmp))
                rate = (len(df) - 1) / float(df.arrival_s.max())
                p50, p99 = np.percentile(late, [50, 99]) * 1e3
                print(f"{name:<30} {len(late):>6} {ok:>6} {rate:>7.0f} {p50:>7.2f} {p99:>7.2f} "
                      f"{late.max() * 1e3:>7.2f} {p99 / (TARGET_P99_S * 1e3):>10.0%}")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        asyncio.run(_serve(int(sys.argv[2]), float(sys.argv[4])))
    else:
        main()
