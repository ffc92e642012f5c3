"""`model.vllm`: how each vLLM instance is started (`model.engine: vllm`, docs/vllm.md).

A section of the experiment description (`testbed.experiment.ModelSpec.vllm`), real-world
values only: vLLM computes at real speed, so a vLLM experiment runs at `scale.time: 1` and
`scale.bytes: 1` (`check` refuses anything else, and a machine without the vLLM venv).
"""

import dataclasses
import pathlib

from testbed import units, vllmenv
from testbed.schema import at_most, choice, integer, optional, positive, spec, string

CONNECTORS = ("NixlConnector",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmSpec:
    path: str = spec(optional(string), None,
                     "model directory (Hugging Face format: config, safetensors, tokenizer); "
                     "null: the testbed's own small random Llama, written once by `testbed "
                     "models --write` into results/.vllm-model; a GPU user names real weights")
    dtype: str = spec(choice("float32", "bfloat16"), "float32",
                      "--dtype of every server (float32: greedy output is reproducible)")
    max_model_len: int = spec(integer(32, 131072), 8192, "--max-model-len")
    max_num_seqs: int = spec(integer(1, 1024), 8, "--max-num-seqs (vLLM's batch size)")
    kv_cache_space_gib: float = spec(at_most(positive(units.number), 1024, "1024"), 1.0,
                                     "VLLM_CPU_KVCACHE_SPACE of each instance, GiB")
    cpus: str = spec(string, "auto",
                     "VLLM_CPU_OMP_THREADS_BIND of each instance: auto (each instance a CPU "
                     "of its own; nobind when there are more instances than CPUs), nobind, or "
                     "a CPU list (0-1)")
    connector: str = spec(choice(*CONNECTORS), "NixlConnector",
                          "the KV connector (NIXL over UCX TCP on CPU; RDMA where there is any)")
    nixl_progress_delay_us: int = spec(
        integer(0, 1_000_000), 1000,
        "pause of NIXL's UCX progress thread between polls, us (the testbed's NixlConnector, "
        "workers/vllm_plugin/tb_nixl.py); 0: NIXL's own, which polls without pause and holds "
        "a core per idle instance")
    shm_busy_loop_s: float = spec(
        at_most(units.duration_s, 60, "60s"), 0.0,
        "how long vLLM's shared-memory queue readers (EngineCore and its worker, every step) "
        "spin after a message before they sleep between looks (the testbed's vLLM plugin, "
        "workers/vllm_plugin/tb_shm.py); 1s: vLLM's own, which spins on a core another "
        "instance computes on")
    start_timeout: float = spec(at_most(positive(units.duration_s), 3600, "1h"), 600.0,
                                "bound on every server's start-up (load, compile, /health) "
                                "plus the KV-connector handshakes warmed before the workload")


def default_model_dir():
    return vllmenv.REPO / "results" / ".vllm-model"


def check(exp):
    """Why `exp` cannot run the vLLM engine here, or '' (ValueError text, one line)."""
    if exp.model.engine != "vllm":
        return ""
    if exp.scale.time != 1 or exp.scale.bytes != 1:
        return ("engine vllm runs at real speed: scale.time and scale.bytes must be 1 (got "
                f"{exp.scale.time:g} and {exp.scale.bytes:g})")
    if vllmenv.find_python() is None:
        return vllmenv.INSTALL_HINT
    if exp.cache.enabled or exp.scheduler.roles.enabled:
        return "engine vllm runs without cache.enabled and scheduler.roles (vLLM's own prefix " \
               "cache serves each instance)"
    if exp.backend.kind != "mininet":
        return f"engine vllm runs on backend mininet only (got {exp.backend.kind})"
    p = exp.model.vllm.path
    if p is not None and not (pathlib.Path(p).expanduser() / "config.json").exists():
        return f"vllm.path: {p} holds no config.json (a Hugging Face model directory)"
    return ""
