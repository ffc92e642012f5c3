"""vLLM general plugin: the shared-memory queue readers of an instance block instead of spin.

Loaded in every process of a vLLM server that loads general plugins (EngineCore and its
workers): the server's PYTHONPATH is this folder (`workers.vllm_server` sets it), and
`testbed_vllm_plugin-0.dist-info` beside this file registers `register` under
`vllm.general_plugins`, the entry-point group vLLM loads. It imports vLLM and nothing of the
testbed.

On CPU vLLM always runs its model in a worker process (`mp` executor), and EngineCore and the
worker pass every step through shared-memory MessageQueues (vLLM's
distributed/device_communicators/shm_broadcast.py). A reader that finds no message spins
with `sched_yield()` for `busy_loop_s` (1 s) after its last read before it blocks on the
queue's zmq notification. So the worker spins for 1 s after every step on its instance's
CPUs, and EngineCore, which waits on the worker's reply through every forward pass, spins
through each one, on whichever CPU is free: on a GPU host an idle core; on the testbed's 2
cores the other instance's, whose forward pass it then shares (sched_yield does not give the
CPU away under CFS). With `TESTBED_SHM_BUSY_LOOP_S` set (the testbed sets
`model.vllm.shm_busy_loop_s`, 0 by default), every reader of this process waits that long at
most before it blocks, as vLLM's own readers do after a second idle. The writer notifies on
every message, so nothing is lost: a step costs one zmq wake-up more.
"""

from __future__ import annotations

import os

from vllm.distributed.device_communicators import shm_broadcast

BUSY_LOOP_ENV = "TESTBED_SHM_BUSY_LOOP_S"


def busy_loop_s():
    """Seconds a reader spins after its last read (the env), or None: vLLM's own."""
    try:
        v = float(os.environ[BUSY_LOOP_ENV])
    except (KeyError, ValueError):
        return None
    return max(0.0, v)


def register():
    """vLLM calls this in each process (maybe more than once): every SpinCondition reader
    spins at most `busy_loop_s()`, from its next wait on, also the readers made already."""
    seconds = busy_loop_s()
    cls = shm_broadcast.SpinCondition
    wait = getattr(cls.wait, "__wrapped_by_testbed__", cls.wait)
    if seconds is None:
        cls.wait = wait
        return

    def bounded_wait(self, timeout_ms=None):
        self.busy_loop_s = seconds
        return wait(self, timeout_ms)

    bounded_wait.__wrapped_by_testbed__ = wait
    cls.wait = bounded_wait
