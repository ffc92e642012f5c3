"""The root front door test's client command (tests/test_frontdoor_root.py), run in the client
host: bad requests, a client that disconnects mid-stream, a check that nothing is left in flight
in the scheduler or any worker, then the trace replayed by scripts/openai_stream_client.py.

Writes `probe.json` in the run directory: each bad request's HTTP status and error code, the
tokens read before disconnecting, and the scheduler's and workers' health after it."""

import asyncio
import json
import pathlib
import subprocess
import sys
import time

import aiohttp
import grpc

from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg

URL, MODEL, TRACE, RUN_DIR = sys.argv[1:5]
REPO = pathlib.Path(__file__).resolve().parent.parent.parent


async def health(rt):
    """{instance: (queue_depth, active)} of the scheduler and every prefill/decode worker."""
    out = {}
    for name, inst in rt["instances"].items():
        stub = {"scheduler": pbg.SchedulerStub, "prefill": pbg.PrefillStub,
                "decode": pbg.DecodeStub}.get(inst["role"])
        if stub is None:
            continue
        async with grpc.aio.insecure_channel(f"{inst['ip']}:{inst['grpc_port']}") as ch:
            h = await stub(ch).Health(pb.Empty(), timeout=5)
            out[name] = [h.queue_depth, h.active]
    return out


async def main():
    rt = json.loads((pathlib.Path(RUN_DIR) / "runtime.json").read_text())
    result = {"bad": []}
    bad = [b"{not json", json.dumps({"model": MODEL}).encode(),
           json.dumps({"model": "other", "prompt": "hi"}).encode(),
           json.dumps({"model": MODEL, "prompt": "w " * 200, "prompt_tokens": 131000,
                       "max_tokens": 1000}).encode()]
    async with aiohttp.ClientSession() as s:
        for body in bad:
            async with s.post(f"{URL}/v1/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                err = (await r.json())["error"]
                result["bad"].append([r.status, err["code"], err["param"]])
        # A client that goes away after its first token.
        r = await s.post(f"{URL}/v1/completions", json={
            "model": MODEL, "prompt": "w " * 512, "max_tokens": 2000, "stream": True})
        first = await r.content.readline()
        result["disconnect_first_line"] = first.decode()[:60]
        r.close()
    t0 = time.time()
    while time.time() - t0 < 10:
        h = await health(rt)
        if all(v == [0, 0] for v in h.values()):
            break
        await asyncio.sleep(0.1)
    result["health_after_disconnect"] = h
    result["settled_s"] = time.time() - t0
    (pathlib.Path(RUN_DIR) / "probe.json").write_text(json.dumps(result))


asyncio.run(main())
sys.exit(subprocess.call([sys.executable, str(REPO / "scripts" / "openai_stream_client.py"),
                          "--url", URL, "--model", MODEL, "--trace", TRACE,
                          "--out", str(pathlib.Path(RUN_DIR) / "stream_client.jsonl")]))
