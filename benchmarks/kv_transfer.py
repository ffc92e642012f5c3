"""Goodput of the worker's KV transfer path vs a plain TCP socket, over a veth between namespaces.

    sudo .venv/bin/python benchmarks/kv_transfer.py [--tokens 4096] [--requests 96] [--repeat 7]
    sudo .venv/bin/python benchmarks/kv_transfer.py --smoke    # seconds: one tiny row

One run, side by side, over one unshaped veth between two fresh namespaces (`tb<id>-pre`,
`tb<id>-dec`, removed at the end):
  raw     a plain TCP socket sends the same number of bytes with `sock_sendall` straight from
          one buffer (no copy, no framing) to a sink that reads them into one reused 1 MB
          buffer and discards them (`BufferedProtocol`: the kernel's copy and nothing else);
  worker  real state frames (`state_wire.encode_layer` of each layer of a prefilled request,
          plus its trailer) sent with `workers.kvwire` as the prefill worker sends them (a
          layer's frames in one `send_frames`; no frame crc32: state frames carry a crc32 per
          tensor and header) to a receiver set up as the decode
          worker's (`kvwire.serve` with `TorchDecodeEngine.frame_buffer`: data frames received
          in place into the layer's state memory; `TorchDecodeEngine.receive`: per-tensor crc32,
          assembly) -- per chunk size and number of concurrent TCP streams (one request per
          stream at a time).
Goodput = state payload bytes / time from the first byte sent to the receiver's report that
the last request is complete. Each trial is short (~0.1-0.3 s), so raw and worker trials
alternate `--repeat` times; the table shows median goodputs and the median (and range) of the
ratio of each worker trial to the raw trial just before it, which cancels slow load changes;
the load average before and after is printed, because other work on the machine moves both.
Beside each side's CPU (a share of a core over the trial), the receiver's CPU time per payload
byte (ns/byte, median over trials) says what the path costs whatever the rate it reached: the
receiver is what limits the worker path, so this is the number that travels between machines.
`--receiver wire` takes the decode engine out of the worker side to say where its cost is: the
same frames over the same `kvwire.serve`, each received into a buffer of kvwire's own, counted
and dropped (no state tensors, no per-tensor crc32, no assembly).
Its numbers are not part of the test suite's pass/fail (its `--smoke` run is).
"""

import argparse
import asyncio
import json
import os
import pathlib
import secrets
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from testbed import eventloop, lifecycle  # noqa: E402
from testbed.net.ns import ns_popen, ns_run  # noqa: E402
from testbed.net.pair import veth_pair  # noqa: E402
from workers import kvwire  # noqa: E402
from workers.engine_torch import TorchDecodeEngine  # noqa: E402
from workers.model.config import HybridConfig  # noqa: E402
from workers.model.hybrid import HybridModel  # noqa: E402
from workers.model.state_wire import encode_layer, encode_trailer  # noqa: E402

RAW_PORT, KV_PORT, CTL_PORT = 6000, 6001, 6002
READY_TIMEOUT_S = 60.0
TRIAL_TIMEOUT_S = 120.0
# --smoke: the same path end to end in seconds (a short state, few requests, one row)
SMOKE = {"tokens": 256, "requests": 4, "chunks": [1 << 16], "streams": [2], "repeat": 1}


# ---- receiver (in the decode namespace) ----

async def receiver(host, wire_only=False):
    kvwire.keep_receive_memory()       # as the decode worker does
    dec = TorchDecodeEngine(HybridConfig(), "cpu")
    state = {"want": None, "done": 0, "failed": 0, "raw": 0, "raw_want": None,
             "event": asyncio.Event()}

    def on_frame(rid, seq, flags, payload, t_first, t_last):
        if not wire_only:
            dec.receive(rid, seq, 0, payload)
        if flags & kvwire.FLAG_LAST:
            if not wire_only:
                asm = dec.assemblers.pop(rid, None)
                if asm is None or not asm.complete or dec.error(rid):
                    print(f"request {rid} incomplete: {dec.error(rid)}", file=sys.stderr)
                    state["failed"] += 1
            state["done"] += 1
            if state["done"] == state["want"]:
                state["event"].set()

    class RawSink(asyncio.BufferedProtocol):
        """Reads into one reused 1 MB buffer and discards: the kernel's copy and nothing else."""
        buf = memoryview(bytearray(1 << 20))

        def get_buffer(self, sizehint):
            return self.buf

        def buffer_updated(self, nbytes):
            state["raw"] += nbytes
            if state["raw"] == state["raw_want"]:
                state["event"].set()

    async def control(reader, writer):
        while line := await reader.readline():
            trial = json.loads(line)
            state.update(done=0, failed=0, raw=0, want=trial.get("requests"),
                         raw_want=trial.get("bytes"))
            cpu0 = time.process_time()
            state["event"].clear()
            writer.write(b"go\n")
            await writer.drain()
            await asyncio.wait_for(state["event"].wait(), TRIAL_TIMEOUT_S)
            writer.write(json.dumps({"t_done": time.time(), "failed": state["failed"],
                                     "cpu_s": time.process_time() - cpu0}).encode() + b"\n")
            await writer.drain()
        writer.close()

    raw = await asyncio.get_running_loop().create_server(RawSink, host, RAW_PORT)
    kv = await kvwire.serve(host, KV_PORT, on_frame,
                            payload_buffer=None if wire_only else dec.frame_buffer)
    ctl = await asyncio.start_server(control, host, CTL_PORT)
    print("ready", flush=True)
    await asyncio.gather(raw.serve_forever(), kv.serve_forever(), ctl.serve_forever())


# ---- sender (in the prefill namespace) ----

def encoded_layers(st, cfg, chunk):
    """The wire frames of a prefilled state, per layer, plus its trailer."""
    layers = [encode_layer(i, st.layer_tensors(i), cfg.n_layers, st.kinds[i], chunk)
              for i in range(cfg.n_layers)]
    layers.append([encode_trailer(1, st.length, cfg.n_layers)])
    return layers


def raw_runner(host, blob):
    async def run():   # sendall straight from the buffer: no copy, no framing
        loop = asyncio.get_running_loop()
        with socket.socket() as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, (host, RAW_PORT))
            await loop.sock_sendall(sock, blob)
    return run


def kv_runner(host, layers, requests, n_streams):
    """`requests` requests' frames over at most `n_streams` pooled connections, as
    PrefillService._send sends them (a layer's frames in one send_frames)."""
    pool = kvwire.SenderPool()

    async def one(rid):
        async with pool.connection(host, KV_PORT) as conn:
            seq = 0
            for i, frames in enumerate(layers):
                last = i == len(layers) - 1
                batch = [(rid, seq + j, kvwire.FLAG_LAST if last and j == len(frames) - 1
                          else 0, f) for j, f in enumerate(frames)]
                seq += len(frames)
                await conn.send_frames(batch, checksum=False)

    async def run():
        sem = asyncio.Semaphore(n_streams)

        async def limited(rid):
            async with sem:
                await one(rid)
        try:
            await asyncio.gather(*(limited(i + 1) for i in range(requests)))
        finally:
            pool.close()
    return run


def row(chunk, n_streams, total, raw, kv):
    """One table row from alternated (wall, send CPU, receive CPU, receive CPU s) trials."""
    ratios = sorted(r[0] / k[0] for r, k in zip(raw, kv))   # t_raw / t_worker

    def med(trials, i):
        return statistics.median(t[i] for t in trials)
    return {"chunk_bytes": chunk, "streams": n_streams, "bytes": total,
            "raw_gbps": 8 * total / med(raw, 0) / 1e9,
            "worker_gbps": 8 * total / med(kv, 0) / 1e9,
            "ratio": statistics.median(ratios),
            "ratio_min": ratios[0], "ratio_max": ratios[-1],
            "raw_cpu": (med(raw, 1), med(raw, 2)),
            "worker_cpu": (med(kv, 1), med(kv, 2)),
            "raw_recv_ns_per_byte": 1e9 * med(raw, 3) / total,
            "worker_recv_ns_per_byte": 1e9 * med(kv, 3) / total}


async def sender(host, tokens, requests, chunks, streams, repeat):
    cfg = HybridConfig()
    model = HybridModel(cfg)
    ids = torch.randint(0, cfg.vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    _, st = model.prefill(ids)
    r, w = await asyncio.open_connection(host, CTL_PORT)

    async def trial(spec, run):
        w.write(json.dumps(spec).encode() + b"\n")
        await w.drain()
        await r.readline()
        t0, cpu0 = time.time(), time.process_time()
        await run()
        cpu = time.process_time() - cpu0
        done = json.loads(await r.readline())
        if done["failed"]:
            raise SystemExit(f"kv_transfer: {done['failed']} requests arrived incomplete")
        wall = done["t_done"] - t0
        return wall, cpu / wall, done["cpu_s"] / wall, done["cpu_s"]

    rows = []
    for chunk in chunks:
        layers = encoded_layers(st, cfg, chunk)
        payload = sum(memoryview(f).nbytes for frames in layers for f in frames)
        total = payload * requests
        blob = memoryview(bytearray(os.urandom(1 << 20)) * (total // (1 << 20) + 1))[:total]
        for n_streams in streams:
            raw, kv = [], []
            for _ in range(repeat):     # alternate, so both see the same background load
                raw.append(await trial({"bytes": total}, raw_runner(host, blob)))
                kv.append(await trial({"requests": requests},
                                      kv_runner(host, layers, requests, n_streams)))
            rows.append(row(chunk, n_streams, total, raw, kv))
    w.close()
    print(json.dumps({"state_bytes": st.nbytes(), "rows": rows}))


# ---- orchestration (root namespace) ----

def measure(a):
    """Receiver in one namespace, sender in the other; the sender's result."""
    reg = lifecycle.Registry(secrets.token_hex(4), kind="bench-kv")
    try:
        with veth_pair(reg, names=("pre", "dec")) as pair:
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            base = [sys.executable, __file__, "--host", pair.ip_b]
            recv = ns_popen(pair.b, base + ["--role", "recv", "--receiver", a.receiver],
                            stdout=subprocess.PIPE, text=True, env=env)
            reg.add_process(recv.pid, "kv_transfer receiver")
            if recv.stdout.readline().strip() != "ready":
                sys.exit("kv_transfer: receiver did not start")
            args = ["--role", "send", "--tokens", str(a.tokens), "--requests", str(a.requests),
                    "--chunks", *map(str, a.chunks), "--streams", *map(str, a.streams),
                    "--repeat", str(a.repeat)]
            out = ns_run(pair.a, base + args, env=env, capture_output=True, text=True,
                         timeout=a.timeout)
            if out.returncode:
                sys.exit(f"kv_transfer: sender failed:\n{out.stderr[-2000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        reg.close()


def print_table(a, res, load_before):
    load = " ".join(f"{x:.2f}" for x in load_before)
    print(f"# receiver {a.receiver}; unshaped veth between two namespaces; state of a "
          f"{a.tokens}-token request "
          f"= {res['state_bytes']} bytes; {a.requests} requests per trial; medians of "
          f"{a.repeat} alternated trials; {os.cpu_count()} cores; load average {load} before, "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after")
    print("| chunk bytes | streams | MB per trial | raw socket Gbps | worker path Gbps | ratio "
          "| ratio range | raw CPU send / recv | worker CPU send / recv "
          "| recv ns/byte raw / worker |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['chunk_bytes']} | {r['streams']} | {r['bytes'] / 1e6:.1f} | "
              f"{r['raw_gbps']:.2f} | {r['worker_gbps']:.2f} | "
              f"{r['ratio']:.2f} | "
              f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f} | "
              f"{r['raw_cpu'][0]:.2f} / {r['raw_cpu'][1]:.2f} | "
              f"{r['worker_cpu'][0]:.2f} / {r['worker_cpu'][1]:.2f} | "
              f"{r['raw_recv_ns_per_byte']:.3f} / {r['worker_recv_ns_per_byte']:.3f} |")
    print("# CPU = process CPU time (user + system) / trial wall time, per side: 1.00 is one "
          "core busy the whole trial; recv ns/byte = the receiving process's CPU time per "
          "payload byte (median over trials; 1 ns/byte = 1 CPU-second per GB)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="prompt length of the shipped state")
    p.add_argument("--requests", type=int, default=96, help="requests per trial")
    p.add_argument("--chunks", type=int, nargs="+", default=[1 << 16, 1 << 20, 4 << 20])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeat", type=int, default=7, help="alternated raw/worker trials per row")
    p.add_argument("--timeout", type=float, default=600, help="bound on the whole sender run (s)")
    p.add_argument("--receiver", choices=["decoder", "wire"], default="decoder",
                   help="the worker side's receiver: the decode engine's (default) or kvwire's "
                        "alone (frames counted and dropped: where the engine's cost is)")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny parameters, seconds: {SMOKE} (the same path end to end)")
    p.add_argument("--role", choices=["recv", "send"], help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(SMOKE)
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.role == "recv":
        return eventloop.run(receiver(a.host, a.receiver == "wire"))
    if a.role == "send":
        return eventloop.run(sender(a.host, a.tokens, a.requests, a.chunks, a.streams, a.repeat))
    if os.geteuid() != 0:
        sys.exit("kv_transfer: needs root (two network namespaces and a veth)")
    lifecycle.sigterm_unwinds()   # so `finally` tears the namespaces down on SIGTERM too
    load_before = os.getloadavg()
    print_table(a, measure(a), load_before)


if __name__ == "__main__":
    main()
