"""Replay a run's routing decisions through the simulator's decision path.

    run directory: runtime.json -> Router.of_runtime (the router testbed/sim/cluster.py builds)
                   decisions.jsonl -> per record: Router.set_book(record), Router.route -> ?=
                   (prefix cache: + CachePlacer.choose on the record's view and link -> ?=)
                   (vLLM's KV events: workers.kvplace.choose on the record's hits -> ?=)

Both backends write decisions.jsonl the same way (`workers.policy.Router.route_recorded`: one
`testbed.records.DecisionRecord` per request's first routing, with the book the router read:
threshold, which instance is in which list, outstanding predicted prefill seconds, decode
requests in flight, which instances are down; with the prefix cache also what the pools
answered, the link reading and the learned fetch time, and the placement's choice:
`workers.placement.CachePlacer.plan`). Replaying an emulated run's records here asks
whether the simulator, given the state the emulation's scheduler saw, decides as it did: issue
25's "one decision code path". Reads only the run directory; no root, no processes.
"""

from __future__ import annotations

import dataclasses
import logging

from testbed import profile as profiles
from testbed.records import DecisionRecord, RunDir, read_decisions
from testbed.runtime import WorkerRuntime
from workers import kvfeed, kvplace
from workers.placement import CachePlacer, CacheView, plan_fields, profile_prefill_s
from workers.policy import Router


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """A decision the replay did not reproduce: (policy, kind, prefill, decode, error) each."""

    id: int
    recorded: tuple
    replayed: tuple


@dataclasses.dataclass(frozen=True)
class Replay:
    decisions: int                  # records replayed
    mismatches: list[Mismatch]


class RecordedClock:
    """The replay's clock: the recorded decision's time (`workers.clock.Clock`)."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t


def router_of(run_dir) -> Router:
    """The router of a run, as the scheduler and the simulator build it, from its runtime.json."""
    return deciders_of(run_dir)[0]


def deciders_of(run_dir):
    """(router, placer or None, its clock): the run's router and, with the prefix cache, its
    placement (`CachePlacer`) on that router, as the scheduler and the simulator build them."""
    rt = WorkerRuntime.load(RunDir(run_dir).runtime)
    prof = profiles.load(rt.profile)
    router = Router.of_runtime(rt, prof)
    if not rt.cache.enabled:
        return router, None, None
    clock = RecordedClock()
    placer = CachePlacer(rt, router, profile_prefill_s(rt.scale, prof),
                         logging.getLogger("testbed.sim.replay"), clock=clock,
                         read_row=lambda: None)
    return router, placer, clock


def outcome(rec: DecisionRecord) -> tuple:
    """What a record says was decided: (policy, kind, prefill, decode, error), or under the
    prefix cache (policy, placement, the cluster, the plan)."""
    if rec.cache and rec.cache.get("source") != kvfeed.SOURCE:
        c = rec.cache
        return rec.policy, c["placement"], c["remote"], c["plan"]
    return rec.policy, rec.kind, rec.prefill, rec.decode, rec.error


def place(placer, clock, rec: DecisionRecord) -> tuple:
    """The placement's choice on the record's book, pools' answer, link and learned fetch
    time, as `outcome` spells it (`CachePlacer.choose`, after `abundant` as `plan` calls it)."""
    c = rec.cache
    clock.t = rec.time
    placer.set_book(rec)
    choice, best = placer.choose(c["input_len"], CacheView(*c["view"]), placer.abundant())
    return (placer.router.policy, placer.placement, *plan_fields(choice, best).values())


def decide(router: Router, rec: DecisionRecord, placer=None, clock=None) -> tuple:
    """`router`'s decision on the record's book and length (with the cache, `placer`'s), as
    `outcome` spells it."""
    by_events = rec.cache.get("source") == kvfeed.SOURCE     # vLLM: the hits its view gave
    if rec.cache and not by_events:
        return place(placer, clock, rec)
    router.set_book(rec)
    try:
        kind, p, d = kvplace.choose(router, rec.cache["hits"], rec.cache["input_len"],
                                    rec.uncached_len) if by_events else \
            router.route(rec.uncached_len)
    except LookupError as e:
        return router.policy, "", "", "", str(e)
    return router.policy, kind, p.name, d.name, ""


def replay(run_dir, records: list[DecisionRecord] | None = None) -> Replay:
    """Every decision of `run_dir` (or `records`, default: its decisions.jsonl) made again by a
    fresh router of that run; the ones that come out differently."""
    if records is None:
        records = read_decisions(RunDir(run_dir).decisions)
    router, placer, clock = deciders_of(run_dir)
    out = []
    for rec in records:
        got = decide(router, rec, placer, clock)
        if got != outcome(rec):
            out.append(Mismatch(rec.id, outcome(rec), got))
    return Replay(len(records), out)
