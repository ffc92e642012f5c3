"""Unit tests of the model catalog (testbed.catalog, `testbed models`): S_kv by hand."""

import contextlib
import io
import json

import pytest

from testbed import catalog
from testbed.cli import main as cli_main
from testbed.errors import ConfigError

EXPECTED = {"Kimi-Linear-48B-A3B", "MiMo-V2-Flash", "Qwen3.5-397B-A17B", "Qwen3-Next-80B-A3B",
            "Ring-2.5-1T", "MiniMax-M2.5", "Qwen3-235B-A22B"}


def by_name():
    return {m.name: m for m in catalog.models()}


def test_every_architecture_of_the_paper_is_in_the_catalog():
    assert set(by_name()) == EXPECTED


def test_kimi_linear_s_kv_by_hand():
    m = by_name()["Kimi-Linear-48B-A3B"]
    # 7 MLA layers x (512 + 64) x 2 bytes per token; 20 KDA layers x (32 x 128 x 128 x 4 bytes
    # of state + 12288 conv channels x 3 x 2 bytes).
    per_token = 7 * 576 * 2
    state = 20 * (32 * 128 * 128 * 4 + 12288 * 3 * 2)
    assert (per_token, state) == (8064, 43_417_600)
    assert m.s_kv(32768) == per_token * 32768 + state == 307_658_752


def test_dense_models_by_hand():
    q = by_name()["Qwen3-235B-A22B"]
    assert q.s_kv(1024) == 94 * 4 * (128 + 128) * 2 * 1024 == 197_132_288
    mm = by_name()["MiniMax-M2.5"]
    assert mm.s_kv(32768) == 62 * 8 * 256 * 2 * 32768
    assert q.state_bytes == 0 and mm.state_bytes == 0


def test_swa_state_stops_growing_at_the_window():
    m = by_name()["MiMo-V2-Flash"]
    per_token = 9 * 4 * (192 + 128) * 2
    swa = 39 * 8 * (192 + 128) * 2 * 128
    assert m.bytes_per_token == per_token
    assert m.s_kv(2048) - m.s_kv(1024) == per_token * 1024
    assert m.s_kv(64) == (per_token + 39 * 8 * 320 * 2) * 64         # inside the window
    assert m.state_bytes == swa


def test_gated_deltanet_state_by_hand():
    q = by_name()["Qwen3.5-397B-A17B"]
    assert q.s_kv(0) == 45 * (64 * 128 * 128 * 4 + 12288 * 3 * 2)
    n = by_name()["Qwen3-Next-80B-A3B"]
    assert n.bytes_per_token == 12 * 2 * 512 * 2
    assert n.s_kv(0) == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)


def test_hybrids_cache_far_less_per_token_than_dense():
    m = by_name()
    dense = min(m["MiniMax-M2.5"].bytes_per_token, m["Qwen3-235B-A22B"].bytes_per_token)
    for name in EXPECTED - {"MiniMax-M2.5", "Qwen3-235B-A22B"}:
        assert m[name].bytes_per_token * 5 < dense, name


def test_implied_prefill_latency_by_hand():
    mm = by_name()["MiniMax-M2.5"]
    s = 62 * 8 * 256 * 2 * 32768
    assert mm.implied_prefill_s()[32768] == pytest.approx(s * 8 / 59.93e9)
    assert by_name()["Qwen3-Next-80B-A3B"].implied_prefill_s() == {}
    # The fit of the implied latencies gives back the paper's Phi_kv within a few percent.
    for m in catalog.models():
        for l, gbps in m.paper_phi_kv_gbps.items():
            assert float(m.phi_kv_curve(l)) == pytest.approx(gbps, rel=0.1), (m.name, l)


def test_every_number_has_a_source_and_uncertain_ones_are_flagged():
    for m in catalog.models():
        for g in m.groups:
            assert set(catalog.KINDS[g.kind]) <= set(g.sources), (m.name, g.name)
            assert set(g.sources.values()) <= set(m.references), (m.name, g.name)
    assert any("8 or 9" in u for u in by_name()["MiMo-V2-Flash"].uncertain())
    assert by_name()["Ring-2.5-1T"].uncertain()


def test_a_number_without_a_source_is_rejected(tmp_path, monkeypatch):
    (tmp_path / "bad.yaml").write_text(
        "name: Bad\nreferences: {x: y}\ngroups:\n"
        "  - {kind: gqa, layers: 1, kv_heads: 1, k_head_dim: 1, v_head_dim: 1, dtype_bytes: 2,\n"
        "     sources: {layers: x}}\n")
    monkeypatch.setattr(catalog, "MODEL_DIR", tmp_path)
    catalog.load.cache_clear()
    try:
        with pytest.raises(ConfigError, match="no source for kv_heads"):
            catalog.load("bad")
    finally:
        catalog.load.cache_clear()


def test_models_command_json():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["models", "--json"]) == 0
    out = json.loads(buf.getvalue())
    assert out["lengths"] == [1024, 8192, 32768, 131072]
    rows = {r["model"]: r for r in out["models"]}
    assert set(rows) == EXPECTED
    kimi = rows["Kimi-Linear-48B-A3B"]
    assert kimi["s_kv_mib"]["32768"] == pytest.approx(307_658_752 / 2**20)
    assert set(kimi["implied_prefill_s"]) == {"1024", "8192", "32768", "131072"}
    assert rows["Qwen3-Next-80B-A3B"]["implied_prefill_s"] is None


def test_models_command_table(capsys):
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    assert "Kimi-Linear-48B-A3B" in out and "S_kv 128K" in out
