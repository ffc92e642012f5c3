"""One vLLM instance: its OpenAI server process, started, awaited and stopped by its worker.

`model.engine: vllm` (docs/vllm.md). Each prefill and decode worker starts vLLM's own OpenAI
server (`python -m vllm.entrypoints.openai.api_server`) from the vLLM venv
(`testbed.vllmenv`) as its child, in its own network namespace, and talks HTTP to it. A server
process rather than `AsyncLLM` inside the worker, because:

- vLLM lives in its own venv (it pins numpy and more; the worker's venv stays as it is);
- vLLM spawns its EngineCore and CPU worker processes itself; the server is the parent that
  shuts them down, as it does in a real deployment;
- it is the binary users deploy (`vllm serve`), flags and all.

The server stays in the worker's process group (Mininet starts each worker as a session
leader), so `pause` (SIGSTOP to the group) stops the API server, EngineCore and its workers
together, and `kill` (SIGKILL to the group) leaves none; its parent-death signal and vLLM's
own death pipe from the API server to EngineCore cover a worker killed alone; `stop` ends the
server and then whatever descendant is left. The worker records the PIDs (`pids()`) for
`testbed clean`.

KV crosses between instances through vLLM's KV connector (NixlConnector over UCX TCP on
CPU, UCX_TLS=tcp,self): the prefill server (`kv_producer`) keeps the KV, the decode server
(`kv_consumer`) pulls it from the prefill instance's side-channel address, which is the
prefill instance's own IP (`VLLM_NIXL_SIDE_CHANNEL_HOST`), so the pull crosses the shaped WAN.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import time

from testbed import lifecycle

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
HEALTH_POLL_S = 1.0
THREAD_CRASH = "Exception in thread "     # threading's default excepthook, on stderr


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """Everything one server is started with (real-world values: vLLM runs at real speed)."""

    python: str                     # the vLLM venv's Python (testbed.vllmenv.find_python)
    model_dir: str
    role: str                       # prefill | decode | both
    host: str                       # the instance's IP: HTTP and the NIXL side channel
    port: int                       # HTTP (OpenAI API)
    side_port: int                  # NIXL side channel (handshake)
    dtype: str = "float32"
    max_model_len: int = 8192
    max_num_seqs: int = 8
    kv_cache_space_gib: float = 1.0
    cpus: str = "nobind"            # VLLM_CPU_OMP_THREADS_BIND: a CPU list (0-1, 1) or nobind
    connector: str = "NixlConnector"
    seed: int = 0
    kv_dump_dir: str | None = None  # verification: KVDumpNixlConnector dumps the KV blocks
    nixl_progress_delay_us: int = 1000  # 0: NIXL's own progress thread, polling without pause
    shm_busy_loop_s: float = 0.0    # spin of EngineCore's and the worker's queue readers; 1: vLLM's
    kv_events_port: int = 0         # KV-event publisher (zmq PUB) on every interface; 0: none
    kv_replay_port: int = 0         # its replay endpoint (zmq ROUTER)
    kv_events_topic: str = ""
    dev_mode: bool = False          # VLLM_SERVER_DEV_MODE: /reset_prefix_cache (tests)

    @property
    def url(self):
        return f"http://{self.host}:{self.port}"


PLUGIN_DIR = str(pathlib.Path(__file__).resolve().parent / "vllm_plugin")
# NixlConnector subclasses of the testbed's (workers/vllm_plugin/): the progress thread paced
# and the instance kept on its CPUs, and, for verification, the KV blocks dumped on both ends:
# (class, module)
TESTBED = ("TestbedNixlConnector", "tb_nixl")
DUMP = ("KVDumpNixlConnector", "tb_kvdump")


def plugin(spec):
    """(class, module) of the testbed's connector this server loads. Always one of the
    testbed's: vLLM's own NixlConnector moves the forward pass off the instance's CPUs
    (workers/vllm_plugin/tb_nixl.py)."""
    return DUMP if spec.kv_dump_dir else TESTBED


def kv_transfer_config(spec):
    conf = {"kv_connector": spec.connector, "kv_role": ROLES[spec.role],
            "kv_buffer_device": "cpu"}
    if spec.connector != "NixlConnector":
        raise ValueError(f"the testbed's connectors extend NixlConnector, not {spec.connector}")
    ours = plugin(spec)
    conf.update(kv_connector=ours[0], kv_connector_module_path=ours[1])
    return conf


def kv_events_config(spec):
    """--kv-events-config: publish on every interface of the instance's host (vLLM binds an
    endpoint with `*` and connects to any other), replay buffer on the next port."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{spec.kv_events_port}",
            "replay_endpoint": f"tcp://*:{spec.kv_replay_port}", "topic": spec.kv_events_topic}


def argv(spec):
    events = ["--kv-events-config", json.dumps(kv_events_config(spec))] \
        if spec.kv_events_port else []
    return [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model_dir,
            "--host", spec.host, "--port", str(spec.port), "--dtype", spec.dtype,
            "--enforce-eager", "--max-model-len", str(spec.max_model_len),
            "--max-num-seqs", str(spec.max_num_seqs), "--seed", str(spec.seed),
            "--disable-uvicorn-access-log",
            "--enable-prompt-tokens-details",      # the reply's cached_tokens: vLLM's own hit
            "--kv-transfer-config", json.dumps(kv_transfer_config(spec)), *events]


def env(spec, base=None):
    e = dict(os.environ if base is None else base)
    # The testbed's, not the vLLM venv's; the runner's one OpenMP thread per worker is not
    # vLLM's (its CPU backend sizes its threads from the binding, VLLM_CPU_OMP_THREADS_BIND).
    for k in ("PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS"):
        e.pop(k, None)
    kib = spec.kv_cache_space_gib
    # No `sm`: UCX finds every instance on this one machine and would move the KV through
    # shared memory, past the emulated WAN (measured: the kernel counted none of it).
    e.update({"UCX_TLS": "tcp,self", "VLLM_NIXL_SIDE_CHANNEL_HOST": spec.host,
              "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_port),
              "VLLM_CPU_KVCACHE_SPACE": str(int(kib) if float(kib).is_integer() else kib),
              "VLLM_CPU_OMP_THREADS_BIND": spec.cpus, "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
              # NIXL moves a hybrid's conv state only in this layout; vLLM sets it for the
              # connectors it knows by name, not for the testbed's subclasses
              "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
              "VLLM_LOGGING_LEVEL": e.get("VLLM_LOGGING_LEVEL", "INFO")})
    # the testbed's connector module, its general plugin (tb_shm.py) and their settings
    e.update(PYTHONPATH=PLUGIN_DIR, TESTBED_NIXL_PROGRESS_DELAY_US=str(spec.nixl_progress_delay_us),
             TESTBED_SHM_BUSY_LOOP_S=f"{spec.shm_busy_loop_s:g}")
    if spec.dev_mode:
        e["VLLM_SERVER_DEV_MODE"] = "1"
    if spec.kv_dump_dir:
        e["TESTBED_KV_DUMP_DIR"] = spec.kv_dump_dir
    return e


def descendants(pid):
    """PIDs below `pid` (children first walked through /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in _listdir(f"/proc/{p}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
    return out


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


class ServerFailed(RuntimeError):
    """The server exited, or did not answer /health in time."""


async def wait_healthy(session, url, timeout_s, exited=lambda: None, late=None):
    """Poll GET url/health every HEALTH_POLL_S until 200; the seconds it took. ServerFailed
    with `exited()`'s message as soon as it returns one (the server process is gone), or with
    `late` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        why = exited()
        if why:
            raise ServerFailed(why)
        with contextlib.suppress(Exception):
            async with session.get(f"{url}/health") as r:
                if r.status == 200:
                    return time.monotonic() - (deadline - timeout_s)
        await asyncio.sleep(HEALTH_POLL_S)
    raise ServerFailed(late or f"no healthy vLLM server at {url} within {timeout_s:.0f}s "
                       f"(GET /health)")


class VllmServer:
    """Start, await and stop one server; `proc` is its Popen once started."""

    def __init__(self, spec: ServerSpec, log_path):
        self.spec, self.log_path, self.proc = spec, log_path, None
        self._log_at = 0        # how far `thread_crash` has read the log

    def start(self):
        with open(self.log_path, "ab") as log:
            self._log_at = log.tell()
            self.proc = subprocess.Popen(argv(self.spec), stdout=log, stderr=subprocess.STDOUT,
                                         env=env(self.spec), stdin=subprocess.DEVNULL,
                                         preexec_fn=lifecycle.die_with_parent())
        return self.proc

    async def wait_healthy(self, timeout_s, session):
        """Poll GET /health (bounded by `timeout_s`) until 200; ServerFailed otherwise, at
        once when the server exits or one of its threads dies while it starts."""
        def exited():
            if self.proc.poll() is not None:
                return (f"vLLM server exited with {self.proc.returncode} before it was "
                        f"healthy; see {self.log_path}")
            crash = self.thread_crash()
            if crash:
                return (f"vLLM server's thread {crash} died before the server was healthy "
                        f"(it would wait for it forever); see {self.log_path}")
            return None
        return await wait_healthy(session, self.spec.url, timeout_s, exited,
                                  f"vLLM server not healthy after {timeout_s:.0f}s; see "
                                  f"{self.log_path}")

    def thread_crash(self):
        """The name of a thread whose uncaught exception the server logged since the last
        call (Python's `Exception in thread NAME:` line), else None. A thread of vLLM's that
        dies while the server starts leaves it waiting for that thread's readiness forever:
        on 2026-12-03 the NIXL handshake listener lost its port to another process, and the
        server never answered /health."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_at)
                new = f.read()
        except OSError:
            return None
        whole = new[:new.rfind(b"\n") + 1]
        self._log_at += len(whole)
        for line in whole.decode(errors="replace").splitlines():
            if line.startswith(THREAD_CRASH):
                return line[len(THREAD_CRASH):].rstrip(":").strip() or "?"
        return None

    def pids(self):
        """[(pid, start time)] of the server and every process below it, for the record."""
        if self.proc is None:
            return []
        return [(p, lifecycle.proc_start_time(p)) for p in [self.proc.pid]
                + descendants(self.proc.pid)]

    def stop(self, grace_s=10.0):
        """SIGTERM the server (it shuts EngineCore down), then SIGKILL whatever is left of it
        and its descendants after `grace_s`."""
        if self.proc is None:
            return
        below = self.pids()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        for pid, start in reversed(below):
            lifecycle.kill_recorded(pid, start, grace_s=0.5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)
