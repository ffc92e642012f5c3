"""Accelerator profiles: measured points fitted into T_prefill(l) and S_kv(l).

A profile (`testbed/profiles/NAME.yaml`) holds, for one model, the KV bytes a prefill of l tokens
produces and, per accelerator, the prefill latency at a few lengths, plus the decode step time and
maximum batch. As PRFAAS.md prescribes, the latency is fitted by least squares to
`T_prefill(l) = a + b*l + c*l^2` (attention is quadratic) and the size to `S_kv(l) = a + b*l`.

The profile engine (workers) and the planner (`testbed.plan`) both read profiles through this
module so that prediction and emulation use the same numbers. The workers evaluate fits on
scalars only: fitting and scalar evaluation are plain Python, and numpy is imported only when a
caller (the planner) passes arrays, so a profile worker stays small (docs/performance.md).
"""

import dataclasses
import functools
import pathlib

import yaml

from testbed import units
from testbed.errors import ConfigError

PROFILE_DIR = pathlib.Path(__file__).parent / "profiles"


def available():
    """Names of the profiles shipped with the testbed."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def is_path(ref):
    """`model.profile` names a file (`testbed calibrate --out`), not a shipped profile."""
    return str(ref).endswith((".yaml", ".yml"))


def resolve(ref, base_dir):
    """A profile file's path made absolute: `base_dir`/ref if it exists, else as given from the
    working directory; a shipped profile's name unchanged."""
    if not is_path(ref):
        return ref
    path = pathlib.Path(ref).expanduser()
    if not path.is_absolute() and (pathlib.Path(base_dir) / path).exists():
        path = pathlib.Path(base_dir) / path
    return str(path.resolve())


def model_name(ref):
    """The model's name as clients see it: the profile's name, or its file's stem."""
    return pathlib.Path(ref).stem if is_path(ref) else ref


@dataclasses.dataclass(frozen=True)
class Fit:
    """Polynomial in l with coefficients lowest order first; evaluates on scalars or arrays."""

    coeffs: tuple

    def __call__(self, l):
        if _is_scalar(l):
            l = float(l)
            return float(sum(c * l**i for i, c in enumerate(self.coeffs)))
        import numpy as np      # arrays only: a profile worker stays numpy-free
        l = np.asarray(l, dtype=float)
        out = np.zeros_like(l)
        for i, c in enumerate(self.coeffs):
            out = out + c * l**i
        return out


def _is_scalar(x):
    return not isinstance(x, (list, tuple)) and getattr(x, "ndim", 0) == 0


def fit(points, degree):
    """Least-squares polynomial of `degree` through `points` ((l, value) pairs), coefficients
    lowest order first. The lengths are scaled to [0, 1] before the normal equations are solved
    (Gaussian elimination with partial pivoting), which keeps them well conditioned for the
    degrees profiles use (1 and 2)."""
    xs = [float(p[0]) for p in points]
    ys = [float(p[1]) for p in points]
    if len(xs) < degree + 1:
        raise ValueError(f"need at least {degree + 1} points for a degree-{degree} fit")
    span = max(abs(x) for x in xs) or 1.0
    us = [x / span for x in xs]
    n = degree + 1
    a = [[sum(u ** (i + j) for u in us) for j in range(n)] + [sum(y * u**i for u, y in zip(us, ys))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if a[pivot][col] == 0.0:
            raise ValueError(f"the points do not determine a degree-{degree} fit")
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                k = a[r][col] / a[col][col]
                a[r] = [v - k * w for v, w in zip(a[r], a[col])]
    return Fit(tuple(a[i][n] / a[i][i] / span**i for i in range(n)))


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """Decode step time as a function of the batch: T_step(B, C), real-world seconds.

    T_step(B, C) = T_decode * (base + per_request * B / BS_max + context * C / (BS_max * C_ref))

    B is the number of requests in the step and C the context tokens they hold together. The
    three shares sum to 1, so a full batch (B = BS_max) of requests at the reference context
    C_ref takes exactly T_decode, the paper's constant: the planner's decode stage is unchanged
    at saturation, while a lighter batch steps faster and longer contexts step slower. Decode is
    memory-bound: `base` is the weights read once per step, `per_request` what each sequence adds
    whatever its length (the linear-attention state, expert spread), `context` the full-attention
    KV read, proportional to the tokens held. `constant()` is the paper's model (share 1 on
    base). `kv_capacity` (bytes, None = unbounded) is the memory an instance has for the KV of the
    requests it decodes; a request reserves S_kv(input + output) when it joins the batch.
    """

    step_s: float
    bs_max: int
    base: float = 1.0
    per_request: float = 0.0
    context: float = 0.0
    reference_context: float = 1.0
    kv_capacity: float | None = None

    def step_time(self, batch, context_tokens):
        return self.step_s * (self.base + self.per_request * batch / self.bs_max
                              + self.context * context_tokens
                              / (self.bs_max * self.reference_context))

    def constant(self):
        return dataclasses.replace(self, base=1.0, per_request=0.0, context=0.0)

    def with_step(self, step_s=None, bs_max=None, kv_capacity=None):
        return dataclasses.replace(
            self, step_s=self.step_s if step_s is None else step_s,
            bs_max=self.bs_max if bs_max is None else bs_max,
            kv_capacity=self.kv_capacity if kv_capacity is None else kv_capacity)


def _decode_model(dec):
    shares = dec.get("step_shares") or {"base": 1.0}
    if not isinstance(shares, dict) or set(shares) - {"base", "per_request", "context"}:
        raise ConfigError("expected {base, per_request, context} shares", key="decode.step_shares")
    vals = {k: float(shares.get(k, 0.0)) for k in ("base", "per_request", "context")}
    if any(v < 0 for v in vals.values()) or abs(sum(vals.values()) - 1.0) > 1e-6:
        raise ConfigError(f"shares must be >= 0 and sum to 1, got {vals}", key="decode.step_shares")
    cap = dec.get("kv_capacity")
    return DecodeModel(step_s=units.duration_s(dec.get("step_time", "25ms")),
                       bs_max=int(dec.get("bs_max", 20)), **vals,
                       reference_context=float(units.tokens(dec.get("reference_context", 1))),
                       kv_capacity=None if cap is None else float(units.size_bytes(cap)))


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    kv_size: Fit                  # S_kv(l), bytes
    prefill: dict                 # accelerator -> Fit of T_prefill(l), seconds
    kv_points: tuple
    prefill_points: dict
    decode_step_s: float          # T_decode
    bs_max: int                   # BS_max
    stream_chunks: int
    decode: DecodeModel = None    # T_step(B, C) and the decode memory
    weights_bytes: float = 0.0    # the weights' footprint on one instance
    memory: dict = dataclasses.field(default_factory=dict)   # accelerator -> bytes per instance
    kv_transfer: str = "stream"   # stream: KV sent while it is computed; pull: after (kvpull)
    kv_pull_latency_s: float = 0.0  # pull: the connector's fixed cost per transfer, seconds

    def free_memory(self, accelerator):
        """Accelerator memory of one instance left after the weights (the prefix cache's share)."""
        if accelerator not in self.memory:
            raise ConfigError(f"profile {self.name!r} gives no memory for {accelerator!r}; set "
                              f"cache.capacity", key="cache.capacity")
        return max(0.0, self.memory[accelerator] - self.weights_bytes)

    def t_prefill(self, accelerator, l):
        return self.prefill[accelerator](l)

    def s_kv(self, l):
        return self.kv_size(l)

    def t_prefill_cached(self, accelerator, l, cached):
        """Prefill time of `l` input tokens of which the first `cached` come from a prefix
        cache (docs/cache.md): T(l) - T(cached) + T(0). The suffix's tokens still attend over
        the whole context, so the quadratic term costs c*(l^2 - cached^2), more than
        T(l - cached) would charge; the linear term counts only the new tokens; the fixed
        per-request cost T(0) = a (launch, scheduling, the first layer's setup) is paid once,
        cached or not. `cached` = 0 gives T(l)."""
        f = self.prefill[accelerator]
        if _is_scalar(l) and _is_scalar(cached):
            l = float(l)
            return f(l) - f(min(float(cached), l)) + f.coeffs[0]
        import numpy as np      # arrays only: a profile worker stays numpy-free
        l = np.asarray(l, dtype=float)
        cached = np.minimum(np.asarray(cached, dtype=float), l)
        out = f(l) - f(cached) + f.coeffs[0]
        return float(out) if np.ndim(out) == 0 else out

    def phi_kv(self, accelerator, l):
        """KV throughput of one instance, bytes/s: Phi_kv(l) = S_kv(l) / T_prefill(l)."""
        return self.s_kv(l) / self.t_prefill(accelerator, l)


KV_TRANSFER_MODES = ("stream", "pull")


def _transfer(data):
    """`kv_transfer` (stream | pull) and `kv_pull_latency` (a duration >= 0, pull only)."""
    mode = data.get("kv_transfer", "stream")
    if mode not in KV_TRANSFER_MODES:
        raise ConfigError(f"expected one of {', '.join(KV_TRANSFER_MODES)}, got {mode!r}",
                          key="kv_transfer")
    if "kv_pull_latency" not in data:
        return {"kv_transfer": mode}
    if mode != "pull":
        raise ConfigError("applies to kv_transfer: pull only", key="kv_pull_latency")
    try:
        latency = units.duration_s(data["kv_pull_latency"])
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), key="kv_pull_latency") from None
    if not 0 <= latency < 60:
        raise ConfigError(f"expected a duration from 0 to 60s, got {data['kv_pull_latency']!r}",
                          key="kv_pull_latency")
    return {"kv_transfer": mode, "kv_pull_latency_s": latency}


def _points(mapping, parse, where):
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError("expected a mapping of token count -> value", key=where)
    pts = []
    for k, v in mapping.items():
        try:
            pts.append((units.tokens(k), parse(v)))
        except ValueError as e:
            raise ConfigError(str(e), key=f"{where}.{k}") from None
    return tuple(sorted(pts))


# libyaml's parser with PyYAML's safe constructor and resolver: the same data as safe_load, a
# tenth of its CPU (0.5 ms against 4.6 for a profile); every worker process loads its profile.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(name_or_path):
    """Load and fit a profile by name (from testbed/profiles) or by path."""
    path = pathlib.Path(name_or_path)
    if not is_path(name_or_path):
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"no profile {name_or_path!r}; available: {', '.join(available())} "
                          f"or a profile file's path", key="model.profile")
    return _load(path.resolve(), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _load(path, mtime_ns):
    """The fitted profile of one file version (every engine of a simulated cluster of thousands
    loads it: parsed once)."""
    try:
        data = yaml.load(path.read_text(), Loader=_LOADER)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", path=str(path)) from None
    try:
        kv = _points(data["kv_size"]["points"], units.size_bytes, "kv_size.points")
        accs = data["accelerators"]
        lat = {a: _points(v["prefill_latency"], units.duration_s, f"accelerators.{a}")
               for a, v in accs.items()}
        dec = data.get("decode", {})
        return Profile(
            name=data.get("name", path.stem),
            kv_size=fit(kv, 1),
            prefill={a: fit(p, 2) for a, p in lat.items()},
            kv_points=kv,
            prefill_points=lat,
            decode_step_s=units.duration_s(dec.get("step_time", "25ms")),
            bs_max=int(dec.get("bs_max", 20)),
            stream_chunks=int(data.get("stream_chunks", 16)),
            decode=_decode_model(dec),
            weights_bytes=units.size_bytes(data.get("weights", 0)),
            memory={a: units.size_bytes(v) for a, v in (data.get("memory") or {}).items()},
            **_transfer(data),
        )
    except ConfigError as e:
        raise ConfigError(str(e), path=str(path)) from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"malformed profile ({e!r})", path=str(path)) from None
