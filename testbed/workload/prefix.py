"""Shared prefixes as chained 512-token block ids, and what an unbounded prefix cache would hit.

Block ids follow the Mooncake trace format: a request's input is cut into 512-token blocks and
each block gets an id that stands for the block *and everything before it* (a chained hash).
Two requests that share their first k ids therefore share their first k*512 tokens, and a
prefix cache can be emulated from the ids alone, without any text.

`synthetic_blocks` makes such ids for a synthetic workload: `documents` shared prefixes with
Zipf popularity; a request that uses document d starts with d's first whole blocks (at most
`length` tokens, at most its own input) and continues with blocks no other request has.
`hit_tokens` replays a request list in arrival order against an unbounded cache.
"""

import numpy as np

from testbed.workload.spec import BLOCK_TOKENS


def blocks_needed(input_len):
    """ceil(input_len / 512): the number of block ids a request of that length carries."""
    return -(-np.asarray(input_len, dtype=np.int64) // BLOCK_TOKENS)


def empty(n):
    """n empty block lists (no prefix information)."""
    e = np.empty(0, dtype=np.int64)
    return [e] * n


def zipf_weights(n, s):
    """P(document k) ~ 1/k^s for k = 1..n (s = 0 is uniform)."""
    w = np.arange(1, n + 1, dtype=np.float64) ** -s
    return w / w.sum()


def synthetic_blocks(spec, input_len, rng):
    """Block ids of each request under PrefixSpec `spec`; empty lists when documents == 0."""
    n = len(input_len)
    if spec.documents == 0:
        return empty(n)
    per_doc = spec.length // BLOCK_TOKENS
    doc = rng.choice(spec.documents, size=n, p=zipf_weights(spec.documents, spec.zipf))
    uses = rng.random(n) < spec.share
    total = blocks_needed(input_len)
    shared = np.where(uses, np.minimum(per_doc, np.asarray(input_len) // BLOCK_TOKENS), 0)
    own = total - shared
    # Document d owns ids [d*per_doc, (d+1)*per_doc); ids of unshared blocks follow, in
    # request order, so every id names one (prefix, block) pair.
    own_start = spec.documents * per_doc + np.concatenate(([0], np.cumsum(own)[:-1]))
    out = []
    for d, k, o, s in zip(doc.tolist(), shared.tolist(), own.tolist(), own_start.tolist()):
        out.append(np.concatenate((np.arange(d * per_doc, d * per_doc + k, dtype=np.int64),
                                   np.arange(s, s + o, dtype=np.int64))))
    return out


def hit_tokens(blocks, input_len):
    """Tokens of each request an unbounded prefix cache holds when it arrives (arrival order).

    A request hits its longest run of leading block ids that earlier requests carried; the
    hit is that many blocks of 512 tokens, at most its input length (the last block may be
    partial). Requests must be given in arrival order.
    """
    seen = set()
    hits = np.zeros(len(blocks), dtype=np.int64)
    for i, (ids, length) in enumerate(zip(blocks, np.asarray(input_len).tolist())):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        k = 0
        for h in ids:
            if h not in seen:
                break
            k += 1
        hits[i] = min(k * BLOCK_TOKENS, length)
        seen.update(ids)
    return hits


def hit_share(blocks, input_len):
    """Share of all input tokens an unbounded prefix cache would hit, in arrival order."""
    total = int(np.sum(input_len))
    return float(hit_tokens(blocks, input_len).sum() / total) if total else 0.0
