"""The simulation backend (`backend: sim`): the same Deployment in virtual time.

    config -> deploy (Deployment) -> sim: loop + engine + wan models, the scheduler's own
    decision code (workers/policy.py, workers/adaptive.py) -> the run directory -> analyse

- `loop`: the heap-based event loop (virtual, emulated seconds);
- `engine`: prefill and decode instances timed by the profile engines (workers/engine_profile.py);
- `wan`: the WAN and the datacenter fabrics as a flow-level model (max-min sharing, delay,
  jitter, queueing, the loss-limited TCP rate);
- `cluster`: requests through the Router and the models, recorded as the client records them;
- `run`: one expanded run, writing the same run directory files as the emulation.

Nothing here needs root, namespaces or processes. `unsupported(exp)` (here, cheap to import)
says what a deployment asks that the simulator does not model yet; the runner refuses it
before anything starts (exit 2). docs/sim.md says what is modelled and how it compares.
"""


def unsupported(exp):
    """Why the simulator cannot run `exp` yet (one line), or None."""
    if exp.model.engine != "profile":
        return (f"model.engine {exp.model.engine} computes for real: the simulator models "
                "profiled accelerators only (model.engine: profile)")
    if exp.workload.client != "builtin":
        return (f"workload.client {exp.workload.client}: the simulator replays the request list "
                "itself (workload.client: builtin)")
    if exp.cache.enabled:
        return "cache.enabled: the prefix cache and its placement are not simulated yet"
    if any(f.kind != "link" for f in exp.faults):
        return ("faults of kind pause/kill/restart/slow need health checks and re-dispatch, "
                "which are not simulated yet (link faults are)")
    if exp.scheduler.failover.enabled and (exp.faults or any(
            c.up is False for c in exp.network.wan.changes)):
        return ("scheduler.failover.enabled with an outage: health checks and re-dispatch are "
                "not simulated yet")
    return None
