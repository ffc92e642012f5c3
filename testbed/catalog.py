"""Model catalog: KV bytes per request, S_kv(l), computed from architecture parameters.

PRFAAS.md ("Why hybrid models") argues from these numbers: a full-attention layer caches a
fixed number of bytes per token, a linear-attention (or SWA) layer a fixed-size state, so
`S_kv(l) = a*l + c` with `a` summed over full-attention layers and `c` over the others. Each
model is a data file `testbed/models/NAME.yaml` holding its layer groups, the source of every
number and the numbers that are uncertain; this module validates the files and evaluates

    gqa     layers * kv_heads * (k_head_dim + v_head_dim) * dtype_bytes          per token
    mla     layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes             per token
    swa     layers * kv_heads * (k_head_dim + v_head_dim) * dtype_bytes * min(l, window)
    linear  layers * (heads * k_head_dim * v_head_dim * state_dtype_bytes
                      + conv_channels * (conv_kernel - 1) * conv_dtype_bytes)     per request

Where the paper gives Phi_kv (8 x H200), the prefill latency it implies is
`T_prefill(l) = S_kv(l) / Phi_kv(l)`. `testbed models` prints the table; the planner's figures
plot Phi_kv(l) from a quadratic fit of those implied latencies (as PRFAAS.md fits profiles).
"""

import dataclasses
import functools
import pathlib

import numpy as np
import yaml

from testbed.errors import ConfigError

MODEL_DIR = pathlib.Path(__file__).parent / "models"
LENGTHS = (1024, 8192, 32768, 131072)       # the paper's 1K / 8K / 32K / 128K
GBPS = 1e9
MIB = 2.0**20

KINDS = {
    "gqa": ("layers", "kv_heads", "k_head_dim", "v_head_dim", "dtype_bytes"),
    "mla": ("layers", "kv_lora_rank", "qk_rope_head_dim", "dtype_bytes"),
    "swa": ("layers", "kv_heads", "k_head_dim", "v_head_dim", "window", "dtype_bytes"),
    "linear": ("layers", "heads", "k_head_dim", "v_head_dim", "state_dtype_bytes",
               "conv_channels", "conv_kernel", "conv_dtype_bytes"),
}


@dataclasses.dataclass(frozen=True)
class Group:
    """Layers of one kind that share a cache shape."""

    name: str
    kind: str
    params: dict
    sources: dict
    uncertain: dict

    def bytes_per_token(self):
        """Bytes every token adds (full-attention layers); 0 for fixed-size states."""
        q = self.params
        if self.kind == "gqa":
            return q["layers"] * q["kv_heads"] * (q["k_head_dim"] + q["v_head_dim"]) * \
                q["dtype_bytes"]
        if self.kind == "mla":
            return q["layers"] * (q["kv_lora_rank"] + q["qk_rope_head_dim"]) * q["dtype_bytes"]
        return 0

    def state_bytes(self, l):
        """Bytes of the state that does not grow with l beyond a bound (SWA window, recurrent)."""
        q = self.params
        l = np.asarray(l, dtype=float)
        if self.kind == "swa":
            per = q["layers"] * q["kv_heads"] * (q["k_head_dim"] + q["v_head_dim"]) * \
                q["dtype_bytes"]
            return per * np.minimum(l, q["window"])
        if self.kind == "linear":
            state = q["heads"] * q["k_head_dim"] * q["v_head_dim"] * q["state_dtype_bytes"]
            conv = q["conv_channels"] * max(q["conv_kernel"] - 1, 0) * q["conv_dtype_bytes"]
            return q["layers"] * (state + conv) + 0 * l
        return 0 * l


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """One catalog model: its layer groups and the paper's Phi_kv where it gives one."""

    key: str
    name: str
    kind: str
    groups: tuple
    references: dict
    paper_phi_kv_gbps: dict     # tokens -> Gbps, or {} when the paper gives none

    @property
    def layers(self):
        return sum(g.params["layers"] for g in self.groups)

    @property
    def full_layers(self):
        return sum(g.params["layers"] for g in self.groups if g.kind in ("gqa", "mla"))

    @property
    def bytes_per_token(self):
        """a of S_kv(l) = a*l + c."""
        return sum(g.bytes_per_token() for g in self.groups)

    @property
    def state_bytes(self):
        """c of S_kv(l) = a*l + c: the fixed-size states (SWA windows full, recurrent states)."""
        l = float(LENGTHS[-1])
        return float(self.s_kv(l) - self.bytes_per_token * l)

    def s_kv(self, l):
        """KV (and state) bytes one prefill of l tokens produces."""
        l = np.asarray(l, dtype=float)
        out = self.bytes_per_token * l + sum(g.state_bytes(l) for g in self.groups)
        return float(out) if out.ndim == 0 else out

    def uncertain(self):
        """['group.param: why', ...] for every flagged number."""
        return [f"{g.name}.{k}: {v}" for g in self.groups for k, v in g.uncertain.items()]

    def implied_prefill_s(self):
        """T_prefill = S_kv / Phi_kv at each length the paper gives Phi_kv for (8 x H200)."""
        return {l: self.s_kv(l) * 8 / (gbps * GBPS) for l, gbps in self.paper_phi_kv_gbps.items()}

    def phi_kv_curve(self, l):
        """Phi_kv(l) in Gbps from a least-squares quadratic fit of the implied latencies."""
        pts = self.implied_prefill_s()
        if len(pts) < 3:
            return None
        xs = np.array(sorted(pts), dtype=float)
        c = np.polynomial.polynomial.polyfit(xs, [pts[int(x)] for x in xs], 2)
        t = np.polynomial.polynomial.polyval(np.asarray(l, dtype=float), c)
        return self.s_kv(l) * 8 / t / GBPS


def _positive_int(v, where):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"expected a non-negative integer, got {v!r}", key=where)
    return v


def _group(raw, where):
    if not isinstance(raw, dict):
        raise ConfigError("expected a mapping", key=where)
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}",
                          key=f"{where}.kind")
    params = {k: _positive_int(raw.get(k), f"{where}.{k}") for k in KINDS[kind]}
    sources = raw.get("sources") or {}
    missing = [k for k in KINDS[kind] if k not in sources]
    if missing:
        raise ConfigError(f"no source for {', '.join(missing)}", key=f"{where}.sources")
    uncertain = raw.get("uncertain") or {}
    unknown = sorted(set(uncertain) - set(KINDS[kind]))
    if unknown:
        raise ConfigError(f"flags unknown parameter {unknown[0]!r}", key=f"{where}.uncertain")
    return Group(str(raw.get("name", kind)), kind, params, dict(sources), dict(uncertain))


def available():
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


@functools.lru_cache(maxsize=None)
def load(key):
    """One catalog model by file stem (testbed/models/KEY.yaml)."""
    path = MODEL_DIR / f"{key}.yaml"
    if not path.is_file():
        raise ConfigError(f"no catalog model {key!r}; available: {', '.join(available())}")
    try:
        raw = yaml.safe_load(path.read_text())
        refs = raw.get("references") or {}
        groups = tuple(_group(g, f"groups[{i}]") for i, g in enumerate(raw["groups"]))
        for g in groups:
            bad = sorted(set(g.sources.values()) - set(refs))
            if bad:
                raise ConfigError(f"source {bad[0]!r} is not in references",
                                  key=f"{g.name}.sources")
        phi = {int(k): float(v) for k, v in (raw.get("paper_phi_kv_gbps") or {}).items()}
        return ModelArch(key, raw["name"], raw.get("kind", "hybrid"), groups, refs, phi)
    except ConfigError as e:
        raise ConfigError(str(e), path=str(path)) from None
    except (KeyError, TypeError, ValueError, AttributeError, yaml.YAMLError) as e:
        raise ConfigError(f"malformed model file ({e!r})", path=str(path)) from None


def models():
    return [load(k) for k in available()]


def table(lengths=LENGTHS):
    """Plain-data rows: S_kv and (where the paper has Phi_kv) the implied prefill latency."""
    rows = []
    for m in models():
        implied = m.implied_prefill_s()
        rows.append({
            "model": m.name, "key": m.key, "kind": m.kind, "layers": m.layers,
            "full_attention_layers": m.full_layers,
            "bytes_per_token": m.bytes_per_token,
            "state_bytes": m.state_bytes,
            "s_kv_mib": {str(l): m.s_kv(l) / MIB for l in lengths},
            "paper_phi_kv_gbps": {str(l): v for l, v in m.paper_phi_kv_gbps.items()} or None,
            "implied_prefill_s": {str(l): v for l, v in implied.items()} or None,
            "uncertain": m.uncertain(),
        })
    return rows


__all__ = ["ModelArch", "Group", "load", "models", "available", "table", "LENGTHS"]
