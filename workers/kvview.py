"""The scheduler's global cache view of vLLM instances, fed by their KV events.

`model.engine: vllm` (docs/vllm.md, "KV events"; docs/cache.md). Each instance's prefix cache
is vLLM's own; what the scheduler knows of it is what the instance publishes
(workers/kvevents.py), not what the scheduler sent where.

vLLM's block hashes are its own (chained, seeded per process), so the view does not use them
as keys. It keys each block by the token ids it holds, chained like vLLM's: a block's key is a
digest of its parent's key, its token ids and its extra keys (cache_salt and the like: a salted
block is not one an unsalted prompt can reuse). A `BlockStored` event names the parent's vLLM
hash and carries every block's token ids, so the view maps vLLM hash -> key per instance and
counts which keys each instance holds; `BlockRemoved` drops by vLLM hash, `AllBlocksCleared`
drops them all. A request's prompt is keyed the same way, block by block, so its hit on an
instance is the leading run of its keys that instance holds: the prefix vLLM would reuse.

The testbed's own prefix keys (`Request.prefix_blocks`, `cache.block` tokens each) map onto
this as whole prefix blocks inside the hit (`prefix_blocks`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct

from workers.kvevents import Cleared, Removed, Stored

ROOT = b""                          # the key before a prompt's first block


def block_key(parent, token_ids, extra=None):
    """A block's key: its parent's key, its token ids (and extra keys) digested."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra is not None:
        h.update(repr(tuple(extra)).encode())
    return h.digest()


def prompt_keys(token_ids, block_size):
    """The keys of a prompt's whole blocks, in order."""
    keys, parent = [], ROOT
    for i in range(len(token_ids) // block_size):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


@dataclasses.dataclass
class InstanceCounts:
    """What one instance's events did to the view (all counts since the start)."""

    stored: int = 0                 # blocks announced stored (a reused block again: counted)
    removed: int = 0                # blocks announced removed that the view held
    cleared: int = 0                # AllBlocksCleared
    orphans: int = 0                # stored blocks whose parent the view did not know
    resyncs: int = 0                # its view dropped: lost events, or a restarted server


class InstanceView:
    """One instance: vLLM hash -> key, and how many of its hashes hold each key."""

    def __init__(self):
        self.by_hash = {}
        self.held = collections.Counter()
        self.counts = InstanceCounts()
        self.block_size = 0         # the engine's, from its events

    def apply(self, event):
        if isinstance(event, Stored):
            self._store(event)
        elif isinstance(event, Removed):
            for h in event.block_hashes:
                self._drop(h)
        elif isinstance(event, Cleared):
            self.counts.cleared += 1
            self.drop_all()

    def _store(self, ev):
        if ev.parent is None:
            parent = ROOT
        elif ev.parent in self.by_hash:
            parent = self.by_hash[ev.parent]
        else:                       # its parent was evicted, or announced in a lost batch
            self.counts.orphans += len(ev.block_hashes)
            return
        extras = ev.extra_keys or (None,) * len(ev.block_hashes)
        for (h, ids), extra in zip(ev.blocks(), extras):
            parent = block_key(parent, ids, extra)
            self.counts.stored += 1
            if h not in self.by_hash:
                self.by_hash[h] = parent
                self.held[parent] += 1
        self.block_size = max(self.block_size, ev.block_size)

    def _drop(self, h):
        key = self.by_hash.pop(h, None)
        if key is None:
            return
        self.counts.removed += 1
        self.held[key] -= 1
        if self.held[key] <= 0:
            del self.held[key]

    def drop_all(self):
        self.by_hash.clear()
        self.held.clear()

    def hit_blocks(self, keys):
        n = 0
        for k in keys:
            if k not in self.held:
                break
            n += 1
        return n


class CacheView:
    """Every instance's `InstanceView`, by name."""

    def __init__(self, names=()):
        self.instances = {n: InstanceView() for n in names}

    def of(self, name):
        return self.instances.setdefault(name, InstanceView())

    def apply(self, name, batch):
        """Apply one `Batch` of instance `name`; (stored, removed, cleared) event counts."""
        v = self.of(name)
        kinds = collections.Counter(type(e).__name__ for e in batch.events)
        for e in batch.events:
            v.apply(e)
        return kinds["Stored"], kinds["Removed"], kinds["Cleared"]

    def resync(self, name):
        """Events were lost and cannot be replayed: forget what this instance held (vLLM
        announces a block again when a request reuses it, so hits come back)."""
        v = self.of(name)
        v.counts.resyncs += 1
        v.drop_all()

    def block_size(self):
        return max((v.block_size for v in self.instances.values()), default=0)

    def hit_tokens(self, token_ids, names):
        """{instance: leading prompt tokens its prefix cache holds} for `names`."""
        size = self.block_size()
        if size == 0:
            return {n: 0 for n in names}
        keys = prompt_keys(token_ids, size)
        return {n: self.of(n).hit_blocks(keys) * size for n in names}

    def blocks_held(self, name):
        return len(self.of(name).by_hash)

    def holds(self, name, token_ids):
        """Whether instance `name` holds every whole block of `token_ids`."""
        size = self.block_size()
        keys = prompt_keys(token_ids, size) if size else []
        return bool(keys) and self.of(name).hit_blocks(keys) == len(keys)


def prefix_blocks(hit_tokens, block):
    """The testbed's prefix blocks (`block` tokens each) wholly inside a hit."""
    return hit_tokens // block if block else 0
