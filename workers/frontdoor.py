"""Front door: an OpenAI-compatible HTTP server, so standard load generators can drive a run.

It runs in the client host (`cli`, inside the emulated local datacenter) when
`workload.client` is `command` or `aiperf`, and serves (aiohttp):

- `POST /v1/completions` and `POST /v1/chat/completions`, streamed (`stream: true`: server-sent
  events in OpenAI's chunk format, one event per output token, then `data: [DONE]`) or not;
  `max_tokens` (chat also `max_completion_tokens`; default 16, OpenAI's) is the number of
  output tokens; `stream_options.include_usage` adds the usage chunk before `[DONE]`;
- `GET /v1/models` (the one model: the run's profile name) and `GET /health`.

Each request becomes one scheduler `Submit`, the same `Request` the built-in client sends; its
output tokens are the decode worker's tokens, which come straight from the decode workers as to
the built-in client (workers/tokens.py), each streamed as the text " tok". The prompt's
length is its token count under the testbed's tokenizer: a token is a maximal run of
non-whitespace characters (`count_tokens`; `testbed/tokenizer/` is the same rule as a Hugging
Face tokenizer, for tools that need one). A prompt given as token ids (a list of integers) has
that many tokens; the extension field `prompt_tokens` (an integer) sets the length of a
synthetic prompt outright. Whole 512-token blocks of a text or id prompt get chained block ids,
so the prefix cache sees shared prefixes.

Records, in the run directory: `requests.jsonl` (the built-in client's format: `sent` and `done`
lines, TTFT from the Submit call to its first token, so `testbed analyse` works unchanged) and
`frontdoor.jsonl`, one `http` line per HTTP request: arrival (headers read), the first and last
token handed to the client's connection, tokens, HTTP status, outcome (`ok`, `failed`, `rejected`,
`disconnected`) and error. Bad requests get OpenAI-style JSON errors (`{"error": {"message",
"type", "param", "code"}}`): malformed JSON or fields 400, an unknown model 404, a body over the
size limit 413, a prompt plus `max_tokens` beyond `workload.frontdoor.max_context` 400
`context_length_exceeded`; the scheduler failing a request before its first token 502 (after
it: an error event in the stream). A client that disconnects cancels its Submit, which cancels
the request's prefill and decode (workers/recovery.py `Flight.run`); nothing is left in flight.
"""

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import json
import pathlib
import signal
import time

import grpc
from aiohttp import web

from testbed import eventloop
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from testbed.records import RecordLog, SentRecord
from workers import common, tokens
from workers.client import Tracker

DEFAULT_MAX_TOKENS = 16       # OpenAI's completions default
BLOCK_TOKENS = 512            # prefix block size (testbed.workload.spec.BLOCK_TOKENS)
TOKEN_TEXT = " tok"           # the text of every output token (one token under the rule)
MAX_BODY_BYTES = 64 << 20     # a 128Ki-token prompt of long words fits
LAG_PERIOD_S = 0.01           # how often the event loop's lateness is sampled


class _Disconnected(ConnectionError):
    """The client went away mid-stream; `resp`: the response begun (or None)."""

    def __init__(self, resp):
        super().__init__("client disconnected")
        self.resp = resp


class HttpError(Exception):
    """A request the front door refuses: HTTP status and an OpenAI-style error object."""

    def __init__(self, status, message, type_="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass
class Parsed:
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    prefix_blocks: list


def count_tokens(text):
    """The testbed's tokenizer: a token is a maximal run of non-whitespace characters."""
    return len(text.split())


def block_ids(tokens):
    """Chained ids of the whole BLOCK_TOKENS-token blocks of a token sequence (strings or ints):
    equal prefixes give equal leading ids, as the Mooncake trace's hash_ids."""
    ids, h = [], b""
    for i in range(len(tokens) // BLOCK_TOKENS):
        block = " ".join(map(str, tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]))
        h = hashlib.blake2b(h + block.encode(), digest_size=8).digest()
        ids.append(int.from_bytes(h, "big") >> 2)       # a positive int64
    return ids


def _int(body, key, lo=None):
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise HttpError(400, f"'{key}' must be an integer, got {json.dumps(v)[:40]}", param=key)
    if lo is not None and v < lo:
        raise HttpError(400, f"'{key}' must be at least {lo}, got {v}", param=key)
    return v


def _prompt_tokens(body, chat):
    """The prompt's tokens (a list of words or of ids), or its length from `prompt_tokens`."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise HttpError(400, "'messages' must be a non-empty list", param="messages")
        words = []
        for i, m in enumerate(msgs):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(m, dict) and "role" in m and isinstance(content, str):
                words += content.split()
            elif isinstance(m, dict) and "role" in m and isinstance(content, list) and all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(
                        p.get("text"), str) for p in content):
                words += [w for p in content for w in p["text"].split()]
            else:
                raise HttpError(400, f"messages[{i}] must be {{role, content: text or [{{type: "
                                f"text, text}}]}}", param="messages")
        return words
    if "prompt" not in body:
        raise HttpError(400, "'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]        # a batch of one
    if isinstance(p, str):
        return p.split()
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise HttpError(400, "'prompt' must be a string, a list of token ids, or a batch of one "
                    "of those", param="prompt")


def parse(raw, chat, model, max_context):
    """An HTTP body -> Parsed, or HttpError naming what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the body is not valid JSON ({type(e).__name__})") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    if "model" not in body:
        raise HttpError(400, "'model' is required", param="model")
    if body["model"] != model:
        raise HttpError(404, f"The model `{body['model']}` does not exist; this server has "
                        f"`{model}`", type_="NotFoundError", param="model",
                        code="model_not_found")
    tokens = _prompt_tokens(body, chat)
    n_prompt = len(tokens)
    if "prompt_tokens" in body:             # extension: a synthetic prompt of this length
        n_prompt = _int(body, "prompt_tokens", 1)
        tokens = []
    if n_prompt < 1:
        raise HttpError(400, "the prompt has no tokens", param="messages" if chat else "prompt")
    key = next((k for k in ("max_completion_tokens", "max_tokens") if chat and k in body
                and body[k] is not None), "max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if body.get(key) is None else _int(body, key, 1)
    if body.get("n", 1) != 1:
        raise HttpError(400, "only n = 1 is supported", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, "'stream' must be true or false", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise HttpError(400, "'stream_options' must be an object", param="stream_options")
    if n_prompt + max_tokens > max_context:
        raise HttpError(400, f"This model's maximum context length is {max_context} tokens. "
                        f"However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in "
                        f"the prompt, {max_tokens} for the completion).",
                        param="prompt" if not chat else "messages",
                        code="context_length_exceeded")
    return Parsed(n_prompt, max_tokens, stream, bool(opts.get("include_usage")),
                  block_ids(tokens))


def _quantile_ms(sorted_s, q):
    """The q-quantile (nearest rank) of sorted seconds, in ms."""
    return round(sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1e3, 3)


def _sse(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class FrontDoor:
    """The HTTP handlers; `stub` is the scheduler's (anything with a `Submit` stream call)."""

    def __init__(self, stub, model, max_context, requests_path, http_path, timeout_s=None,
                 first_id=0, first_request_path=None):
        self.stub, self.model, self.max_context = stub, model, max_context
        self.rec, self.http = RecordLog(requests_path), RecordLog(http_path)
        self.timeout_s = timeout_s
        self.next_id = first_id
        self.counts = collections.Counter()      # outcome -> HTTP requests
        self.codes = collections.Counter()       # HTTP status -> HTTP requests
        self.active = set()                      # handler tasks with a Submit in flight
        self.stopping = False
        self.created = int(time.time())
        # Where to say when the first completion request arrived: an external tool's arrival 0
        # for the runner, which starts the link schedule and faults from it (testbed/run.py).
        self.first_request_path = first_request_path
        self.lag_s = []             # event loop lateness samples (watch_lag)

    def app(self):
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat),
                        web.get("/v1/models", self.models), web.get("/health", self.health)])
        return app

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created,
             "owned_by": "prfaas-testbed", "max_model_len": self.max_context}]})

    async def health(self, request):
        return web.json_response({"active": len(self.active), "served": dict(self.counts)})

    async def completions(self, request):
        return await self.serve(request, chat=False)

    async def chat(self, request):
        return await self.serve(request, chat=True)

    def _log(self, row, outcome, status, error=""):
        self.counts[outcome] += 1
        self.codes[status] += 1
        row.update(outcome=outcome, http_status=status, error=error, end=time.time())
        self.http.write(row)

    def _mark_first(self, arrival):
        path, self.first_request_path = self.first_request_path, None
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{arrival:.6f}")
        tmp.rename(path)         # the runner never reads a partial time

    async def serve(self, request, chat):
        arrival = time.time()
        if self.first_request_path is not None:
            self._mark_first(arrival)
        row = {"ev": "http", "id": None, "arrival": arrival, "endpoint": request.path,
               "first_token": None, "last_token": None, "n_tokens": 0,
               # a client's own id for the request (aiperf sends both), to pair records exactly
               "client_request_id": request.headers.get("X-Request-Id")
               or request.headers.get("X-Correlation-Id")}
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise HttpError(413, f"the body is larger than {MAX_BODY_BYTES} bytes",
                                code="body_too_large") from None
            p = parse(raw, chat, self.model, self.max_context)
        except HttpError as e:
            self._log(row, "rejected", e.status, e.message)
            return web.json_response(e.body(), status=e.status)
        row.update(prompt_tokens=p.prompt_tokens, max_tokens=p.max_tokens, stream=p.stream)
        task = asyncio.current_task()
        self.active.add(task)
        try:
            return await self._submit(request, chat, p, row)
        finally:
            self.active.discard(task)

    def _chunk(self, cid, chat, text=None, finish=None, first=False, created=None):
        if chat:
            delta = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": cid, "object": obj, "created": created or int(time.time()),
                "model": self.model, "choices": [choice]}

    def _usage(self, p, n):
        return {"prompt_tokens": p.prompt_tokens, "completion_tokens": n,
                "total_tokens": p.prompt_tokens + n}

    async def _submit(self, request, chat, p, row):
        rid = self.next_id
        self.next_id += 1
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        req = pb.Request(id=rid, input_len=p.prompt_tokens, output_len=p.max_tokens)
        req.prefix_blocks.extend(p.prefix_blocks)
        send = time.time()
        req.send_time = send
        row["id"] = rid
        self.rec.write(SentRecord(id=rid, send_time=send, scheduled=row["arrival"],
                                  lateness_s=send - row["arrival"], input_len=p.prompt_tokens,
                                  output_len=p.max_tokens))
        track = Tracker(req, send)
        created = int(send)
        call = self.stub.Submit(req, timeout=self.timeout_s)
        try:
            resp, error, n_out = await self._stream(request, call, track, chat, cid, p, row,
                                                    created)
        except (asyncio.CancelledError, ConnectionError) as e:
            call.cancel()
            why = ("run ended before the request finished" if self.stopping
                   else "client disconnected")
            self.rec.write(track.record(why, end=not self.stopping))
            self._log(row, "disconnected" if not self.stopping else "failed", 499, why)
            if isinstance(e, asyncio.CancelledError):
                raise
            return e.resp
        self.rec.write(track.record(error))
        row["n_tokens"] = n_out
        if track.out.status != "ok":
            return await self._failed(resp, row, track.out.error)
        return await self._reply(resp, row, chat, cid, p, n_out, created)

    async def _stream(self, request, call, track, chat, cid, p, row, created):
        """Relay the Submit's tokens as they come (streamed: one SSE event each); returns
        (response or None, scheduler error or None, tokens)."""
        # Every token's event is the same bytes (one `created` per completion, as OpenAI's), so
        # they are encoded once, not once per token on the event loop that serves every stream.
        first_event = _sse(self._chunk(cid, chat, TOKEN_TEXT, first=True, created=created))
        token_event = _sse(self._chunk(cid, chat, TOKEN_TEXT, created=created))
        resp, n_out = None, 0
        try:
            async for chunk in call:
                n = track.add(chunk, tokens.received(call))
                if not n or not p.stream:
                    n_out += n
                    continue
                if resp is None:
                    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                    await resp.prepare(request)
                now = time.time()        # handed to the HTTP connection (the write may
                row["first_token"] = row["first_token"] or now   # return after the client
                row["last_token"] = now                         # has read it)
                await resp.write(first_event + token_event * (n - 1) if n_out == 0
                                 else token_event * n)
                n_out += n
        except grpc.aio.AioRpcError as e:
            return resp, f"scheduler: {e.code().name}: {e.details()}", n_out
        except ConnectionError as e:
            row["n_tokens"] = n_out
            raise _Disconnected(resp) from e
        except asyncio.CancelledError:
            row["n_tokens"] = n_out
            raise
        return resp, None, n_out

    async def _failed(self, resp, row, error):
        """A request the scheduler failed: 502 before its first token, an error event after."""
        err = HttpError(502, f"the request failed: {error}", type_="server_error",
                        code="upstream_failed")
        self._log(row, "failed", 502 if resp is None else 200, error)
        if resp is None:
            return web.json_response(err.body(), status=502)
        await resp.write(_sse(err.body()) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _reply(self, resp, row, chat, cid, p, n_out, created):
        """The end of a request served in full: the whole reply, or the stream's tail."""
        if not p.stream:
            text = TOKEN_TEXT * n_out
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "logprobs": None, "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            row["first_token"] = row["last_token"] = time.time()     # the whole reply at once
            self._log(row, "ok", 200)
            return web.json_response({
                "id": cid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": [choice],
                "usage": self._usage(p, n_out)})
        tail = _sse(self._chunk(cid, chat, finish="length", created=created))
        if p.include_usage:
            tail += _sse({"id": cid, "object": "chat.completion.chunk" if chat else
                          "text_completion", "created": created, "model": self.model,
                          "choices": [], "usage": self._usage(p, n_out)})
        await resp.write(tail + b"data: [DONE]\n\n")
        await resp.write_eof()
        self._log(row, "ok", 200)
        return resp

    async def watch_lag(self):
        """Sample the event loop's lateness (a sleep's overshoot) until cancelled: a request
        that arrives while the loop is busy with other streams waits about that long before
        its handler runs (summary row `loop_lag_ms`)."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(LAG_PERIOD_S)
            self.lag_s.append(loop.time() - t - LAG_PERIOD_S)

    def _lag_summary(self):
        if not self.lag_s:
            return None
        lag = sorted(self.lag_s)
        return {"samples": len(lag), **{f"p{round(q * 100)}": _quantile_ms(lag, q)
                                         for q in (0.5, 0.9, 0.99)},
                "max": _quantile_ms(lag, 1.0)}

    async def stop(self):
        """Cancel what is still in flight (recorded as ended by the run), close the records."""
        self.stopping = True
        tasks = list(self.active)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self):
        self.rec.write({"ev": "finished", "time": time.time()})
        self.rec.close()
        self.http.write({"ev": "summary", "time": time.time(), "outcomes": dict(self.counts),
                         "http_status": {str(k): v for k, v in self.codes.items()},
                         "loop_lag_ms": self._lag_summary()})
        self.http.close()


async def serve(door, host, port):
    """An aiohttp runner serving `door` on host:port; handlers are cancelled on disconnect."""
    runner = web.AppRunner(door.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


async def main_async(args):
    rt = common.load_runtime(args.runtime)
    log = common.setup_logging(args.name)
    fd = rt.frontdoor
    channel = grpc.aio.insecure_channel(rt.instance("scheduler").addr,
                                        options=common.grpc_options())
    await asyncio.wait_for(channel.channel_ready(), 10.0)
    streams = await tokens.TokenStreams(
        args.name, [i for i in rt.instances.values() if i.may_decode], log).start()
    door = FrontDoor(tokens.DirectStub(pbg.SchedulerStub(channel), streams), fd.model, fd.max_context, args.out,
                     args.http_log, rt.request_timeout_s,
                     first_id=args.first_id,
                     first_request_path=args.first_request_file and pathlib.Path(
                         args.first_request_file))
    host = rt.instance(args.host).ip
    runner = await serve(door, host, fd.port)
    lag = asyncio.create_task(door.watch_lag())
    common.mark_ready(rt, args.name)
    log.info("front door on http://%s:%s/v1 (model %s)", host, fd.port, fd.model)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    lag.cancel()
    await door.stop()
    await runner.cleanup()
    door.close()
    await streams.close()
    await channel.close()
    log.info("front door stopped: %s", dict(door.counts))


def main():
    p = argparse.ArgumentParser(description="PrfaaS testbed OpenAI-compatible front door")
    p.add_argument("--runtime", required=True)
    p.add_argument("--name", default="frontdoor")
    p.add_argument("--host", default="client", help="the instance whose address it serves on")
    p.add_argument("--out", required=True, help="requests.jsonl to append to")
    p.add_argument("--http-log", required=True, help="frontdoor.jsonl to append to")
    p.add_argument("--first-id", type=int, default=0,
                   help="the first request id it gives (after the built-in client's, when "
                        "both drive one deployment: `testbed up --load`)")
    p.add_argument("--first-request-file",
                   help="written (Unix time) when the first completion request arrives")
    args = p.parse_args()
    common.die_with_orchestrator()
    eventloop.run(main_async(args))


if __name__ == "__main__":
    main()
