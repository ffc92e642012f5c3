"""Calibration of the KV pull between two servers: `testbed calibrate --pair CPUS`.

    testbed calibrate -> calibrun (measures; with --pair, this too) -> calibfit (writes)

One server cannot show what a disaggregated engine pays to move the KV: vLLM's NixlConnector
pulls it after the prefill (the decode instance reads the finished blocks), and the pull has a
fixed cost per transfer of its own (the decode server's request handling, NIXL's read set-up
and completion notice) besides the bytes and the link's round trip. With `--pair`, calibrun
starts a second server (role decode, the same connector and plugin, on CPUS) beside the
measured one and, on loopback, times for several prompt lengths:

- the prefill on the first server (`max_tokens: 1`, `do_remote_decode`), and
- the hand-off: from the prefill's reply to the first token the decode server streams for
  the same prompt with the returned `kv_transfer_params` (its connector pulls the KV, then
  one decode step computes the first token).

`testbed.calibfit.pull_fit` subtracts that one step (T_step(1, l) of the decode fit) from every hand-off and fits
what is left to a + b*l: `a` is the connector's fixed cost per transfer, written into the
profile as `kv_pull_latency` with `kv_transfer: pull` (workers/kvpull.py waits it, plus the
emulated link's own round trip, and then sends the bytes across the link); `b`, the per-token
cost on loopback (where the link costs next to nothing), goes into `calibration:` only: across
a WAN the link's rate takes its place. The first pull to a new peer (NIXL's handshake) is a
warm-up, not measured.

The prefills of the pair's runs are timed with the decode server up on the other CPU, as in
a deployment: they are `prefill` samples as well (calibfit fits them with the rest).
"""

from __future__ import annotations

import time

from testbed.calibfit import Sample
from workers import vllm_api


async def handoff(p, url_b, ids):
    """(prefill seconds, seconds from the prefill's reply to the decode server's first
    token) of one prompt, the KV pulled by the decode server's connector."""
    t0 = time.perf_counter()
    params = await vllm_api.prefill(p.session, p.url, p.model, ids)
    t1 = time.perf_counter()
    async for _ in vllm_api.decode_stream(p.session, url_b, p.model, ids, 2, params):
        return t1 - t0, time.perf_counter() - t1
    raise vllm_api.VllmRequestError(f"{url_b}: no token streamed after the KV pull")


def within(plan, deadline, skipped, what):
    """(repeat, length) of the plan's prefill lengths, `repeats` times, while `deadline`
    (monotonic) has not passed; those after it go to `skipped` as `what length`."""
    for rep in range(plan["repeats"]):
        for l in plan["prefill_lengths"]:
            if time.monotonic() > deadline:
                skipped.append(f"{what} {l}")
            else:
                yield rep, l


async def measure(p, url_b, plan, m, progress, deadline):
    """Hand-offs at the plan's prefill lengths, `repeats` each, into `m`; the points skipped."""
    await handoff(p, url_b, p.prompt(64))      # warm-up: NIXL's handshake with the new peer
    skipped = []
    for rep, l in within(plan, deadline, skipped, "pull"):
        pre, pull = await handoff(p, url_b, p.prompt(l))
        m.samples.append(Sample("prefill", length=l, seconds=pre, repeat=rep))
        m.samples.append(Sample("pull", length=l, seconds=pull, repeat=rep))
        progress(f"pull {l:>6} tokens: prefill {pre * 1e3:7.1f} ms, first token of the "
                 f"decode server {pull * 1e3:7.1f} ms later (repeat {rep + 1})")
    return skipped
