"""A hybrid model on the vLLM engine: the testbed's own Qwen3-Next (`testbed models --write DIR
--arch qwen3_next`: three Gated DeltaNet linear-attention layers to one full-attention layer,
bfloat16, random weights), served by two real vLLM CPU servers on loopback, its prefill and
decode disaggregated through NixlConnector over UCX TCP as the dense model's are.

- Greedy decode after the transfer is token-identical to the decode server serving the prompt
  alone (its own `cache_salt`), so the linear layers' state crossed with the KV, up to the
  first near-tie: the CPU kernels of Gated DeltaNet take bfloat16 only, and bf16 rounds
  differently where the decode instance computes the prompt's last token after a pull than
  where one instance computes it all, which flips greedy decoding only where the best two
  tokens were within NEAR_TIE of each other.
- What the connector moved has a part that does not grow with the prompt (the linear layers'
  conv and recurrent state, one per request) and a part that grows like the one
  full-attention layer's KV, not like four layers' KV.

Skipped without the vLLM venv (`make vllm`; `make test` installs it). docs/vllm.md, "Hybrid
architectures", says which hybrids vLLM runs on CPU and why this one.
"""

import asyncio
import json
import random

import pytest

from test_vllm import START_TIMEOUT_S, _free_ports, _ready
from testbed import vllmenv
from workers import vllm_api as api
from workers import vllm_server as vs

# Log-probability. The logits are bf16: at this model's magnitudes (8-16) they come in steps
# of 1/16, and so do the margins (measured: 0, 0.0625, 0.125, 0.3125). A flip where the best
# two were one step apart (seen once in 8 prompts, at 0.0625) is a rounding tie.
NEAR_TIE = 0.1
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    vllmenv.find_python() is None, reason="vLLM not installed (`make vllm`)")]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(prefill url, decode url, model name, the writer's shape JSON), running for the module."""
    d = tmp_path_factory.mktemp("hybrid")
    shape = json.loads(vllmenv.write_model(d / "model", arch="qwen3_next"))
    ports = _free_ports(4)
    servers = [vs.VllmServer(vs.ServerSpec(
        python=vllmenv.find_python(), model_dir=str(d / "model"), role=role, host="127.0.0.1",
        port=ports[i], side_port=ports[i + 2], max_model_len=4096, kv_cache_space_gib=1,
        dtype="bfloat16"), d / f"{role}.log") for i, role in enumerate(("prefill", "decode"))]
    for s in servers:
        s.start()
    try:
        model = asyncio.run(_ready(servers))
        yield servers[0].spec.url, servers[1].spec.url, model, shape
    finally:
        for s in servers:
            s.stop()


async def _transfer(pfx, dec, model, ids):
    import aiohttp  # reason: aiohttp (loaded by the workers anyway)
    async with aiohttp.ClientSession() as session:
        before = await api.connector_bytes(session, dec)
        params = await api.prefill(session, pfx, model, ids)
        got, _ = await api.generate_with_margins(session, dec, model, ids, 12, params)
        moved = await api.connector_bytes(session, dec) - before
        alone, margins = await api.generate_with_margins(
            session, dec, model, ids, 12, cache_salt=f"alone-{random.random()}")
        return got, alone, margins, moved


def test_a_hybrid_moves_its_state_and_decodes_as_if_colocated(hybrid):
    pfx, dec, model, shape = hybrid
    assert shape["architecture"] == "Qwen3NextForCausalLM" and shape["kv_layers"] == 1
    rng = random.Random(3)
    moved = {}
    for n in (300, 2000):
        ids = [rng.randrange(shape["vocab_size"] - 3) for _ in range(n)]
        got, alone, margins, moved[n] = asyncio.run(_transfer(pfx, dec, model, ids))
        assert len(got) == len(alone) == 12, (got, alone)
        split = next((i for i, (a, b) in enumerate(zip(got, alone)) if a != b), None)
        assert split is None or margins[split] < NEAR_TIE, (n, got, alone, margins)
    attention = shape["kv_bytes_per_token"]["bfloat16"]     # the full-attention layer only
    slope = (moved[2000] - moved[300]) / 1700
    assert slope <= 1.25 * attention, (moved, attention)    # not 4 layers' KV a token
    assert moved[300] > 300 * attention, (moved, attention)   # the linear layers' state too
