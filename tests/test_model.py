"""Unit tests of the tiny hybrid model and its state wire format (no root, CPU, fp32)."""

import pytest
import torch
import torch.nn.functional as F

from testbed.scale import Scale
from workers.model import state_wire
from workers.model.config import HybridConfig
from workers.model.hybrid import (HybridModel, RequestState, analytical_layer_bytes,
                                  analytical_state_bytes, state_bytes)
from workers.model.kda import kda_chunked, kda_recurrent
from workers.model.mla import LatentCache
from workers.model.state_wire import (ALIGN, PACK_BYTES, LayerAssembler, StateWireError,
                                      encode_layer, encode_state)

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return HybridModel(HybridConfig(seed=3))


def _tokens(n, seed=0, vocab=1024):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _kda_inputs(T, decay, seed, B=2, H=2, K=32, V=48):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, H, T, K, generator=g), dim=-1)
    v = torch.randn(B, H, T, V, generator=g)
    gate = -decay * torch.rand(B, H, T, K, generator=g) * torch.rand(B, H, 1, K, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    S0 = torch.randn(B, H, K, V, generator=g)
    return q, k, v, gate, beta, S0


@pytest.mark.parametrize("T,decay,chunk", [(200, 2.0, 64), (64, 0.01, 64), (150, 20.0, 64),
                                           (90, 1.0, 40), (1, 1.0, 64)])
def test_chunked_kda_equals_recurrent_steps(T, decay, chunk):
    q, k, v, g, beta, S0 = _kda_inputs(T, decay, seed=T)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, S0)
    o, S = kda_chunked(q, k, v, g, beta, S0, chunk=chunk)
    assert (o - o_ref).abs().max() < 1e-5
    assert (S - S_ref).abs().max() < 1e-5


def test_kda_layer_prefill_equals_layer_steps(model):
    """The layer's chunked prefill == feeding it one token at a time (conv tails included)."""
    layer = model.blocks[0].mixer
    x = torch.randn(1, 100, model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    out, st = layer.prefill(x)
    state = layer.empty_state(1, x.device, x.dtype)
    steps = []
    for t in range(x.shape[1]):
        o, state = layer.step(x[:, t], state)
        steps.append(o)
    assert (torch.stack(steps, 1) - out).abs().max() < 1e-5
    for name in st:
        assert (st[name] - state[name]).abs().max() < 1e-5, name


def test_mla_absorbed_decode_equals_naive(model):
    """Absorbed decode over the latent cache == explicit keys/values from the same cache."""
    layer = model.blocks[3].mixer
    assert layer.kind == "mla"
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 70, model.cfg.d_model, generator=g)
    _, (c, r) = layer.prefill(x)
    nxt = torch.randn(1, 1, model.cfg.d_model, generator=g)
    naive, _ = layer.prefill(nxt, (c, r))
    absorbed = layer.step(nxt[:, 0], [LatentCache(c, r)])
    assert (absorbed - naive[:, 0]).abs().max() < 1e-5


def test_prefill_then_batched_decode_equals_forward_full(model):
    """Two requests of different lengths decoded in one batch == one full pass each."""
    toks = _tokens(260, seed=5)
    full = model.forward_full(toks)
    la, a = model.prefill(toks[:100])
    lb, b = model.prefill(toks[:190])
    assert (la - full[99]).abs().max() < TOL and (lb - full[189]).abs().max() < TOL
    worst = 0.0
    for j in range(40):
        out = model.decode_step([a, b], torch.stack([toks[100 + j], toks[190 + j]]))
        worst = max(worst, (out[0] - full[100 + j]).abs().max().item(),
                    (out[1] - full[190 + j]).abs().max().item())
    assert worst < TOL
    assert (a.length, b.length) == (140, 230)


def test_prefill_continues_from_a_prefix_state(model):
    toks = _tokens(250, seed=6)
    full = model.forward_full(toks)
    _, st = model.prefill(toks[:130])
    logits, st = model.prefill(toks[130:], state=st)
    assert (logits - full[-1]).abs().max() < TOL and st.length == 250


def test_layer_callback_fires_per_layer_with_the_final_state(model):
    seen = []
    _, st = model.prefill(_tokens(80), on_layer=lambda i, kind, t: seen.append((i, kind, t)))
    assert [i for i, _, _ in seen] == list(range(model.cfg.n_layers))
    assert tuple(k for _, k, _ in seen) == model.cfg.layer_kinds
    for i, _, tensors in seen:
        for name, t in st.layer_tensors(i).items():
            assert torch.equal(tensors[name], t)


def test_same_seed_same_weights():
    a, b = HybridModel(HybridConfig(seed=9)), HybridModel(HybridConfig(seed=9))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("ratio", ["3:1", "1:1", "1:0", "0:1"])
def test_measured_state_bytes_equal_the_formula(ratio):
    cfg = HybridConfig(ratio=ratio, n_layers=4, d_model=64)
    m = HybridModel(cfg)
    for l in (1, 64, 333):
        assert state_bytes(cfg, l, m) == analytical_state_bytes(cfg, l)
    # KDA layers are constant in l, MLA layers linear: S_kv(l) = a*l + c.
    a = sum(analytical_layer_bytes(cfg, i, 1) - analytical_layer_bytes(cfg, i, 0)
            for i in range(cfg.n_layers))
    assert analytical_state_bytes(cfg, 1000) - analytical_state_bytes(cfg, 0) == 1000 * a


# ---- wire ----

def test_wire_roundtrip_is_bit_exact_and_rebuilds_the_state(model):
    _, st = model.prefill(_tokens(300))
    frames = encode_state(st, chunk_bytes=5000)
    asm = LayerAssembler(model.cfg.n_layers, model.cfg.layer_kinds)
    done = [asm.feed(bytes(f)) for f in frames]
    assert [d for d in done if d is not None] == list(range(model.cfg.n_layers))
    assert asm.complete
    st2 = RequestState.from_layer_tensors(model.cfg, asm.states())
    assert st2.length == 300 and st2.nbytes() == st.nbytes()
    for i in range(model.cfg.n_layers):
        for name, t in st.layer_tensors(i).items():
            got = st2.layer_tensors(i)[name]
            assert got.dtype == t.dtype and torch.equal(got, t)


def test_wire_sends_tensor_memory_without_copying():
    t = torch.arange(PACK_BYTES // 4, dtype=torch.float32)
    frames = encode_layer(0, {"x": t}, n_layers=1, chunk_bytes=1024)
    t[0] = 42.0   # a large tensor's data frame is a view of the tensor itself
    assert bytes(frames[1][:4]) == t[:1].numpy().tobytes()


def test_wire_packs_small_tensors_into_one_frame_and_aligns_them():
    """A KDA-like layer: small tensors of odd sizes share a data frame (copied, each at an
    ALIGN-aligned offset), a large one is cut into views; the receiver rebuilds all of them."""
    g = torch.Generator().manual_seed(3)
    ts = {"a": torch.randn(5, 3, generator=g), "b": torch.randint(0, 9, (7,), generator=g),
          "h": torch.randn(3, generator=g).to(torch.bfloat16), "e": torch.empty(0, 4),
          "big": torch.randn(PACK_BYTES // 4 + 3, generator=g)}
    frames = encode_layer(0, ts, n_layers=1, chunk_bytes=1 << 15)
    big = ts["big"].numel() * 4
    assert [memoryview(f).nbytes for f in frames[1:]][1:] == [1 << 15, 1 << 15, big - (1 << 16)]
    asm = LayerAssembler(1)
    for f in frames:
        asm.feed(bytes(f))
    got = asm.states()[0]
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in ts.items())
    assert all(got[n].data_ptr() % ALIGN == 0 for n in ts if ts[n].numel())


def test_wire_sends_padding_with_the_packed_frame_before_a_large_tensor():
    """Padding before a large tensor ends the packed frame before it, not a frame of its own."""
    ts = {"a": torch.ones(10, dtype=torch.uint8), "big": torch.ones(100000, dtype=torch.uint8)}
    frames = encode_layer(0, ts, n_layers=1, chunk_bytes=65536)
    assert [memoryview(f).nbytes for f in frames[1:]] == [ALIGN, 65536, 100000 - 65536]
    asm = LayerAssembler(1)
    for f in frames:
        asm.feed(bytes(f))
    assert all(torch.equal(asm.states()[0][n], t) for n, t in ts.items())


def test_wire_handles_empty_tensors_and_interleaved_streams():
    cfg = HybridConfig(conv_kernel=1, n_layers=4, d_model=64)   # empty conv tails
    m = HybridModel(cfg)
    _, st = m.prefill(_tokens(70))
    per_layer = [encode_layer(i, st.layer_tensors(i), 4, st.kinds[i], 3000) for i in range(4)]
    asm = LayerAssembler(4, cfg.layer_kinds)
    # Layers 0/1 on stream "a", 2/3 on stream "b", frames interleaved between streams.
    a = per_layer[0] + per_layer[1]
    b = per_layer[2] + per_layer[3]
    for i in range(max(len(a), len(b))):
        if i < len(a):
            asm.feed(a[i], stream="a")
        if i < len(b):
            asm.feed(b[i], stream="b")
    assert asm.complete
    assert all(torch.equal(asm.states()[i][n], t)
               for i in range(4) for n, t in st.layer_tensors(i).items())


def _frames(model):
    _, st = model.prefill(_tokens(100))
    return [bytes(f) for f in encode_layer(3, st.layer_tensors(3), model.cfg.n_layers, "mla", 4096)]


def test_wire_detects_a_flipped_byte(model):
    frames = _frames(model)
    bad = bytearray(frames[2])
    bad[17] ^= 0x01
    asm = LayerAssembler(model.cfg.n_layers, model.cfg.layer_kinds)
    with pytest.raises(StateWireError, match="crc32 mismatch"):
        for f in frames[:2] + [bytes(bad)] + frames[3:]:
            asm.feed(f)


@pytest.mark.parametrize("mutate,match", [
    (lambda fr: [fr[0][:-3] + b"xyz"] + fr[1:], "header corrupt"),
    (lambda fr: fr[:1] + [fr[1][:-1]] + fr[2:], "crc32 mismatch"),     # a byte lost
    (lambda fr: fr[:-1] + [fr[-1] + b"x"], "runs past"),               # one too many
    (lambda fr: [fr[0][:4] + b"\x01" + fr[0][5:]] + fr[1:], "version 1, this receiver reads 2"),
    (lambda fr: fr[1:], "magic"),
])
def test_wire_rejects_corrupt_or_truncated_frames(model, mutate, match):
    asm = LayerAssembler(model.cfg.n_layers, model.cfg.layer_kinds)
    with pytest.raises(StateWireError, match=match):
        for f in mutate(_frames(model)):
            asm.feed(f)


def test_wire_rejects_a_mismatched_model_and_incomplete_state(model):
    frames = _frames(model)
    with pytest.raises(StateWireError, match="layers"):
        LayerAssembler(4).feed(frames[0])
    with pytest.raises(StateWireError, match="'mla'"):
        LayerAssembler(8, ["kda"] * 8).feed(frames[0])
    asm = LayerAssembler(model.cfg.n_layers, model.cfg.layer_kinds)
    for f in frames:
        asm.feed(f)
    with pytest.raises(StateWireError, match="twice"):
        asm.feed(frames[0])
    with pytest.raises(StateWireError, match=r"missing"):
        asm.states()


# ---- engines ----

def test_torch_engines_stream_layers_and_decode_like_forward_full():
    import asyncio

    from workers.engine_torch import TorchDecodeEngine, TorchPrefillEngine, emit_sender

    cfg = HybridConfig(seed=4, n_layers=4, d_model=64)
    pre, dec = TorchPrefillEngine(cfg, "cpu", chunk_bytes=4096), TorchDecodeEngine(cfg, "cpu")
    reqs = [{"id": 7, "input_len": 90}, {"id": 8, "input_len": 150}]
    layers_seen = []

    async def go():
        out = []
        for r in reqs:
            def emit(seq, payload, last, rid=r["id"]):
                dec.receive(rid, seq, 1 if last else 0, bytes(payload))
            send = emit_sender(emit)

            async def send_layer(i, frames):
                layers_seen.append(i)
                send(i, frames)
            out.append(await pre.prefill(r, send_layer))
        return out

    timings = asyncio.run(go())
    assert layers_seen == [0, 1, 2, 3, None] * 2
    assert all(t["kv_bytes"] > t["state_bytes"] > 0 for t in timings)
    for r, t in zip(reqs, timings):
        dec.admit(r["id"])
        assert dec.resident_bytes(r["id"]) == t["state_bytes"]
    fed = {7: [timings[0]["first_token"]], 8: [timings[1]["first_token"]]}
    for _ in range(6):
        for rid, tok in dec.step([7, 8]).items():
            fed[rid].append(tok)
    m = dec.model
    for r in reqs:
        from workers.engine_torch import request_tokens
        toks = request_tokens(r, cfg.vocab).tolist() + fed[r["id"]][:-1]
        assert m.forward_full(toks)[len(toks) - 7:].argmax(-1).tolist() == fed[r["id"]]
    dec.release(7)
    assert dec.step([7, 8]).keys() == {8}
    pre.close()
    dec.close()


def test_torch_decode_engine_reports_a_corrupt_transfer():
    from workers.engine_torch import TorchDecodeEngine

    cfg = HybridConfig(n_layers=4, d_model=64)
    m = HybridModel(cfg)
    _, st = m.prefill(_tokens(70))
    frames = [bytearray(f) for f in encode_state(st, chunk_bytes=2048)]
    frames[3][5] ^= 0xFF
    dec = TorchDecodeEngine(cfg, "cpu")
    for seq, f in enumerate(frames):
        dec.receive(1, seq, 0, bytes(f))
    assert "crc32" in dec.error(1)
    with pytest.raises(StateWireError, match="crc32"):
        dec.admit(1)
    dec.close()


# ---- prefix cache: snapshots, blocks, continued prefill ----

BLOCK = 32      # model tokens per cache block in these tests (not a multiple of the chunk, 64)
SMALL = dict(n_layers=4, d_model=64, kda_head_k=32, kda_head_v=32, mlp_hidden=128)


@pytest.fixture(scope="module")
def small():
    return HybridModel(HybridConfig(seed=5, **SMALL))


def _pool_blocks(model, toks, every=1):
    """What a pool holds after prefilling `toks`: each whole block as bytes (KDA snapshot at
    every `every`-th block boundary)."""
    from workers.model.prefix import blocks_of

    cuts = list(range(BLOCK * every, len(toks) + 1, BLOCK * every))
    _, st = model.prefill(toks, snapshot_at=cuts)
    return [b.to_bytes(chunk_bytes=3000) for b in blocks_of(st, BLOCK)], st


def _assert_same_state(a, b, tol=TOL):
    assert a.length == b.length
    for i in range(len(a.layers)):
        for name, t in a.layer_tensors(i).items():
            assert (t - b.layer_tensors(i)[name]).abs().max() < tol, (i, name)


@pytest.mark.parametrize("P", [0, BLOCK, 3 * BLOCK, 160 - BLOCK])
def test_continued_prefill_equals_full_prefill(small, P):
    """Prefix of P tokens from the pool's bytes + prefill of the rest == one prefill."""
    from workers.model.prefix import PrefixState

    toks = _tokens(160, seed=8)
    pool, _ = _pool_blocks(small, toks)
    full_logits, full = small.prefill(toks)
    state = PrefixState.from_blocks(small.cfg, pool[:P // BLOCK]).request_state(small.cfg) \
        if P else None
    logits, st = small.prefill(toks[P:], state=state)
    assert (logits - full_logits).abs().max() < TOL
    _assert_same_state(st, full)


def test_snapshots_equal_the_state_of_a_shorter_prefill(small):
    toks = _tokens(150, seed=9)
    _, st = small.prefill(toks, snapshot_at=[BLOCK, 100, 150])
    for p in (BLOCK, 100):
        _, short = small.prefill(toks[:p])
        for i, snap in st.snapshots[p].items():
            for name, t in snap.items():
                assert (t - short.layers[i][name]).abs().max() < 1e-5, (p, i, name)
    assert all(torch.equal(st.layers[i][n], t) for i, s in st.snapshots[150].items()
               for n, t in s.items())


def test_block_bytes_roundtrip_bit_exact_and_checked(small):
    from workers.model.prefix import BlockState

    pool, st = _pool_blocks(small, _tokens(100, seed=10), every=2)
    blocks = [BlockState.from_bytes(b, small.cfg) for b in pool]
    assert [b.index for b in blocks] == [0, 1, 2]
    assert [b.kda is not None for b in blocks] == [False, True, False]
    for b in blocks:
        for i, ts in b.mla.items():
            for name, t in ts.items():
                assert torch.equal(t, st.layer_tensors(i)[name][b.start:b.end])
    assert all(torch.equal(t, st.snapshots[2 * BLOCK][i][n])
               for i, ts in blocks[1].kda.items() for n, t in ts.items())
    assert BlockState.from_bytes(blocks[1].to_bytes(), small.cfg).nbytes() == blocks[1].nbytes()
    bad = bytearray(pool[1])
    bad[-5] ^= 0x10
    with pytest.raises(StateWireError, match="crc32"):
        BlockState.from_bytes(bytes(bad), small.cfg)
    with pytest.raises(StateWireError, match="truncated"):
        BlockState.from_bytes(pool[1][:-7], small.cfg)
    with pytest.raises(StateWireError, match="layers"):
        BlockState.from_bytes(pool[1], HybridConfig(n_layers=4, ratio="1:1"))


def test_kda_reuse_refused_at_a_boundary_without_snapshot(small):
    from workers.model.prefix import PrefixError, PrefixState, reusable_blocks

    pool, st = _pool_blocks(small, _tokens(100, seed=11), every=2)     # KDA snapshot at 64 only
    with pytest.raises(PrefixError, match="no KDA snapshot at token 32"):
        PrefixState.from_blocks(small.cfg, pool[:1])
    with pytest.raises(PrefixError, match="no KDA snapshot at token 32"):
        PrefixState.from_state(st, BLOCK)
    assert PrefixState.from_blocks(small.cfg, pool[:2]).length == 2 * BLOCK
    assert PrefixState.from_blocks(small.cfg, pool[:1], need_kda=False).length == BLOCK  # MLA only
    from workers.model.prefix import BlockState
    assert reusable_blocks([BlockState.from_bytes(b, small.cfg) for b in pool]) == 2
    with pytest.raises(PrefixError, match="blocks 0, 1, 2"):
        PrefixState.from_blocks(small.cfg, pool[1:2])


def test_request_tokens_share_prefix_blocks_and_scale_by_block():
    from workers.engine_torch import request_tokens
    from workers.model.prefix import model_block, model_tokens

    a = request_tokens({"id": 1, "input_len": 1200, "prefix_blocks": [5, 6, 7]}, 1024,
                       scale=Scale(tokens=8), block=512)
    b = request_tokens({"id": 2, "input_len": 1100, "prefix_blocks": [5, 6, 9]}, 1024,
                       scale=Scale(tokens=8), block=512)
    assert model_block(512, Scale(tokens=8)) == 64
    assert len(a) == model_tokens(1200, 512, Scale(tokens=8)) == 150
    assert torch.equal(a[:128], b[:128]) and not torch.equal(a[128:137], b[128:137])
    assert model_block(512, Scale(tokens=100)) == 5
    assert model_tokens(1024, 512, Scale(tokens=100)) == 10


def _engine_prefill(pre, req, **kw):
    import asyncio

    frames = []
    t = asyncio.run(pre.prefill(req, lambda i, f: frames.extend(bytes(x) for x in f), **kw))
    return t, frames


@pytest.mark.parametrize("ship", ["full", "suffix"])
def test_engine_prefix_prefill_ship_and_decode_equal_forward_full(ship):
    from workers.engine_torch import TorchDecodeEngine, TorchPrefillEngine, request_tokens
    from workers.model.prefix import PrefixError

    cfg = HybridConfig(seed=6, **SMALL)
    # Trace blocks of 128 tokens, scale 4: model blocks of 32 tokens.
    pre = TorchPrefillEngine(cfg, "cpu", chunk_bytes=4096, scale=Scale(tokens=4), block=128)
    pool = {}
    first = {"id": 1, "input_len": 500, "prefix_blocks": [21, 22, 23, 24]}
    t0, _ = _engine_prefill(pre, first, on_block=lambda b: pool.__setitem__(b.key, b.to_bytes()))
    assert t0["blocks_stored"] == 3 and sorted(pool) == [21, 22, 23]
    req = {"id": 2, "input_len": 600, "prefix_blocks": [21, 22, 23, 31, 32]}
    t, frames = _engine_prefill(pre, req, prefix_state=[pool[k] for k in (21, 22, 23)],
                                cached_len=384, ship=ship)
    assert (t["cached_tokens"], t["tokens"], t["prompt_tokens"]) == (96, 54, 150)
    dec = TorchDecodeEngine(cfg, "cpu", prefix_source=lambda ref: [pool[k] for k in ref["keys"]])
    for seq, f in enumerate(frames):
        dec.receive(2, seq, 1 if seq == len(frames) - 1 else 0, f)
    dec.admit(2)
    mla_bytes_per_token = cfg.layer_kinds.count("mla") * (cfg.mla_latent + cfg.mla_rope) * 4
    assert dec.resident_bytes(2) == t["state_bytes"]
    # Suffix: the decode side got 96 tokens of MLA latents less over the wire, from its pool.
    sent = sum(len(f) for f in frames)
    assert (sent < t["state_bytes"] - 96 * mla_bytes_per_token + 4096) == (ship == "suffix")
    out = [t["first_token"]] + [dec.step([2])[2] for _ in range(4)]
    toks = request_tokens(req, cfg.vocab, scale=Scale(tokens=4), block=128).tolist()
    assert dec.model.forward_full(toks + out[:-1])[len(toks) - 1:].argmax(-1).tolist() == out
    if ship == "suffix":      # no prefix on the decode side: refused, with the reason
        bare = TorchDecodeEngine(cfg, "cpu")
        for seq, f in enumerate(frames):
            bare.receive(3, seq, 0, f)
        with pytest.raises(PrefixError, match="no prefix blocks"):
            bare.admit(3)
    pre.close()


def test_engine_refuses_kda_reuse_without_snapshot_and_recomputes_a_whole_hit():
    import asyncio

    from workers.engine_torch import TorchPrefillEngine
    from workers.model.prefix import PrefixError

    cfg = HybridConfig(seed=6, **SMALL)
    req = {"id": 1, "input_len": 128}
    for every in (2, 1):
        pre = TorchPrefillEngine(cfg, "cpu", block=32, snapshot_every=every)
        pool = []
        t0, _ = _engine_prefill(pre, req, on_block=lambda b: pool.append(b.to_bytes()))
        assert t0["blocks_stored"] == 4
        if every == 2:
            with pytest.raises(PrefixError, match="no KDA snapshot at token 32"):
                asyncio.run(pre.prefill(req, lambda i, f: None, prefix_state=pool, cached_len=32))
            with pytest.raises(PrefixError, match="multiple of the block"):
                asyncio.run(pre.prefill(req, lambda i, f: None, prefix_state=pool, cached_len=40))
            pre.close()
    # All 128 tokens cached: the last block is computed again (its first token needs logits).
    t, _ = _engine_prefill(pre, req, prefix_state=pool, cached_len=128)
    assert (t["cached_tokens"], t["tokens"], t["first_token"]) == (96, 32, t0["first_token"])
    pre.close()
