"""Health and re-dispatch decisions, asyncio- and gRPC-free: what workers/recovery.py (the
emulation's scheduler) and testbed/sim/cluster.py (the simulator) both run.

    recovery (gRPC, asyncio: Health.loop, Flight) -> redispatch (this) <- testbed.sim.cluster

- `HealthBook`: every instance's missed checks and its up/down state. `checked` judges one
  health check (down after `misses_down` missed checks in a row, up again at the first answer;
  a late answer is no miss while the instance's chunks kept arriving halfway through the wait);
  `set` makes a transition: the `health` row in events.csv, the `failovers` count, and the
  callbacks that tell the requests on the instance (`on_down`) or the waiters (`on_up`).
- The re-dispatch decisions of one request (a `FlightView`: the instances it is on, its
  attempt and the tokens known to have left the decode worker), the route through a callable:
  `place_prefill` (where a prefill moves, or None), `reroute_decode` (where a request without
  tokens re-prefills for another decode instance, or the error that fails it),
  `after_prefill_failure` (what a failed prefill attempt leads to) and `after_kv_timeout`
  (what a decode instance's KV deadline leads to: wait again while the prefill still runs, or
  prefill again).

The clock is injected (`clock()`: seconds), so the simulator hands in its virtual time.
"""

from __future__ import annotations

from typing import Callable, Protocol

MAX_ATTEMPTS = 4          # prefill attempts per request before it fails


class FlightView(Protocol):
    """What the decisions read of one request in flight."""

    failover: bool
    attempt: int          # the current prefill attempt (0 first)
    tokens: int           # tokens known to have left the decode worker
    p: object             # the prefill Instance (workers.policy.Instance)
    d: object             # the decode Instance
    kv_waits: int         # KV deadlines waited out again while the prefill still ran


class HealthBook:
    def __init__(self, names, events, clock, on_down=None, on_up=None, stats=None,
                 misses_down=2):
        """`events(kind, **fields)`: events.csv; `clock()`: seconds (monotonic or virtual);
        `on_down(inst, reason)` / `on_up(inst)`: after a transition; `stats`: a
        SchedulerStats-like object whose `failovers` counts transitions."""
        self.events, self.clock = events, clock
        self.on_down, self.on_up, self.stats = on_down, on_up, stats
        self.misses_down = misses_down
        self.misses = dict.fromkeys(names, 0)
        self.last_seen = {}         # instance name -> clock() of its last chunk

    def seen(self, inst):
        """Traffic from `inst` (a chunk of its stream) is a sign of life."""
        self.last_seen[inst.name] = self.clock()

    def checked(self, inst, answered, asked, timeout, why=""):
        """One health check of `inst` asked at `asked`: (down, reason) for a transition to
        make (None: none). `answered`: it replied within `timeout`; `why`: the error."""
        name = inst.name
        if answered or self.last_seen.get(name, -1e18) > asked + timeout / 2:
            # A busy worker may answer late while its chunks still flow: passive liveness.
            # What it sent just before it froze lands at once and must not excuse the check.
            self.misses[name] = 0
        else:
            self.misses[name] += 1
        if self.misses[name] >= self.misses_down:
            return True, f"{self.misses[name]} missed health checks ({why})"
        if self.misses[name] == 0:
            return False, "answered a health check"
        return None

    def set(self, inst, down, reason, log=None):
        """Mark `inst` down or up (nothing when it already is): logged, counted, told."""
        if inst.down == down:
            return False
        inst.down = down
        if self.stats is not None:
            self.stats.failovers += 1
        if log is not None:
            log.warning("health: %s is %s (%s)", inst.name, "DOWN" if down else "up", reason)
        self.events("health", instance=inst.name, role=inst.role,
                    state="down" if down else "up", reason=reason.replace(" ", "_"))
        if down and self.on_down is not None:
            self.on_down(inst, reason)
        elif not down and self.on_up is not None:
            self.on_up(inst)
        return True


def place_prefill(route: Callable):
    """An up prefill instance for the request (the routing policy's choice through `route()`,
    which returns (kind, p, d) or raises LookupError), or None."""
    try:
        _, p, _ = route()
    except LookupError:
        return None
    return None if p.down else p


def move_prefill(f: FlightView, route: Callable):
    """Where the prefill of `f` moves (an up instance), or None: attempts spent, none up."""
    if f.attempt + 1 >= MAX_ATTEMPTS:
        return None
    return place_prefill(route)


def reroute_decode(f: FlightView, route: Callable, reason):
    """(error, None) when `f` cannot leave its decode instance (no failover, tokens already
    sent, attempts spent, nowhere up), else (None, (p, d)): re-prefill on p for d."""
    why = f"decode {f.d.name} failed ({reason})"
    if not f.failover:
        return why, None
    if f.tokens:
        return f"{why} after {f.tokens} tokens", None
    if f.attempt + 1 >= MAX_ATTEMPTS:
        return f"{why}; {MAX_ATTEMPTS} prefill attempts made", None
    try:
        _, p, d = route()
    except LookupError as e:
        return f"{why}; {e}", None
    if d is f.d or d.down:
        return f"{why}; no other decode instance is up", None
    return None, (p, d)


def after_prefill_failure(f: FlightView, route: Callable, error):
    """What a failed prefill attempt (`error`) of `f` leads to: ("fail", error),
    ("decode", None) (its decode instance is down: reroute it), ("move", p) (the next attempt
    on p) or ("wait", None) (retry once an instance is up)."""
    if not f.failover:
        return "fail", error
    if f.d.down:
        return "decode", None
    p = move_prefill(f, route)
    if p is not None:
        return "move", p
    if f.attempt + 1 >= MAX_ATTEMPTS:
        return "fail", f"{error}; {MAX_ATTEMPTS} prefill attempts made"
    return "wait", None


def on_instance_down(f: FlightView, inst, prefill_done):
    """What `inst` going down means for `f`: "decode" (reroute it), "prefill" (move the
    prefill if it can; a paused instance keeps it otherwise) or None."""
    if f.failover and inst is f.d:
        return "decode"
    if f.failover and inst is f.p and not prefill_done:
        return "prefill"
    return None


def after_kv_timeout(f: FlightView, route: Callable, error, prefill_running):
    """What the decode instance's KV deadline (`error`: its KV not complete, no token made)
    leads to: ("fail", error), ("wait", None) (the prefill attempt still runs on an up
    instance, e.g. queued behind others: the KV is late, not lost, so the decode stream opens
    again on the same instance and the attempt goes on) or ("prefill", (p, d)) (the attempt
    ended, or its instance is down, and the KV never came: a new attempt on p for d, which may
    be the same decode instance). Waits and attempts together are bounded by MAX_ATTEMPTS."""
    if not f.failover or f.tokens:
        return "fail", error
    if f.attempt + f.kv_waits + 1 >= MAX_ATTEMPTS:
        return "fail", f"{error}; {MAX_ATTEMPTS} KV deadlines"
    if prefill_running and not f.p.down:
        return "wait", None
    try:
        _, p, d = route()
    except LookupError as e:
        return "fail", f"{error}; {e}"
    if p.down or d.down:
        return "fail", f"{error}; no instance is up for another prefill"
    return "prefill", (p, d)
