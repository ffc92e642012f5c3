"""The two processes of `testbed selfcheck`: a prefill peer and a decode peer.

    python -m workers.model.selfcheck_peer decode  --dir D --listen HOST
    python -m workers.model.selfcheck_peer prefill --dir D --connect HOST:PORT

Both read `D/request.json` (model config, device, prompt, number of new tokens, chunk size),
written by `testbed/commands/selfcheck.py`, which starts them in two network namespaces. The
decode peer listens with `workers.kvwire.serve` and writes `D/ready` (its port) once it does.
The prefill peer prefills on its own model instance and sends each layer's state frames
(`state_wire.encode_layer`) over one kvwire connection *while the next layers compute* (the
prefill runs in a thread, the sender in the event loop); a last frame (FLAG_LAST) carries the
greedy first token. The decode peer verifies and assembles the state, decodes `new_tokens`
greedy steps and writes the logits it computed to `D/decode.npz`; the prefill peer writes its
last-token logits to `D/prefill.npz`. Each also writes a JSON record of its timings.
"""

import argparse
import asyncio
import json
import pathlib
import sys
import time

import numpy as np
import torch

from testbed import eventloop
from workers import kvwire
from workers.model.config import HybridConfig
from workers.model.hybrid import HybridModel, RequestState
from workers.model.prefix import PrefixState, blocks_of
from workers.model.state_wire import LayerAssembler, encode_layer

REQUEST_ID = 1
# A peer that sees nothing for this long gives up (the parent also bounds the whole run).
IDLE_TIMEOUT_S = 120.0
PORT_FILE = "port"          # in --dir: this decode peer's port, once it listens


def load_request(d):
    req = json.loads((pathlib.Path(d) / "request.json").read_text())
    cfg = HybridConfig.from_dict(req["config"])
    model = HybridModel(cfg, device=req["device"])
    return req, cfg, model


# ---- prefill ----

async def run_prefill(d, host, port):
    req, cfg, model = load_request(d)
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()
    layer_ready = {}

    def on_layer(i, kind, tensors):
        # Called in the compute thread: encode here (host copy + crc), hand frames to the loop.
        frames = encode_layer(i, tensors, cfg.n_layers, kind, req["chunk_bytes"])
        layer_ready[i] = time.time()
        loop.call_soon_threadsafe(queue.put_nowait, (i, frames))

    P = req.get("prefix_len", 0)
    state = None
    if P:   # the cached prefix, as a pool holds it: block bytes (KDA snapshot per block)
        block = req["block"]
        _, pst = model.prefill(req["prompt"][:P], snapshot_at=list(range(block, P + 1, block)))
        pool = [b.to_bytes() for b in blocks_of(pst, block)]
        state = PrefixState.from_blocks(cfg, pool).request_state(cfg, model.device)

    def compute():
        t0 = time.time()
        logits, _ = model.prefill(req["prompt"][P:], state=state, on_layer=on_layer)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        loop.call_soon_threadsafe(queue.put_nowait, None)
        return logits.cpu(), t0, time.time()

    r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    conn = kvwire.Connection(r, w)
    work = loop.run_in_executor(None, compute)
    seq, sent, layer_sent = 0, 0, {}
    while (item := await asyncio.wait_for(queue.get(), IDLE_TIMEOUT_S)) is not None:
        i, frames = item
        for f in frames:
            await conn.send(REQUEST_ID, seq, 0, f)
            seq += 1
            sent += memoryview(f).nbytes
        layer_sent[i] = time.time()
    logits, t0, t1 = await work
    first = int(logits.argmax())
    meta = json.dumps({"first_token": first, "length": len(req["prompt"])}).encode()
    await conn.send(REQUEST_ID, seq, kvwire.FLAG_LAST, meta)
    t_end = time.time()
    conn.close()
    np.savez(pathlib.Path(d) / "prefill.npz", logits=logits.numpy())
    overlap = sum(max(0.0, min(layer_sent[i], t1) - layer_ready[i]) for i in layer_sent)
    (pathlib.Path(d) / "prefill.json").write_text(json.dumps({
        "prefill_s": t1 - t0, "transfer_end_s": t_end - t0, "frames": seq + 1,
        "payload_bytes": sent, "first_token": first,
        "layer_ready_s": {i: layer_ready[i] - t0 for i in layer_ready},
        "layer_sent_s": {i: layer_sent[i] - t0 for i in layer_sent},
        "transfer_overlapping_compute_s": overlap}))


# ---- decode ----

async def run_decode(d, host):
    req, cfg, model = load_request(d)
    asm = LayerAssembler(cfg.n_layers, cfg.layer_kinds)
    done = asyncio.get_running_loop().create_future()
    rec = {"frames": 0, "t_first": None}
    expect_seq = [0]

    def on_frame(rid, seq, flags, payload, t_first, t_last):
        try:
            if seq != expect_seq[0]:
                raise RuntimeError(f"frame {seq} arrived, expected {expect_seq[0]}")
            expect_seq[0] += 1
            rec["frames"] += 1
            rec["t_first"] = rec["t_first"] or t_first
            if flags & kvwire.FLAG_LAST:
                rec["t_last"] = t_last
                done.done() or done.set_result(json.loads(payload))
            else:
                asm.feed(payload)
        except Exception as e:
            done.done() or done.set_exception(e)

    def on_error(e):
        done.done() or done.set_exception(e)

    server = await kvwire.serve(host, 0, on_frame, on_error)
    port = server.sockets[0].getsockname()[1]
    (pathlib.Path(d) / PORT_FILE).write_text(str(port))
    try:
        meta = await asyncio.wait_for(done, IDLE_TIMEOUT_S)
    finally:
        server.close()
    states = asm.states()
    state_bytes = sum(t.numel() * t.element_size() for layer in states for t in layer.values())
    st = RequestState.from_layer_tensors(cfg, states, device=model.device, length=meta["length"])
    token, fed, logits = meta["first_token"], [], []
    t0 = time.time()
    for _ in range(req["new_tokens"]):
        out = model.decode_step([st], [token])[0]
        fed.append(token)
        logits.append(out.cpu())
        token = int(out.argmax())
    t1 = time.time()
    np.savez(pathlib.Path(d) / "decode.npz", logits=torch.stack(logits).numpy(),
             tokens=np.array(fed, dtype=np.int64))
    (pathlib.Path(d) / "decode.json").write_text(json.dumps({
        "state_bytes": state_bytes, "payload_bytes": asm.bytes_received,
        "frames": rec["frames"], "transfer_s": rec["t_last"] - rec["t_first"],
        "decode_steps": req["new_tokens"], "decode_s": t1 - t0}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--dir", required=True)
    p.add_argument("--listen", default="127.0.0.1")
    p.add_argument("--connect", default=None, help="HOST:PORT of the decode peer")
    a = p.parse_args(argv)
    torch.set_num_threads(1)   # two peers share the machine's cores
    if a.role == "decode":
        eventloop.run(run_decode(a.dir, a.listen))
    else:
        host, port = a.connect.rsplit(":", 1)
        eventloop.run(run_prefill(a.dir, host, int(port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
