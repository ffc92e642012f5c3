"""The runner's side of `model.engine: vllm` (docs/vllm.md): the model, the PIDs, the record.

- `ensure_model(rt)`: the default model directory (`results/.vllm-model`) is written once, by
  `testbed.vllmenv.write_model`, before any worker starts (into a temporary directory renamed
  into place, so two runs never see half a model);
- `PidRecord(rd, registry)`: each worker writes `vllm/<name>.json` once its server is healthy
  (the server's PID and its descendants: EngineCore, CPU workers); the runner puts them on its
  lifecycle record, so teardown and `testbed clean` end them (PID and start time checked),
  when the workers are ready and again while the run goes (`refresh`), so a server that a
  `restart` fault starts is on the record too;
- `metadata(rd, rt)`: which connector ran and why, and per server its start-up time and the
  KV bytes its connector reports (metadata.json `vllm`);
- `cache_view(rd, rt)`: what fed the scheduler's cache view (metadata.json `cache_view`): the
  instances' KV events with vLLM (the scheduler's kv_events.json), the pools' answers with the
  prefix cache, else nothing.
"""

import contextlib
import json
import pathlib
import shutil
import tempfile
import time

from testbed import vllmenv, vllmspec

WHY = {"NixlConnector": "vLLM's NixlConnector runs over UCX's TCP transport on CPU (UCX_TLS="
                        "tcp,self), pulled by the decode instance from the prefill instance's "
                        "IP, so the KV crosses the shaped WAN; on GPU hosts the same connector "
                        "uses RDMA where UCX finds it; the testbed's subclass (workers/vllm_plugin/"
                        "tb_nixl.py) paces NIXL's progress thread "
                        "and keeps the instance on its CPUs (`changes`)"}
# What the testbed changes in each vLLM server, and why (metadata.json `vllm.changes`)
CHANGES = {
    "nixl_progress_delay_us": "NIXL's UCX progress thread sleeps this long between polls "
                              "(workers/vllm_plugin/tb_nixl.py; NIXL's own: 0, a core per "
                              "idle instance)",
    "forward_pass_cpus": "the worker thread that runs the forward pass is put back on the "
                         "instance's CPUs after NixlConnector's construction, which pins it to "
                         "the last core of each NUMA node on CPU (tb_nixl.py)",
    "shm_busy_loop_s": "EngineCore's and the worker's shared-memory queue readers spin at most "
                       "this long, then wait for the queue's notification 1-10 ms at a time "
                       "(workers/vllm_plugin/tb_shm.py, a vLLM general plugin; vLLM's own: "
                       "spin 1 s, on the CPUs another instance computes on, then block)"}


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
    """{instance: its vllm/<name>.json}; a worker's half-written temporary (.<name>.json,
    renamed into place) is not one."""
    out = {}
    for p in sorted(rd.vllm.glob("*.json")) if rd.vllm.is_dir() else ():
        if not p.name.startswith("."):
            with contextlib.suppress(OSError, ValueError):
                out[p.stem] = json.loads(p.read_text())
    return out


class PidRecord:
    """The vLLM server processes on the run's lifecycle record, each (PID, start time) once."""

    REFRESH_S = 1.0

    def __init__(self, rd, registry):
        self.rd, self.registry = rd, registry
        self.known = set()
        self.next_s = 0.0

    def refresh(self, force=False):
        """Record the processes the workers' files name that are not on record yet (read at
        most every REFRESH_S unless `force`); how many were added."""
        now = time.monotonic()
        if not force and now < self.next_s:
            return 0
        self.next_s = now + self.REFRESH_S
        added = 0
        for name, r in _records(self.rd).items():
            for pid, start in r.get("pids", ()):
                if (pid, start) not in self.known:
                    self.known.add((pid, start))
                    self.registry.add_process(pid, f"{name}: vLLM server process")
                    added += 1
        return added


def metadata(rd, rt):
    servers = {name: {k: r.get(k) for k in ("url", "started_s", "cpus", "connector_bytes",
                                            "warm_failed")} for name, r in _records(rd).items()}
    return {"connector": rt.vllm.connector, "why": WHY[rt.vllm.connector],
            "nixl_progress_delay_us": rt.vllm.nixl_progress_delay_us,
            "shm_busy_loop_s": rt.vllm.shm_busy_loop_s, "changes": CHANGES,
            "model_dir": rt.vllm.model_dir, "dtype": rt.vllm.dtype, "servers": servers,
            "connector_bytes": sum(s["connector_bytes"] or 0 for s in servers.values())}


def cache_view(rd, rt):
    """metadata.json `cache_view`: its source and, for vLLM, what the KV events measured."""
    if rt.vllm is not None:
        try:
            return json.loads((rd / rd.KV_EVENTS_SUMMARY).read_text())
        except (OSError, ValueError) as e:
            return {"source": "vllm_kv_events", "missing": f"{rd.KV_EVENTS_SUMMARY}: {e}"}
    if rt.cache.enabled:
        return {"source": "cache_pools", "why": "each request's Lookup in both clusters' "
                                                "prefix cache pools (docs/cache.md)"}
    return {"source": "none", "why": "no prefix cache: placement is cache-oblivious"}
