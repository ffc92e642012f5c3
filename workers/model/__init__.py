"""The tiny real model: a KDA + MLA hybrid in torch, and the wire format of its per-layer state.

`config.HybridConfig` describes it, `hybrid.HybridModel` runs it (prefill with a per-layer state
callback, batched decode steps, a single-pass reference), `kda` and `mla` are its two mixers and
`state_wire` turns one layer's state into checksummed frames and back. The torch engines
(`workers/engine_torch.py`) and `testbed selfcheck` are built on these.
"""
