"""Multi-head Latent Attention (DeepSeek-V2/V3): the full-attention layer with a compressed cache.

    [c_kv | k_rope] = x W_DKV       c_kv RMS-normed (width `mla_latent`), k_rope (width
                                    `mla_rope`) rotated by RoPE and shared by every head
    [k_nope_h | v_h] = c_kv W_UKV   per head, recomputed from the latent, never cached
    q_h = [q_nope_h | RoPE(q_rope_h)] = x W_Q

The cache per token is c_kv and k_rope only: that is what a prefill ships for an MLA layer, and
it is what makes S_kv(l) grow by `(mla_latent + mla_rope) * bytes` per token per MLA layer.

* `prefill`: the explicit form, keys and values expanded from the latent, full causal attention
  (`scaled_dot_product_attention`) over the prior cache plus the new tokens.
* `step`: the absorbed form for decode. W_UK is folded into the query (q_nope_h W_UK_h lives in
  the latent space) and W_UV is applied after attending, so one step attends over the latent
  cache directly. Requests of different lengths are batched by padding with a mask.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope(x, pos, theta):
    """Rotate the halves of x [..., T, R] by angles pos [..., T] * theta^(-2i/R) (fp32 math)."""
    R = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, R, 2, device=x.device, dtype=torch.float32) / R)
    ang = pos.to(torch.float32).unsqueeze(-1) * inv_freq
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.float()[..., :R // 2], x.float()[..., R // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class LatentCache:
    """One request's MLA cache for one layer: c_kv [n, latent] and k_rope [n, rope], growable.

    Capacity doubles on demand so a decode step appends in O(1) amortised.
    """

    def __init__(self, c_kv, k_rope, spare=64):
        n = c_kv.shape[0]
        cap = n + spare
        self._c = c_kv.new_empty(cap, c_kv.shape[1])
        self._r = k_rope.new_empty(cap, k_rope.shape[1])
        self._c[:n] = c_kv
        self._r[:n] = k_rope
        self.length = n

    def append(self, c, r):
        """Add one token (c [latent], r [rope])."""
        if self.length == self._c.shape[0]:
            for name in ("_c", "_r"):
                old = getattr(self, name)
                new = old.new_empty(2 * old.shape[0], old.shape[1])
                new[:self.length] = old[:self.length]
                setattr(self, name, new)
        self._c[self.length] = c
        self._r[self.length] = r
        self.length += 1

    @property
    def c_kv(self):
        return self._c[:self.length]

    @property
    def k_rope(self):
        return self._r[:self.length]

    def tensors(self):
        return {"c_kv": self.c_kv, "k_rope": self.k_rope}


def _param(gen, shape, std):
    return nn.Parameter(torch.randn(*shape, generator=gen) * std)


class MLA(nn.Module):
    """One MLA mixer; see the module docstring."""

    kind = "mla"

    def __init__(self, cfg, gen):
        super().__init__()
        D, H = cfg.d_model, cfg.mla_heads
        self.H, self.dc, self.dr = H, cfg.mla_latent, cfg.mla_rope
        self.dn, self.dv = cfg.mla_nope, cfg.mla_v
        self.theta, self.eps = cfg.rope_theta, cfg.norm_eps
        self.scale = (self.dn + self.dr) ** -0.5
        s = D ** -0.5
        self.w_q = _param(gen, (H * (self.dn + self.dr), D), s)
        self.w_dkv = _param(gen, (self.dc + self.dr, D), s)
        self.kv_norm = nn.Parameter(torch.ones(self.dc))
        self.w_ukv = _param(gen, (H * (self.dn + self.dv), self.dc), self.dc ** -0.5)
        self.w_o = _param(gen, (D, H * self.dv), (H * self.dv) ** -0.5)

    def _queries(self, x, pos):
        """q_nope [..., T, H, dn] and rotated q_rope [..., T, H, dr] for x [..., T, D]."""
        q = F.linear(x, self.w_q).unflatten(-1, (self.H, self.dn + self.dr))
        q_nope, q_pe = q[..., :self.dn], q[..., self.dn:]
        q_pe = rope(q_pe.transpose(-2, -3), pos.unsqueeze(-2), self.theta).transpose(-2, -3)
        return q_nope, q_pe

    def _latent(self, x, pos):
        """The cache entries of x [..., T, D]: normed c_kv [..., T, dc], rotated k_rope [..., T, dr]."""
        ckr = F.linear(x, self.w_dkv)
        return rms_norm(ckr[..., :self.dc], self.kv_norm, self.eps), \
            rope(ckr[..., self.dc:], pos, self.theta)

    def prefill(self, x, cache=None):
        """x [1, T, D] for one request; cache: prior (c_kv [P, dc], k_rope [P, dr]) or None.

        Returns (out [1, T, D], (c_kv [P+T, dc], k_rope [P+T, dr])).
        """
        T = x.shape[1]
        P = 0 if cache is None else cache[0].shape[0]
        pos = torch.arange(P, P + T, device=x.device)
        q_nope, q_pe = self._queries(x[0], pos)                        # [T, H, *]
        c, r = self._latent(x[0], pos)
        if P:
            c, r = torch.cat([cache[0].to(c.dtype), c]), torch.cat([cache[1].to(r.dtype), r])
        kv = F.linear(c, self.w_ukv).unflatten(-1, (self.H, self.dn + self.dv))
        k = torch.cat([kv[..., :self.dn], r.unsqueeze(1).expand(-1, self.H, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        v = kv[..., self.dn:]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, *, *]
        if P == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # query i sits at position P + i and sees keys 0 .. P + i: causal, lower right
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, P + T),
                                               scale=self.scale)
        out = F.linear(o[0].transpose(0, 1).flatten(-2), self.w_o)
        return out.unsqueeze(0), (c, r)

    def step(self, x, caches):
        """Absorbed decode. x [B, D], one token per request; caches: B `LatentCache`s (appended)."""
        B = x.shape[0]
        pos = torch.tensor([c.length for c in caches], device=x.device)
        q_nope, q_pe = self._queries(x.unsqueeze(1), pos.unsqueeze(1))
        q_nope, q_pe = q_nope[:, 0], q_pe[:, 0]                         # [B, H, *]
        c, r = self._latent(x.unsqueeze(1), pos.unsqueeze(1))
        for b, cache in enumerate(caches):
            cache.append(c[b, 0], r[b, 0])
        L = max(cache.length for cache in caches)
        C = x.new_zeros(B, L, self.dc)
        R = x.new_zeros(B, L, self.dr)
        for b, cache in enumerate(caches):
            C[b, :cache.length] = cache.c_kv
            R[b, :cache.length] = cache.k_rope
        valid = torch.arange(L, device=x.device) < (pos + 1).unsqueeze(1)  # [B, L]
        w = self.w_ukv.view(self.H, self.dn + self.dv, self.dc)
        w_uk, w_uv = w[:, :self.dn], w[:, self.dn:]
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
        scores = (torch.einsum("bhc,blc->bhl", q_lat, C) +
                  torch.einsum("bhr,blr->bhl", q_pe, R)).float() * self.scale
        p = scores.masked_fill(~valid.unsqueeze(1), float("-inf")).softmax(-1).to(x.dtype)
        o_lat = torch.einsum("bhl,blc->bhc", p, C)
        o = torch.einsum("bhc,hvc->bhv", o_lat, w_uv)
        return F.linear(o.flatten(-2), self.w_o)
