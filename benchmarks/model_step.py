"""Prefill and decode step time of the tiny torch model, inside the worker engine vs plain torch.

    .venv/bin/python benchmarks/model_step.py [--lengths 1024 4096 16384] [--device cpu]
    .venv/bin/python benchmarks/model_step.py --smoke     # one short length, few steps: seconds

For each prompt length, side by side in one run:
  prefill  plain  = `HybridModel.prefill(tokens)` called directly (the math only);
           engine = `TorchPrefillEngine.prefill` (compute thread, per-layer callback, state
                    encoded to wire frames with crc32, frames handed to a null sender);
  decode   plain  = `HybridModel.decode_step` on a state of that length (batch 1 and 8);
           engine = `TorchDecodeEngine.step` on the same requests admitted from wire frames;
  memory   state bytes per request (measured and formula) and the process RSS growth per
           in-flight request (receive + assemble + admit 8 requests, divided by 8).
The ratio engine/plain is the harness overhead. Its numbers are not part of the test suite's
pass/fail (its `--smoke` run is).
"""

import argparse
import asyncio
import json
import pathlib
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workers.engine_torch import (  # noqa: E402
    TorchDecodeEngine, TorchPrefillEngine, request_tokens)
from workers.model.config import HybridConfig  # noqa: E402
from workers.model.hybrid import analytical_state_bytes  # noqa: E402
from workers.model.state_wire import encode_state, encode_trailer  # noqa: E402


def rss_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, repeat):
    out, ts = None, []
    for _ in range(repeat):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        ts.append(time.perf_counter() - t)
    return out, statistics.median(ts)


RSS_REQUESTS = 8
SMOKE = {"lengths": [256], "repeat": 1, "steps": 2}   # --smoke: the same path in seconds


def rss_per_request(state, cfg, dev):
    """RSS growth of a fresh decode process per admitted request of this state's length.

    A fresh process, so memory freed by earlier work in this one cannot hide the growth: it
    warms up, then receives the frames of RSS_REQUESTS requests from a file, assembles,
    admits and decodes one step for all of them.
    """
    frames = [bytes(f) for f in encode_state(state)] + [encode_trailer(1, state.length,
                                                                       cfg.n_layers)]
    with tempfile.NamedTemporaryFile(suffix=".pkl") as f:
        pickle.dump({"cfg": cfg.to_dict(), "frames": frames, "device": str(dev)}, f)
        f.flush()
        out = subprocess.run([sys.executable, __file__, "--rss-child", f.name],
                             capture_output=True, text=True, check=True).stdout
    return json.loads(out)["rss_per_request"]


def rss_child(path):
    data = pickle.load(open(path, "rb"))
    cfg = HybridConfig.from_dict(data["cfg"])
    dec = TorchDecodeEngine(cfg, data["device"])
    warm = [bytes(f) for f in encode_state(dec.model.prefill([1, 2, 3])[1])] + \
        [encode_trailer(1, 3, cfg.n_layers)]
    for seq, fr in enumerate(warm):
        dec.receive(-1, seq, 0, fr)
    dec.admit(-1)
    dec.step([-1])
    dec.release(-1)
    frames = data.pop("frames")
    raw = sum(len(f) for f in frames)
    rss0 = rss_bytes() - raw          # the frames file's bytes are the sender's, not state
    for r in range(RSS_REQUESTS):
        for seq, fr in enumerate(frames):
            dec.receive(r, seq, 0, fr)
        dec.admit(r)
    dec.step(list(range(RSS_REQUESTS)))
    rss1 = rss_bytes() - raw
    print(json.dumps({"rss_per_request": (rss1 - rss0) / RSS_REQUESTS}))


def bench_length(pre, dec, L, repeat, steps):
    model, dev = pre.model, pre.device
    req = {"id": L, "input_len": L}
    tokens = request_tokens(req, pre.cfg.vocab)
    async def null_send(i, frames):
        for f in frames:
            memoryview(f).nbytes
    # Alternate the two so warm-up and allocator state favour neither.
    plain, engine = [], []
    for _ in range(repeat):
        (_, st), t = timed(lambda: model.prefill(tokens), dev, 1)
        plain.append(t)
        engine.append(timed(lambda: asyncio.run(pre.prefill(req, null_send)), dev, 1)[1])
    t_plain, t_engine = statistics.median(plain), statistics.median(engine)

    row = {"L": L, "prefill_plain_s": t_plain, "prefill_engine_s": t_engine,
           "state_bytes": st.nbytes(), "formula_bytes": analytical_state_bytes(pre.cfg, L)}
    for B in (1, 8):
        # plain: decode_step on B copies of the state
        states = [model.prefill(tokens)[1] for _ in range(B)] if B > 1 else [st]
        toks = [1] * B
        model.decode_step(states, toks)
        _, t = timed(lambda s=states: model.decode_step(s, toks), dev, steps)
        row[f"decode_plain_b{B}_ms"] = 1e3 * t
        # engine: the same requests received as frames, assembled and admitted
        rids = []
        for b in range(B):
            rid = L * 100 + b
            frames = encode_state(states[b]) + [encode_trailer(1, states[b].length, 8)]
            for seq, f in enumerate(frames):
                dec.receive(rid, seq, 0, bytes(f))
            del frames
            dec.admit(rid)
            rids.append(rid)
        dec.step(rids)
        _, t = timed(lambda: dec.step(rids), dev, steps)
        row[f"decode_engine_b{B}_ms"] = 1e3 * t
        if B == 8:
            row["resident_state_per_request"] = statistics.mean(dec.resident_bytes(r) for r in rids)
            row["rss_per_request"] = rss_per_request(states[0], pre.cfg, dev)
        for r in rids:
            dec.release(r)
        del states
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeat", type=int, default=3, help="prefill repetitions (median)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed (median)")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE}: seconds")
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        vars(a).update(SMOKE)
    if a.rss_child:
        return rss_child(a.rss_child)
    cfg = HybridConfig(dtype=a.dtype)
    pre, dec = TorchPrefillEngine(cfg, a.device), TorchDecodeEngine(cfg, a.device)
    asyncio.run(pre.prefill({"id": 0, "input_len": 64}, lambda i, f: None))   # warm-up
    print(f"# tiny hybrid model: {cfg.n_layers} layers {cfg.layer_kinds}, width {cfg.d_model}, "
          f"vocab {cfg.vocab}, {a.device} {a.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    hdr = ("| L | prefill plain s | prefill engine s | ratio | decode b1 plain ms | engine ms | "
           "ratio | decode b8 plain ms | engine ms | ratio | S_kv measured B | formula B | "
           "RSS growth / request B |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for L in a.lengths:
        r = bench_length(pre, dec, L, a.repeat, a.steps)
        print(f"| {L} | {r['prefill_plain_s']:.3f} | {r['prefill_engine_s']:.3f} | "
              f"{r['prefill_engine_s'] / r['prefill_plain_s']:.2f} | "
              f"{r['decode_plain_b1_ms']:.2f} | {r['decode_engine_b1_ms']:.2f} | "
              f"{r['decode_engine_b1_ms'] / r['decode_plain_b1_ms']:.2f} | "
              f"{r['decode_plain_b8_ms']:.2f} | {r['decode_engine_b8_ms']:.2f} | "
              f"{r['decode_engine_b8_ms'] / r['decode_plain_b8_ms']:.2f} | "
              f"{r['state_bytes']} | {r['formula_bytes']} | {r['rss_per_request']:.0f} |",
              flush=True)
    pre.close()
    dec.close()


if __name__ == "__main__":
    main()
