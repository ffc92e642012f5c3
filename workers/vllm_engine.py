"""The vLLM engine behind the prefill and decode workers (`model.engine: vllm`, docs/vllm.md).

A prefill or decode worker keeps its gRPC service, its KV socket and token path; what the
engine does is vLLM's, in the instance's own OpenAI server (`workers/vllm_server.py`):

- prefill (`VllmPrefill`, a `PrefillEngine`): POST the prompt to this instance's server with
  `max_tokens: 1` and `do_remote_decode` (`workers/vllm_api.py`). vLLM computes and keeps the
  KV; the one piece handed to `emit` is the small handle a decode instance pulls it with (the
  returned `kv_transfer_params` and the prompt's token ids, JSON), which the worker sends to
  the decode worker's KV socket as before.
- decode (`workers.decode.VllmDecodeService`): POST the prompt with that handle, streamed;
  vLLM's KV connector pulls the blocks from the prefill instance's IP across the shaped WAN,
  vLLM batches (continuous batching, paged KV, prefix cache: its own), and every streamed
  token is stamped on arrival and goes to the client on the existing token path.

Prompts are token ids drawn from the request: each prefix block id of `Request.prefix_blocks`
maps to the same `cache.block` tokens in every request (vLLM's prefix cache sees real hits),
and the rest is drawn from the request id. The handshake each decode instance needs with each
prefill instance (NIXL's, with a fixed 5 s timeout in vLLM) is warmed before the workload
starts (`warm_pairs`); a pull that still fails mid-run is re-prefilled on the decode instance
(counted: `reprefills`).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import time

from testbed.records import RunDir
from workers import vllm_api as api
from workers import vllm_server as vs
from workers.engine import PrefillEngine

WARM_BACKOFF_S = (1.0, 2.0, 4.0, 8.0)


def cpus_for(rt, name, allowed=None):
    """VLLM_CPU_OMP_THREADS_BIND of instance `name`: `model.vllm.cpus` as given, or, for
    `auto`, one CPU of this machine's each, in the deployment's order, so that two engines'
    OpenMP threads never share a core (oversubscribed, their barriers wait for a descheduled
    thread). With more vLLM instances than CPUs, `auto` binds none (nobind): two engines bound
    to one CPU stalled a prefill for 60 s (docs/vllm.md, "Interference")."""
    if rt.vllm.cpus != "auto":
        return rt.vllm.cpus
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    names = [i.name for i in rt.of_role("prefill", "decode")]
    if len(names) > len(cpus):
        return "nobind"
    return str(cpus[names.index(name)])


def spec_for(rt, inst, role):
    v = rt.vllm
    return vs.ServerSpec(python=v.python, model_dir=v.model_dir, role=role, host=inst.ip,
                         port=v.http_port, side_port=v.side_port, dtype=v.dtype,
                         max_model_len=v.max_model_len, max_num_seqs=v.max_num_seqs,
                         kv_cache_space_gib=v.kv_cache_space_gib, cpus=cpus_for(rt, inst.name),
                         connector=v.connector, seed=rt.seed,
                         nixl_progress_delay_us=v.nixl_progress_delay_us,
                         shm_busy_loop_s=v.shm_busy_loop_s,
                         kv_events_port=v.kv_events_port, kv_replay_port=v.kv_replay_port,
                         kv_events_topic=inst.name)


def vocab_size(model_dir):
    return int(json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"])


def prompt_ids(request, seed, vocab, block):
    """The request's prompt as token ids: shared prefix blocks, then its own tokens."""
    hi = max(2, vocab - 3)          # the writer's last ids are <unk>, <s>, </s>
    ids = []
    for b in request.prefix_blocks:
        if len(ids) + block > request.input_len:
            break
        r = random.Random(f"{seed}:block:{b}")
        ids += [r.randrange(hi) for _ in range(block)]
    r = random.Random(f"{seed}:request:{request.id}")
    ids += [r.randrange(hi) for _ in range(request.input_len - len(ids))]
    return ids


class VllmInstance:
    """This worker's vLLM server and the HTTP session to it; `start` is bounded."""

    def __init__(self, rt, name, inst, role, log):
        self.rt, self.name, self.log = rt, name, log
        rd = RunDir(rt.dir)
        self.pid_file = rd.vllm_file(name)
        self.server = vs.VllmServer(spec_for(rt, inst, role), rd.vllm_log(name))
        self.url = self.server.spec.url
        self.vocab = vocab_size(rt.vllm.model_dir)
        self.session = self.model = None
        self.started_s = 0.0
        self.bytes_at_ready = 0.0   # what the warm-up moved: not the workload's
        self.facts = {}             # what `record` has been told so far

    async def start(self):
        import aiohttp  # reason: aiohttp, only for the vllm engine
        self.server.start()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=10))
        self.started_s = await self.server.wait_healthy(self.rt.vllm.start_timeout_s,
                                                        self.session)
        self.model = await api.model_name(self.session, self.url)
        self.record()
        self.log.info("vLLM server healthy after %.1fs on %s (%d processes)", self.started_s,
                      self.url, len(self.server.pids()))

    def record(self, **extra):
        """vllm/<name>.json: the server's PIDs (the runner puts them on record for `testbed
        clean`), its start-up time and, at the end, the connector's bytes."""
        self.pid_file.parent.mkdir(exist_ok=True)
        self.facts.update(extra)
        data = {"pids": self.server.pids(), "url": self.url, "started_s": self.started_s,
                "cpus": self.server.spec.cpus, **self.facts}
        tmp = self.pid_file.with_name(f".{self.pid_file.name}")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.pid_file)

    async def mark_ready(self, **extra):
        """After the warm-up: the connector's bytes so far are not the workload's."""
        self.bytes_at_ready = await api.connector_bytes(self.session, self.url)
        self.record(**extra)

    def decode_stream(self, ids, max_tokens, params):
        return api.decode_stream(self.session, self.url, self.model, ids, max_tokens, params)

    def prompt(self, request):
        return prompt_ids(request, self.rt.seed, self.vocab, self.rt.cache.block)

    async def close(self):
        if self.session is not None:
            try:
                moved = await asyncio.wait_for(api.connector_bytes(self.session, self.url), 5)
                self.record(connector_bytes=moved - self.bytes_at_ready,
                            warmup_bytes=self.bytes_at_ready, connector=self.rt.vllm.connector)
            except Exception as e:  # the server may be gone (killed): nothing to read
                self.log.warning("no connector bytes from %s: %s", self.url, e)
            await self.session.close()
        await asyncio.to_thread(self.server.stop)


class VllmPrefill(PrefillEngine):
    """Prefill on this instance's vLLM server; the KV handle is the one piece emitted."""

    frames_checksummed = False
    clock_factor = 1.0              # vLLM computes at its own speed: `slow` cannot apply

    def __init__(self, instance: VllmInstance):
        self.vllm = instance

    async def prefill(self, request, emit, arrived=None):
        v = self.vllm
        ids = v.prompt(request)
        start = time.time()
        params, cached = await api.prefill_reply(v.session, v.url, v.model, ids)
        emit(0, json.dumps({"params": params, "ids": ids}).encode(), True)
        return {"kv_bytes": 0, "start": start, "cached_len": cached}


async def warm_pairs(decode: VllmInstance, prefill_urls, deadline_s, log):
    """One tiny request through every prefill -> this decode pair (NIXL's handshake), retried
    with backoff until `deadline_s` (monotonic); the pairs that never worked."""
    ids = list(range(1, 33))
    failed = []
    for url in prefill_urls:
        for attempt in range(1000):
            try:
                params = await api.prefill(decode.session, url, decode.model, ids)
                await api.generate(decode.session, decode.url, decode.model, ids, 1, params)
                break
            except Exception as e:  # not up yet, or the handshake timed out: again
                wait = WARM_BACKOFF_S[min(attempt, len(WARM_BACKOFF_S) - 1)]
                if time.monotonic() + wait > deadline_s:
                    log.warning("KV connector handshake with %s failed: %s", url, e)
                    failed.append(url)
                    break
                await asyncio.sleep(wait)
    return failed


class VllmDecodeEngine:
    """What the decode worker's KV intake hands the handle to (`receive`), and the
    `DecodeEngine` surface the service's shared parts read; vLLM batches for itself."""

    step_s = 0.0
    clock_factor = 1.0

    def __init__(self, instance: VllmInstance):
        self.vllm = instance
        self.bs_max = instance.rt.vllm.max_num_seqs
        self.handles = {}

    def receive(self, request_id, seq, flags, payload):
        self.handles[request_id] = self.handles.get(request_id, b"") + bytes(payload)

    def frame_buffer(self, request_id, seq, flags, length):
        return None

    def error(self, request_id):
        return "" if request_id in self.handles else "no KV handle received"

    def take(self, request_id):
        """(kv_transfer_params, prompt token ids) the prefill instance sent."""
        h = json.loads(self.handles.pop(request_id))
        return h["params"], h["ids"]

    def admit(self, request_id, state=None):
        """vLLM admits it (its own scheduler)."""

    def step(self, request_ids):
        return {}

    def release(self, request_id):
        self.handles.pop(request_id, None)
