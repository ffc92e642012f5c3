"""Unit tests of the tiny hybrid model and its state wire format (no root, CPU, fp32)."""

import pytest
import torch
import torch.nn.functional as F

from workers.model import state_wire
from workers.model.config import HybridConfig
from workers.model.hybrid import (HybridModel, RequestState, analytical_layer_bytes,
                                  analytical_state_bytes, state_bytes)
from workers.model.kda import kda_chunked, kda_recurrent
from workers.model.mla import LatentCache
from workers.model.state_wire import LayerAssembler, StateWireError, encode_layer, encode_state

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
    t = torch.arange(1000, dtype=torch.float32)
    frames = encode_layer(0, {"x": t}, n_layers=1, chunk_bytes=1024)
    t[0] = 42.0   # a data frame is a view of the tensor itself
    assert bytes(frames[1][:4]) == t[:1].numpy().tobytes()


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
    (lambda fr: fr[:1] + [fr[1][:-1]] + fr[2:], "expected"),
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
