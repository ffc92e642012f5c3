"""Kimi Delta Attention (KDA): the linear-attention layer whose state does not grow with length.

Per head, with a state S in R^{K x V} and a per-key-channel decay g_t <= 0:

    S'  = diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (q_t / sqrt(K))

q, k, v come from a causal depthwise convolution (kernel 4) + SiLU, q and k are L2-normalised,
`beta = sigmoid(x W_b)` and `g = -exp(A_log) * softplus(f(x) + dt_bias)` with a low-rank f.

Two forms of the same recurrence:

* `kda_chunked` (prefill): chunks of 64 tokens. Inside a chunk the delta-rule updates form a unit
  lower-triangular system (the WY / UT transform); solving it once per chunk gives every token's
  update u_t in matrix form, so a chunk costs a few matmuls instead of 64 sequential steps. Only
  the state S crosses chunk boundaries.
* `kda_step` (decode): one recurrent step, batched over requests.

`kda_recurrent` (the step, looped) is the reference the chunked form is tested against.

What a prefill hands to the decode side for one KDA layer: S [heads, K, V] (fp32 always, the
paper's "fp32 recurrent state") and the last kernel-1 *pre-convolution* inputs of q, k and v
(the conv tail), so the first decode step convolves exactly what a full forward would.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

# Chunks whose intra-chunk matrices are built at once; bounds the [C, C, K] temporaries.
CHUNK_GROUP = 16
# Sub-chunk of the exact pairwise decay products inside a chunk (see `_decayed_products`).
SUB_CHUNK = 16


def kda_step(q, k, v, g, beta, S, scale):
    """One recurrent step. q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H]; S: [B, H, K, V]."""
    S = S * torch.exp(g).unsqueeze(-1)
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhkv,bhk->bhv", S, k))
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = torch.einsum("bhkv,bhk->bhv", S, q * scale)
    return o, S


def kda_recurrent(q, k, v, g, beta, S0=None, scale=None):
    """Reference: `kda_step` over time. q, k, g: [B, H, T, K]; v: [B, H, T, V]; beta: [B, H, T]."""
    B, H, T, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, v.shape[-1]) if S0 is None else S0
    outs = []
    for t in range(T):
        o, S = kda_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], S, scale)
        outs.append(o)
    return torch.stack(outs, dim=2), S


def kda_chunked(q, k, v, g, beta, S0=None, chunk=64, scale=None):
    """Chunked (WY/UT) form of the same recurrence; same arguments as `kda_recurrent`.

    Within a chunk, with G_t = cumsum(g) and D_ts = exp(G_t - G_s) (<= 1 for s <= t), the
    updates U = [u_t] satisfy (I + A) U = diag(beta) (V - (K * exp(G)) S0), A_ts =
    beta_t sum_k k_t k_s D_ts (s < t). With the unit lower-triangular solves
    W = (I+A)^-1 diag(beta)(K * exp(G)) and U~ = (I+A)^-1 diag(beta) V:  U = U~ - W S0,
    O = (Q * exp(G)) S0 + M U with M_ts = sum_k q_t k_s D_ts (s <= t), and
    S_C = diag(exp(G_C)) S0 + (K * exp(G_C - G))^T U.
    Padding tokens get k = v = beta = g = 0, which leaves the state untouched.
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, V) if S0 is None else S0
    if T == 0:
        return v.new_zeros(B, H, 0, V), S
    C = chunk
    pad = (-T) % C
    if pad:
        q, k, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, g))
        v = F.pad(v, (0, 0, 0, pad))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q = (q * scale).view(B, H, N, C, K)
    k = k.reshape(B, H, N, C, K)
    v = v.reshape(B, H, N, C, V)
    g = g.reshape(B, H, N, C, K)
    beta = beta.reshape(B, H, N, C, 1)
    idx = torch.arange(C, device=q.device)
    incl = (idx[:, None] >= idx[None, :])
    strict = (idx[:, None] > idx[None, :])
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    outs = []
    for n0 in range(0, N, CHUNK_GROUP):
        sl = slice(n0, n0 + CHUNK_GROUP)
        qc, kc, vc, gc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl]
        G = gc.cumsum(-2)
        KK, M = _decayed_products(kc, qc, G, incl)
        A = (KK * bc).masked_fill(~strict, 0.0)
        T_ut = A + eye
        W = torch.linalg.solve_triangular(T_ut, bc * kc * G.exp(), upper=False, unitriangular=True)
        U_t = torch.linalg.solve_triangular(T_ut, bc * vc, upper=False, unitriangular=True)
        Qg = qc * G.exp()
        G_last = G[..., -1:, :]
        Kd = (kc * torch.exp(G_last - G)).transpose(-1, -2)
        decay = G_last.exp().transpose(-1, -2)                      # [B, H, n, K, 1]
        for j in range(qc.shape[2]):
            U = U_t[:, :, j] - W[:, :, j] @ S
            outs.append(Qg[:, :, j] @ S + M[:, :, j] @ U)
            S = decay[:, :, j] * S + Kd[:, :, j] @ U
    o = torch.cat(outs, dim=-2)[:, :, :T]
    return o, S


def _decayed_products(k, q, G, incl, sub=SUB_CHUNK):
    """[C, C] matrices sum_c k_t k_s D_ts and sum_c q_t k_s D_ts (D_ts = exp(G_t - G_s), s <= t).

    Pairs inside one sub-chunk of `sub` tokens use the exact pairwise form ([sub, sub, K]
    temporaries). For a pair in different sub-chunks the decay factors through the first token r
    of t's sub-chunk: D_ts = exp(G_t - G_r) * exp(G_r - G_s), both factors <= 1 because g <= 0,
    so the block is one matmul and nothing can overflow (fla's secondary chunking, in torch).
    """
    C = G.shape[-2]
    sub = sub if C % sub == 0 else C
    nb = C // sub
    lead = G.shape[:-2]
    Kd = k.new_zeros(*lead, C, C)
    Md = k.new_zeros(*lead, C, C)
    blk = lambda x: x.reshape(*lead, nb, sub, x.shape[-1])
    Gb, kb, qb = blk(G), blk(k), blk(q)
    m = incl[:sub, :sub, None]
    Db = torch.exp((Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(~m, -math.inf))
    kk = (kb.unsqueeze(-2) * kb.unsqueeze(-3) * Db).sum(-1)          # [..., nb, sub, sub]
    qk = (qb.unsqueeze(-2) * kb.unsqueeze(-3) * Db).sum(-1)
    for i in range(nb):
        r = i * sub
        Kd[..., r:r + sub, r:r + sub] = kk[..., i, :, :]
        Md[..., r:r + sub, r:r + sub] = qk[..., i, :, :]
        if i == 0:
            continue
        Gr = G[..., r:r + 1, :]
        left = torch.exp(G[..., r:r + sub, :] - Gr)
        right = (k[..., :r, :] * torch.exp(Gr - G[..., :r, :])).transpose(-1, -2)
        Kd[..., r:r + sub, :r] = (k[..., r:r + sub, :] * left) @ right
        Md[..., r:r + sub, :r] = (q[..., r:r + sub, :] * left) @ right
    return Kd, Md


def short_conv(x, tail, weight, cuts=()):
    """Causal depthwise convolution. x: [B, T, C]; tail: [B, k-1, C] earlier inputs; weight [C, k].

    Written as k shifted multiply-adds (not cuDNN), so CPU and CUDA give the same fp32 result.
    Returns the output (fp32) and the new tail (the last k-1 inputs, x's dtype); with `cuts`
    (offsets 1..T into x) also the tail as it stood after each cut, as a list of copies.
    """
    ksz = weight.shape[1]
    T = x.shape[1]
    xe = torch.cat([tail.to(x.dtype), x], dim=1)
    xf, w = xe.float(), weight.float()
    out = sum(xf[:, j:j + T] * w[:, j] for j in range(ksz))
    # x[c-(k-1):c] sits at xe[c:c+k-1] (xe is x shifted right by the k-1 tail entries).
    at_cuts = [xe[:, c:c + ksz - 1].clone() for c in cuts]
    return (out, xe[:, xe.shape[1] - (ksz - 1):]) + ((at_cuts,) if cuts else ())


def _param(gen, shape, std):
    return nn.Parameter(torch.randn(*shape, generator=gen) * std)


class KDA(nn.Module):
    """One KDA mixer. `prefill` runs the chunked form, `step` one recurrent step for a batch."""

    kind = "kda"

    def __init__(self, cfg, gen):
        super().__init__()
        D, H, K, V, ks = cfg.d_model, cfg.kda_heads, cfg.kda_head_k, cfg.kda_head_v, cfg.conv_kernel
        self.H, self.K, self.V, self.ksz, self.chunk = H, K, V, ks, cfg.chunk
        self.eps = cfg.norm_eps
        s = D ** -0.5
        self.w_q = _param(gen, (H * K, D), s)
        self.w_k = _param(gen, (H * K, D), s)
        self.w_v = _param(gen, (H * V, D), s)
        self.conv_q = _param(gen, (H * K, ks), ks ** -0.5)
        self.conv_k = _param(gen, (H * K, ks), ks ** -0.5)
        self.conv_v = _param(gen, (H * V, ks), ks ** -0.5)
        self.w_b = _param(gen, (H, D), s)
        # Low-rank gate input f(x); small so the decay is set mostly by A_log and dt_bias,
        # giving a spread of slow and fast channels (as in the Kimi Linear / Mamba init).
        self.w_f1 = _param(gen, (K, D), s)
        self.w_f2 = _param(gen, (H * K, K), 0.1 * K ** -0.5)
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16, generator=gen)))
        dt = torch.exp(torch.empty(H * K).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))   # softplus^-1(dt)
        self.w_og = _param(gen, (H * V, D), s)
        self.o_norm = nn.Parameter(torch.ones(V))
        self.w_o = _param(gen, (D, H * V), (H * V) ** -0.5)

    # ---- state ----
    def empty_state(self, batch, device, dtype):
        return {"S": torch.zeros(batch, self.H, self.K, self.V, device=device, dtype=torch.float32),
                "conv_q": torch.zeros(batch, self.ksz - 1, self.H * self.K, device=device, dtype=dtype),
                "conv_k": torch.zeros(batch, self.ksz - 1, self.H * self.K, device=device, dtype=dtype),
                "conv_v": torch.zeros(batch, self.ksz - 1, self.H * self.V, device=device, dtype=dtype)}

    # ---- shared pieces ----
    def _inputs(self, x, state, cuts=()):
        """q, k, v (fp32, [B, T, H, *]), g, beta and the new conv tails, for x [B, T, D].

        With `cuts` the conv tails come back as a list: the tails after each cut, then the
        final ones.
        """
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        tails = {}
        convs = []
        for name, w_in, w_conv in (("conv_q", self.w_q, self.conv_q),
                                   ("conv_k", self.w_k, self.conv_k),
                                   ("conv_v", self.w_v, self.conv_v)):
            out, *tail = short_conv(F.linear(x, w_in), state[name], w_conv, cuts)
            convs.append(out)
            tails[name] = tail
        q, k, v = convs
        q = F.normalize(F.silu(q).view(B, T, H, K), dim=-1, eps=1e-6)
        k = F.normalize(F.silu(k).view(B, T, H, K), dim=-1, eps=1e-6)
        v = F.silu(v).view(B, T, H, V)
        beta = torch.sigmoid(F.linear(x, self.w_b).float())                       # [B, T, H]
        f = F.linear(F.linear(x, self.w_f1), self.w_f2).float().view(B, T, H, K)
        g = -torch.exp(self.A_log.float())[:, None] * F.softplus(f + self.dt_bias.float().view(H, K))
        final = {n: t[0] for n, t in tails.items()}
        if not cuts:
            return q, k, v, g, beta, final
        per_cut = [{n: t[1][j] for n, t in tails.items()} for j in range(len(cuts))]
        return q, k, v, g, beta, per_cut + [final]

    def _output(self, o, x):
        """Per-head RMSNorm, sigmoid output gate, output projection. o: [B, T, H, V] fp32."""
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        gate = torch.sigmoid(F.linear(x, self.w_og).float()).view(o.shape)
        return F.linear((o * gate).flatten(-2).to(x.dtype), self.w_o)

    # ---- the two forms ----
    def prefill(self, x, state=None, cuts=()):
        """x: [B, T, D]; state (or None for an empty prefix). Returns (out [B, T, D], new state).

        `cuts`: increasing offsets 1..T into x where a snapshot of the state is wanted (a prefix
        cache keeps them at block boundaries). The recurrence then runs segment by segment,
        each segment chunked from its start, and the return value is (out, [state after each
        cut..., final state]). Nothing else changes: projections and convolutions run once over
        the whole x; when the cuts are multiples of the chunk length the chunks are the same.
        """
        if state is None:
            state = self.empty_state(x.shape[0], x.device, x.dtype)
        cuts = list(cuts)
        if cuts and (cuts != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] > x.shape[1]):
            raise ValueError(f"cuts must increase within 1..{x.shape[1]}, got {cuts}")
        q, k, v, g, beta, tails = self._inputs(x, state, cuts)
        args = [t.transpose(1, 2) for t in (q, k, v, g, beta)]
        S = state["S"].float()
        outs, states = [], []
        for a, b in zip([0] + cuts, cuts + [x.shape[1]]):
            if b == a:          # a cut at T: the final state is that snapshot
                continue
            o, S = kda_chunked(*(t[:, :, a:b] for t in args), S, chunk=self.chunk)
            outs.append(o)
            states.append(S)
        if cuts and cuts[-1] == x.shape[1]:
            states.append(S)
        out = self._output(torch.cat(outs, dim=2).transpose(1, 2), x)
        if not cuts:
            return out, {"S": S, **tails}
        return out, [{"S": s, **t} for s, t in zip(states, tails)]

    def step(self, x, state):
        """x: [B, D], one token per request; state batched ([B, ...]). Returns (out [B, D], state)."""
        q, k, v, g, beta, tails = self._inputs(x.unsqueeze(1), state)
        o, S = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                        state["S"].float(), self.K ** -0.5)
        return self._output(o.unsqueeze(1), x.unsqueeze(1))[:, 0], {"S": S, **tails}
