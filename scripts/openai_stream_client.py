"""A small streaming OpenAI client: replays a mooncake trace against /v1/completions.

Independent of the testbed's own client: it sends each trace row at its timestamp (ms after
the first) as a text prompt of `input_length` words with `max_tokens = output_length` and
`stream: true`, and writes one JSON line per request with its own clock: start (before the
request is written), first (first token event read), last, tokens, ok, error. Used with
`workload.client: command`, e.g.

    command: python scripts/openai_stream_client.py --url {url} --model {model}
             --trace {trace} --out {run_dir}/stream_client.jsonl
"""

import argparse
import asyncio
import json
import time

import aiohttp


async def one(session, url, model, row, out):
    words = " ".join(f"w{i % 4000}" for i in range(row["input_length"]))
    body = {"model": model, "prompt": words, "max_tokens": row["output_length"], "stream": True,
            "stream_options": {"include_usage": True}}
    rec = {"i": row["i"], "start": time.time(), "first": None, "last": None, "tokens": 0,
           "ok": False, "error": ""}
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                headers={"X-Request-Id": str(row["i"])}) as r:
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
            else:
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        rec["ok"] = rec["tokens"] == row["output_length"]
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec["error"] = obj["error"]["message"]
                        continue
                    if obj["choices"] and obj["choices"][0].get("text"):
                        now = time.time()
                        rec["first"] = rec["first"] or now
                        rec["last"] = now
                        rec["tokens"] += 1
                    if obj.get("usage"):
                        rec["usage"] = obj["usage"]
    except aiohttp.ClientError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    out.write(json.dumps(rec) + "\n")
    out.flush()


async def main(args):
    rows = [json.loads(line) for line in open(args.trace) if line.strip()]
    t0 = rows[0]["timestamp"] if rows else 0
    start = time.time() + 0.2
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    with open(args.out, "a") as out:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = []
            for i, row in enumerate(rows):
                row["i"] = i
                delay = start + (row["timestamp"] - t0) / 1e3 - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(session, args.url, args.model, row, out)))
            await asyncio.gather(*tasks)
    print(f"sent {len(rows)} requests")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="base URL, http://host:port")
    p.add_argument("--model", required=True)
    p.add_argument("--trace", required=True, help="mooncake JSONL: timestamp (ms), lengths")
    p.add_argument("--out", required=True, help="JSONL of per-request records to append to")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit (s)")
    asyncio.run(main(p.parse_args()))
