"""The runner's side of `model.engine: vllm` (docs/vllm.md): the model, the PIDs, the record.

- `ensure_model(rt)`: the default model directory (`results/.vllm-model`) is written once, by
  `testbed.vllmenv.write_model`, before any worker starts (into a temporary directory renamed
  into place, so two runs never see half a model);
- `record_pids(rd, registry)`: each worker writes `vllm/<name>.json` once its server is healthy
  (the server's PID and its descendants: EngineCore, CPU workers); the runner puts them on its
  lifecycle record, so teardown and `testbed clean` end them (PID and start time checked);
- `metadata(rd, rt)`: which connector ran and why, and per server its start-up time and the
  KV bytes its connector reports (metadata.json `vllm`).
"""

import json
import pathlib
import shutil
import tempfile

from testbed import vllmenv, vllmspec

WHY = {"NixlConnector": "vLLM's NixlConnector runs over UCX's TCP transport on CPU (UCX_TLS="
                        "tcp,self), pulled by the decode instance from the prefill instance's "
                        "IP, so the KV crosses the shaped WAN; on GPU hosts the same connector "
                        "uses RDMA where UCX finds it"}


def ensure_model(rt):
    """Write the default model if the run uses it and it is not there yet."""
    if pathlib.Path(rt.vllm.model_dir) == vllmspec.default_model_dir().resolve():
        ensure_default_model()


def ensure_default_model():
    """results/.vllm-model, written if absent; its path."""
    out = vllmspec.default_model_dir().resolve()
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".vllm-model-", dir=out.parent))
    try:
        vllmenv.write_model(tmp / "m")
        (tmp / "m").rename(out)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _records(rd):
    d = rd.vllm
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))} if d.is_dir() \
        else {}


def record_pids(rd, registry):
    for name, r in _records(rd).items():
        for pid, _start in r.get("pids", ()):
            registry.add_process(pid, f"{name}: vLLM server process")


def metadata(rd, rt):
    servers = {name: {k: r.get(k) for k in ("url", "started_s", "connector_bytes",
                                            "warm_failed")} for name, r in _records(rd).items()}
    return {"connector": rt.vllm.connector, "why": WHY[rt.vllm.connector],
            "model_dir": rt.vllm.model_dir, "dtype": rt.vllm.dtype, "servers": servers,
            "connector_bytes": sum(s["connector_bytes"] or 0 for s in servers.values())}
