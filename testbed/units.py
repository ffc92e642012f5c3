"""Quantities written the way people write them: `100Gbit`, `5ms`, `19.4K` tokens, `3/s`.

Each parser takes what YAML gave (a number or a string) and returns a plain float or int in base
units: bits per second, seconds, bytes, tokens, events per second, a probability. A bad value
raises `ValueError` with what was expected; `testbed.schema` turns that into a `ConfigError`
naming the file and key.

Prefixes, one rule for rates, byte counts and token counts: SI prefixes (k, K = 10^3, M = 10^6,
G = 10^9, T = 10^12) and IEC prefixes (Ki = 2^10, Mi = 2^20, Gi = 2^30, Ti = 2^40). So "19.4K" is
19,400 tokens (the paper's threshold, whose 49.6% offload share implies exactly that) and a
context of "128Ki" is 131,072 tokens.
"""

import math
import re

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"

_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_IEC = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_TOKENS = {"": 1, "k": 1000, "K": 1000, "M": 1000**2, "Ki": 1024, "Mi": 1024**2}
MAX_TOKENS = 16 * 1024**2     # 16Mi: beyond any model's context (a hard limit)
DAY_S = 86400.0
MAX_DURATION_S = 7 * DAY_S    # any duration, span of arrivals or scheduled change (a hard limit)
_TIME = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0,
         "min": 60.0, "m": 60.0, "h": 3600.0}


def _split(value, what):
    if isinstance(value, bool):
        raise ValueError(f"expected {what}, got a boolean")
    if isinstance(value, (int, float)):
        try:
            return float(value), ""
        except OverflowError:
            raise ValueError(f"expected {what}, got a number out of range") from None
    if not isinstance(value, str):
        raise ValueError(f"expected {what}, got {type(value).__name__}")
    m = re.fullmatch(_NUM + r"\s*(.*)", value.strip())
    if not m:
        raise ValueError(f"expected {what}, got {value!r}")
    return float(m.group(1)), m.group(2).strip()


def _finite(x, value, what):
    if not math.isfinite(x):
        raise ValueError(f"expected {what}, got {value!r}")
    return x


def number(value):
    """A plain number; accepts strings such as '1e-3' (YAML 1.1 reads those as strings)."""
    x, unit = _split(value, "a number")
    if unit:
        raise ValueError(f"expected a plain number, got {value!r}")
    return _finite(x, value, "a finite number")


def rate_bps(value):
    """Link rate in bit/s: '100Gbit', '10 Mbit/s', '1Gbps', '125MB/s' (bytes), plain number = bit/s."""
    what = "a rate such as 100Gbit, 10Mbit/s or 1Gbps"
    x, unit = _split(value, what)
    m = re.fullmatch(r"(Ki|Mi|Gi|Ti|[kKMGT]?)(bit|bps|b|B|Byte|bytes)?(/s|ps)?", unit)
    if not m or (unit and not m.group(2) and not m.group(1)):
        raise ValueError(f"expected {what}, got {value!r}")
    prefix, base = m.group(1), m.group(2) or "bit"
    scale = _IEC.get(prefix) or _SI[prefix]
    bits = 8.0 if base in ("B", "Byte", "bytes") else 1.0
    r = _finite(x * scale * bits, value, what)
    if r < 0:
        raise ValueError(f"expected a non-negative rate, got {value!r}")
    return r


def duration_s(value):
    """Time in seconds: '5ms', '250us', '1.5s', '2min'. A plain number is seconds."""
    what = "a duration such as 5ms, 250us or 60s"
    x, unit = _split(value, what)
    if unit not in _TIME and unit != "":
        raise ValueError(f"expected {what}, got {value!r}")
    d = _finite(x * _TIME.get(unit, 1.0), value, what)
    if d < 0:
        raise ValueError(f"expected a non-negative duration, got {value!r}")
    return d


def size_bytes(value):
    """Byte count: '64KiB', '1.5MB', '2GiB', plain number = bytes."""
    what = "a size such as 64KiB, 1MB or 1500"
    x, unit = _split(value, what)
    m = re.fullmatch(r"(Ki|Mi|Gi|Ti|[kKMGT]?)(B|bytes?)?", unit)
    if not m or (unit and not m.group(2)):
        raise ValueError(f"expected {what}, got {value!r}")
    scale = _IEC.get(m.group(1)) or _SI[m.group(1)]
    b = _finite(x * scale, value, what)
    if b < 0:
        raise ValueError(f"expected a non-negative size, got {value!r}")
    return b


def tokens(value):
    """Token count: '19.4K' = 19400 (K = 1000), '128Ki' = 131072 (Ki = 1024), plain integer.

    Rounded to an int; at most MAX_TOKENS."""
    what = "a token count such as 1024, 19.4K (19,400) or 128Ki (131,072)"
    x, unit = _split(value, what)
    if unit not in _TOKENS:
        raise ValueError(f"expected {what}, got {value!r}")
    t = _finite(x * _TOKENS[unit], value, what)
    if t < 0:
        raise ValueError(f"expected a non-negative token count, got {value!r}")
    if t > MAX_TOKENS:
        raise ValueError(f"expected at most {MAX_TOKENS:,} tokens (16Mi, a hard limit), "
                         f"got {value!r}")
    return int(round(t))


def per_s(value):
    """Event rate per second: '1.2/s', '72/min', '3' (per second)."""
    what = "a rate such as 1.2/s or 72/min"
    x, unit = _split(value, what)
    m = re.fullmatch(r"(?:/|per\s*)?(s|sec|min|m|h)?", unit)
    if not m:
        raise ValueError(f"expected {what}, got {value!r}")
    r = _finite(x / _TIME[m.group(1) or "s"], value, what)
    if r < 0:
        raise ValueError(f"expected a non-negative rate, got {value!r}")
    return r


def probability(value):
    """A probability: '0.1%' or 0.001, in [0, 1]."""
    what = "a probability such as 0.1% or 0.001"
    x, unit = _split(value, what)
    if unit == "%":
        x /= 100.0
    elif unit:
        raise ValueError(f"expected {what}, got {value!r}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"expected {what} between 0 and 1, got {value!r}")
    return x


def fmt_rate(bps):
    """Human form of a rate in bit/s (for tables and messages)."""
    for unit, f in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if abs(bps) >= f:
            return f"{bps / f:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def fmt_duration(s):
    """Human form of a duration in seconds."""
    if s >= 1 or s == 0:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def fmt_bytes(n):
    """Human form of a byte count (SI prefixes, as `size_bytes` reads them)."""
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.4g} {unit}"
    return f"{n:.4g} B"
