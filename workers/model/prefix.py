"""Prefix-cache state of the hybrid model: the blocks a pool keeps, the state a prefill continues
from, and the map from trace tokens to model tokens.

A prefix cache reuses the state of a request's first P tokens, P a whole number of blocks. The
two layer kinds reuse differently (the paper's hybrid prefix cache pool):

* MLA (full attention): the latents c_kv / k_rope of token t depend on tokens <= t only, so the
  latents of the first P tokens are reusable for any P, block by block. A block holds its own
  tokens' latents, per MLA layer.
* KDA (linear attention): the recurrent state after P tokens summarises all of them and cannot
  be cut out of a longer state. It is reusable only at a block boundary where a snapshot was
  kept while the prefix was prefilled (`HybridModel.prefill(..., snapshot_at=...)`). A block
  carries the snapshot at its end, or none.

`BlockState` is one block; its bytes (`to_bytes` / `from_bytes`) are state_wire frames: a 'PKVB'
record ({index, block, key, kinds, snapshot}), then one layer per MLA layer and per
snapshotted KDA layer, each crc32-checked. `blocks_of` cuts a prefilled `RequestState` into
blocks. `PrefixState` is what a prefill continues from (MLA latents of the first `length`
tokens, KDA state at `length`); `PrefixState.from_blocks` assembles it from leading blocks and
refuses (`PrefixError`) a last block without a KDA snapshot. The decode side of a suffix-only
transfer uses the MLA part only (`join_suffix`).

Blocks after `scale.tokens`: a trace block of `B` tokens (Mooncake `hash_ids`, `cache.block`)
is `model_block(B, scale)` = round(B / scale.tokens) model tokens (`Scale.model_tokens`), at
least 1, and a request of n trace tokens has `model_tokens(n, B, scale)` model tokens: its whole blocks exactly, its partial last block in
proportion. So a cached prefix of k trace blocks is exactly k model blocks and every block
boundary of the trace is one of the model (where KDA snapshots sit); when s does not divide B
the model's cached share differs from the trace's by the rounding of B / s.
"""

import dataclasses

import torch

from testbed.errors import TestbedError
from testbed.scale import Scale
from workers.model.hybrid import RequestState
from workers.model.state_wire import (BLOCK_MAGIC, DEFAULT_CHUNK_BYTES, LayerAssembler,
                                      StateWireError, encode_layer, encode_record, pack,
                                      read_record, unpack)

MLA_NAMES = ("c_kv", "k_rope")


class PrefixError(TestbedError):
    """A cached prefix that cannot be used as asked (no KDA snapshot there, wrong blocks)."""


def model_block(block, scale: Scale = Scale()):
    """Model tokens per cache block of `block` trace tokens (the run's `scale.tokens`)."""
    return max(1, round(scale.model_tokens(block)))


def model_tokens(n, block, scale: Scale = Scale()):
    """Model tokens of a request of `n` trace tokens: whole blocks exactly, the rest in
    proportion, at least one token."""
    full, rest = divmod(int(n), int(block))
    mb = model_block(block, scale)
    return max(1, full * mb + round(rest * mb / block))


@dataclasses.dataclass
class BlockState:
    """One cache block: model tokens [index * block, (index + 1) * block) of some prefix."""

    index: int
    block: int          # model tokens per block
    kinds: tuple        # the model's layer kinds ('kda' / 'mla')
    mla: dict           # MLA layer -> {"c_kv": [block, latent], "k_rope": [block, rope]}
    kda: dict | None    # KDA layer -> its state after the block's last token; None: no snapshot
    key: int | None = None      # the pool's id of the block (a trace hash id), carried along

    @property
    def start(self):
        return self.index * self.block

    @property
    def end(self):
        return (self.index + 1) * self.block

    def layers(self):
        """(layer, tensors) of every layer the block holds, in layer order."""
        both = {**self.mla, **(self.kda or {})}
        return [(i, both[i]) for i in sorted(both)]

    def nbytes(self):
        return sum(t.numel() * t.element_size() for _, ts in self.layers() for t in ts.values())

    def to_bytes(self, chunk_bytes=DEFAULT_CHUNK_BYTES):
        """The block as one byte string of state_wire frames (what a pool stores)."""
        rec = {"index": self.index, "block": self.block, "key": self.key,
               "kinds": list(self.kinds), "snapshot": self.kda is not None}
        n = len(self.kinds)
        frames = [encode_record(BLOCK_MAGIC, rec)]
        for i, ts in self.layers():
            frames += encode_layer(i, ts, n, self.kinds[i], chunk_bytes)
        return pack(frames)

    @classmethod
    def from_bytes(cls, data, cfg):
        """A block from `to_bytes` output, checked (crc32s, layers, shapes) against `cfg`."""
        frames = unpack(data)
        rec = read_record(next(frames), BLOCK_MAGIC)
        kinds = tuple(cfg.layer_kinds)
        if tuple(rec["kinds"]) != kinds:
            raise StateWireError(f"block {rec['index']}: cut from a model with layers "
                                 f"{rec['kinds']}, this model has {list(kinds)}")
        asm = LayerAssembler(len(kinds), kinds)
        for f in frames:
            asm.feed(f)
        if asm.pending:
            raise StateWireError(f"block {rec['index']}: layer {asm.missing()} incomplete")
        want = {i for i, k in enumerate(kinds) if k == "mla" or rec["snapshot"]}
        if set(asm.layers) != want:
            raise StateWireError(f"block {rec['index']}: layers {sorted(asm.layers)}, "
                                 f"expected {sorted(want)}")
        for i in want:
            if kinds[i] == "mla" and any(asm.layers[i][n].shape[0] != rec["block"]
                                         for n in MLA_NAMES):
                raise StateWireError(f"block {rec['index']} layer {i}: latents are not "
                                     f"{rec['block']} tokens long")
        mla = {i: asm.layers[i] for i in want if kinds[i] == "mla"}
        kda = {i: asm.layers[i] for i in want if kinds[i] == "kda"} if rec["snapshot"] else None
        return cls(rec["index"], rec["block"], kinds, mla, kda, rec["key"])


def blocks_of(state, block, first=0, keys=None):
    """The whole blocks `first`.. of a prefilled `RequestState`, as `BlockState`s.

    A block gets a KDA snapshot when the prefill kept one at its end (`state.snapshots`), or
    when it ends where the state does (the final state is that snapshot). MLA latents are
    copied, so a pool holding the blocks does not keep the request's whole cache alive.
    `keys[j]`, when given, names block j.
    """
    out = []
    kda_layers = [i for i, k in enumerate(state.kinds) if k == "kda"]
    for j in range(first, state.length // block):
        a, b = j * block, (j + 1) * block
        mla = {i: {n: t[a:b].clone() for n, t in state.layer_tensors(i).items()}
               for i, k in enumerate(state.kinds) if k == "mla"}
        if b in state.snapshots:
            kda = state.snapshots[b]
        elif b == state.length:
            kda = {i: state.layer_tensors(i) for i in kda_layers}
        else:
            kda = None
        out.append(BlockState(j, block, state.kinds, mla, kda,
                              None if keys is None or j >= len(keys) else int(keys[j])))
    return out


def reusable_blocks(blocks, limit=None):
    """How many leading `blocks` a prefill can continue from: the longest run of consecutive
    blocks from index 0 that ends at a KDA snapshot and at most `limit` model tokens."""
    best = 0
    for n, blk in enumerate(blocks, 1):
        if blk.index != n - 1 or (limit is not None and blk.end > limit):
            break
        if blk.kda is not None or "kda" not in blk.kinds:
            best = n
    return best


class PrefixState:
    """The state of a prefix of `length` model tokens: what a prefill continues from.

    `mla`: MLA layer -> (c_kv [length, latent], k_rope [length, rope]); `kda`: KDA layer -> its
    state after `length` tokens, or None when only the MLA part is known (enough for the decode
    side of a suffix-only transfer, not for a prefill).
    """

    def __init__(self, kinds, length, mla, kda, keys=()):
        self.kinds, self.length, self.mla, self.kda = tuple(kinds), int(length), mla, kda
        self.keys = list(keys)

    @classmethod
    def from_blocks(cls, cfg, blocks, need_kda=True):
        """From the leading blocks of a prefix (`BlockState`s or their bytes), in order.

        Raises `PrefixError` when they do not start at block 0, skip a block, mix block
        sizes, or (need_kda) the last one has no KDA snapshot: the recurrent state can be
        reused only at a boundary where one was kept.
        """
        blocks = [b if isinstance(b, BlockState) else BlockState.from_bytes(b, cfg)
                  for b in blocks]
        kinds = tuple(cfg.layer_kinds)
        if not blocks:
            return cls(kinds, 0, {}, {} if need_kda else None)
        for n, blk in enumerate(blocks):
            if blk.index != n or blk.block != blocks[0].block or blk.kinds != kinds:
                raise PrefixError(f"prefix blocks must be blocks 0, 1, 2, ... of one block "
                                  f"size and this model; got block {blk.index} "
                                  f"({blk.block} tokens) at position {n}")
        last = blocks[-1]
        if need_kda and "kda" in kinds and last.kda is None:
            raise PrefixError(f"no KDA snapshot at token {last.end} (end of block {last.index}):"
                              f" the linear-attention state is reusable only at a block boundary"
                              f" where a snapshot was kept")
        mla = {i: tuple(torch.cat([b.mla[i][n] for b in blocks]) for n in MLA_NAMES)
               for i, k in enumerate(kinds) if k == "mla"}
        return cls(kinds, last.end, mla, last.kda if need_kda else None,
                   [b.key for b in blocks])

    @classmethod
    def from_state(cls, state, length):
        """The first `length` tokens of a prefilled `RequestState`: MLA latents cut to length,
        KDA state from a snapshot kept at `length` (or the final one when length is all)."""
        if length == state.length:
            kda = {i: state.layer_tensors(i) for i, k in enumerate(state.kinds) if k == "kda"}
        elif length in state.snapshots:
            kda = state.snapshots[length]
        elif "kda" not in state.kinds:
            kda = {}
        else:
            raise PrefixError(f"no KDA snapshot at token {length}: kept at "
                              f"{sorted(state.snapshots)} and {state.length} (the end)")
        mla = {i: tuple(state.layer_tensors(i)[n][:length] for n in MLA_NAMES)
               for i, k in enumerate(state.kinds) if k == "mla"}
        return cls(state.kinds, length, mla, kda)

    def nbytes(self):
        ts = [t for pair in self.mla.values() for t in pair]
        ts += [t for d in (self.kda or {}).values() for t in d.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    def request_state(self, cfg, device=None):
        """A `RequestState` of the prefix on `device`, for `HybridModel.prefill(state=...)`."""
        if self.kda is None and "kda" in self.kinds:
            raise PrefixError("this prefix has no KDA state (MLA part only): a prefill cannot "
                              "continue from it")
        layers = [self.kda[i] if k == "kda" else dict(zip(MLA_NAMES, self.mla[i]))
                  for i, k in enumerate(self.kinds)]
        return RequestState.from_layer_tensors(cfg, layers, device, self.length)


def join_suffix(layers, starts, prefix):
    """Per-layer tensors of a whole request from a suffix-only transfer and its cached prefix.

    `layers` / `starts`: what a `LayerAssembler` received (`states()`, `starts`); an MLA layer
    shipped from token s > 0 gets the prefix's first s latents in front; KDA layers come whole.
    """
    out = []
    for i, ts in enumerate(layers):
        s = starts.get(i, 0) if isinstance(starts, dict) else starts[i]
        if not s:
            out.append(ts)
            continue
        if prefix is None or i not in prefix.mla:
            raise PrefixError(f"layer {i} was shipped from token {s} but no cached prefix "
                              f"latents for it were given")
        if prefix.length != s:
            raise PrefixError(f"layer {i} was shipped from token {s}, the cached prefix has "
                              f"{prefix.length} tokens")
        out.append({n: torch.cat([prefix.mla[i][j].to(ts[n].dtype), ts[n]])
                    for j, n in enumerate(MLA_NAMES)})
    return out
