"""`model.device: cuda` is refused at load on a machine that cannot run it, without importing
torch (testbed.config._no_cuda_reason)."""

import importlib.metadata

from testbed.config import _no_cuda_reason


def test_no_device_node_is_a_reason(tmp_path):
    assert "no NVIDIA GPU" in _no_cuda_reason(tmp_path)


def test_cpu_only_build_is_a_reason(tmp_path, monkeypatch):
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cpu")
    assert "CPU-only" in _no_cuda_reason(tmp_path)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cu128")
    assert _no_cuda_reason(tmp_path) == ""
