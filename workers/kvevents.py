"""vLLM's KV cache events on the wire: the batch decoder and the sequence check.

`model.engine: vllm` (docs/vllm.md, "KV events"). Each vLLM instance publishes its prefix
cache's changes (`--kv-events-config`, publisher zmq): every engine step that stored or dropped
blocks sends one multipart message (topic, sequence number as 8 bytes big-endian, payload),
the payload a msgpack `KVEventBatch` (vllm/distributed/kv_events.py, msgspec structs):
`[ts, [event, ...], data_parallel_rank]`, each event a map tagged by `type`:

- `BlockStored`: `block_hashes` (vLLM's chained hashes, 64-bit ints by default), the
  `parent_block_hash` of the first (None at the prompt's start), `token_ids` (`block_size`
  per block, in order) and more (medium, lora, extra keys: cache_salt and the like);
- `BlockRemoved`: `block_hashes` dropped (evicted to make room, or re-hashed);
- `AllBlocksCleared`: the whole prefix cache reset (`/reset_prefix_cache`).

This module is pure Python with no dependency: the scheduler (the testbed's venv, which has no
msgpack or zmq) decodes what the subscriber (workers/kvsub.py, in the vLLM venv, which has
zmq) forwards, and tests decode recorded batches without vLLM. `Sequencer` is what the
subscriber does with the sequence numbers: in order, a duplicate, a gap to replay, or a
publisher that started over (a restarted server).
"""

from __future__ import annotations

import dataclasses
import json
import struct


class DecodeError(ValueError):
    """A payload that is not a KV event batch (the reason names what was found)."""


# ---------------------------------------------------------------- msgpack (the subset used)

_FIXED = {0xc0: None, 0xc2: False, 0xc3: True}
_INTS = {0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q",
         0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q", 0xca: ">f", 0xcb: ">d"}
_LENS = {0xd9: ">B", 0xda: ">H", 0xdb: ">I",          # str 8/16/32
         0xc4: ">B", 0xc5: ">H", 0xc6: ">I",          # bin 8/16/32
         0xdc: ">H", 0xdd: ">I", 0xde: ">H", 0xdf: ">I"}   # array 16/32, map 16/32


class _Reader:
    def __init__(self, data):
        self.data, self.pos = memoryview(data), 0

    def take(self, n):
        if self.pos + n > len(self.data):
            raise DecodeError(f"msgpack: truncated at byte {self.pos} (wanted {n} more)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def fmt(self, f):
        return struct.unpack(f, self.take(struct.calcsize(f)))[0]

    def value(self):
        b = self.take(1)[0]
        if b <= 0x7f or b >= 0xe0:                  # positive / negative fixint
            return b if b <= 0x7f else b - 0x100
        if b in _FIXED:
            return _FIXED[b]
        if b in _INTS:
            return self.fmt(_INTS[b])
        if 0xa0 <= b <= 0xbf:
            return self._str(b & 0x1f)
        if 0x90 <= b <= 0x9f:
            return self._array(b & 0x0f)
        if 0x80 <= b <= 0x8f:
            return self._map(b & 0x0f)
        if b in _LENS:
            n = self.fmt(_LENS[b])
            if b >= 0xdc:
                return self._array(n) if b <= 0xdd else self._map(n)
            return self._str(n) if b >= 0xd9 else bytes(self.take(n))
        raise DecodeError(f"msgpack: type byte 0x{b:02x} at {self.pos - 1} is not used by "
                          f"KV events")

    def _str(self, n):
        return str(self.take(n), "utf-8")

    def _array(self, n):
        return [self.value() for _ in range(n)]

    def _map(self, n):
        return {self.value(): self.value() for _ in range(n)}


def unpack(data):
    """One msgpack value from `data` (bytes); DecodeError if it is cut or has trailing bytes."""
    r = _Reader(data)
    out = r.value()
    if r.pos != len(r.data):
        raise DecodeError(f"msgpack: {len(r.data) - r.pos} bytes after the value")
    return out


# ---------------------------------------------------------------- events

@dataclasses.dataclass(frozen=True)
class Stored:
    block_hashes: tuple             # vLLM's hashes (int or bytes), one per block
    parent: object                  # the hash of the block before the first; None at the start
    token_ids: tuple                # block_size per block, in order
    block_size: int
    medium: str | None = None
    extra_keys: tuple | None = None     # per block: cache_salt, lora, multimodal (None: none)

    def blocks(self):
        """[(vLLM hash, its token ids)] in order."""
        n = self.block_size
        return [(h, self.token_ids[i * n:(i + 1) * n]) for i, h in enumerate(self.block_hashes)]


@dataclasses.dataclass(frozen=True)
class Removed:
    block_hashes: tuple
    medium: str | None = None


@dataclasses.dataclass(frozen=True)
class Cleared:
    pass


@dataclasses.dataclass(frozen=True)
class Batch:
    ts: float                       # the engine's time.time() when it published the step's events
    events: tuple
    dp_rank: int | None = None


def _hashes(v):
    return tuple(v or ())


def _event(e):
    if not isinstance(e, dict) or "type" not in e:
        raise DecodeError(f"KV event: expected a map with 'type', got {type(e).__name__}")
    kind = e["type"]
    if kind == "BlockStored":
        size, ids = int(e["block_size"]), tuple(e["token_ids"])
        if size <= 0 or len(ids) != size * len(e["block_hashes"]):
            raise DecodeError(f"BlockStored: {len(ids)} token ids for "
                              f"{len(e['block_hashes'])} blocks of {size}")
        extra = e.get("extra_keys")
        return Stored(_hashes(e["block_hashes"]), e.get("parent_block_hash"), ids, size,
                      e.get("medium"), None if extra is None else tuple(
                          None if x is None else tuple(x) for x in extra))
    if kind == "BlockRemoved":
        return Removed(_hashes(e["block_hashes"]), e.get("medium"))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None                     # a kind this testbed does not know: skipped


def decode_batch(payload) -> Batch:
    """A `KVEventBatch` payload as a `Batch` (unknown event kinds left out)."""
    v = unpack(payload)
    if not isinstance(v, list) or len(v) < 2 or not isinstance(v[1], list):
        raise DecodeError("KV event batch: expected [ts, [events], dp_rank]")
    try:
        events = tuple(x for x in (_event(e) for e in v[1]) if x is not None)
    except (KeyError, TypeError) as e:
        raise DecodeError(f"KV event: {type(e).__name__}: {e}") from None
    return Batch(float(v[0]), events, v[2] if len(v) > 2 else None)


def seq_of(frame) -> int:
    """The publisher's sequence number (8 bytes, big-endian, signed: -1 ends a replay)."""
    return int.from_bytes(frame, "big", signed=True)


# ---------------------------------------------------------------- sequence numbers

IN_ORDER, DUPLICATE, GAP, RESTARTED = "in_order", "duplicate", "gap", "restarted"


class Sequencer:
    """What one publisher's next sequence number means. vLLM numbers every batch from 0 and
    keeps the last `buffer_steps` for replay; a subscriber that joined late, or whose socket
    dropped messages (zmq's high-water mark), sees a gap."""

    def __init__(self):
        self.next = 0               # the sequence number expected next
        self.seen = False

    def classify(self, seq):
        """IN_ORDER, DUPLICATE (already applied: a replay's overlap), GAP (seq > next: the
        batches next .. seq-1 are missing) or RESTARTED (0 after others: a new server)."""
        if seq == self.next:
            return IN_ORDER
        if seq > self.next:
            return GAP
        if seq == 0 and self.seen:
            return RESTARTED
        return DUPLICATE

    def applied(self, seq):
        self.next, self.seen = seq + 1, True

    def restart(self):
        self.next, self.seen = 0, False


# ---------------------------------------------------------------- subscriber -> scheduler

_FRAME = struct.Struct(">II")


def frame(header, payload=b""):
    """One record of the subscriber's stream: lengths, a JSON header, the raw batch payload."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return _FRAME.pack(len(head), len(payload)) + head + bytes(payload)


def frame_lengths(prefix):
    """(header length, payload length) from a record's first `FRAME_PREFIX` bytes."""
    return _FRAME.unpack(prefix)


FRAME_PREFIX = _FRAME.size
