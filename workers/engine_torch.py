"""The torch engine: a real (tiny) KDA + MLA hybrid model behind the worker interfaces.

Where the profile engine (`engine_profile.py`) waits the profiled time and sends random bytes,
these engines compute: `TorchPrefillEngine` prefills the request's tokens and streams each
layer's real state (`workers.model.state_wire` frames) as soon as that layer is done, while the
next layers compute (the prefill runs in a worker thread; torch releases the GIL, so the event
loop keeps sending). `TorchDecodeEngine` assembles and verifies the frames per request, admits
the state and runs continuous-batching decode steps over requests of any lengths.

Prompts: a request carries lengths, not text, so its tokens are drawn from seeded generators:
per prefix block from the block's id (`prefix_blocks`, the trace's hash_ids), so requests that
share a prefix share its tokens, the rest from (seed, request id). The run's `scale.tokens` divides
the length (a trace of 100K-token prompts on a tiny model), block-aligned: a cache block of
`block` trace tokens is `prefix.model_block(block, scale)` model tokens.

Prefix cache: `prefill(request, send_layer, prefix_state=..., cached_len=P)` continues from the
cached state of the first P trace tokens (P a multiple of `block`): it computes only the model
tokens after that prefix, attending over the cached MLA latents, KDA starting from the snapshot
(`workers.model.prefix`). What decode gets is either the whole state (`ship="full"`: the prefix
latents travel again, from this instance) or the suffix (`ship="suffix"`: MLA layers from token
P on, the trailer naming the prefix's length and block keys; the decode engine puts the prefix
latents in front from blocks its side holds). `on_block` receives every whole block this
prefill computed, KDA snapshot included, for the pool to keep.

Frames: `prefill` calls `send_layer(layer_idx, frames)` once per layer and then
`send_layer(None, [trailer])` (first token and length; the sender marks it last). Frames are
memoryviews of the state tensors, freed when the call returns or the transfer fails.
`emit_sender(emit)` adapts that to a per-frame `emit(seq, payload, last)` callback.
"""

import asyncio
import concurrent.futures
import inspect
import itertools
import threading
import time

import torch

from testbed.scale import Scale
from testbed.workload.spec import BLOCK_TOKENS
from workers.engine import AssemblingDecodeEngine
from workers.model.config import HybridConfig
from workers.model.hybrid import HybridModel, RequestState
from workers.model.prefix import (BlockState, PrefixError, PrefixState, blocks_of, join_suffix,
                                  model_block, model_tokens)
from workers.model.state_wire import (DEFAULT_CHUNK_BYTES, LayerAssembler, StateWireError,
                                      encode_layer, encode_trailer)

SHIP_MODES = ("full", "suffix")


def _field(request, name, default=None):
    if isinstance(request, dict):
        return request.get(name, default)
    return getattr(request, name, default)


def _config(cfg):
    return cfg if isinstance(cfg, HybridConfig) else HybridConfig.from_dict(dict(cfg or {}))


def request_tokens(request, vocab, seed=0, scale: Scale = Scale(), block=BLOCK_TOKENS):
    """The request's whole prompt as model token ids: its own `tokens`, else
    `model_tokens(input_len)` seeded ones -- block j of the request's `prefix_blocks` drawn from
    (seed, that block id), so a shared prefix is the same tokens in every request that has it;
    the tokens after those blocks from (seed, request id)."""
    toks = _field(request, "tokens")
    if toks is not None and len(toks):
        return torch.as_tensor(list(toks), dtype=torch.long)
    n = model_tokens(int(_field(request, "input_len", 0)), block, scale)
    mb = model_block(block, scale)
    parts = []
    for h in list(_field(request, "prefix_blocks", None) or [])[:-(-n // mb)]:
        g = torch.Generator().manual_seed((seed * 1_000_003 + 2 * int(h) + 1) % (1 << 63))
        parts.append(torch.randint(0, vocab, (mb,), generator=g))
    done = sum(len(p) for p in parts)
    if done < n:
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(_field(request, "id", 0)))
        parts.append(torch.randint(0, vocab, (n - done,), generator=g))
    return torch.cat(parts)[:n]


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
                 scale: Scale = Scale(), threads=None, block=BLOCK_TOKENS, ship="full",
                 snapshot_every=1):
        self.cfg = _config(cfg)
        if ship not in SHIP_MODES:
            raise ValueError(f"ship: expected one of {SHIP_MODES}, got {ship!r}")
        self.block, self.ship, self.snapshot_every = int(block), ship, int(snapshot_every)
        self.model_block = model_block(self.block, scale)
        if threads:
            torch.set_num_threads(threads)
        self.model = HybridModel(self.cfg, device)
        self.device = self.model.device
        self.chunk_bytes = chunk_bytes
        self.seed, self.scale = seed, scale
        # One compute thread: an instance prefills one request at a time.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")

    def close(self):
        self._pool.shutdown(wait=False)

    def plan_prefix(self, request, prefix_state=None, cached_len=None):
        """(cached model tokens, `PrefixState` or None, prompt tokens) for a prefill.

        `cached_len` (default: the request's) counts trace tokens, a multiple of `block`. A
        prompt cached whole still computes its last block (partial or not): its first token's
        logits need a forward pass. `prefix_state`: a `PrefixState` of exactly that many model
        tokens, or the pool's blocks (`BlockState`s or their bytes) from block 0 on.
        """
        tokens = request_tokens(request, self.cfg.vocab, self.seed, self.scale, self.block)
        cached = int(_field(request, "cached_len", 0) or 0) if cached_len is None else int(cached_len)
        if cached < 0 or cached % self.block:
            raise PrefixError(f"cached_len {cached} is not a multiple of the block "
                              f"({self.block} tokens)")
        mb = self.model_block
        P = min(cached // self.block, (len(tokens) - 1) // mb) * mb
        if P == 0:
            return 0, None, tokens
        if prefix_state is None:
            raise PrefixError(f"request {_field(request, 'id')}: cached_len {cached} but no "
                              f"prefix state given")
        if not isinstance(prefix_state, PrefixState):
            blocks = list(prefix_state)
            if len(blocks) < P // mb:
                raise PrefixError(f"{P // mb} cached blocks needed, {len(blocks)} given")
            prefix_state = PrefixState.from_blocks(self.cfg, blocks[:P // mb])
        if prefix_state.length != P:
            raise PrefixError(f"prefix state holds {prefix_state.length} model tokens, the "
                              f"prefill continues at {P}")
        return P, prefix_state, tokens

    async def prefill(self, request, send_layer, prefix_state=None, cached_len=None, ship=None,
                      on_block=None):
        """Prefill `request`; `send_layer` (sync or async) gets each layer's frames in order.

        With a cached prefix (`cached_len`, `prefix_state`; see `plan_prefix`) only the tokens
        after it are computed. `ship` ("full" | "suffix", default the engine's): what the
        decode side gets of the MLA layers, see the module docstring. `on_block(BlockState)`
        (sync or async), when given, gets each whole block computed here, with a KDA snapshot
        every `snapshot_every` blocks and at the prompt's end.

        Returns timings (time.time() seconds) and bytes: compute start/end, per layer when its
        state was ready and when its frames were handed over, how much of the transfer
        overlapped the compute, and the prefix used (`cached_len` trace tokens,
        `cached_tokens` model tokens) and tokens computed.
        """
        ship = ship or self.ship
        if ship not in SHIP_MODES:
            raise ValueError(f"ship: expected one of {SHIP_MODES}, got {ship!r}")
        P, prefix, tokens = self.plan_prefix(request, prefix_state, cached_len)
        suffix = ship == "suffix" and P > 0
        queue = asyncio.Queue()
        stop = threading.Event()
        work = self._start_compute(tokens, P, prefix, suffix, bool(on_block), queue, stop)
        try:
            layers, kv_bytes = await self._send_layers(queue, send_layer)
            first, st, t0, t1 = await work
            ref = self._prefix_ref(request, prefix, P) if suffix else None
            trailer = encode_trailer(first, st.length, self.cfg.n_layers, prefix=ref)
            await _call(send_layer, None, [trailer])
            kv_bytes += len(trailer)
        except BaseException:
            stop.set()
            while not queue.empty():
                queue.get_nowait()
            if not work.done():
                await asyncio.shield(work)
            raise
        stored = 0
        if on_block:
            keys = list(_field(request, "prefix_blocks", None) or [])
            for blk in blocks_of(st, self.model_block, first=P // self.model_block, keys=keys):
                await _call(on_block, blk)
                stored += 1
        overlap = sum(max(0.0, min(r["send_end"], t1) - max(r["send_start"], t0)) for r in layers)
        return {"tokens": int(len(tokens)) - P, "prompt_tokens": int(len(tokens)),
                "cached_tokens": P, "cached_len": P // self.model_block * self.block,
                "ship": ship, "blocks_stored": stored, "first_token": first,
                "kv_bytes": kv_bytes, "state_bytes": st.nbytes(), "compute_start": t0,
                "compute_end": t1, "prefill_s": t1 - t0,
                "send_start": layers[0]["send_start"] if layers else t1,
                "send_end": time.time(), "overlap_s": overlap, "layers": layers}

    def _start_compute(self, tokens, P, prefix, suffix, snapshots, queue, stop):
        """The forward pass from token `P` on, started in the compute thread: each layer's
        frames go to `queue` as (layer, frames, ready time) as the layer is done (MLA from `P`
        on with `suffix`), then None; `stop` set: the rest are not encoded. With `snapshots`,
        a KDA snapshot every `snapshot_every` blocks. The future gives (first token, state,
        compute start, compute end)."""
        state = prefix.request_state(self.cfg, self.device) if prefix else None
        step = self.model_block * self.snapshot_every
        snap_at = list(range((P // step + 1) * step, len(tokens) + 1, step)) if snapshots else []
        n = self.cfg.n_layers
        loop = asyncio.get_running_loop()

        def on_layer(i, kind, tensors):
            if stop.is_set():
                return
            if suffix and kind == "mla":     # the decode side holds tokens 0..P-1
                tensors = {name: t[P:] for name, t in tensors.items()}
            frames = encode_layer(i, tensors, n, kind, self.chunk_bytes,
                                  start=P if suffix and kind == "mla" else 0)
            loop.call_soon_threadsafe(queue.put_nowait, (i, frames, time.time()))

        def compute():
            t0 = time.time()
            try:
                logits, st = self.model.prefill(tokens[P:], state=state, on_layer=on_layer,
                                                snapshot_at=snap_at)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return int(logits.argmax()), st, t0, time.time()
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        return loop.run_in_executor(self._pool, compute)

    @staticmethod
    async def _send_layers(queue, send_layer):
        """Every layer's frames from `queue` to `send_layer`, in order, until the compute ends;
        (per layer: ready, send start and end, bytes; the bytes sent)."""
        layers, kv_bytes = [], 0
        while (item := await queue.get()) is not None:
            i, frames, t_ready = item
            t_send = time.time()
            size = sum(memoryview(f).nbytes for f in frames)
            await _call(send_layer, i, frames)
            del frames, item                      # the transfer buffer of this layer
            layers.append({"layer": i, "ready": t_ready, "send_start": t_send,
                           "send_end": time.time(), "bytes": size})
            kv_bytes += size
        return layers, kv_bytes

    def _prefix_ref(self, request, prefix, P):
        """The trailer's reference to the `P` prefix tokens the decode side holds (suffix
        shipping): their length and the pool keys of their blocks."""
        keys = list(_field(request, "prefix_blocks", None) or []) or prefix.keys
        return {"length": P, "keys": [None if k is None else int(k)
                                      for k in keys[:P // self.model_block]]}


async def _call(fn, *args):
    res = fn(*args)
    if inspect.isawaitable(res):
        await res


class TorchDecodeEngine(AssemblingDecodeEngine):
    """Continuous-batching greedy decode over states assembled from the wire.

    `receive(rid, seq, flags, payload)` feeds a request's frames (the decode worker's KV
    socket calls it; its `frame_buffer` lets the socket read data frames straight into the
    state tensors, so `receive` need not copy them); `admit` turns the assembled state into a
    live request; `step` advances a batch by one token each; `release` frees everything held
    for a request.

    A suffix-only transfer (MLA layers from token P on, the trailer naming the prefix) is
    completed with the prefix latents of blocks held on this side: `admit(..., prefix=...)`,
    or `prefix_source(ref)` called with the trailer's {length, keys}; either gives a
    `PrefixState` or the blocks (`BlockState`s or their bytes) from block 0 on.
    """

    def __init__(self, cfg=None, device="auto", bs_max=20, step_s=0.0, threads=None,
                 prefix_source=None):
        self.cfg = _config(cfg)
        self.prefix_source = prefix_source
        if threads:
            torch.set_num_threads(threads)
        self.model = HybridModel(self.cfg, device)
        self.device = self.model.device
        self.bs_max = bs_max
        self.step_s = step_s             # no emulated pacing: the computation is the step
        self.clock_factor = 1.0          # scales step_s, which is 0: the slow fault cannot
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
        """Where kvwire should receive a frame's payload: the slice of the layer's state (its
        tensors' memory) it fills (then `receive` does not copy it), or None for a buffer of
        kvwire's own."""
        asm = self.assemblers.get(request_id)
        if asm is None or flags & 2 or request_id in self.errors:
            return None
        return asm.buffer_for(length)

    def error(self, request_id):
        """Why a request's state is unusable (corrupt, mismatched), or None."""
        return self.errors.get(request_id)

    # ---- lifecycle ----
    def admit(self, request_id, assembled_state=None, first_token=None, prefix=None):
        """Make a request live. `assembled_state`: per-layer dicts, a `RequestState`, or None
        (use what `receive` assembled; any other object, such as a worker's slot, counts as
        None). Raises `StateWireError` with the reason when the state is corrupt or incomplete,
        `PrefixError` when a suffix-only transfer's prefix is not at hand.
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
            if any(asm.starts.values()):
                assembled_state = join_suffix(assembled_state, asm.starts,
                                              self._prefix(asm.trailer, prefix))
        if first_token is None:
            raise StateWireError(f"request {request_id}: no first token (no trailer frame)")
        st = assembled_state if isinstance(assembled_state, RequestState) else \
            RequestState.from_layer_tensors(self.cfg, list(assembled_state), self.device, length)
        self.live[request_id] = [st, int(first_token)]

    def _prefix(self, trailer, prefix):
        """The cached prefix (MLA latents) a suffix-only transfer is completed with."""
        ref = (trailer or {}).get("prefix")
        if ref is None:
            raise PrefixError("MLA layers were shipped as a suffix but the trailer names no prefix")
        if prefix is None and self.prefix_source is not None:
            prefix = self.prefix_source(ref)
        if prefix is None:
            raise PrefixError(f"suffix-only state after a {ref['length']}-token prefix, and no "
                              f"prefix blocks on this side")
        if not isinstance(prefix, PrefixState):
            blocks = [b if isinstance(b, BlockState) else BlockState.from_bytes(b, self.cfg)
                      for b in prefix]
            prefix = PrefixState.from_blocks(self.cfg, [b for b in blocks
                                                        if b.end <= ref["length"]], need_kda=False)
        return prefix

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
