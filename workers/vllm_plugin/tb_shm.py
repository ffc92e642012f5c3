"""vLLM general plugin: the shared-memory queue readers of an instance sleep instead of spin.

Loaded in every process of a vLLM server that loads general plugins (EngineCore and its
workers): the server's PYTHONPATH is this folder (`workers.vllm_server` sets it), and
`testbed_vllm_plugin-0.dist-info` beside this file registers `register` under
`vllm.general_plugins`, the entry-point group vLLM loads. It imports vLLM and nothing of the
testbed.

On CPU vLLM always runs its model in a worker process (`mp` executor), and EngineCore and the
worker pass every step through shared-memory MessageQueues (vLLM's
distributed/device_communicators/shm_broadcast.py). A reader that finds no message spins
with `sched_yield()` for `busy_loop_s` (1 s) after its last read, and only then blocks on the
queue's zmq notification. So the worker spins for 1 s after every step on its instance's CPU,
and EngineCore, which waits for the worker's reply through every forward pass, spins through
each one on whichever CPU is free: on a GPU host an idle core; on the testbed's 2 cores the
other instance's, whose forward pass it then shares (sched_yield does not give the CPU away
under CFS). Measured on one instance: 0.94-0.97 of a core in the half second after a prefill.

Blocking at once on the notification is not enough: notifications get lost when messages
follow each other within about a millisecond (the writer's PUB socket, high-water mark 1,
drops a notification while its pipe looks full), and a reader then sleeps until vLLM's 5 s
recheck. Measured with `busy_loop_s` 0: prefills of 5.1 and 10.5 s, TPOT 3.3 s. So with
`TESTBED_SHM_BUSY_LOOP_S` set (the testbed sets `model.vllm.shm_busy_loop_s`, 0 by default)
a reader spins that long, then waits on the notification with a bounded timeout that grows
with the time since its last read: 1 ms right after one (a lost notification costs at most
that), up to POLL_MAX_MS when idle (100 wake-ups a second, each a few tens of us). A
notification that does arrive wakes it at once, as in vLLM.
"""

from __future__ import annotations

import os
import time

import zmq
from vllm.distributed.device_communicators import shm_broadcast

BUSY_LOOP_ENV = "TESTBED_SHM_BUSY_LOOP_S"
POLL_MAX_MS = 10        # the longest a reader sleeps between looks at the queue, idle
POLL_GROWTH = 8         # sleep 1/8 of the time since the last read (1 ms .. POLL_MAX_MS)


def busy_loop_s():
    """Seconds a reader spins after its last read (the env), or None: vLLM's own wait."""
    try:
        v = float(os.environ[BUSY_LOOP_ENV])
    except (KeyError, ValueError):
        return None
    return max(0.0, v)


def poll_ms(idle_s, timeout_ms):
    """How long a reader idle for `idle_s` waits for a notification before it looks again."""
    step = int(min(POLL_MAX_MS, max(1.0, idle_s * 1000 / POLL_GROWTH)))
    return step if timeout_ms is None else max(0, min(step, timeout_ms))


def register():
    """vLLM calls this in each process (maybe more than once): every SpinCondition reader
    waits as the module says from its next wait on, also the readers made already."""
    seconds = busy_loop_s()
    cls = shm_broadcast.SpinCondition
    vllms = getattr(cls.wait, "__wrapped_by_testbed__", cls.wait)
    if seconds is None:
        cls.wait = vllms
        return

    def wait(self, timeout_ms=None):
        idle_s = time.monotonic() - self.last_read
        if idle_s <= seconds:
            shm_broadcast.sched_yield()
            return
        events = dict(self.poller.poll(timeout=poll_ms(idle_s, timeout_ms)))
        if self.local_notify_socket in events:      # CONFLATE: one message at most
            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    wait.__wrapped_by_testbed__ = vllms
    cls.wait = wait
