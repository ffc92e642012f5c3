"""Read public request traces (Mooncake JSONL, Azure LLM inference CSV) into arrays.

`read(path, format, on_error)` parses a whole file into a `Trace`: trace time in seconds since
the file's first row, input and output lengths, the 512-token prefix block ids (Mooncake
`hash_ids`; none for Azure) and the 1-based line each row came from. Every line is checked;
a malformed or out-of-order line raises `ConfigError` naming the file and the line, or, with
`on_error: skip`, is dropped and counted. `select(trace, spec)` cuts the window a `TraceSpec`
asks for and clips long inputs; `load(spec, base_dir)` does both.

Nothing here is random: `testbed.workload.generate` decides what to do with the rows.
"""

import calendar
import csv
import dataclasses
import io
import json
import logging
import math
import re

import numpy as np

from testbed import units
from testbed.errors import ConfigError
from testbed.yamlload import read_text
from testbed.workload.spec import BLOCK_TOKENS, resolve_trace_path

MAX_TRACE_BYTES = 256 * 1024**2   # a trace file (a hard limit; slice bigger traces first)
MAX_TIMESTAMP_MS = 1e15           # ~31,700 years of trace time
_INT64 = 2**63 - 1

log = logging.getLogger(__name__)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(\.\d+)?")
_EXAMPLES = 3  # skipped lines quoted in the report


@dataclasses.dataclass(frozen=True)
class Trace:
    """Rows of one trace, in file order (which is arrival order)."""

    path: str
    format: str
    time_s: np.ndarray        # float64, seconds since the file's first accepted row
    input_len: np.ndarray     # int64
    output_len: np.ndarray    # int64
    line: np.ndarray          # int64, 1-based line in the file
    blocks: tuple | None      # per row an int64 array of block ids; None: no prefix information
    rows_read: int = 0        # data lines in the file (blank lines not counted)
    skipped: int = 0          # lines dropped by on_error: skip
    skip_examples: tuple = () # the first few "line N: why" of those
    clipped: np.ndarray | None = None  # bool per row: input clipped to max_input

    def __len__(self):
        return len(self.time_s)

    @property
    def span_s(self):
        return float(self.time_s[-1] - self.time_s[0]) if len(self) else 0.0

    def report(self):
        """What reading and selecting did, as plain data (run metadata, `testbed workload`)."""
        return {"path": self.path, "format": self.format, "rows_read": self.rows_read,
                "rows_selected": len(self), "skipped": self.skipped,
                "skip_examples": list(self.skip_examples),
                "clipped": 0 if self.clipped is None else int(self.clipped.sum())}


class _Rows:
    """Accumulates accepted rows; applies the on_error policy to rejected ones."""

    def __init__(self, path, on_error):
        self.path, self.on_error = path, on_error
        self.t, self.inp, self.out, self.line, self.blocks = [], [], [], [], []
        self.read = 0
        self.skipped = 0
        self.examples = []

    def reject(self, lineno, why):
        if self.on_error == "fail":
            raise ConfigError(f"line {lineno}: {why} (workload.trace.on_error: skip drops such "
                              f"lines and counts them)", path=self.path)
        self.skipped += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(f"line {lineno}: {why}")

    def in_order(self, lineno, t, unit):
        if self.t and t < self.t[-1]:
            self.reject(lineno, f"timestamp {_fmt(t)} {unit} is earlier than the previous "
                                f"row's {_fmt(self.t[-1])} {unit} (the trace must be in "
                                f"arrival order)")
            return False
        return True

    def add(self, lineno, row, unit):
        """Accept a parsed row (t, input, output[, block ids]) unless it is out of order."""
        t, inp, out, *ids = row
        if not self.in_order(lineno, t, unit):
            return
        self.t.append(t)
        self.inp.append(inp)
        self.out.append(out)
        self.line.append(lineno)
        if ids:
            self.blocks.append(ids[0])

    def trace(self, fmt, seconds_per_unit):
        if not self.t:
            raise ConfigError(f"no valid rows ({self.read} data lines, {self.skipped} skipped)",
                              path=self.path)
        t = np.asarray(self.t, dtype=np.float64) * seconds_per_unit     # a unit, not the Scale
        blocks = None
        if self.blocks:
            blocks = tuple(np.asarray(b, dtype=np.int64) for b in self.blocks)
        if self.skipped:
            log.warning("%s: skipped %d malformed or out-of-order lines (first: %s)",
                        self.path, self.skipped, self.examples[0])
        return Trace(path=self.path, format=fmt, time_s=t - t[0],
                     input_len=np.asarray(self.inp, dtype=np.int64),
                     output_len=np.asarray(self.out, dtype=np.int64),
                     line=np.asarray(self.line, dtype=np.int64), blocks=blocks,
                     rows_read=self.read, skipped=self.skipped,
                     skip_examples=tuple(self.examples))


def _fmt(x):
    return f"{x:g}" if isinstance(x, float) else str(x)


def _count(v):
    """A token count from a trace: a positive int up to units.MAX_TOKENS (not bool or float)."""
    return type(v) is int and 1 <= v <= units.MAX_TOKENS


def _open(path):
    """The trace's text as a file object: UTF-8, no NUL bytes, at most MAX_TRACE_BYTES."""
    return io.StringIO(read_text(path, "a trace file", MAX_TRACE_BYTES,
                                 key="workload.trace.path"), newline="")


def read_mooncake(path, on_error="fail"):
    """Mooncake JSONL: {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}."""
    rows = _Rows(str(path), on_error)
    with _open(path) as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            rows.read += 1
            why, row = _mooncake_row(text)
            if why is not None:
                rows.reject(lineno, why)
                continue
            rows.add(lineno, row, "ms")
    return rows.trace("mooncake", 1e-3)


def _mooncake_row(text):
    """(None, (t_ms, input, output, ids)) or (why it is malformed, None)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg} at column {e.colno})", None
    except (ValueError, RecursionError):
        return "not valid JSON (nested too deeply or a number out of range)", None
    if not isinstance(obj, dict):
        return "expected a JSON object", None
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids")
               if k not in obj]
    if missing:
        return f"missing {', '.join(missing)}", None
    t, inp, out, ids = (obj["timestamp"], obj["input_length"], obj["output_length"],
                        obj["hash_ids"])
    if type(t) not in (int, float) or not math.isfinite(t) or not 0 <= t <= MAX_TIMESTAMP_MS:
        return f"timestamp must be a number of ms in [0, 1e15], got {_short(t)}", None
    if not _count(inp):
        return (f"input_length must be an integer in [1, {units.MAX_TOKENS}], "
                f"got {_short(inp)}"), None
    if not _count(out):
        return (f"output_length must be an integer in [1, {units.MAX_TOKENS}], "
                f"got {_short(out)}"), None
    if not isinstance(ids, list) or not all(type(h) is int and 0 <= h <= _INT64 for h in ids):
        return "hash_ids must be a list of non-negative 64-bit integers", None
    if len(ids) != -(-inp // BLOCK_TOKENS):
        return (f"hash_ids has {len(ids)} ids but input_length {inp} needs "
                f"{-(-inp // BLOCK_TOKENS)} blocks of {BLOCK_TOKENS}"), None
    return None, (t, inp, out, ids)


def _short(v):
    text = repr(v)
    return text if len(text) <= 40 else text[:40] + "..."


def read_azure(path, on_error="fail"):
    """Azure LLM inference CSV: TIMESTAMP (wall clock), ContextTokens, GeneratedTokens."""
    rows = _Rows(str(path), on_error)
    with _open(path) as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise ConfigError("empty file; expected a CSV header with "
                              f"{', '.join(AZURE_COLUMNS)}", path=str(path)) from None
        except csv.Error as e:
            raise ConfigError(f"line 1: not valid CSV ({e})", path=str(path)) from None
        header = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise ConfigError(f"line 1: the header lacks {', '.join(missing)} (expected "
                              f"{', '.join(AZURE_COLUMNS)}), got {','.join(header)}",
                              path=str(path))
        cols = [header.index(c) for c in AZURE_COLUMNS]
        width = len(header)
        try:
            for fields in reader:
                lineno = reader.line_num
                if not fields or (len(fields) == 1 and not fields[0].strip()):
                    continue
                rows.read += 1
                why, row = _azure_row(fields, width, cols)
                if why is not None:
                    rows.reject(lineno, why)
                    continue
                rows.add(lineno, row, "s")
        except csv.Error as e:
            raise ConfigError(f"line {reader.line_num}: not valid CSV ({e})",
                              path=str(path)) from None
    tr = rows.trace("azure", 1.0)
    return tr


def _azure_row(fields, width, cols):
    if len(fields) != width:
        return f"expected {width} fields, got {len(fields)}", None
    ts, inp, out = (fields[i].strip() for i in cols)
    m = _AZURE_TIME.fullmatch(ts)
    if not m:
        return f"TIMESTAMP {ts!r} is not like 2023-11-16 18:15:46.6805900", None
    y, mo, d, h, mi, s, frac = m.groups()
    try:
        whole = calendar.timegm((int(y), int(mo), int(d), int(h), int(mi), int(s)))
    except ValueError:
        return f"TIMESTAMP {ts!r} is not a valid date", None
    # Seconds since 2000 keep sub-microsecond precision in a float64.
    t = float(whole - 946684800) + (float(frac) if frac else 0.0)
    for name, v in (("ContextTokens", inp), ("GeneratedTokens", out)):
        if not (v.isascii() and v.isdigit()) or len(v) > 12 or not 1 <= int(v) <= units.MAX_TOKENS:
            return f"{name} must be an integer in [1, {units.MAX_TOKENS}], got {_short(v)}", None
    return None, (t, int(inp), int(out))


READERS = {"mooncake": read_mooncake, "azure": read_azure}


def read(path, fmt, on_error="fail"):
    """The whole trace file as a `Trace` (raises ConfigError naming the file and line)."""
    return READERS[fmt](path, on_error)


def select(trace, spec):
    """The rows of `trace` that `spec` (TraceSpec) replays: window, row limit, input clipping."""
    t = trace.time_s
    lo = np.searchsorted(t, spec.start, side="left")
    hi = len(t) if spec.duration is None else np.searchsorted(t, spec.start + spec.duration,
                                                              side="left")
    if spec.max_requests is not None:
        hi = min(hi, lo + spec.max_requests)
    if hi <= lo:
        raise ConfigError(f"the window start {spec.start:g} s, duration "
                          f"{'(to the end)' if spec.duration is None else f'{spec.duration:g} s'}"
                          f" selects no rows (the trace spans {trace.span_s:.1f} s)",
                          path=trace.path, key="workload.trace")
    inp = trace.input_len[lo:hi].copy()
    blocks = None if trace.blocks is None else list(trace.blocks[lo:hi])
    clipped = np.zeros(hi - lo, dtype=bool)
    if spec.max_input is not None:
        clipped = inp > spec.max_input
        long = np.flatnonzero(clipped)
        inp[long] = spec.max_input
        if blocks is not None and len(long):
            _clip_blocks(blocks, long, spec.max_input, trace.blocks)
    return dataclasses.replace(
        trace, time_s=t[lo:hi], input_len=inp, output_len=trace.output_len[lo:hi],
        line=trace.line[lo:hi], blocks=None if blocks is None else tuple(blocks),
        clipped=clipped)


def _clip_blocks(blocks, rows, max_input, all_blocks):
    """Keep the blocks a clipped input still covers; a block cut short gets a fresh id.

    A block id stands for its whole content, so a block that clipping leaves partial is no
    longer the block the trace named; fresh ids above every id in the trace keep it unique.
    """
    full, partial = divmod(max_input, BLOCK_TOKENS)
    fresh = 1 + max((int(b.max()) for b in all_blocks if len(b)), default=-1)
    for i in rows:
        b = blocks[i][:full]
        if partial:
            b = np.append(b, np.int64(fresh))
            fresh += 1
        blocks[i] = b


def load(spec, base_dir=None):
    """Read and select the trace a `TraceSpec` names (path resolved as `resolve_trace_path`)."""
    path = resolve_trace_path(spec.path, base_dir)
    return select(read(path, spec.format, spec.on_error), spec)
