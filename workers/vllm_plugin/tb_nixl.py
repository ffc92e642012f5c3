"""TestbedNixlConnector: vLLM's NixlConnector, its progress thread paced, its CPU binding kept.

Loaded inside a vLLM server (`kv_connector_module_path: tb_nixl`, this folder on the server's
PYTHONPATH: `workers.vllm_server` sets both), so it imports vLLM and nothing of the testbed.

NIXL's Python agent starts its UCX progress thread with `pthrDelay = 0` (nixl `_api.py`), so
the thread polls without pause: measured here, each idle vLLM CPU instance burned 0.99 of a
core in that one thread (py-spy: every Python thread idle; `/proc/<pid>/task` showed the
native one). On a GPU host with dozens of cores that is one core lost; on the testbed's 2
cores two idle instances take both, and every prefill, decode step and handshake of the
emulated system competes with them. With `TESTBED_NIXL_PROGRESS_DELAY_US` set (the testbed
sets `model.vllm.nixl_progress_delay_us`, 1000 by default), each agent this process creates
gets that delay instead: idle CPU fell to 0.04 of a core per instance, and a 12.6 MB pull on
loopback took 82-108 ms against 69-392 ms without it (docs/vllm.md). The transfer protocol,
the handshake and the bytes are NixlConnector's, unchanged: this class is that class.

It also keeps the instance on the CPUs it was bound to. On CPU, NixlConnector's worker side
pins the thread that constructs it to the last core of each NUMA node
(`os.sched_setaffinity(0, ...)` in nixl/base_worker.py, meant to leave the other cores to the
forward pass). That thread is the worker's main thread, which is also the thread that runs
the forward pass (OpenMP's initial thread, bound to the first of VLLM_CPU_OMP_THREADS_BIND's
CPUs at start-up). So every instance computed on the last core whatever its binding: with two
instances on 2 cores bound to CPUs 0 and 1 (`model.vllm.cpus: auto`), both computed on CPU 1
and CPU 0 held only their EngineCores, and a prefill beside a decode took up to 12x its
calibrated time (docs/vllm.md). The worker side here restores the thread's CPUs as they were
before NixlConnector's construction; threads NIXL started meanwhile keep theirs.
"""

from __future__ import annotations

import os

import nixl._api as nixl_api
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

DELAY_ENV = "TESTBED_NIXL_PROGRESS_DELAY_US"


def progress_delay_us():
    try:
        return max(0, int(os.environ.get(DELAY_ENV, "0")))
    except ValueError:
        return 0


def _apply(delay_us):
    """Every NIXL agent created from now on in this process polls every `delay_us`."""
    bind = nixl_api.nixlBind
    create = getattr(bind.nixlAgent, "__wrapped_by_testbed__", bind.nixlAgent)

    def agent(name, config):
        config.pthrDelay = delay_us
        return create(name, config)

    agent.__wrapped_by_testbed__ = create
    bind.nixlAgent = agent


if progress_delay_us() > 0:
    _apply(progress_delay_us())


class TestbedNixlConnector(NixlConnector):
    """NixlConnector (pull mode), its agents' progress thread paced and the constructing
    thread left on its own CPUs (see the module)."""

    def __init__(self, *args, **kwargs):
        cpus = os.sched_getaffinity(0)
        super().__init__(*args, **kwargs)
        if os.sched_getaffinity(0) != cpus:
            os.sched_setaffinity(0, cpus)
