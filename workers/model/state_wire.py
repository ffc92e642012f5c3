"""The wire format of one layer's state: a header frame, then the layer's bytes in data frames.

Transport-agnostic: `encode_layer` returns a list of frames (bytes, bytearray or memoryview)
and the receiver feeds each frame's payload to a `LayerAssembler` in the order it was produced.
The spine's KV data socket (`workers/kvwire.py`) carries one frame per kvwire frame.

    header frame = 'PKVL' | version u8 | 0 u8 | json length u32 | crc32(json) u32 | json
    json         = {layer, n_layers, kind, nbytes,
                    tensors: [{name, dtype, shape, offset, nbytes, crc32}, ...][, start]}
                   (`nbytes`: the layer's bytes; each tensor lies at its `offset` in them,
                   `ALIGN`-aligned, zero padding between; `start`, when present: the tensors
                   hold tokens start.. of the layer; a suffix shipped against a cached prefix,
                   see `workers.model.prefix`)
    data frames  = the layer's `nbytes` bytes in order, in frames of any length: the receiver
                   needs no chunk size. The sender packs tensors under `PACK_BYTES` together
                   (copied, up to `chunk_bytes` a frame: a KDA layer's four tensors are one
                   frame) and cuts larger ones into `chunk_bytes` views of the tensor itself
    trailer      = 'PKVT' | version u8 | 0 u8 | json length u32 | crc32(json) u32 | json
                   (optional, after the last layer: {first_token, length, n_layers[, prefix]};
                   `prefix` = {length, keys}: the decode side adds the first `length` tokens
                   of every MLA layer from cached prefix blocks `keys`)
    block header = 'PKVB' | version u8 | 0 u8 | json length u32 | crc32(json) u32 | json
                   (a prefix-cache block's own record, first in its `pack`ed bytes)

`pack` joins frames into one byte string (a pool holds a block as one) and `unpack` cuts it
back into frames: each header, then its layer's bytes as one frame.

Large tensors' data frames carry no header of their own, so on the sending side they are
memoryviews of the tensors themselves (torch -> numpy -> memoryview, no copy; a CUDA tensor is
first copied to host memory, which is the transfer buffer). Small ones are copied into a packed
frame: per frame the receiver pays a wake-up's worth of Python (kvwire's header, the engine's
bookkeeping), which for a 1.5 KB tensor cost more than its copy (version 1 sent a frame a
tensor: 37 frames for the 8-layer model's state, 19 now). The price of headerless frames is
ordering: the frames of one layer must reach the assembler in order and not interleaved with
another layer of the same request on the same `stream` -- true for one TCP connection. A sender
that spreads one request's layers over several connections passes the connection as `stream`;
each stream keeps its own cursor.

The receiver allocates each layer's bytes once (the tensors are views of them), copies each
frame once into place, checks every tensor's crc32 and every length, shape, dtype and offset
against the header, and raises `StateWireError` naming the layer and the tensor on any
mismatch. A transport that can receive in place asks `LayerAssembler.buffer_for(length,
stream)` for the slice of the layer the next frame fills and reads the socket straight into it;
`feed` of that very buffer then skips the copy (the crc32 still covers what landed). The crc32
is accumulated frame by frame, while each frame is still in cache.
"""

import json
import math
import struct

try:    # zlib-ng's crc32 is the same CRC-32, vectorized: ~50 GB/s here against zlib's ~4
    from zlib_ng.zlib_ng import crc32
except ImportError:
    from zlib import crc32

import torch

from testbed.errors import TestbedError

MAGIC = b"PKVL"
TRAILER_MAGIC = b"PKVT"
BLOCK_MAGIC = b"PKVB"
VERSION = 2                   # 2: a layer's bytes in frames of any length (1: a tensor's)
HEADER = struct.Struct("!4sBBII")
DEFAULT_CHUNK_BYTES = 1 << 20
ALIGN = 64                    # a tensor's offset in its layer's bytes (any dtype; a cache line)
PACK_BYTES = 64 << 10         # tensors below this are copied into packed frames

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in DTYPES.items()}


class StateWireError(TestbedError):
    """A layer's state arrived corrupt, truncated, out of order or not matching the model."""


def _host_bytes(t):
    """A contiguous host copy-or-view of tensor t and a memoryview of its bytes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def encode_layer(idx, tensors, n_layers=None, kind="", chunk_bytes=DEFAULT_CHUNK_BYTES, start=0):
    """Frames of layer `idx`'s state (`tensors`: name -> tensor): a header, then data frames
    of at most `chunk_bytes`.

    `start` > 0 marks per-token tensors that begin at token `start` (a suffix)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    descs, views, end = [], [], 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise StateWireError(f"layer {idx} tensor {name!r}: dtype {t.dtype} not supported")
        mv = _host_bytes(t)
        offset = -(-end // ALIGN) * ALIGN
        descs.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                      "offset": offset, "nbytes": mv.nbytes, "crc32": crc32(mv)})
        views.append(mv)
        end = offset + mv.nbytes
    head = {"layer": idx, "n_layers": n_layers, "kind": kind, "nbytes": end, "tensors": descs}
    if start:
        head["start"] = int(start)
    meta = json.dumps(head, separators=(",", ":")).encode()
    return [HEADER.pack(MAGIC, VERSION, 0, len(meta), crc32(meta)) + meta,
            *_data_frames(descs, views, chunk_bytes)]


def _data_frames(descs, views, chunk_bytes):
    """The layer's bytes as frames: tensors under PACK_BYTES copied together (with the padding
    before each) into frames of at most `chunk_bytes`, larger ones as views of themselves cut
    at `chunk_bytes`."""
    frames, packed, pos = [], bytearray(), 0     # pos: layer bytes in frames or `packed`
    for d, mv in zip(descs, views):
        pad, n = d["offset"] - pos, mv.nbytes
        small = n < PACK_BYTES
        if packed and not (small and len(packed) + pad + n <= chunk_bytes):
            if len(packed) + pad <= chunk_bytes:    # the padding ends the frame before
                packed += bytes(pad)
                pad = 0
            frames.append(packed)
            packed = bytearray()
        packed += bytes(pad)
        if small and len(packed) + n <= chunk_bytes:
            packed += mv
        else:
            if packed:                              # padding after a large tensor: alone
                frames.append(packed)
                packed = bytearray()
            frames.extend(mv[o:o + chunk_bytes] for o in range(0, n, chunk_bytes))
        pos = d["offset"] + n
    if packed:
        frames.append(packed)
    return frames


def encode_trailer(first_token, length, n_layers, prefix=None):
    """The frame that ends a request's state: prefill's greedy first token and the length;
    `prefix` ({length, keys}) when the MLA layers were shipped from token `length` on."""
    rec = {"first_token": int(first_token), "length": int(length), "n_layers": n_layers}
    if prefix is not None:
        rec["prefix"] = prefix
    return encode_record(TRAILER_MAGIC, rec)


def encode_record(magic, rec):
    """A header-form frame carrying the JSON record `rec` (trailer, block header)."""
    meta = json.dumps(rec, separators=(",", ":")).encode()
    return HEADER.pack(magic, VERSION, 0, len(meta), crc32(meta)) + meta


def pack(frames):
    """Frames joined into one byte string (`unpack` cuts it back)."""
    return b"".join(frames)


def unpack(data):
    """The frames of `pack(frames)`, in order, as memoryviews of `data`.

    Each header frame says how long it is; a layer header also says how many bytes of data
    follow (one frame here). Truncated data raises `StateWireError`.
    """
    mv = memoryview(data).cast("B")
    off = 0

    def take(n, what):
        nonlocal off
        if off + n > mv.nbytes:
            raise StateWireError(f"packed state truncated: {what} needs {n} bytes at offset "
                                 f"{off}, {mv.nbytes - off} left")
        off += n
        return mv[off - n:off]

    while off < mv.nbytes:
        head = take(HEADER.size, "a header")
        n = HEADER.unpack(head)[3]
        off -= HEADER.size
        frame = take(HEADER.size + n, "a header")
        magic, meta = _parse_header(frame)
        yield frame
        n = meta.get("nbytes") if magic == MAGIC else None
        if isinstance(n, int) and n > 0:    # else the assembler says what is wrong with it
            yield take(n, f"layer {meta.get('layer')}'s bytes")


def encode_state(state, chunk_bytes=DEFAULT_CHUNK_BYTES):
    """Frames of every layer of a `hybrid.RequestState`, layer by layer."""
    n = len(state.layers)
    return [f for i in range(n) for f in encode_layer(i, state.layer_tensors(i), n,
                                                      state.kinds[i], chunk_bytes)]


def frames_nbytes(frames):
    return sum(memoryview(f).nbytes for f in frames)


def _parse_header(frame):
    """(magic, meta) of a layer header or trailer frame."""
    mv = memoryview(frame)
    if mv.nbytes < HEADER.size:
        raise StateWireError(f"expected a layer header frame, got {mv.nbytes} bytes")
    magic, version, _, n, crc = HEADER.unpack(mv[:HEADER.size])
    if magic not in (MAGIC, TRAILER_MAGIC, BLOCK_MAGIC):
        raise StateWireError(f"expected a layer header frame (magic {MAGIC!r}), got {bytes(magic)!r}")
    if version != VERSION:
        raise StateWireError(f"layer header version {version}, this receiver reads {VERSION}")
    meta = mv[HEADER.size:]
    if meta.nbytes != n or crc32(meta) != crc:
        raise StateWireError("layer header corrupt (length or crc32 mismatch)")
    return magic, json.loads(bytes(meta))


def read_record(frame, magic):
    """The JSON record of a header-form frame that must carry `magic`."""
    got, meta = _parse_header(frame)
    if got != magic:
        raise StateWireError(f"expected a {magic!r} frame, got {bytes(got)!r}")
    return meta


class _Pending:
    """A layer being received: its header, its bytes (one allocation; the tensors are views of
    it) and the tensors checked so far."""

    def __init__(self, meta, where):
        self.meta = meta
        self.layer = meta["layer"]
        self.total = meta.get("nbytes")
        if not isinstance(self.total, int) or self.total < 0:
            raise StateWireError(f"{where}: header says {self.total!r} bytes")
        self.ranges, end = [], 0
        for d in meta["tensors"]:
            if d["dtype"] not in DTYPES:
                raise StateWireError(f"{where}: tensor {d['name']!r} has unknown dtype {d['dtype']!r}")
            if not all(isinstance(n, int) and n >= 0 for n in d["shape"]):
                raise StateWireError(f"{where}: tensor {d['name']!r} has shape {d['shape']}")
            want, off = math.prod(d["shape"]) * ITEMSIZE[d["dtype"]], d.get("offset")
            if (want != d["nbytes"] or not isinstance(off, int) or off < end
                    or off % ITEMSIZE[d["dtype"]] or off + want > self.total):
                raise StateWireError(f"{where}: tensor {d['name']!r} header inconsistent "
                                     f"(shape {d['shape']} {d['dtype']} = {want} bytes, header "
                                     f"says {d['nbytes']} at byte {off} of {self.total}, the "
                                     f"tensor before ends at {end})")
            end = off + want
            self.ranges.append((off, end, d))
        # whole ALIGN units, so that one view of it per dtype holds every tensor (`tensors`)
        self.flat = torch.empty(-(-self.total // ALIGN) * ALIGN, dtype=torch.uint8)
        self.mv = memoryview(self.flat.numpy())
        self.off = 0        # layer bytes received
        self.t = 0          # the first tensor not yet checked
        self.crc = 0        # crc32 of its bytes received so far
        self.lent = None    # the slice handed out by `buffer_for`, not yet fed
        self._check(0)

    @property
    def done(self):
        return self.off >= self.total

    def buffer_for(self, length):
        """The slice of the layer's bytes the next `length`-byte frame fills, else None (it
        would run past them)."""
        if self.off + length > self.total:
            return None
        self.lent = self.mv[self.off:self.off + length]
        return self.lent

    def fill(self, frame):
        off = self.off
        if frame is self.lent:          # received in place: already where it belongs
            n, self.lent = len(frame), None
        else:
            mv = memoryview(frame).cast("B")
            n = mv.nbytes
            if off + n > self.total:
                raise StateWireError(f"layer {self.layer}: a data frame of {n} bytes at byte "
                                     f"{off} runs past the layer's {self.total} bytes (expected "
                                     f"at most {self.total - off})")
            self.mv[off:off + n] = mv
        self.off = off + n
        self._check(off)

    def _check(self, lo):
        """crc32 the tensors' bytes in [lo, self.off); check each tensor that ended."""
        hi = self.off
        while self.t < len(self.ranges):
            s, e, d = self.ranges[self.t]
            a = max(s, lo)
            if a < min(e, hi):
                self.crc = crc32(self.mv[a:min(e, hi)], self.crc)
            if e > hi:
                return
            if self.crc != d["crc32"]:
                raise StateWireError(f"layer {self.layer} tensor {d['name']!r}: crc32 mismatch "
                                     f"({d['nbytes']} bytes arrived corrupt)")
            self.t += 1
            self.crc = 0

    def tensors(self):
        """name -> tensor, each a view of the layer's bytes: `as_strided` on one view of them
        per dtype (one torch call a tensor; slicing and two views took 3.8x as long here)."""
        out, typed = {}, {}
        for s, _, d in self.ranges:
            dt = DTYPES[d["dtype"]]
            if dt not in typed:
                typed[dt] = self.flat.view(dt)
            out[d["name"]] = typed[dt].as_strided(d["shape"], _strides(d["shape"]),
                                                  s // ITEMSIZE[d["dtype"]])
        return out


def _strides(shape):
    """A contiguous tensor's strides (elements) for `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return out[::-1]


class LayerAssembler:
    """Receives one request's layer frames and assembles its per-layer state.

    `n_layers` (and optionally `kinds`, one per layer) is what the decode model expects; a
    header that disagrees is an error. `feed` returns the index of a layer it just completed,
    else None. `complete` is true when every layer arrived; `states()` returns the per-layer
    dicts of tensors (name -> tensor, on CPU) in layer order; `starts` the first token each
    layer's tensors hold (0 unless a suffix was shipped); `trailer` is the end-of-state
    record ({first_token, length, n_layers[, prefix]}) once it arrived, else None.
    """

    def __init__(self, n_layers, kinds=None):
        self.n_layers = n_layers
        self.kinds = tuple(kinds) if kinds is not None else None
        self.layers = {}
        self.starts = {}             # layer -> first token its tensors hold (0: all of them)
        self.pending = {}            # stream -> _Pending
        self.bytes_received = 0
        self.trailer = None

    def buffer_for(self, length, stream=None):
        """Where the next `length`-byte frame of `stream` should be received, to be passed to
        `feed` as is: the slice of the layer's bytes it fills, or None (a header is next, or
        the frame would run past the layer; `feed` then copies, or says what is wrong)."""
        cur = self.pending.get(stream)
        return cur.buffer_for(length) if cur is not None else None

    def feed(self, frame, stream=None):
        self.bytes_received += memoryview(frame).nbytes
        cur = self.pending.get(stream)
        if cur is None:
            magic, meta = _parse_header(frame)
            if magic == TRAILER_MAGIC:
                if meta.get("n_layers") != self.n_layers:
                    raise StateWireError(f"trailer says {meta.get('n_layers')} layers, "
                                         f"receiver's model has {self.n_layers}")
                self.trailer = meta
                return None
            if magic == BLOCK_MAGIC:
                raise StateWireError("a prefix-block header among a request's layer frames")
            cur = self._start(meta)
            if not cur.done:
                self.pending[stream] = cur
                return None
        else:
            cur.fill(frame)
            if not cur.done:
                return None
            del self.pending[stream]
        self.layers[cur.layer] = cur.tensors()
        self.starts[cur.layer] = cur.meta.get("start", 0)
        return cur.layer

    def _start(self, meta):
        i = meta.get("layer")
        where = f"layer {i}"
        if not isinstance(i, int) or not 0 <= i < self.n_layers:
            raise StateWireError(f"layer index {i!r} outside 0..{self.n_layers - 1}")
        if meta.get("n_layers") not in (None, self.n_layers):
            raise StateWireError(f"{where}: sender's model has {meta['n_layers']} layers, "
                                 f"receiver's has {self.n_layers}")
        if self.kinds and meta.get("kind") and meta["kind"] != self.kinds[i]:
            raise StateWireError(f"{where}: sender says {meta['kind']!r}, receiver's model has "
                                 f"{self.kinds[i]!r}")
        if i in self.layers or any(p.layer == i for p in self.pending.values()):
            raise StateWireError(f"{where} received twice")
        return _Pending(meta, where)

    @property
    def complete(self):
        return len(self.layers) == self.n_layers and not self.pending

    def missing(self):
        return [i for i in range(self.n_layers) if i not in self.layers]

    def states(self):
        if not self.complete:
            raise StateWireError(f"state incomplete: layers {self.missing()} missing")
        return [self.layers[i] for i in range(self.n_layers)]
