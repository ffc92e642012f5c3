"""Replay a run's routing decisions through the simulator's decision path.

    run directory: runtime.json -> Router.of_runtime (the router testbed/sim/cluster.py builds)
                   decisions.jsonl -> per record: Router.set_book(record), Router.route -> ?=

Both backends write decisions.jsonl the same way (`workers.policy.Router.route_recorded`: one
`testbed.records.DecisionRecord` per request's first routing, with the book the router read:
threshold, which instance is in which list, outstanding predicted prefill seconds, decode
requests in flight, which instances are down). Replaying an emulated run's records here asks
whether the simulator, given the state the emulation's scheduler saw, decides as it did: issue
25's "one decision code path". Reads only the run directory; no root, no processes.
"""

from __future__ import annotations

import dataclasses

from testbed import profile as profiles
from testbed.records import DecisionRecord, RunDir, read_decisions
from testbed.runtime import WorkerRuntime
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


def router_of(run_dir) -> Router:
    """The router of a run, as the scheduler and the simulator build it, from its runtime.json."""
    rt = WorkerRuntime.load(RunDir(run_dir).runtime)
    return Router.of_runtime(rt, profiles.load(rt.profile))


def outcome(rec: DecisionRecord) -> tuple:
    """What a record says was decided: (policy, kind, prefill, decode, error)."""
    return rec.policy, rec.kind, rec.prefill, rec.decode, rec.error


def decide(router: Router, rec: DecisionRecord) -> tuple:
    """`router`'s decision on the record's book and length, as `outcome` spells it."""
    router.set_book(rec)
    try:
        kind, p, d = router.route(rec.uncached_len)
    except LookupError as e:
        return router.policy, "", "", "", str(e)
    return router.policy, kind, p.name, d.name, ""


def replay(run_dir, records: list[DecisionRecord] | None = None) -> Replay:
    """Every decision of `run_dir` (or `records`, default: its decisions.jsonl) made again by a
    fresh router of that run; the ones that come out differently."""
    if records is None:
        records = read_decisions(RunDir(run_dir).decisions)
    router = router_of(run_dir)
    out = []
    for rec in records:
        got = decide(router, rec)
        if got != outcome(rec):
            out.append(Mismatch(rec.id, outcome(rec), got))
    return Replay(len(records), out)
