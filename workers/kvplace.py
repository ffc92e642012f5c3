"""Placement on vLLM instances by their KV events: where a request's prefix is cached.

`model.engine: vllm` (docs/vllm.md, "KV events"). The scheduler's view of each instance's
prefix cache is what that instance published (workers/kvview.py, fed by workers/kvfeed.py).
For a request it keys the prompt's blocks as vLLM would hold them and asks the view how many
leading tokens each prefill instance holds (its hit). Then:

- the cluster: the policy's rule on the incremental length. `prfaas` compares `L - h_local`
  with the threshold (h_local: the best hit among the local prefill instances; the paper's
  bandwidth-scarce rule, docs/cache.md), `naive` and `homogeneous` keep their one cluster;
- the instance in that cluster: least estimated prefill finish, its queued work plus the
  profile's prefill time of what it would not find cached, `T(L - h)`; so a request whose
  prefix one instance holds goes there unless that instance's queue costs more than the hit
  saves.

The decision is a line of decisions.jsonl like the router's, its `cache` field the view's
answer (`source`, the hits, the block size). The request's `cached_len` and the Route's are
the planned hit; the prefill reply's `cached_len` is vLLM's own count (`cached_tokens`), so
the records hold both.
"""

from __future__ import annotations

from workers.kvfeed import SOURCE
from workers.kvview import prefix_blocks
from workers.vllm_engine import prompt_ids, vocab_size


def choose(router, hits, input_len, uncached):
    """(kind, prefill, decode): the cluster by `router`'s rule on `uncached`, then the least
    queued work + T(input_len - hit) there; LookupError if nothing is up. The replay
    (testbed/sim/replay.py) calls it on a recorded decision's hits."""
    def cost(p):
        return p.outstanding_s + router.predict_s(p, max(input_len - hits.get(p.name, 0), 1))
    return router.route_to(router.wants_remote(uncached), uncached, cost)


class KvPlacer:
    """Place requests by a `CacheView` (the instances' own KV events)."""

    def __init__(self, router, view, seed, model_dir, block, write):
        self.router, self.view, self.write = router, view, write
        self.seed, self.block = seed, block
        self.vocab = vocab_size(model_dir)
        self.placed = 0
        self.hits = 0

    def prompt(self, req):
        return prompt_ids(req, self.seed, self.vocab, self.block)

    def place(self, req, now):
        """(kind, prefill, decode, Route cache fields); LookupError if nothing is up."""
        r, L = self.router, req.input_len
        hits = self.view.hit_tokens(self.prompt(req), [p.name for p in r.remote + r.local])
        h_local = max((hits[p.name] for p in r.local if not p.down), default=0)
        uncached = L - h_local
        rec = r.book(req.id, now, uncached)
        rec.cache = {"source": SOURCE, "block_size": self.view.block_size(), "input_len": L,
                     "hits": {n: h for n, h in hits.items() if h}}
        try:
            kind, p, d = choose(r, hits, L, uncached)
        except LookupError as e:
            rec.error = str(e)
            self.write(rec)
            raise
        hit = hits[p.name]
        rec.kind, rec.prefill, rec.decode = kind, p.name, d.name
        rec.cache.update(cached_len=hit, prefix_blocks=prefix_blocks(hit, self.block))
        self.write(rec)
        self.placed += 1
        self.hits += hit > 0
        req.cached_len = hit
        return kind, p, d, {"cached_len": hit,
                            "cache_source": (p.dc if hit else "")}
