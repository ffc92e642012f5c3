"""The tiny hybrid model and the torch engines on CUDA (skipped where torch sees no GPU).

The same properties as test_model.py's, on the device the workers use with `model.device:
cuda`: prefill -> state -> decode equals one full pass, CUDA agrees with CPU, bf16 tracks fp32,
and a state crosses the wire between the engines (CPU frames, CUDA tensors) intact.
`scripts/gpu_check.sh` runs this file on a GPU machine.
"""

import asyncio

import pytest
import torch

from workers.engine_torch import TorchDecodeEngine, TorchPrefillEngine, emit_sender, request_tokens
from workers.model.config import HybridConfig
from workers.model.hybrid import HybridModel, RequestState, analytical_state_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

TOL = 1e-4          # fp32, same device: the two forms of one computation
CROSS_TOL = 1e-3    # fp32, CPU vs CUDA: other kernels, other summation order
BF16_REL = 2e-2     # bf16 vs fp32, relative to the fp32 logits' norm


def _tokens(n, seed=0, vocab=1024):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def cuda_model():
    return HybridModel(HybridConfig(seed=3), device="cuda")


def test_cuda_prefill_then_batched_decode_equals_forward_full(cuda_model):
    m = cuda_model
    toks = _tokens(600, seed=5)
    full = m.forward_full(toks)
    assert full.device.type == "cuda"
    la, a = m.prefill(toks[:300])
    lb, b = m.prefill(toks[:530])
    assert all(t.device.type == "cuda" for i in range(len(a.layers))
               for t in a.layer_tensors(i).values())
    assert (la - full[299]).abs().max() < TOL and (lb - full[529]).abs().max() < TOL
    worst = 0.0
    for j in range(40):
        out = m.decode_step([a, b], torch.stack([toks[300 + j], toks[530 + j]]))
        worst = max(worst, (out[0] - full[300 + j]).abs().max().item(),
                    (out[1] - full[530 + j]).abs().max().item())
    assert worst < TOL


def test_cuda_agrees_with_cpu(cuda_model):
    cpu = HybridModel(HybridConfig(seed=3))
    toks = _tokens(700, seed=7)
    diff = (cuda_model.forward_full(toks).cpu() - cpu.forward_full(toks)).abs().max().item()
    assert diff < CROSS_TOL


def test_state_prefilled_on_cpu_decodes_on_cuda(cuda_model):
    """The heterogeneous case: one side's state (host tensors) continues on the other device."""
    cpu = HybridModel(HybridConfig(seed=3))
    toks = _tokens(400, seed=8)
    ref = cpu.forward_full(toks)
    _, st = cpu.prefill(toks[:350])
    st = RequestState.from_layer_tensors(cpu.cfg, [st.layer_tensors(i) for i in range(len(st.layers))],
                                         device="cuda", length=st.length)
    worst = max((cuda_model.decode_step([st], toks[350 + j:351 + j])[0].cpu()
                 - ref[350 + j]).abs().max().item() for j in range(49))
    assert worst < CROSS_TOL


def test_bf16_tracks_fp32_and_its_own_full_pass():
    f32 = HybridModel(HybridConfig(seed=4), device="cuda")
    b16 = HybridModel(HybridConfig(seed=4, dtype="bfloat16"), device="cuda")
    toks = _tokens(500, seed=9)
    ref, got = f32.forward_full(toks), b16.forward_full(toks)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < BF16_REL
    _, st = b16.prefill(toks[:450])
    assert st.layers[3].c_kv.dtype == torch.bfloat16 and st.layers[0]["S"].dtype == torch.float32
    for j in range(49):
        out = b16.decode_step([st], toks[450 + j:451 + j])[0]
        assert ((out - ref[450 + j]).norm() / ref[450 + j].norm()).item() < BF16_REL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_engines_ship_state_over_wire_frames(dtype):
    """TorchPrefillEngine on CUDA -> frames (host bytes) -> TorchDecodeEngine on CUDA."""
    cfg = HybridConfig(seed=1, dtype=dtype)
    pre, dec = TorchPrefillEngine(cfg, "cuda"), TorchDecodeEngine(cfg, "cuda")
    try:
        req = {"id": 7, "input_len": 333}
        frames = []
        res = asyncio.run(pre.prefill(req, emit_sender(
            lambda seq, f, last: frames.append((seq, bytes(f), last)))))
        assert res["state_bytes"] == analytical_state_bytes(cfg, 333)
        assert frames[-1][2] and sum(len(f) for _, f, _ in frames) == res["kv_bytes"]
        for seq, f, _ in frames:
            dec.receive(7, seq, 0, f)
        dec.admit(7)
        st = dec.live[7][0]
        assert st.length == 333 and st.layers[3].c_kv.device.type == "cuda"
        toks = [dec.live[7][1]] + [dec.step([7])[7] for _ in range(16)]
        # The same greedy continuation from one full pass on the prefill engine's model.
        prompt = request_tokens(req, cfg.vocab).tolist()
        full = pre.model.forward_full(prompt + toks[:-1])[len(prompt) - 1:]
        agree = sum(int(full[j].argmax()) == toks[j] for j in range(len(toks)))
        assert agree == len(toks) if dtype == "float32" else agree >= len(toks) - 4
        assert toks[0] == res["first_token"]
    finally:
        pre.close()
        dec.close()
