"""The hybrid stack: KDA and MLA mixers interleaved at the configured ratio, random weights.

Each block is pre-norm: x += mixer(norm(x)); x += SwiGLU(norm(x)). Weights come from a CPU
generator seeded by `cfg.seed`, so two processes (a prefill worker and a decode worker, on any
device) build bit-identical models; they are then cast to `cfg.dtype` on the chosen device.

Three entry points, all without autograd:

* `prefill(tokens, state=None, on_layer=None, snapshot_at=())` -> (logits of the last token,
  `RequestState`). `on_layer(i, kind, tensors)` fires as soon as layer i's state is final,
  before layer i+1 is computed: that is where layer-wise streaming hands a layer to the network
  while the rest of the prefill runs. A prior `state` continues a prefix (chunked prefill /
  prefix cache: only the new tokens are computed, attending over the prior MLA latents, KDA
  starting from the prior recurrent state). `snapshot_at` (absolute token positions) keeps the
  KDA layers' state at those positions in `RequestState.snapshots` (`workers.model.prefix`
  cuts them into pool blocks).
* `decode_step(states, tokens)` -> logits [B, vocab], one token for each of B requests of any
  lengths (continuous batching); each `RequestState` is advanced in place.
* `forward_full(tokens)` -> logits for every position in one pass: the reference the
  prefill -> ship -> decode path must reproduce.

Per-layer state (what crosses the WAN), for a request of l tokens:
  KDA: S [heads, K, V] fp32 + conv tails conv_q, conv_k [kernel-1, heads*K], conv_v
       [kernel-1, heads*V] in the model dtype -- constant in l;
  MLA: c_kv [l, latent] + k_rope [l, rope] in the model dtype -- linear in l.
`state_bytes` measures it on real tensors; `analytical_state_bytes` is the formula.
"""

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import HybridConfig
from workers.model.kda import KDA
from workers.model.mla import MLA, LatentCache, rms_norm

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def resolve_device(device):
    """'auto' -> cuda when available, else cpu; anything else is passed to torch.device."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class RequestState:
    """One request's per-layer state on the decode (or prefill) side, plus its length in tokens.

    `layers[i]` is a dict of tensors for a KDA layer (no batch dim) and a `LatentCache` for an
    MLA layer. `snapshots` maps a token position to {KDA layer index: its state after that
    many tokens}, for the positions a prefill was asked to keep (`snapshot_at`).
    """

    def __init__(self, kinds, layers, length, snapshots=None):
        self.kinds = tuple(kinds)
        self.layers = layers
        self.length = length
        self.snapshots = snapshots or {}

    def layer_tensors(self, i):
        """Layer i's state as name -> tensor (the unit that is shipped)."""
        st = self.layers[i]
        return st.tensors() if self.kinds[i] == "mla" else dict(st)

    def nbytes(self):
        return sum(t.numel() * t.element_size()
                   for i in range(len(self.layers)) for t in self.layer_tensors(i).values())

    @classmethod
    def from_layer_tensors(cls, cfg, tensors, device=None, length=None):
        """Rebuild from per-layer dicts (as `state_wire.LayerAssembler.states()` returns them)."""
        kinds = cfg.layer_kinds
        if len(tensors) != len(kinds):
            raise ValueError(f"state has {len(tensors)} layers, model has {len(kinds)}")
        dev = resolve_device(device or "cpu")
        dt = cfg.torch_dtype
        layers = []
        for i, (kind, t) in enumerate(zip(kinds, tensors)):
            expect = {"kda": {"S", "conv_q", "conv_k", "conv_v"}, "mla": {"c_kv", "k_rope"}}[kind]
            if set(t) != expect:
                raise ValueError(f"layer {i} ({kind}): tensors {sorted(t)}, expected {sorted(expect)}")
            if kind == "kda":
                layers.append({"S": t["S"].to(dev, torch.float32),
                               **{n: t[n].to(dev, dt) for n in ("conv_q", "conv_k", "conv_v")}})
            else:
                layers.append(LatentCache(t["c_kv"].to(dev, dt), t["k_rope"].to(dev, dt)))
        if length is None:
            mla = [c.length for c in layers if isinstance(c, LatentCache)]
            if not mla:
                raise ValueError("no MLA layer: pass the request length explicitly")
            length = mla[0]
        return cls(kinds, layers, length)


class SwiGLU(nn.Module):
    def __init__(self, cfg, gen):
        super().__init__()
        D, F_ = cfg.d_model, cfg.mlp_hidden
        self.w_gate = nn.Parameter(torch.randn(F_, D, generator=gen) * D ** -0.5)
        self.w_up = nn.Parameter(torch.randn(F_, D, generator=gen) * D ** -0.5)
        self.w_down = nn.Parameter(torch.randn(D, F_, generator=gen) * F_ ** -0.5)

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)


class Block(nn.Module):
    def __init__(self, cfg, kind, gen):
        super().__init__()
        self.kind = kind
        self.norm1 = nn.Parameter(torch.ones(cfg.d_model))
        self.mixer = KDA(cfg, gen) if kind == "kda" else MLA(cfg, gen)
        self.norm2 = nn.Parameter(torch.ones(cfg.d_model))
        self.mlp = SwiGLU(cfg, gen)
        self.eps = cfg.norm_eps
        # Residual branches scaled so activations stay O(1) through the stack.
        self.res_scale = (2 * cfg.n_layers) ** -0.5

    def mlp_residual(self, x):
        return x + self.res_scale * self.mlp(rms_norm(x, self.norm2, self.eps))


class HybridModel(nn.Module):
    """The KDA + MLA hybrid; see the module docstring."""

    def __init__(self, cfg=None, device="cpu"):
        super().__init__()
        self.cfg = cfg = cfg or HybridConfig()
        self.device = resolve_device(device)
        if cfg.torch_dtype == torch.bfloat16 and self.device.type == "cpu":
            raise ValueError("dtype bfloat16 is for CUDA; use float32 on cpu")
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = nn.Parameter(torch.randn(cfg.vocab, cfg.d_model, generator=gen))
        self.blocks = nn.ModuleList(Block(cfg, kind, gen) for kind in cfg.layer_kinds)
        self.norm_f = nn.Parameter(torch.ones(cfg.d_model))
        self.lm_head = nn.Parameter(torch.randn(cfg.vocab, cfg.d_model, generator=gen)
                                    * cfg.d_model ** -0.5)
        self.to(device=self.device, dtype=cfg.torch_dtype)
        self.requires_grad_(False)
        self.eval()

    @property
    def kinds(self):
        return self.cfg.layer_kinds

    def _tokens(self, tokens):
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        if t.dim() != 1:
            raise ValueError(f"tokens: expected a 1-D sequence, got shape {tuple(t.shape)}")
        return t

    def _logits(self, x):
        return F.linear(rms_norm(x, self.norm_f, self.cfg.norm_eps), self.lm_head).float()

    @torch.no_grad()
    def _run(self, tokens, state, on_layer, all_logits, snapshot_at=()):
        tok = self._tokens(tokens)
        x = self.embed[tok].unsqueeze(0)                                   # [1, T, D]
        start = 0 if state is None else state.length
        cuts = [p - start for p in snapshot_at]
        if cuts and (cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] > len(tok)):
            raise ValueError(f"snapshot_at must increase within {start + 1}..{start + len(tok)}"
                             f" (the tokens this prefill computes), got {list(snapshot_at)}")
        layers, snapshots = [], {p: {} for p in snapshot_at}
        for i, blk in enumerate(self.blocks):
            h = rms_norm(x, blk.norm1, self.cfg.norm_eps)
            prior = None if state is None else state.layers[i]
            if blk.kind == "kda":
                if prior is not None:
                    prior = {n: t.unsqueeze(0) for n, t in prior.items()}
                out, st = blk.mixer.prefill(h, prior, cuts)
                if cuts:
                    for p, snap in zip(snapshot_at, st):
                        snapshots[p][i] = {n: t[0] for n, t in snap.items()}
                    st = st[-1]
                layer = {n: t[0] for n, t in st.items()}
            else:
                if prior is not None:
                    prior = (prior.c_kv, prior.k_rope)
                out, (c, r) = blk.mixer.prefill(h, prior)
                layer = LatentCache(c, r)
            layers.append(layer)
            if on_layer is not None:
                on_layer(i, blk.kind, layer.tensors() if blk.kind == "mla" else dict(layer))
            x = blk.mlp_residual(x + blk.res_scale * out)
        logits = self._logits(x[0] if all_logits else x[0, -1])
        return logits, RequestState(self.kinds, layers, start + len(tok), snapshots)

    def prefill(self, tokens, state=None, on_layer=None, snapshot_at=()):
        """Logits [vocab] of the last token and the request's state; see the module docstring."""
        if len(tokens) == 0:
            raise ValueError("prefill needs at least one token")
        return self._run(tokens, state, on_layer, all_logits=False, snapshot_at=snapshot_at)

    def forward_full(self, tokens):
        """Logits [T, vocab] of every position, in one pass (chunked KDA, causal MLA)."""
        return self._run(tokens, None, None, all_logits=True)[0]

    @torch.no_grad()
    def decode_step(self, states, tokens):
        """One token for each request in `states` (a list of `RequestState`), advanced in place."""
        tok = self._tokens(tokens)
        if len(tok) != len(states) or not states:
            raise ValueError(f"decode_step: {len(states)} states but {len(tok)} tokens")
        x = self.embed[tok]                                                # [B, D]
        for i, blk in enumerate(self.blocks):
            h = rms_norm(x, blk.norm1, self.cfg.norm_eps)
            if blk.kind == "kda":
                batched = {n: torch.stack([s.layers[i][n] for s in states])
                           for n in states[0].layers[i]}
                out, new = blk.mixer.step(h, batched)
                for b, s in enumerate(states):
                    s.layers[i] = {n: t[b] for n, t in new.items()}
            else:
                out = blk.mixer.step(h, [s.layers[i] for s in states])
            x = blk.mlp_residual(x + blk.res_scale * out)
        for s in states:
            s.length += 1
        return self._logits(x)


# ---- S_kv(l): measured and analytical ----

def _elt(dtype):
    return DTYPE_BYTES[dtype]


def analytical_layer_bytes(cfg, i, l):
    """Bytes of layer i's state after l tokens, from the architecture alone."""
    e = _elt(cfg.torch_dtype)
    if cfg.layer_kinds[i] == "kda":
        H, K, V = cfg.kda_heads, cfg.kda_head_k, cfg.kda_head_v
        return H * K * V * 4 + (cfg.conv_kernel - 1) * (2 * H * K + H * V) * e
    return l * (cfg.mla_latent + cfg.mla_rope) * e


def analytical_state_bytes(cfg, l):
    """S_kv(l) = a*l + c for this architecture: a from the MLA layers, c from the KDA layers."""
    return sum(analytical_layer_bytes(cfg, i, l) for i in range(cfg.n_layers))


def state_bytes(cfg, l, model=None, seed=0):
    """S_kv(l) measured: prefill l random tokens and add up the real state tensors' bytes."""
    model = model or HybridModel(cfg)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (l,), generator=g)
    _, st = model.prefill(tokens)
    return st.nbytes()
