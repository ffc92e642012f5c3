"""The profile engine: an accelerator emulated by its profile.

Prefill waits the profiled `T_prefill(l) / scale.time` (with P prefix tokens cached,
`T(l) - T(P) + T(0)`, docs/cache.md) and produces `S_kv(l) * scale.bytes` real bytes (less the
MLA KV of the prefix the decode side takes from its own pool), handed to the sender in
`stream_chunks` pieces as the prefill progresses (layer-wise pipelining: piece i is ready at
(i+1)/n of the compute time). A decode step takes `T_step(B, C) / scale.time` for a batch of B
requests holding C context tokens (the profile's `DecodeModel`; `model.decode_model: constant`
gives the paper's T_decode whatever the batch), and a request joins the batch only once its KV
fits the instance's decode memory; a request whose KV is larger than all of it fails with
that reason (`refusal`), as vLLM refuses it.
"""

import asyncio
import os
import time

from testbed import profile as profiles
from testbed import units
from workers.clock import wall_of
from workers.engine import PacedDecodeEngine, PrefillEngine

# Payload bytes are sent from one buffer (memoryview slices): no per-request allocation. It is
# a 64 KiB random block repeated: drawing 4 MiB from os.urandom took 17 ms of CPU in each of a
# deployment's prefill workers at start-up; nothing on the path compresses or looks at them.
_BUF = None
_BLOCK = 1 << 16


def _payload(n):
    global _BUF
    if _BUF is None or len(_BUF) < n:
        size = max(n, 4 << 20)
        _BUF = memoryview(os.urandom(_BLOCK) * (size // _BLOCK + 1))
    return _BUF[:n]


class ProfilePrefillEngine(PrefillEngine):
    frames_checksummed = False      # emulated KV bytes: the kvwire frame's crc32 checks them

    def __init__(self, rt, inst):
        self.profile = profiles.load(rt.profile)
        self.accelerator = inst.accelerator
        self.scale = rt.scale
        self.chunks = max(1, int(self.profile.stream_chunks))
        # kv_transfer: pull -> the sender's wait per transfer beyond the link (workers/kvpull.py)
        self.pull_latency_s = (self.scale.emulated_s(self.profile.kv_pull_latency_s)
                               if self.profile.kv_transfer == "pull" else None)
        self.clock_factor = 1.0    # > 1: a slowed instance (the `slow` fault, workers/control.py)
        self.free_at = 0.0         # scheduled end of the last compute (monotonic)
        _payload(1)                # draw the payload buffer in start-up, not on a request's clock

    def compute_s(self, input_len, cached=0):
        """T_prefill(L | P cached) / scale.time (`Profile.t_prefill_cached`, docs/cache.md)."""
        return self.scale.emulated_s(self.profile.t_prefill_cached(
            self.accelerator, max(input_len, 1), cached))

    def kv_bytes(self, input_len, decode_cached=0):
        """What the decode instance still needs: S_kv(L) less the MLA KV of the `decode_cached`
        prefix tokens it takes from its own cluster's pool (the recurrent state always ships)."""
        a, b = self.profile.kv_size.coeffs[:2]
        full = a + b * max(input_len, 1) - b * min(decode_cached, input_len)
        return max(1, int(round(self.scale.emulated_bytes(full))))

    async def prefill(self, request, emit, arrived=None):
        """Emulate one prefill; `emit(seq, payload, last)` is called as each piece is ready.

        The instance keeps its schedule: a request that `arrived` while the previous one
        computed starts when that compute was due to end, not when the event loop got round to
        it (a timer fires up to a millisecond late), so queued prefills run back to back at the
        profiled rate. Pieces are emitted when ready or later, never earlier."""
        t_compute = self.compute_s(request.input_len, request.cached_len)
        size = self.kv_bytes(request.input_len, request.decode_cached_len)
        n = min(self.chunks, size)
        now = time.monotonic()
        ready_at = now if arrived is None else min(now, max(arrived, self.free_at))
        start = wall_of(ready_at)
        sent, model_s, done = 0, 0.0, False
        try:
            for i in range(n):
                # Each piece's compute at the clock factor in force when it starts.
                model_s += t_compute / n * self.clock_factor
                ready_at += t_compute / n * self.clock_factor
                delay = ready_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                piece = size // n + (1 if i < size % n else 0)
                emit(i, _payload(piece), i == n - 1)
                sent += piece
            done = True
        finally:
            # A cancelled (or failed) prefill computed until now, not to its scheduled end;
            # left unset, the next queued request would start back-dated into that time.
            self.free_at = ready_at if done else min(ready_at, time.monotonic())
        return {"kv_bytes": sent, "start": start, "model_s": model_s}


class ProfileDecodeEngine(PacedDecodeEngine):
    def __init__(self, rt, inst):
        self.profile = profiles.load(rt.profile)
        self.scale = rt.scale
        self.step_s = rt.decode.step_s
        self.bs_max = rt.decode.bs_max
        self.model = rt.decode.model()
        self.reserved = 0.0          # real-world KV bytes of the requests in the batch
        self.clock_factor = 1.0    # > 1: a slowed instance (the `slow` fault, workers/control.py)

    def step_seconds(self, batch, context_tokens):
        """Emulated duration of one step of `batch` requests holding `context_tokens`."""
        return self.scale.emulated_s(self.model.step_time(batch, context_tokens))

    def kv_need(self, input_len, output_len):
        """Real-world bytes a request holds in decode memory (its KV at full length)."""
        return float(self.profile.s_kv(input_len + output_len))

    def fits(self, need):
        cap = self.model.kv_capacity
        return cap is None or self.reserved + need <= cap

    def refusal(self, need):
        """Why a request needing `need` bytes can never join a batch here, or '': its KV is
        larger than the whole decode memory (vLLM refuses such a request rather than run it
        alone; a batch of one would hold more KV than the instance has)."""
        cap = self.model.kv_capacity
        if cap is None or need <= cap:
            return ""
        # One reason per instance, whatever the request, so that summary.json counts them.
        return (f"KV of input + output larger than the decode memory "
                f"({units.fmt_bytes(cap)}, model.decode_kv_capacity); never batched")

    def reserve(self, need):
        self.reserved += need

    def free(self, need):
        self.reserved = max(0.0, self.reserved - need)

    def admit(self, request_id, state):
        pass

    def step(self, request_ids):
        """One decode step for the batch; the profile engine produces no token ids."""
        return {}

    def release(self, request_id):
        pass
