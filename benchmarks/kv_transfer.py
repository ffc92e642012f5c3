"""Goodput of the worker's KV transfer path vs a plain TCP socket, over a veth between namespaces.

    sudo .venv/bin/python benchmarks/kv_transfer.py [--tokens 4096] [--requests 24]

One run, side by side, over one unshaped veth between two fresh namespaces (`tb<id>-pre`,
`tb<id>-dec`, removed at the end):
  raw     a plain asyncio TCP sender writes the same number of bytes to a sink that reads
          and discards them;
  worker  real state frames (`state_wire.encode_state` of a prefilled request, plus its
          trailer) sent with `testbed.kvwire` (frame crc32) to a receiver that feeds
          `TorchDecodeEngine.receive` (copy, per-tensor crc32, assembly) -- per chunk size and
          number of concurrent TCP streams (one request per stream at a time).
Goodput = state payload bytes / time from the first byte sent to the receiver's report that
the last request is complete. Not part of the test suite.
"""

import argparse
import asyncio
import json
import os
import pathlib
import secrets
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RAW_PORT, KV_PORT, CTL_PORT = 6000, 6001, 6002
READY_TIMEOUT_S = 60.0
TRIAL_TIMEOUT_S = 120.0


# ---- receiver (in the decode namespace) ----

async def receiver(host):
    from testbed import kvwire
    from workers.engine_torch import TorchDecodeEngine
    from workers.model.config import HybridConfig

    dec = TorchDecodeEngine(HybridConfig(), "cpu")
    state = {"want": None, "done": 0, "raw": 0, "raw_want": None, "event": asyncio.Event()}

    def on_frame(rid, seq, flags, payload, t_first, t_last):
        dec.receive(rid, seq, 0, payload)
        if flags & kvwire.FLAG_LAST:
            asm = dec.assemblers.pop(rid, None)
            if asm is None or not asm.complete or dec.error(rid):
                print(f"request {rid} incomplete: {dec.error(rid)}", file=sys.stderr)
            state["done"] += 1
            if state["done"] == state["want"]:
                state["event"].set()

    async def raw_sink(reader, writer):
        while data := await reader.read(1 << 20):
            state["raw"] += len(data)
            if state["raw"] == state["raw_want"]:
                state["event"].set()
        writer.close()

    async def control(reader, writer):
        while line := await reader.readline():
            trial = json.loads(line)
            state.update(done=0, raw=0, want=trial.get("requests"), raw_want=trial.get("bytes"))
            state["event"].clear()
            writer.write(b"go\n")
            await writer.drain()
            await asyncio.wait_for(state["event"].wait(), TRIAL_TIMEOUT_S)
            writer.write(json.dumps({"t_done": time.time()}).encode() + b"\n")
            await writer.drain()
        writer.close()

    raw = await asyncio.start_server(raw_sink, host, RAW_PORT, limit=4 << 20)
    kv = await kvwire.serve(host, KV_PORT, on_frame)
    ctl = await asyncio.start_server(control, host, CTL_PORT)
    print("ready", flush=True)
    await asyncio.gather(raw.serve_forever(), kv.serve_forever(), ctl.serve_forever())


# ---- sender (in the prefill namespace) ----

async def sender(host, tokens, requests, chunks, streams):
    import torch

    from testbed import kvwire
    from workers.model.config import HybridConfig
    from workers.model.hybrid import HybridModel
    from workers.model.state_wire import encode_state, encode_trailer

    cfg = HybridConfig()
    model = HybridModel(cfg)
    ids = torch.randint(0, cfg.vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    _, st = model.prefill(ids)
    r, w = await asyncio.open_connection(host, CTL_PORT)

    async def trial(spec, run):
        w.write(json.dumps(spec).encode() + b"\n")
        await w.drain()
        await r.readline()
        t0 = time.time()
        await run()
        return json.loads(await r.readline())["t_done"] - t0

    rows = []
    for chunk in chunks:
        frames = encode_state(st, chunk) + [encode_trailer(1, st.length, cfg.n_layers)]
        payload = sum(memoryview(f).nbytes for f in frames)
        total = payload * requests
        blob = memoryview(bytearray(os.urandom(1 << 20)) * (total // (1 << 20) + 1))[:total]

        async def raw_run():
            rr, ww = await asyncio.open_connection(host, RAW_PORT)
            ww.write(blob)
            await ww.drain()
            ww.close()
        t_raw = await trial({"bytes": total}, raw_run)
        for n_streams in streams:
            pool = kvwire.SenderPool()

            async def one(rid):
                async with pool.connection(host, KV_PORT) as conn:
                    for seq, f in enumerate(frames):
                        await conn.send(rid, seq, kvwire.FLAG_LAST if seq == len(frames) - 1
                                        else 0, f)

            async def kv_run():
                sem = asyncio.Semaphore(n_streams)

                async def limited(rid):
                    async with sem:
                        await one(rid)
                await asyncio.gather(*(limited(i + 1) for i in range(requests)))
            t_kv = await trial({"requests": requests}, kv_run)
            pool.close()
            rows.append({"chunk_bytes": chunk, "streams": n_streams, "bytes": total,
                         "raw_gbps": 8 * total / t_raw / 1e9, "worker_gbps": 8 * total / t_kv / 1e9})
    w.close()
    print(json.dumps({"state_bytes": st.nbytes(), "rows": rows}))


# ---- orchestration (root namespace) ----

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="prompt length of the shipped state")
    p.add_argument("--requests", type=int, default=24, help="requests per trial")
    p.add_argument("--chunks", type=int, nargs="+", default=[1 << 16, 1 << 20, 4 << 20])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--timeout", type=float, default=600, help="bound on the whole sender run (s)")
    p.add_argument("--role", choices=["recv", "send"], help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "recv":
        return asyncio.run(receiver(a.host))
    if a.role == "send":
        return asyncio.run(sender(a.host, a.tokens, a.requests, a.chunks, a.streams))
    if os.geteuid() != 0:
        sys.exit("kv_transfer: needs root (two network namespaces and a veth)")
    from testbed.commands.selfcheck import ADDR_DEC, build_pair
    from testbed.lifecycle import Registry

    import signal

    def on_term(signum, frame):   # so `finally` tears the namespaces down on SIGTERM too
        raise SystemExit(f"kv_transfer: signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    reg = Registry(secrets.token_hex(4), kind="bench-kv")
    try:
        ns_pre, ns_dec, _ = build_pair(reg)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        base = [sys.executable, __file__, "--host", ADDR_DEC]
        recv = subprocess.Popen(["ip", "netns", "exec", ns_dec] + base + ["--role", "recv"],
                                stdout=subprocess.PIPE, text=True, env=env)
        reg.add_process(recv.pid, "kv_transfer receiver")
        if recv.stdout.readline().strip() != "ready":
            sys.exit("kv_transfer: receiver did not start")
        args = ["--role", "send", "--tokens", str(a.tokens), "--requests", str(a.requests),
                "--chunks", *map(str, a.chunks), "--streams", *map(str, a.streams)]
        out = subprocess.run(["ip", "netns", "exec", ns_pre] + base + args, env=env,
                             capture_output=True, text=True, timeout=a.timeout)
        if out.returncode:
            sys.exit(f"kv_transfer: sender failed:\n{out.stderr[-2000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        reg.close()
    print(f"# unshaped veth between two namespaces; state of a {a.tokens}-token request "
          f"= {res['state_bytes']} bytes; {a.requests} requests per trial; {os.cpu_count()} cores")
    print("| chunk bytes | streams | MB per trial | raw socket Gbps | worker path Gbps | ratio |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['chunk_bytes']} | {r['streams']} | {r['bytes'] / 1e6:.1f} | "
              f"{r['raw_gbps']:.2f} | {r['worker_gbps']:.2f} | "
              f"{r['worker_gbps'] / r['raw_gbps']:.2f} |")


if __name__ == "__main__":
    main()
