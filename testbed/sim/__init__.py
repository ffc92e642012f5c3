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

from testbed import deploy
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
    dual = [f for f in exp.faults if f.kind not in WAN_KINDS and exp.scheduler.roles.enabled
            and _hits_dual(f.target)]
    if dual:
        return (f"faults on dual-role instances ({dual[0].kind} on {dual[0].target}, "
                "scheduler.roles) are not simulated yet (PrfaaS instances' faults are)")
    dep = deploy.compile(exp)
    limits = next((k for k in ("mtu", "police") if dep.sets(k)), None)
    if limits:
        return (f"network.wan {limits}: the router's path MTU and policer drop packets, which "
                "the flow-level WAN model does not have (run it on the mininet backend)")
    return None


def _hits_dual(target):
    """Whether a fault's `target` (testbed.faultspec's groups, an instance, random(GROUP), a
    list) may name a local instance, which `scheduler.roles` makes dual-role: only PrfaaS
    (`prfaas`, rp*) is safe."""
    names = target if isinstance(target, (list, tuple)) else [target]
    for n in (str(x).strip() for x in names):
        if n.startswith("random(") and n.endswith(")"):
            n = n[7:-1].strip()
        if n != "prfaas" and not n.startswith("rp"):
            return True
    return False
