"""Run-time control of a worker by the runner (the `slow` fault, testbed/faults.py).

The runner writes `control/<name>.json` in the run directory and sends SIGUSR1; the worker reads
the file and sets its engine's `clock_factor` (1 = the profiled speed, 3 = every prefill and decode
step takes three times its profiled time). A signal and a file, not an RPC: the runner lives
outside the workers' network namespaces, and a paused worker picks the change up when resumed.
"""

import asyncio
import json
import signal

from testbed.measure import EventLog

# KV frames of prefill attempt a of request r travel as kvwire id r | a << ATTEMPT_SHIFT.
ATTEMPT_SHIFT = 48
RID_MASK = (1 << ATTEMPT_SHIFT) - 1


def wire_id(rid, attempt):
    return int(rid) | (int(attempt) << ATTEMPT_SHIFT)


def split_id(wire):
    """(request id, prefill attempt) of a kvwire frame id."""
    return wire & RID_MASK, wire >> ATTEMPT_SHIFT


def install(rt, name, engine, log):
    """Apply control/<name>.json to `engine` on every SIGUSR1."""
    path = rt.dir / "control" / f"{name}.json"

    def apply():
        try:
            factor = float(json.loads(path.read_text()).get("clock_factor", 1.0))
        except (OSError, ValueError) as e:
            log.warning("control: cannot read %s: %s", path, e)
            return
        engine.clock_factor = factor
        log.warning("control: engine clock factor %g", factor)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, apply)


def event_log(rt, name):
    """The run's events.csv, opened for appending from this worker process (instance `name`:
    its rows say who wrote them, so analysis knows whose clock stamped them)."""
    return EventLog(rt.dir / "events.csv", fresh=False, by=name)
