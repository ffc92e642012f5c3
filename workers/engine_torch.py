"""The torch engine: a real (tiny) KDA + MLA hybrid model behind the worker interfaces.

Where the profile engine (`engine_profile.py`) waits the profiled time and sends random bytes,
these engines compute: `TorchPrefillEngine` prefills the request's tokens and streams each
layer's real state (`workers.model.state_wire` frames) as soon as that layer is done, while the
next layers compute (the prefill runs in a worker thread; torch releases the GIL, so the event
loop keeps sending). `TorchDecodeEngine` assembles and verifies the frames per request, admits
the state and runs continuous-batching decode steps over requests of any lengths.

Prompts: a request carries lengths, not text, so its tokens are drawn from a generator seeded
by (seed, request id); `tokens_scale` divides the length (a trace of 100K-token prompts on a
tiny model). A cached prefix is not modelled by this engine: the uncached tokens are the prompt.

Frames: `prefill(request, send_layer)` calls `send_layer(layer_idx, frames)` once per layer and
then `send_layer(None, [trailer])` (first token and length; the sender marks it last). Frames
are memoryviews of the state tensors, freed when the call returns or the transfer fails.
`emit_sender(emit)` adapts that to a per-frame `emit(seq, payload, last)` callback.
"""

import asyncio
import concurrent.futures
import inspect
import itertools
import threading
import time

import torch

from workers.model.config import HybridConfig
from workers.model.hybrid import HybridModel, RequestState
from workers.model.state_wire import (DEFAULT_CHUNK_BYTES, LayerAssembler, StateWireError,
                                      encode_layer, encode_trailer)


def _field(request, name, default=None):
    if isinstance(request, dict):
        return request.get(name, default)
    return getattr(request, name, default)


def _config(cfg):
    return cfg if isinstance(cfg, HybridConfig) else HybridConfig.from_dict(dict(cfg or {}))


def request_tokens(request, vocab, seed=0, tokens_scale=1.0):
    """The request's token ids: its own `tokens`, else `input_len - cached_len` seeded ones."""
    toks = _field(request, "tokens")
    if toks is not None and len(toks):
        return torch.as_tensor(list(toks), dtype=torch.long)
    n = int(_field(request, "input_len", 0)) - int(_field(request, "cached_len", 0) or 0)
    n = max(1, round(n / tokens_scale))
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(_field(request, "id", 0)))
    return torch.randint(0, vocab, (n,), generator=g)


def emit_sender(emit):
    """A `send_layer` that hands each frame to `emit(seq, payload, last)` (the spine's form)."""
    seq = itertools.count()

    def send_layer(layer_idx, frames):
        for j, f in enumerate(frames):
            emit(next(seq), f, layer_idx is None and j == len(frames) - 1)
    return send_layer


class TorchPrefillEngine:
    """Prefill on the real model, streaming each layer's state as it becomes final."""

    def __init__(self, cfg=None, device="auto", chunk_bytes=DEFAULT_CHUNK_BYTES, seed=0,
                 tokens_scale=1.0, threads=None):
        self.cfg = _config(cfg)
        if threads:
            torch.set_num_threads(threads)
        self.model = HybridModel(self.cfg, device)
        self.device = self.model.device
        self.chunk_bytes = chunk_bytes
        self.seed, self.tokens_scale = seed, tokens_scale
        # One compute thread: an instance prefills one request at a time.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")

    def close(self):
        self._pool.shutdown(wait=False)

    async def prefill(self, request, send_layer):
        """Prefill `request`; `send_layer` (sync or async) gets each layer's frames in order.

        Returns timings (time.time() seconds) and bytes: compute start/end, per layer when its
        state was ready and when its frames were handed over, and how much of the transfer
        overlapped the compute.
        """
        tokens = request_tokens(request, self.cfg.vocab, self.seed, self.tokens_scale)
        n = self.cfg.n_layers
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()
        stop = threading.Event()

        def on_layer(i, kind, tensors):
            if stop.is_set():
                return
            frames = encode_layer(i, tensors, n, kind, self.chunk_bytes)
            loop.call_soon_threadsafe(queue.put_nowait, (i, frames, time.time()))

        def compute():
            t0 = time.time()
            try:
                logits, st = self.model.prefill(tokens, on_layer=on_layer)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return int(logits.argmax()), st.length, st.nbytes(), t0, time.time()
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        work = loop.run_in_executor(self._pool, compute)
        layers, kv_bytes = [], 0
        try:
            while (item := await queue.get()) is not None:
                i, frames, t_ready = item
                t_send = time.time()
                size = sum(memoryview(f).nbytes for f in frames)
                await _call(send_layer, i, frames)
                del frames, item                      # the transfer buffer of this layer
                layers.append({"layer": i, "ready": t_ready, "send_start": t_send,
                               "send_end": time.time(), "bytes": size})
                kv_bytes += size
            first, length, state_bytes, t0, t1 = await work
            trailer = encode_trailer(first, length, n)
            await _call(send_layer, None, [trailer])
            kv_bytes += len(trailer)
        except BaseException:
            stop.set()
            while not queue.empty():
                queue.get_nowait()
            if not work.done():
                await asyncio.shield(work)
            raise
        overlap = sum(max(0.0, min(r["send_end"], t1) - max(r["send_start"], t0)) for r in layers)
        return {"tokens": int(len(tokens)), "first_token": first, "kv_bytes": kv_bytes,
                "state_bytes": state_bytes, "compute_start": t0, "compute_end": t1,
                "prefill_s": t1 - t0, "send_start": layers[0]["send_start"] if layers else t1,
                "send_end": time.time(), "overlap_s": overlap, "layers": layers}


async def _call(fn, *args):
    res = fn(*args)
    if inspect.isawaitable(res):
        await res


class TorchDecodeEngine:
    """Continuous-batching greedy decode over states assembled from the wire.

    `receive(rid, seq, flags, payload)` feeds a request's frames (the decode worker's KV
    socket calls it; its `frame_buffer` lets the socket read data chunks straight into the
    state tensors, so `receive` need not copy them); `admit` turns the assembled state into a
    live request; `step` advances a batch by one token each; `release` frees everything held
    for a request.
    """

    def __init__(self, cfg=None, device="auto", bs_max=20, step_s=0.0, threads=None):
        self.cfg = _config(cfg)
        if threads:
            torch.set_num_threads(threads)
        self.model = HybridModel(self.cfg, device)
        self.device = self.model.device
        self.bs_max = bs_max
        self.step_s = step_s             # no emulated pacing: the computation is the step
        self.assemblers = {}
        self.errors = {}
        self.live = {}                   # rid -> [RequestState, next input token]
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode")

    # ---- receiving ----
    def receive(self, request_id, seq, flags, payload):
        """One kvwire frame of a request's state. FLAG_ABORT (2) drops what arrived."""
        if flags & 2:
            self.assemblers.pop(request_id, None)
            return
        if request_id in self.errors:
            return
        asm = self.assemblers.get(request_id)
        if asm is None:
            asm = self.assemblers[request_id] = LayerAssembler(self.cfg.n_layers,
                                                               self.cfg.layer_kinds)
        try:
            if payload:
                asm.feed(payload)
        except StateWireError as e:
            self.errors[request_id] = str(e)
            self.assemblers.pop(request_id, None)

    def frame_buffer(self, request_id, seq, flags, length):
        """Where kvwire should receive a frame's payload: the slice of the state tensor it
        fills (then `receive` does not copy it), or None for a buffer of kvwire's own."""
        asm = self.assemblers.get(request_id)
        if asm is None or flags & 2 or request_id in self.errors:
            return None
        return asm.buffer_for(length)

    def error(self, request_id):
        """Why a request's state is unusable (corrupt, mismatched), or None."""
        return self.errors.get(request_id)

    # ---- lifecycle ----
    def admit(self, request_id, assembled_state=None, first_token=None):
        """Make a request live. `assembled_state`: per-layer dicts, a `RequestState`, or None
        (use what `receive` assembled; any other object, such as a worker's slot, counts as
        None). Raises `StateWireError` with the reason when the state is corrupt or incomplete.
        """
        length = None
        if not isinstance(assembled_state, (list, tuple, RequestState)):
            if request_id in self.errors:
                raise StateWireError(self.errors.pop(request_id))
            asm = self.assemblers.pop(request_id, None)
            if asm is None:
                raise StateWireError(f"request {request_id}: no state received")
            assembled_state = asm.states()
            if asm.trailer:
                length = asm.trailer["length"]
                first_token = asm.trailer["first_token"] if first_token is None else first_token
        if first_token is None:
            raise StateWireError(f"request {request_id}: no first token (no trailer frame)")
        st = assembled_state if isinstance(assembled_state, RequestState) else \
            RequestState.from_layer_tensors(self.cfg, list(assembled_state), self.device, length)
        self.live[request_id] = [st, int(first_token)]

    def step(self, request_ids):
        """One greedy token for each live request in `request_ids`: {request_id: token_id}."""
        rids = [r for r in request_ids if r in self.live]
        if not rids:
            return {}
        states = [self.live[r][0] for r in rids]
        logits = self.model.decode_step(states, [self.live[r][1] for r in rids])
        nxt = logits.argmax(-1).tolist()
        for r, t in zip(rids, nxt):
            self.live[r][1] = t
        return dict(zip(rids, nxt))

    def emit_step(self, request_ids):
        """One decode step, returning the token each request *emits* at it: the token it feeds
        in (the first is the one its prefill predicted) while the step computes the next one.
        This is what the decode worker streams, so a request's output starts with prefill's
        token, as in PD-disaggregated serving."""
        emitted = {r: self.live[r][1] for r in request_ids if r in self.live}
        self.step(list(emitted))
        return emitted

    async def aemit_step(self, request_ids):
        """`emit_step` in the engine's thread, so the event loop keeps receiving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.emit_step,
                                                                list(request_ids))

    async def astep(self, request_ids):
        """`step` in the engine's thread, so the event loop keeps receiving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.step,
                                                                list(request_ids))

    def release(self, request_id):
        self.live.pop(request_id, None)
        self.assemblers.pop(request_id, None)
        self.errors.pop(request_id, None)

    def resident_bytes(self, request_id):
        """Bytes of state held for a live request (its KDA states and MLA caches)."""
        live = self.live.get(request_id)
        return live[0].nbytes() if live else 0

    def close(self):
        self._pool.shutdown(wait=False)
