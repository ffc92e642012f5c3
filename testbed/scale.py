"""Scale: the one place where real-world quantities become emulated ones, and back.

The emulation runs `time` times faster than the real world and moves `bytes` times the real KV
bytes (`scale:` in the experiment file). So a real-world duration d is emulated as d / time, a
byte count b as b x bytes, a link rate r as r x bytes x time (the same fraction of the bytes in
a `time`-times shorter second), an arrival rate λ as λ x time. Every ratio of transfer time to
compute time is preserved; reports convert back with the inverse methods.

`tokens` (torch engine only) divides prompt lengths so a tiny model can replay long traces
(`model_tokens`); it is not a unit conversion of the emulator's clocks or links and has no
inverse here.

Naming convention used with it: a value suffixed `_s`, `_bytes` or `_bps` in `runtime.json`,
the workers and the run directory is *emulated* unless it says `real`; every table a user
reads (requests.parquet, tokens.parquet, summary.json, figures) is real-world.
"""

import dataclasses
import json
import pathlib


@dataclasses.dataclass(frozen=True)
class Scale:
    time: float = 1.0
    bytes: float = 1.0
    tokens: float = 1.0

    def __post_init__(self):
        for k in ("time", "bytes", "tokens"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"scale.{k} must be a positive number, got {v!r}")

    @classmethod
    def of(cls, exp):
        """The scale of an `Experiment` (testbed.config)."""
        return cls(time=exp.scale.time, bytes=exp.scale.bytes, tokens=exp.scale.tokens)

    @classmethod
    def from_dict(cls, d):
        """From a mapping with `time` and `bytes` (and optionally `tokens`), as saved in
        runtime.json, metadata.json and summary.json (`scale_time`, `scale_bytes`)."""
        d = d or {}
        get = lambda k: d.get(k, d.get(f"scale_{k}"))   # noqa: E731
        return cls(time=float(get("time") or 1.0), bytes=float(get("bytes") or 1.0),
                   tokens=float(get("tokens") or 1.0))

    @classmethod
    def load(cls, *paths):
        """The scale a run used, from the first of these JSON files that records one (a run
        directory's runtime.json, then metadata.json: `testbed.rundir.scale`)."""
        for p in map(pathlib.Path, paths):
            if p.exists():
                s = json.loads(p.read_text()).get("scale")
                if s:
                    return cls.from_dict(s)
        raise FileNotFoundError(f"no scale in {', '.join(map(str, paths))}")

    def to_dict(self):
        return dataclasses.asdict(self)

    # -- durations
    def emulated_s(self, real_s):
        return real_s / self.time

    def real_s(self, emulated_s):
        return emulated_s * self.time

    def real_ms(self, emulated_s):
        """Emulated seconds as real-world milliseconds (what tables report)."""
        return emulated_s * self.time * 1e3

    # -- byte counts
    def emulated_bytes(self, real_bytes):
        return real_bytes * self.bytes

    def real_bytes(self, emulated_bytes):
        return emulated_bytes / self.bytes

    # -- link rates (bit/s or byte/s alike)
    @property
    def rate_factor(self):
        """Emulated rate per real-world rate: bytes x time."""
        return self.bytes * self.time

    def emulated_rate(self, real_rate):
        return real_rate * self.rate_factor

    def real_rate(self, emulated_rate):
        return emulated_rate / self.rate_factor

    # -- prompt lengths (torch engine)
    def model_tokens(self, trace_tokens):
        """Model tokens (unrounded) of `trace_tokens` tokens of a trace: trace / tokens."""
        return trace_tokens / self.tokens

    # -- event rates (requests per second)
    def emulated_per_s(self, real_per_s):
        return real_per_s * self.time

    def real_per_s(self, emulated_per_s):
        return emulated_per_s / self.time
