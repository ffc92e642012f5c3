"""The PD proxy protocol against vLLM's OpenAI server: prefill, decode, the connector's bytes.

The testbed is the proxy (the role of vLLM's `disagg_proxy` examples), over aiohttp:

1. `prefill`: POST /v1/completions to the prefill instance with the prompt as token ids,
   `max_tokens: 1` and `kv_transfer_params: {do_remote_decode: true, ...}`; vLLM computes the
   KV, keeps its blocks, and answers with the `kv_transfer_params` a decode instance needs
   (remote_engine_id, remote_block_ids, remote_host = the prefill instance's IP, remote_port).
2. `decode`: POST the same prompt to the decode instance with those params (`stream: true`);
   its connector pulls the KV blocks (NIXL: a read from the prefill instance across the WAN)
   and the server streams the generated tokens, whose ids `return_token_ids` brings.
3. `connector_bytes`: the KV bytes the decode instance's connector reports having moved, the
   sum of its `vllm:nixl_bytes_transferred` histogram on /metrics.

Prompts are token ids, so no tokenizer is involved on the testbed side; sampling is greedy
(temperature 0, `ignore_eos`) so that the output length is the request's.
"""

from __future__ import annotations

import json

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
BYTES_METRIC = "vllm:nixl_bytes_transferred_sum"


class VllmRequestError(RuntimeError):
    """A vLLM server answered with an error (the reason carries its status and body)."""


def completion(token_ids, max_tokens, **extra):
    return {"model": extra.pop("model", None), "prompt": list(token_ids),
            "max_tokens": int(max_tokens), "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}


async def model_name(session, url):
    async with session.get(f"{url}/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def _post(session, url, body):
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise VllmRequestError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        return await r.json()


async def prefill(session, url, model, token_ids, request_id=None):
    """Run the prefill; the `kv_transfer_params` the decode instance pulls the KV with."""
    return (await prefill_reply(session, url, model, token_ids, request_id))[0]


async def prefill_reply(session, url, model, token_ids, request_id=None):
    """(`kv_transfer_params`, prompt tokens vLLM's prefix cache served: its `cached_tokens`,
    0 when the server does not report it)."""
    body = completion(token_ids, 1, model=model, kv_transfer_params=dict(REMOTE_DECODE))
    if request_id is not None:
        body["request_id"] = str(request_id)
    out = await _post(session, url, body)
    params = out.get("kv_transfer_params")
    if not params:
        raise VllmRequestError(f"{url}: no kv_transfer_params in the prefill reply (is it "
                               f"started with a kv_producer connector?)")
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return params, int(details.get("cached_tokens") or 0)


async def _choice(session, url, model, token_ids, max_tokens, params, **extra):
    """The one choice of a non-streaming completion (colocated when `params` is None)."""
    body = completion(token_ids, max_tokens, model=model, **extra)
    if params is not None:
        body["kv_transfer_params"] = params
    return (await _post(session, url, body))["choices"][0]


async def generate(session, url, model, token_ids, max_tokens, params=None, **extra):
    """All generated token ids at once (non-streaming; colocated when `params` is None)."""
    choice = await _choice(session, url, model, token_ids, max_tokens, params, **extra)
    return list(choice["token_ids"])


async def generate_with_margins(session, url, model, token_ids, max_tokens, params=None,
                                **extra):
    """(generated token ids, margins): margins[i] is the gap in log-probability between the
    best and the second-best token at step i, so a caller can tell a near-tie (where a
    bfloat16 rounding difference may flip greedy decoding) from a real difference."""
    choice = await _choice(session, url, model, token_ids, max_tokens, params, logprobs=2,
                           **extra)
    margins = []
    for top in choice["logprobs"]["top_logprobs"]:
        best = sorted(top.values(), reverse=True) + [float("-inf")]
        margins.append(best[0] - best[1])
    return list(choice["token_ids"]), margins


async def decode_stream(session, url, model, token_ids, max_tokens, params):
    """Yield the generated token ids as the server streams them (one list per event)."""
    body = completion(token_ids, max_tokens, model=model, kv_transfer_params=params,
                      stream=True)
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise VllmRequestError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise VllmRequestError(f"{url}: {event['error']}")
            ids = [t for c in event.get("choices", ()) for t in (c.get("token_ids") or ())]
            if ids:
                yield ids


async def connector_bytes(session, url):
    """KV bytes the instance's connector has moved so far (0 before the first transfer)."""
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(BYTES_METRIC))
