"""Failure injection, the spec side: the experiment's `faults:` list and its occurrences.

Three modules, one per phase: this one (`FaultSpec`, a section of `testbed.experiment`; targets
resolved and checked by `testbed.deploy.compile` against the deployment's instances, by role
and datacenter), `testbed.inject` (the `Injector` that carries them out during the run) and
`testbed.faults` (the analysis: accounting and recovery per injected fault).

Kinds (all times real-world, after the first arrival; `testbed.deploy` puts them on the
emulated clock with the rest of the schedule):

- `pause`: SIGSTOP the target's worker process, SIGCONT after `duration` (a gray failure: the
  process keeps its sockets open and answers nothing).
- `kill`: SIGKILL, stays dead.
- `restart`: SIGKILL, then start the worker again `after` later; it rejoins when the scheduler's
  health check hears from it.
- `link`: change the WAN (`direction` kv | request | both; any of `rate`, `delay`, `loss`, `up`)
  for `duration` (none: for good), through the same `LinkSchedule` and shaper as
  `network.wan.changes`; at the end the values in force before the fault (the configured link
  and any `changes` before it) come back. A link fault and a `changes` entry that set the same
  key of the same direction while the fault lasts contradict each other: exit 2.
- `flap`: the link goes down for `down_for`, up for `up_for`, down again, ... while `duration`
  lasts (the `link` fault's cut, `up: false`, repeated; up at the end).
- `blackhole` / `reject`: for `duration` (none: for good) the router drops every packet of the
  direction silently / refuses it, TCP with a RST and the rest with ICMP host unreachable, so
  senders see a fast error instead of a timeout (`testbed.net.linkevents`, both backends).
- `reset`: TCP RSTs injected into the established KV connections that carry a packet during a
  short window (`duration`, default 0.5 s), as toxiproxy's reset_peer; `every`/`count` repeat
  it (a rate of resets).
- `slow`: the target's engine runs its clock `factor` times slower for `duration` (the profile
  engine's own clock: prefills and decode steps take factor x their profiled time; a real
  slowdown of that one instance, nothing else on the machine is touched). The runner writes
  `control/<name>.json` in the run directory and sends SIGUSR1; the worker reads it.

Targets: an instance name (`rp0`, `lp1`, `ld0`), a cluster (`prfaas`, `local`), a role
(`prefill`, `decode`): every instance in it at once; or `random(X)` (X one of those groups): one
instance, drawn with the experiment's seed, for each occurrence. `every`/`count` repeat a fault:
occurrences at `at`, `at + every`, ... (`at` defaults to `every`).
"""

import dataclasses
import math
import random

from testbed import units
from testbed.errors import ConfigError
from testbed.net.linkmodel import STEADY_KEYS, path_mtu
from testbed.net.linkmodel import reorder_gap as _gap
from testbed.schema import boolean, choice, integer, optional, positive, spec, string
from testbed.workload import generate


KINDS = ("pause", "kill", "restart", "link", "slow", "flap", "blackhole", "reject", "reset")
LINK_KEYS = ("rate", "delay", "loss", "up", *STEADY_KEYS)
EVENTS = ("blackhole", "reject", "reset")      # testbed.net.linkevents, in the router
WAN_KINDS = ("link", "flap", *EVENTS)           # what crosses the WAN; no target
RESET_WINDOW_S = 0.5        # reset without a duration: RST for this long (real-world)
GROUPS = ("prfaas", "local", "prefill", "decode")


def _up(value):
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One injected failure (list item of `faults:`)."""

    kind: str = spec(choice(*KINDS), doc="pause | kill | restart | link | slow | flap | "
                                          "blackhole | reject | reset")
    at: float = spec(optional(units.duration_s), None,
                     "when (real-world, after the first arrival), e.g. 30s")
    every: float = spec(optional(positive(units.duration_s)), None,
                        "repeat with this period (first at `at`, default `every`)")
    count: int = spec(optional(integer(1, 10000)), None, "with `every`: number of occurrences")
    target: str = spec(optional(string), None,
                       "instance (rp0, lp1, ld0), cluster (prfaas, local), role (prefill, "
                       "decode) or random(GROUP); not for link")
    duration: float = spec(optional(positive(units.duration_s)), None,
                           "pause, slow: how long; link: how long (none: for good)")
    after: float = spec(optional(positive(units.duration_s)), None,
                        "restart: start the worker again this long after the kill")
    factor: float = spec(optional(positive(units.number)), None,
                         "slow: the engine's clock runs this many times slower (> 1)")
    direction: str = spec(choice("kv", "request", "both"), "both", "link: which direction")
    rate: float = spec(optional(units.rate_bps), None, "link: rate while it lasts")
    delay: float = spec(optional(units.duration_s), None, "link: one-way delay while it lasts")
    loss: float = spec(optional(units.probability), None, "link: loss probability while it lasts")
    up: bool = spec(optional(_up), None, "link: false cuts the link while it lasts")
    down_for: float = spec(optional(positive(units.duration_s)), None,
                           "flap: the link is down this long, then up for `up_for`, ...")
    up_for: float = spec(optional(positive(units.duration_s)), None,
                         "flap: ... up this long, repeated while `duration` lasts")
    corrupt: float = spec(optional(units.probability), None, "link: bit-flip probability")
    duplicate: float = spec(optional(units.probability), None, "link: duplicate probability")
    reorder_prob: float = spec(optional(units.probability), None,
                               "link: probability a packet is sent ahead (netem's reorder)")
    reorder_gap: int = spec(optional(_gap), None, "link: netem's reorder gap")
    mtu: int = spec(optional(path_mtu), None, "link: path MTU at the router while it lasts")
    mtu_icmp: bool = spec(optional(boolean), None,
                          "link: false drops above mtu without ICMP (PMTU blackhole)")
    police: float = spec(optional(units.rate_bps), None, "link: policer rate while it lasts")
    police_burst: int = spec(optional(units.size_bytes), None, "link: the policer's bucket")

    def check(self):
        k = self.kind
        if self.at is None and self.every is None:
            raise ValueError("a fault needs 'at' or 'every'")
        if self.count is not None and self.every is None:
            raise ValueError("'count' needs 'every'")
        if self.every is not None and self.count is None:
            raise ValueError("'every' needs 'count'")
        allowed = {"pause": {"target", "duration"}, "kill": {"target"},
                   "restart": {"target", "after"}, "slow": {"target", "duration", "factor"},
                   "link": {"duration", "direction", *LINK_KEYS},
                   "flap": {"duration", "direction", "down_for", "up_for"},
                   **{e: {"duration", "direction"} for e in EVENTS}}[k]
        for key in ("target", "duration", "after", "factor", *LINK_KEYS, "down_for", "up_for"):
            if getattr(self, key) is not None and key not in allowed:
                raise ValueError(f"kind {k} takes no '{key}' (it takes "
                                 f"{', '.join(sorted(allowed))})")
        if self.direction != "both" and k not in WAN_KINDS:
            raise ValueError(f"kind {k} takes no 'direction'")
        if k not in WAN_KINDS and self.target is None:
            raise ValueError(f"kind {k} needs 'target'")
        if k in ("pause", "slow") and self.duration is None:
            raise ValueError(f"kind {k} needs 'duration'")
        if k == "restart" and self.after is None:
            raise ValueError("kind restart needs 'after'")
        if k == "slow" and (self.factor is None or self.factor <= 1):
            raise ValueError("kind slow needs 'factor' > 1")
        if k == "link" and all(getattr(self, x) is None for x in LINK_KEYS):
            raise ValueError(f"kind link needs at least one of {', '.join(LINK_KEYS)}")
        if k == "flap" and (self.down_for is None or self.up_for is None
                            or self.duration is None):
            raise ValueError("kind flap needs 'down_for', 'up_for' and 'duration'")
        if k == "flap" and self.duration < self.down_for:
            raise ValueError("kind flap needs 'duration' >= 'down_for' (one down period)")

    def flaps(self):
        """flap: (start, end) offsets from `at`, real-world, of every down period."""
        out, t = [], 0.0
        while t < self.duration - 1e-9:
            out.append((t, min(t + self.down_for, self.duration)))
            t += self.down_for + self.up_for
        return out

    def times(self):
        """Real-world injection times of every occurrence."""
        if self.every is None:
            return [self.at]
        first = self.every if self.at is None else self.at
        return [first + k * self.every for k in range(self.count)]


@dataclasses.dataclass(frozen=True)
class Occurrence:
    """One injection: YAML index, occurrence number, resolved target instances, real-world times."""

    index: int
    n: int
    spec: FaultSpec
    targets: tuple          # instance names; () for link
    at_s: float
    end_s: float            # real-world end (SIGCONT, restart, link restored); inf: never

    @property
    def target(self):
        return ",".join(self.targets) if self.targets else f"wan:{self.spec.direction}"

    def as_dict(self):
        return {"index": self.index, "occurrence": self.n, "kind": self.spec.kind,
                "target": self.target, "at_s": self.at_s,
                "end_s": None if math.isinf(self.end_s) else self.end_s}


def targetable(instances):
    """The instances a fault may target (prefill and decode), in the deployment's order:
    objects with `name`, `role` and `dc` (`testbed.runtime.InstanceRuntime`)."""
    return [i for i in instances if i.role in ("prefill", "decode")]


def _group(name, instances):
    """The names a group or instance name stands for, chosen by datacenter and role."""
    if name in ("prfaas", "local"):
        return [i.name for i in instances if i.dc == name]
    if name in ("prefill", "decode"):
        return [i.name for i in instances if i.role == name]
    return [name] if name in {i.name for i in instances} else None


def _resolve_target(text, instances, rng):
    """Instance names a target string stands for; raises ValueError naming what was expected."""
    t = text.strip()
    pick = t.startswith("random(") and t.endswith(")")
    group = _group(t[7:-1].strip() if pick else t, instances)
    if not group:
        names = [i.name for i in instances]
        raise ValueError(f"unknown target {text!r}; expected an instance ({', '.join(names)}), "
                         f"{', '.join(GROUPS)} or random(GROUP), with at least one instance")
    return (rng.choice(group),) if pick else tuple(group)


def expected_end_s(exp):
    """Real-world time of the last arrival of the request list the run will send (the same
    seeded generator), or `duration` when that is longer."""
    wl = generate(exp.workload, exp.seed, requests=exp.requests, duration_s=exp.duration)
    last = float(wl.arrival_s.max()) if len(wl) else 0.0
    return max(last, exp.duration or 0.0)


def resolve(exp, instances):
    """Every occurrence of every fault, YAML order, its targets among `instances` (the
    deployment's, `targetable`); raises _Bad(key, message) on bad specs."""
    names = targetable(instances)
    rng = random.Random(exp.seed)
    out = []
    for i, f in enumerate(exp.faults):
        for n, at in enumerate(f.times()):
            try:
                targets = () if f.kind in WAN_KINDS else _resolve_target(f.target, names, rng)
            except ValueError as e:
                raise _Bad(f"faults[{i}].target", str(e)) from None
            if f.kind == "kill":
                end = math.inf
            elif f.kind == "restart":
                end = at + f.after
            elif f.kind == "reset" and f.duration is None:
                end = at + RESET_WINDOW_S
            else:
                end = at + f.duration if f.duration is not None else math.inf
            out.append(Occurrence(i, n, f, targets, at, end))
    return out


class _Bad(Exception):
    def __init__(self, key, message):
        super().__init__(message)
        self.key = key


def _span(o):
    end = "for good" if math.isinf(o.end_s) else f"until {o.end_s:g}s"
    return f"{o.spec.kind} at {o.at_s:g}s {end}"


def _check_overlaps(occ, exp):
    by_target = {}
    for o in occ:
        for t in o.targets:
            by_target.setdefault(t, []).append(o)
    for t, lst in by_target.items():
        lst = sorted(lst, key=lambda o: o.at_s)
        for a, b in zip(lst, lst[1:]):
            if b.at_s < a.end_s or b.at_s == a.at_s:
                if a.spec.kind == "kill" and b.spec.kind == "restart":
                    raise _Bad(f"faults[{b.index}]", f"restart of {t} at {b.at_s:g}s, already "
                               f"killed for good by faults[{a.index}] at {a.at_s:g}s")
                raise _Bad(f"faults[{b.index}]", f"{_span(b)} on {t} overlaps faults[{a.index}] "
                           f"({_span(a)}) on the same instance")
    links = [o for o in occ if o.spec.kind in WAN_KINDS]
    dirs = lambda d: ("kv", "request") if d == "both" else (d,)   # noqa: E731
    for x in range(len(links)):
        a = links[x]
        for b in links[x + 1:]:
            keys = set(_sets(a.spec)) & set(_sets(b.spec))
            if keys and set(dirs(a.spec.direction)) & set(dirs(b.spec.direction)) and \
                    max(a.at_s, b.at_s) < min(a.end_s, b.end_s):
                first, second = sorted((a, b), key=lambda o: (o.at_s, o.index))
                raise _Bad(f"faults[{second.index}]",
                           f"{second.spec.kind} fault at {second.at_s:g}s sets "
                           f"{', '.join(sorted(keys))} of the same direction as "
                           f"faults[{first.index}] ({_span(first)})")
        for j, c in enumerate(exp.network.wan.changes):
            keys = {k for k in _sets(a.spec) if getattr(c, k, None) is not None}
            if keys and set(dirs(a.spec.direction)) & set(dirs(c.direction)) and \
                    a.at_s <= c.at < a.end_s:
                raise _Bad(f"faults[{a.index}]",
                           f"{a.spec.kind} fault ({_span(a)}) and network.wan.changes[{j}] at "
                           f"{c.at:g}s both set {', '.join(sorted(keys))} of the same direction")


def _sets(f):
    """The link keys a WAN fault sets while it lasts (`event`: the router's event chain)."""
    if f.kind == "flap":
        return ("up",)
    if f.kind in EVENTS:
        return ("event",)
    return tuple(k for k in LINK_KEYS if getattr(f, k) is not None)


def check(exp, instances, path=None):
    """Every occurrence (`resolve`); ConfigError (exit 2, one line) for a fault list that cannot
    be carried out. `testbed.deploy.compile` calls it: targets are the deployment's."""
    if not exp.faults:
        return []
    try:
        occ = resolve(exp, instances)
        end = expected_end_s(exp)
        for o in occ:
            if o.at_s > end:
                raise _Bad(f"faults[{o.index}].at", f"{o.spec.kind} at {o.at_s:g}s is past the "
                           f"run's expected end ({end:g}s, the last arrival)")
            if o.spec.kind == "slow" and exp.model.engine != "profile":
                raise _Bad(f"faults[{o.index}].kind", "slow needs model.engine profile (the "
                           "profile engine's clock is what it slows)")
        _check_overlaps(occ, exp)
    except _Bad as e:
        raise ConfigError(str(e), path=path, key=e.key) from None
    return occ


