"""The hybrid prefix cache pool's bookkeeping: blocks, snapshots, LRU, transfer reservations.

Pure Python (no sockets, no gRPC) so that the pool process (`workers/cachepool.py`), the
prefill workers' instance-resident sets and the unit tests share one implementation.

A block is `block` tokens of one prefix, named by its chained id (Mooncake `hash_ids`: the id
stands for the block *and everything before it*). For the hybrid KDA:MLA model a block holds:

- its full-attention (MLA) KV, `kv_bytes` (grows with length, so one per block); a prefix of
  matching blocks is reusable on any partial match;
- optionally a snapshot of the linear-attention (KDA) recurrent state *after* the block,
  `state_bytes` (fixed size, whatever the length). The recurrent state is reusable only at
  exactly the length it was taken at, so a prefill can continue from a cached prefix only up to
  the last matching block that has a snapshot.

`match(ids)` therefore answers two lengths: `kv_blocks`, the longest run of leading ids present
(what a decode instance, which receives the final state from prefill, can reuse), and
`state_blocks <= kv_blocks`, the longest such run ending in a block with a snapshot (what a
prefill instance can continue from).

Memory: prefix-cache blocks (KV and snapshots) and transfer-cache reservations (the tail of a
prefill being shipped, freed on delivery, `reserve`/`release`) come out of one `capacity`.
Making room evicts prefix blocks in least-recently-used order; a snapshot is dropped with its
block. Transfer reservations are never evicted; when they alone exceed the capacity the pool is
over-committed and says so (`over_bytes`), as a real allocator would have to stall.
"""

import collections
import dataclasses

KIND_KV, KIND_STATE = 0, 1


def snapshot_blocks(n_full, every):
    """Block counts (1-based: "after block k") at which a prefill of `n_full` whole blocks keeps
    a KDA snapshot: every `every`-th block (0: none) and always the last whole block, so the
    next turn of a conversation, which extends this prompt, can continue from all of it."""
    out = set(range(every, n_full + 1, every)) if every > 0 else set()
    if n_full > 0:
        out.add(n_full)
    return out


def fetch_blocks(cached_len, input_len, whole, block):
    """Whole blocks a prefill asks its pool for, planned to continue from `cached_len` tokens of
    a prompt of `input_len` with `whole` whole prefix blocks: at least one token is computed."""
    return max(0, min(cached_len // block, whole, (input_len - 1) // block))


def continued_from(k, block, kv_blocks, state):
    """Tokens a prefill continues from after asking for `k` blocks, of which `kv_blocks` KV and
    the snapshot after the last (`state`) came: all `k`, or nothing (the recurrent state is
    reusable only at exactly the snapshot's length)."""
    return k * block if k > 0 and kv_blocks == k and state else 0


def computed_parts(ids, first, every):
    """[(id, kind)] a prefill that continued from block `first` of its whole prefix blocks
    `ids` writes into its pool: the KV of each new block and the snapshots after blocks beyond
    `first` (`snapshot_blocks`)."""
    parts = [(ids[i], KIND_KV) for i in range(first, len(ids))]
    return parts + [(ids[k - 1], KIND_STATE) for k in sorted(snapshot_blocks(len(ids), every))
                    if k > first]


def received_parts(ids, have):
    """[(id, kind)] a decode instance writes into the local pool for a request prefilled in the
    other cluster: the KV of the whole blocks beyond the `have` it took from the pool (no
    snapshot crossed the WAN)."""
    return [(ids[i], KIND_KV) for i in range(have, len(ids))]


@dataclasses.dataclass
class Entry:
    kv: object = None           # bytes-like, MLA KV of the block
    state: object = None        # bytes-like, KDA snapshot after the block, or None


class BlockStore:
    """LRU store of prefix blocks with snapshots; sizes are real (scaled) byte counts."""

    def __init__(self, capacity):
        self.capacity = int(capacity)
        self.blocks = collections.OrderedDict()     # id -> Entry, least recently used first
        self.prefix_bytes = 0
        self.transfers = {}                         # tag -> reserved bytes
        self.transfer_bytes = 0
        self.evicted_blocks = 0
        self.evicted_bytes = 0
        self.inserted_blocks = 0
        self.hits = collections.Counter()            # "kv_blocks", "state_blocks" looked up

    @staticmethod
    def _size(data):
        return 0 if data is None else memoryview(data).nbytes

    @property
    def used(self):
        return self.prefix_bytes + self.transfer_bytes

    @property
    def over_bytes(self):
        return max(0, self.used - self.capacity)

    def put(self, block_id, kind, data):
        """Store one part of a block (KV or snapshot); returns the ids evicted to make room.
        A snapshot of a block whose KV is absent is useless (the MLA KV is needed too): it is
        kept only once the KV is there."""
        e = self.blocks.get(block_id)
        if kind == KIND_STATE and e is None:
            return []
        if e is None:
            e = self.blocks[block_id] = Entry()
            self.inserted_blocks += 1
        old = e.kv if kind == KIND_KV else e.state
        self.prefix_bytes += self._size(data) - self._size(old)
        if kind == KIND_KV:
            e.kv = data
        else:
            e.state = data
        self.blocks.move_to_end(block_id)
        return self._make_room(keep=block_id)

    def _make_room(self, keep=None):
        evicted = []
        while self.used > self.capacity and self.blocks:
            bid = next(iter(self.blocks))
            if bid == keep and len(self.blocks) == 1:
                break
            if bid == keep:
                self.blocks.move_to_end(bid)
                continue
            e = self.blocks.pop(bid)
            n = self._size(e.kv) + self._size(e.state)
            self.prefix_bytes -= n
            self.evicted_blocks += 1
            self.evicted_bytes += n
            evicted.append(bid)
        if keep is not None and self.used > self.capacity and keep in self.blocks:
            e = self.blocks.pop(keep)            # not even the new block fits
            n = self._size(e.kv) + self._size(e.state)
            self.prefix_bytes -= n
            self.evicted_blocks += 1
            self.evicted_bytes += n
            evicted.append(keep)
        return evicted

    def match(self, ids, touch=True):
        """(kv_blocks, state_blocks) of the leading `ids` present (see the module docstring)."""
        kv = state = 0
        for bid in ids:
            e = self.blocks.get(bid)
            if e is None or e.kv is None:
                break
            kv += 1
            if e.state is not None:
                state = kv
        if touch:
            for bid in ids[:kv]:
                self.blocks.move_to_end(bid)
        return kv, state

    def parts(self, ids, state_at=0):
        """[(id, kind, data)] of the leading `ids` present (KV of each, plus the snapshot after
        block `state_at` when it is there); touches them (most recently used)."""
        out = []
        for k, bid in enumerate(ids, 1):
            e = self.blocks.get(bid)
            if e is None or e.kv is None:
                break
            self.blocks.move_to_end(bid)
            out.append((bid, KIND_KV, e.kv))
            if k == state_at and e.state is not None:
                out.append((bid, KIND_STATE, e.state))
        return out

    def reserve(self, tag, nbytes):
        """Account `nbytes` of transfer-cache for `tag` (evicting prefix blocks as needed)."""
        self.release(tag)
        self.transfers[tag] = int(nbytes)
        self.transfer_bytes += int(nbytes)
        return self._make_room()

    def release(self, tag):
        self.transfer_bytes -= self.transfers.pop(tag, 0)

    def stats(self):
        snaps = sum(1 for e in self.blocks.values() if e.state is not None)
        return {"capacity": self.capacity, "blocks": len(self.blocks), "snapshots": snaps,
                "prefix_bytes": self.prefix_bytes, "transfer_bytes": self.transfer_bytes,
                "transfers": len(self.transfers), "evicted_blocks": self.evicted_blocks,
                "evicted_bytes": self.evicted_bytes, "inserted_blocks": self.inserted_blocks}


class PoolBook:
    """One cluster pool's store and counters: what `workers/cachepool.py` serves over gRPC and
    sockets and the simulator's pools (testbed/sim/cache.py) keep in virtual time, one
    implementation. `stats()` is the run directory's cache_<name>.json."""

    def __init__(self, name, dc, capacity):
        self.name, self.dc = name, dc
        self.store = BlockStore(capacity)
        self.counters = collections.Counter()

    def received(self, block_id, kind, data):
        """A part arrived on the pool's block socket."""
        self.counters["bytes_in"] += memoryview(data).nbytes
        self.store.put(block_id, kind, data)

    def lookup(self, ids):
        self.counters["lookups"] += 1
        return self.store.match(ids, touch=False)

    def sent(self, parts, nbytes):
        """A fetch sent `parts` ([(id, kind, data)], `nbytes`): (kv_blocks, state) it carried."""
        self.counters["bytes_out"] += nbytes
        self.counters["fetches"] += 1
        return (sum(1 for _, kind, _ in parts if kind == KIND_KV),
                any(kind == KIND_STATE for _, kind, _ in parts))

    def pulled(self, nbytes):
        self.counters["pulled_bytes"] += nbytes
        self.counters["pulls"] += 1

    def transfer(self, tag, nbytes, release):
        """Reserve (or release) transfer-cache for a tail being shipped."""
        if release:
            self.store.release(tag)
        else:
            self.store.reserve(tag, nbytes)
            self.counters["transfer_peak"] = max(self.counters["transfer_peak"],
                                                 self.store.transfer_bytes)

    def stats(self):
        return {"name": self.name, "dc": self.dc, **self.store.stats(), **dict(self.counters)}


class BlockSizes:
    """Bytes of one block's MLA KV and of one KDA snapshot, from the profile's S_kv fit.

    S_kv(l) = a + b*l (PRFAAS.md): the intercept `a` is the fixed-size recurrent (KDA) state,
    the slope `b` the full-attention KV per token (real-world bytes). Both emulated through
    the run's `Scale`."""

    def __init__(self, s_kv_coeffs, block, scale):
        a, b = s_kv_coeffs[0], s_kv_coeffs[1]
        self.block = int(block)
        self.state = max(1, int(round(scale.emulated_bytes(a))))
        self.per_token = scale.emulated_bytes(b)
        self.kv = max(1, int(round(scale.emulated_bytes(b * block))))

    def of(self, kind):
        """Bytes of one part of a block: its KV or its snapshot."""
        return self.kv if kind == KIND_KV else self.state

    def shipped(self, input_len, decode_cached):
        """Bytes a decode instance still needs when it holds `decode_cached` tokens of the
        prefix's MLA KV: the final recurrent state plus the KV of every token it lacks."""
        return max(1, int(round(self.state + self.per_token * max(0, input_len - decode_cached))))
