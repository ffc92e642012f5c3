"""Calibration, the measuring side: one vLLM server on loopback, timed from its HTTP client.

    testbed calibrate -> calibrun (this) -> calibfit (fit, write the profile)

One server (`workers.vllm_server`, the launcher `model.engine: vllm` uses, in the vLLM venv)
is started on 127.0.0.1 and awaited; then, within a time budget (points left when it runs out
are skipped and said so), as a client measures it:

- T_prefill(l): wall time of a `max_tokens: 1` completion of l random token ids (a fresh
  prompt every time, so nothing is in the prefix cache), `repeats` times per length; with a
  cached prefix: a prompt whose first half (whole blocks) repeats the prompt just sent;
- T_step(B, C): B streams started together, each a fresh prompt of c tokens and `steps`
  greedy tokens (`ignore_eos`); the step time is the median gap between the streamed tokens
  while all B are in the batch (after the last one's first token, before the first one's
  last), and C = B x (c + the mean token index of those gaps); the median of `repeats` such
  runs is the point fitted (each run is in the CSV as `step_run`);
- S_kv: the model config's layers x KV heads x head dim x 2 x dtype bytes per token;
- decode memory: the server's KV cache blocks (`vllm:cache_config_info` on /metrics) x block
  size x bytes per token;
- with `pair` (`--pair CPUS`): a second server, role decode, and the KV pull between the two
  (testbed/calibpair.py), the decode server up through all of the measuring.

Real-world seconds throughout: vLLM runs at real speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import random
import re
import statistics
import time

from testbed import calibpair, eventloop
from testbed.ports import free_ports
from testbed.calibfit import Measurements, Sample
from workers import vllm_api
from workers import vllm_server
from workers.vllm_server import ServerFailed, ServerSpec, VllmServer  # noqa: F401 (ServerFailed: re-exported)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{(.*)\}', re.M)


def model_shape(model_dir, dtype):
    """(KV bytes per token, layers, weight bytes) from the model directory."""
    d = pathlib.Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    layers = cfg["num_hidden_layers"]
    weights = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    return layers * kv_heads * head_dim * 2 * DTYPE_BYTES[dtype], layers, weights


def cache_blocks(metrics_text):
    """(KV cache blocks, block size) from vLLM's /metrics, (0, 16) if it does not say."""
    m = _CACHE_INFO.search(metrics_text)
    if not m:
        return 0, 16
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    blocks = labels.get("num_gpu_blocks") or labels.get("num_cpu_blocks") or "0"
    return int(float(blocks)) if blocks not in ("", "None") else 0, int(labels.get("block_size", 16))


class Prober:
    """Times requests against one server (aiohttp session, the model's name, fresh prompts)."""

    def __init__(self, session, url, model, vocab, seed):
        self.session, self.url, self.model = session, url, model
        self.vocab, self.rng = vocab, random.Random(seed)

    def prompt(self, n):
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    async def prefill_s(self, ids):
        t0 = time.perf_counter()
        await vllm_api.generate(self.session, self.url, self.model, ids, 1)
        return time.perf_counter() - t0

    async def stream_times(self, ids, steps):
        """perf_counter() at every streamed event of one greedy completion, one per token."""
        body = vllm_api.completion(ids, steps, model=self.model, stream=True)
        times = []
        async with self.session.post(f"{self.url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise vllm_api.VllmRequestError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.strip()
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    n = sum(len(c.get("token_ids") or [0])
                            for c in json.loads(line[5:]).get("choices", ()))
                    times += [time.perf_counter()] * max(1, n)
        return times

    async def step(self, batch, length, steps):
        """(median step seconds while all `batch` streams are batched, context tokens)."""
        runs = await asyncio.gather(*(self.stream_times(self.prompt(length), steps)
                                      for _ in range(batch)))
        lo, hi = max(t[0] for t in runs), min(t[-1] for t in runs)
        gaps, idx = [], []
        for t in runs:
            for i in range(1, len(t)):
                if t[i - 1] >= lo and t[i] <= hi and t[i] > t[i - 1]:
                    gaps.append(t[i] - t[i - 1])
                    idx.append(i)
        if not gaps:
            return None
        return statistics.median(gaps), batch * (length + round(statistics.mean(idx)))


async def measure(p, plan, m, progress, deadline):
    """Run `plan` ({prefill_lengths, repeats, cached, batches, contexts, steps}) into `m`."""
    skipped = []
    for rep, l in calibpair.within(plan, deadline, skipped, "prefill"):
        first = p.prompt(l)
        t = await p.prefill_s(first)
        m.samples.append(Sample("prefill", length=l, seconds=t, repeat=rep))
        progress(f"prefill {l:>6} tokens: {t * 1e3:8.1f} ms (repeat {rep + 1})")
        if plan["cached"] and l >= 4 * m.block_tokens:
            cached = (l // 2) // m.block_tokens * m.block_tokens
            t = await p.prefill_s(first[:cached] + p.prompt(l - cached))
            m.samples.append(Sample("prefill", length=l, cached=cached, seconds=t,
                                    repeat=rep))
            progress(f"prefill {l:>6} tokens, {cached} cached: {t * 1e3:8.1f} ms")
    for b in plan["batches"]:
        for c in plan["contexts"]:
            if time.monotonic() > deadline:
                skipped.append(f"step B={b} c={c}")
                continue
            got = [g for g in [await p.step(b, c, plan["steps"])
                               for _ in range(plan["step_repeats"])] if g is not None]
            if not got:
                skipped.append(f"step B={b} c={c} (no overlap)")
                continue
            m.samples += [Sample("step_run", batch=b, context=ctx, seconds=t, repeat=i)
                          for i, (t, ctx) in enumerate(got)]
            t = statistics.median(t for t, _ in got)
            ctx = round(statistics.mean(ctx for _, ctx in got))
            m.samples.append(Sample("step", batch=b, context=ctx, seconds=t))
            progress(f"decode step B={b} context {ctx:>6}: {t * 1e3:7.2f} ms (median of "
                     f"{len(got)})")
    return skipped


class Running:
    """A vLLM server started by someone else (`testbed calibrate --url`): only its /health."""

    def __init__(self, url):
        self.url = url.rstrip("/")

    async def wait_healthy(self, timeout_s, session):
        return await vllm_server.wait_healthy(session, self.url, timeout_s)


async def _session_run(server, url, plan, m, progress, budget_s, seed, pair=None):
    import aiohttp     # reason: the testbed's HTTP client; only the command needs it here
    timeout = aiohttp.ClientTimeout(total=None, sock_read=max(60.0, budget_s))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start_s = await server.wait_healthy(plan["start_timeout_s"], session)
        progress(f"vLLM server healthy after {start_s:.1f} s")
        if pair is not None:
            pair_s = await pair.wait_healthy(plan["start_timeout_s"], session)
            progress(f"decode server (--pair) healthy after {pair_s:.1f} s")
        m.info["start_up_s"] = round(start_s, 1)
        model = await vllm_api.model_name(session, url)
        async with session.get(f"{url}/metrics") as r:
            m.kv_blocks, m.block_tokens = cache_blocks(await r.text())
        p = Prober(session, url, model, plan["vocab"], seed)
        await p.prefill_s(p.prompt(64))                  # warm-up, not measured
        t0 = time.monotonic()
        skipped = await measure(p, plan, m, progress, t0 + budget_s)
        if pair is not None:
            skipped += await calibpair.measure(p, pair.spec.url, plan, m, progress,
                                               t0 + budget_s)
        m.info["measure_s"] = round(time.monotonic() - t0, 1)
        return skipped


def run(python, model_dir, plan, log_path, progress, budget_s, seed=0, url=None):
    """Start one server, measure, stop it (also on error or Ctrl-C); (Measurements, skipped).
    With `url`, measure the server already running there instead (it loaded `model_dir`; its
    settings are its own, so the plan's server keys are not recorded as its)."""
    dtype = plan["dtype"]
    bpt, layers, weights = model_shape(model_dir, dtype)
    vocab = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]
    plan = {**plan, "vocab": max(2, vocab - 3)}         # the writer's specials sit at the top
    server_keys = ("max_model_len", "max_num_seqs", "kv_cache_space_gib", "cpus")
    m = Measurements(kv_bytes_per_token=bpt, layers=layers, weights_bytes=weights,
                     bs_max=plan["max_num_seqs"],
                     info={"model": str(model_dir), "dtype": dtype,
                           "server": {"url": url} if url else
                           {k: plan[k] for k in server_keys}})
    if url:
        skipped = eventloop.run(_session_run(Running(url), url.rstrip("/"), plan, m, progress,
                                             budget_s, seed))
        m.info["skipped"] = skipped
        return m, skipped
    spec = _spec(python, model_dir, plan, "both", plan["cpus"], seed)
    servers = [VllmServer(spec, log_path)]
    if plan.get("pair"):
        m.info["server"]["pair_cpus"] = plan["pair"]
        servers.append(VllmServer(_spec(python, model_dir, plan, "decode", plan["pair"], seed),
                                  pathlib.Path(log_path).with_suffix(".decode.log")))
    try:
        for server in servers:
            server.start()
        skipped = eventloop.run(_session_run(servers[0], spec.url, plan, m, progress, budget_s,
                                             seed, servers[1] if len(servers) > 1 else None))
    finally:
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()
    m.info["skipped"] = skipped
    return m, skipped


def _spec(python, model_dir, plan, role, cpus, seed):
    port, side_port = free_ports(2)
    return ServerSpec(python=python, model_dir=str(model_dir), role=role, host="127.0.0.1",
                      port=port, side_port=side_port, dtype=plan["dtype"],
                      max_model_len=plan["max_model_len"], max_num_seqs=plan["max_num_seqs"],
                      kv_cache_space_gib=plan["kv_cache_space_gib"], cpus=cpus, seed=seed)
