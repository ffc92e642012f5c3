"""The wire format of one layer's state: a header frame, then the raw tensor bytes in chunks.

Transport-agnostic: `encode_layer` returns a list of frames (bytes or memoryview) and the
receiver feeds each frame's payload to a `LayerAssembler` in the order it was produced. The
spine's KV data socket (`workers/kvwire.py`) carries one frame per kvwire frame.

    header frame = 'PKVL' | version u8 | 0 u8 | json length u32 | crc32(json) u32 | json
    json         = {layer, n_layers, kind, chunk_bytes,
                    tensors: [{name, dtype, shape, nbytes, crc32, chunks}, ...][, start]}
                   (`start`, when present: the tensors hold tokens start.. of the layer; a
                   suffix shipped against a cached prefix, see `workers.model.prefix`)
    data frames  = each tensor's bytes, in header order, cut into `chunk_bytes` pieces
    trailer      = 'PKVT' | version u8 | 0 u8 | json length u32 | crc32(json) u32 | json
                   (optional, after the last layer: {first_token, length, n_layers[, prefix]};
                   `prefix` = {length, keys}: the decode side adds the first `length` tokens
                   of every MLA layer from cached prefix blocks `keys`)
    block header = 'PKVB' | version u8 | 0 u8 | json length u32 | crc32(json) u32 | json
                   (a prefix-cache block's own record, first in its `pack`ed bytes)

`pack` joins frames into one byte string (a pool holds a block as one) and `unpack` cuts it
back into the same frames, reading each header to know its data chunks.

Data frames carry no header of their own, so on the sending side they are memoryviews of the
tensors themselves (torch -> numpy -> memoryview, no copy; a CUDA tensor is first copied to
host memory, which is the transfer buffer). The price is ordering: the frames of one layer must
reach the assembler in order and not interleaved with another layer of the same request on the
same `stream` -- true for one TCP connection. A sender that spreads one request's layers over
several connections passes the connection as `stream`; each stream keeps its own cursor.

The receiver copies each chunk once into a preallocated tensor, checks every tensor's crc32
and every length, shape and dtype against the header, and raises `StateWireError` naming the
layer and the tensor on any mismatch. A transport that can receive in place asks
`LayerAssembler.buffer_for(length, stream)` for the slice of the tensor the next chunk fills
and reads the socket straight into it; `feed` of that very buffer then skips the copy (the
crc32 still covers what landed in the tensor). The crc32 is accumulated chunk by chunk, while
each chunk is still in cache.
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
VERSION = 1
HEADER = struct.Struct("!4sBBII")
DEFAULT_CHUNK_BYTES = 1 << 20

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
    """Frames of layer `idx`'s state (`tensors`: name -> tensor): a header, then data chunks.

    `start` > 0 marks per-token tensors that begin at token `start` (a suffix)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    descs, views = [], []
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise StateWireError(f"layer {idx} tensor {name!r}: dtype {t.dtype} not supported")
        mv = _host_bytes(t)
        descs.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                      "nbytes": mv.nbytes, "crc32": crc32(mv),
                      "chunks": math.ceil(mv.nbytes / chunk_bytes)})
        views.append(mv)
    head = {"layer": idx, "n_layers": n_layers, "kind": kind, "chunk_bytes": chunk_bytes,
            "tensors": descs}
    if start:
        head["start"] = int(start)
    meta = json.dumps(head, separators=(",", ":")).encode()
    frames = [HEADER.pack(MAGIC, VERSION, 0, len(meta), crc32(meta)) + meta]
    for mv in views:
        frames.extend(mv[o:o + chunk_bytes] for o in range(0, mv.nbytes, chunk_bytes))
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

    Each header frame says how long it is; a layer header also says how many data chunks of
    which sizes follow. Truncated data raises `StateWireError`.
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
        if magic != MAGIC:
            continue
        for d in meta["tensors"]:
            left = d["nbytes"]
            while left > 0:
                k = min(meta["chunk_bytes"], left)
                yield take(k, f"layer {meta['layer']} tensor {d['name']!r}")
                left -= k


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


def _byte_view(t):
    """A writable memoryview of the bytes of a fresh contiguous CPU tensor. The tensor is made
    with its dtype and shape at once (not bytes viewed as it later): per tensor that is one
    torch call instead of three, which showed at ~30 tensors per request."""
    if not t.numel():
        return memoryview(bytearray(0))
    if t.dtype == torch.bfloat16:           # numpy has no bfloat16: the same bytes as int16
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


class _Pending:
    """A layer being received: its header and the tensors filled so far."""

    def __init__(self, meta, where):
        self.meta = meta
        self.layer = meta["layer"]
        self.chunk = meta["chunk_bytes"]
        self.bufs, self.views = [], []
        for d in meta["tensors"]:
            if d["dtype"] not in DTYPES:
                raise StateWireError(f"{where}: tensor {d['name']!r} has unknown dtype {d['dtype']!r}")
            if not all(isinstance(n, int) and n >= 0 for n in d["shape"]):
                raise StateWireError(f"{where}: tensor {d['name']!r} has shape {d['shape']}")
            want = math.prod(d["shape"]) * ITEMSIZE[d["dtype"]]
            if want != d["nbytes"] or d["chunks"] != math.ceil(d["nbytes"] / self.chunk):
                raise StateWireError(f"{where}: tensor {d['name']!r} header inconsistent "
                                     f"(shape {d['shape']} {d['dtype']} = {want} bytes, "
                                     f"header says {d['nbytes']} in {d['chunks']} chunks)")
            self.bufs.append(torch.empty(d["shape"], dtype=DTYPES[d["dtype"]]))
            self.views.append(_byte_view(self.bufs[-1]))
        self.t = 0          # tensor being filled
        self.off = 0        # bytes of it filled
        self.crc = 0        # crc32 of those bytes
        self.lent = None    # the slice handed out by `buffer_for`, not yet fed
        self._skip_empty()

    def _skip_empty(self):
        while self.t < len(self.bufs) and self.meta["tensors"][self.t]["nbytes"] == 0:
            self.t += 1

    @property
    def done(self):
        return self.t >= len(self.bufs)

    def _expect(self):
        d = self.meta["tensors"][self.t]
        return d, min(self.chunk, d["nbytes"] - self.off)

    def buffer_for(self, length):
        """The tensor slice the next chunk fills, if it is `length` bytes long, else None."""
        d, expect = self._expect()
        if length != expect:
            return None
        self.lent = self.views[self.t][self.off:self.off + expect]
        return self.lent

    def fill(self, frame):
        d, expect = self._expect()
        if frame is self.lent:          # received in place: already in the tensor
            dst, self.lent = frame, None
        else:
            mv = memoryview(frame).cast("B")
            if mv.nbytes != expect:
                raise StateWireError(f"layer {self.layer} tensor {d['name']!r}: chunk at byte "
                                     f"{self.off} is {mv.nbytes} bytes, expected {expect}")
            dst = self.views[self.t][self.off:self.off + expect]
            dst[:] = mv
        self.crc = crc32(dst, self.crc)
        self.off += expect
        if self.off == d["nbytes"]:
            if self.crc != d["crc32"]:
                raise StateWireError(f"layer {self.layer} tensor {d['name']!r}: crc32 mismatch "
                                     f"({d['nbytes']} bytes arrived corrupt)")
            self.t += 1
            self.off = self.crc = 0
            self._skip_empty()

    def tensors(self):
        return {d["name"]: buf for d, buf in zip(self.meta["tensors"], self.bufs)}


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
        `feed` as is: the slice of the tensor it fills, or None (a header is next, or the
        length is not the next chunk's; `feed` then copies as usual)."""
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
