"""The simulation backend (`backend: sim`): the same Deployment in virtual time.

    config -> deploy (Deployment) -> sim: loop + engine + wan models, the scheduler's own
    decision code (workers/policy.py, workers/adaptive.py) -> the run directory -> analyse

- `loop`: the heap-based event loop (virtual, emulated seconds);
- `engine`: prefill and decode instances timed by the profile engines (workers/engine_profile.py);
- `wan`: the WAN and the datacenter fabrics as a flow-level model (max-min sharing, delay,
  jitter, queueing, the loss-limited TCP rate);
- `cluster`: requests through the Router and the models, recorded as the client records them;
- `run`: one expanded run, writing the same run directory files as the emulation.

`faults`: instance faults, health checks and re-dispatch (workers/redispatch.py's
  decisions).
`cache`: the prefix cache pools and the placement (workers/placement.py's `CachePlacer`,
  workers/cache_core.py's books), a `SimCluster` with them.
`replay`: a run's recorded routing decisions (decisions.jsonl, either backend's) made again by
  the router as the simulator builds it; the ones that differ.

Nothing here needs root, namespaces or processes. `unsupported(exp)` (here, cheap to import)
says what a deployment asks that the simulator does not model yet; the runner refuses it
before anything starts (exit 2). docs/sim.md says what is modelled and how it compares.
"""

from testbed.faultspec import EVENTS, WAN_KINDS


def unsupported(exp):
    """Why the simulator cannot run `exp` yet (one line), or None."""
    if exp.model.engine != "profile":
        return (f"model.engine {exp.model.engine} computes for real: the simulator models "
                "profiled accelerators only (model.engine: profile)")
    if exp.workload.client != "builtin":
        return (f"workload.client {exp.workload.client}: the simulator replays the request list "
                "itself (workload.client: builtin)")
    events = [f.kind for f in exp.faults if f.kind in EVENTS]
    if events:
        return (f"a {events[0]} fault acts on packets and connections (refused, dropped, "
                "reset), which the flow-level WAN model does not have (run it on the mininet "
                "backend)")
    decode = [f for f in exp.faults if f.kind not in WAN_KINDS and _hits_decode(exp, f.target)]
    if decode:
        return (f"faults on decode instances ({decode[0].kind} on {decode[0].target}) are not "
                "simulated yet (prefill instances' faults are)")
    limits = _path_limits(exp)
    if limits:
        return (f"{limits}: the router's path MTU and policer drop packets, which the "
                "flow-level WAN model does not have (run it on the mininet backend)")
    return None


def _path_limits(exp):
    """The first of network.wan's mtu / police set anywhere (directions, changes, link
    faults), or None."""
    wan = exp.network.wan
    for key in ("mtu", "police"):
        if (any(wan.direction(d)[key] for d in ("kv", "request"))
                or any(getattr(c, key) for c in wan.changes)
                or any(f.kind == "link" and getattr(f, key) for f in exp.faults)):
            return f"network.wan {key}"
    return None


def _hits_decode(exp, target):
    """Whether a fault's `target` (testbed.faultspec's groups, an instance, random(GROUP), a
    list) may name a decode instance or a dual-role one: only PrfaaS, `prefill` and the
    prefill instances (rp*, lp*) are safe."""
    names = target if isinstance(target, (list, tuple)) else [target]
    for n in (str(x).strip() for x in names):
        if n.startswith("random(") and n.endswith(")"):
            n = n[7:-1].strip()
        if exp.scheduler.roles.enabled and n != "prfaas" and not n.startswith("rp"):
            return True
        if not (n in ("prfaas", "prefill") or n[:2] in ("rp", "lp")):
            return True
    return False
