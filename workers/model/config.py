"""The tiny hybrid model's shape: one frozen `HybridConfig` that every model piece reads.

Defaults are deliberately small (width 128, 8 layers, vocabulary 1024) so the model runs in
milliseconds on two CPU cores; the *structure* is the paper's: Kimi Delta Attention (linear,
fixed-size recurrent state) and MLA (full attention over a compressed latent cache) interleaved
at a linear:full ratio, 3:1 by default as in Kimi Linear.
"""

import dataclasses

# dtype name -> torch attribute; torch is imported only when a dtype is needed, so the
# experiment loader can check a model shape without loading torch
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig:
    vocab: int = 1024
    d_model: int = 128
    n_layers: int = 8
    ratio: str = "3:1"              # linear (KDA) : full (MLA) layers, repeated in this order
    mlp_hidden: int = 256           # SwiGLU hidden width
    # Kimi Delta Attention
    kda_heads: int = 2
    kda_head_k: int = 64            # K: key / query channels per head
    kda_head_v: int = 64            # V: value channels per head
    conv_kernel: int = 4            # causal depthwise short convolution on q, k, v
    chunk: int = 64                 # chunk length of the chunked (WY/UT) prefill form
    # MLA (DeepSeek-V2/V3)
    mla_heads: int = 2
    mla_latent: int = 64            # c_kv width (the paper's models: 512)
    mla_rope: int = 16              # shared k_rope width (the paper's models: 64)
    mla_nope: int = 32              # per-head no-position query/key width
    mla_v: int = 32                 # per-head value width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 0
    dtype: str = "float32"          # float32 (CPU and CUDA) or bfloat16 (CUDA)

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {self.dtype!r}")
        lin, full = self.ratio_parts
        if lin < 0 or full < 0 or lin + full == 0:
            raise ValueError(f"ratio: expected 'LINEAR:FULL' with a positive sum, got {self.ratio!r}")
        if self.conv_kernel < 1 or self.chunk < 1 or self.n_layers < 1:
            raise ValueError("conv_kernel, chunk and n_layers must be >= 1")
        if self.mla_rope % 2:
            raise ValueError(f"mla_rope must be even (RoPE rotates pairs), got {self.mla_rope}")

    @classmethod
    def from_dict(cls, d):
        """A config from a plain mapping (engine config, JSON); unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"unknown model config key(s) {bad}; expected some of {sorted(names)}")
        return cls(**d)

    def to_dict(self):
        return dataclasses.asdict(self)

    @property
    def ratio_parts(self):
        try:
            lin, full = (int(x) for x in self.ratio.split(":"))
        except ValueError:
            raise ValueError(f"ratio: expected 'LINEAR:FULL' such as '3:1', got {self.ratio!r}") \
                from None
        return lin, full

    @property
    def torch_dtype(self):
        import torch    # optional (the [torch] extra); the profile engine never asks
        return getattr(torch, _DTYPES[self.dtype])

    @property
    def layer_kinds(self):
        """'kda' or 'mla' per layer: each group of LINEAR+FULL layers is LINEAR KDA, then FULL MLA."""
        lin, full = self.ratio_parts
        return tuple("kda" if i % (lin + full) < lin else "mla" for i in range(self.n_layers))
