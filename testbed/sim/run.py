"""One expanded run in virtual time: the sim backend's counterpart of testbed/run.py's `Run`.

    Experiment -> deploy.compile -> runinputs (config.yaml, deployment.json, runtime.json,
    workload.parquet) -> cluster in the event loop -> requests.jsonl, decisions.jsonl,
    events.csv, timeseries.csv, scheduler.csv, metadata.json (`backend: sim`) -> analysis.analyse

The run directory holds the same files, in the same form, as an emulated run's, so `testbed
analyse`, `plot` and `report` read it unchanged. Times in it are Unix times: arrival 0 is the
wall clock when the run started, and every later stamp is that plus virtual (emulated) seconds.
metadata.json records what the simulation cost (`sim`: wall seconds, events, peak memory) and
which model terms were on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import resource
import secrets
import time

from testbed import analysis, deploy, rundir, runinputs
from testbed.records import EventLog, RecordLog, RunDir
from testbed.sim.cache import CachedCluster
from testbed.sim.cluster import SimCluster
from testbed.sim.loop import Loop
from testbed.sim.wan import Terms

# Above this many requests only per-request records are written (first and last token): the
# per-token times of a million requests would not fit (docs/sim.md).
TOKENS_UP_TO = 50_000


@contextlib.contextmanager
def _collector_on_new_objects(young=20_000):
    """The cyclic collector sees only what the simulation allocates: what exists before it
    (modules, the deployment, the workload) is frozen, not scanned again by every full
    collection, and the youngest generation is collected every `young` allocations, not 700
    (fewer events in flight promoted to older ones): the collector took 0.95 of 6.3 CPU s in
    the loop at 10,000 requests on 5,000 instances, 0.38 s so (docs/sim.md, "Cost")."""
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(young, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


class SimRun:
    def __init__(self, exp, run_dir, terms=Terms(), tokens=None, controllers_since_s=0.0,
                 deployment=None):
        """`terms`: the link model's terms (testbed.sim.wan.Terms); `tokens`: write per-token
        times and every routing decision (decisions.jsonl; default: up to TOKENS_UP_TO
        requests); `controllers_since_s`: emulated seconds the periodic controllers (adaptive threshold,
        re-plan) ran before arrival 0 (default 0: they start with it); `deployment`: the run's
        compiled `Deployment` (testbed/run.py compiles every run once), compiled here when not
        given."""
        self.controllers_since_s = controllers_since_s
        self.exp, self.dir = exp, RunDir(run_dir)
        self.terms, self.tokens = terms, tokens
        self.deployment = deployment if deployment is not None else deploy.compile(exp)

    def execute(self):
        self._simulate()
        gc.collect()        # the models' cycles, gone before analysis needs the memory
        return analysis.analyse(self.dir)

    def _simulate(self):
        exp, d, dep = self.exp, self.dir, self.deployment
        wall0, cpu0 = time.monotonic(), time.process_time()
        workload = runinputs.write_inputs(exp, dep, d)
        meta = runinputs.base_metadata(exp, dep, workload)
        tokens = self.tokens if self.tokens is not None else len(workload) <= TOKENS_UP_TO
        base = time.time()
        loop = Loop()
        clock = lambda: base + loop.now()           # noqa: E731  virtual Unix time
        events = EventLog(d.events, clock=clock)
        records = RecordLog(d.records, buffering=1 << 20)   # cannot crash half-way: one block
        decisions = RecordLog(d.decisions, buffering=1 << 20) if tokens else None
        cluster = (CachedCluster if dep.runtime.cache.enabled else SimCluster)(
            dep, loop, records, events, d, base, self.terms, tokens, decisions)
        meta.update(run_id=secrets.token_hex(2), client_start_at=base, wan_counters={},
                    teardown_errors=[], dead_workers=[], link_schedule_errors=[],
                    shaping={"backend": "sim", "backend_reason": "flow-level model "
                             "(testbed/sim/wan.py)"},
                    link_fidelity={"skipped": "backend sim: the link is a model"},
                    topology={"kind": "sim", "instances": len(dep.instances)},
                    tcp={"congestion_control_kv": "model (max-min fair share, Mathis loss cap)"})
        try:
            events("workers_ready", count=len(dep.workers()))
            events("client_started", requests=len(workload))
            cluster.start(workload, d.timeseries, self.controllers_since_s)
            last = dep.scale.emulated_s(float(workload.arrival_s.max())) if len(workload) else 0
            with _collector_on_new_objects():
                loop.run(until=last)
                records.write({"ev": "all_sent", "time": clock()})
                loop.run(until=last + dep.runtime.drain_timeout_s)
            cluster.close()
            records.write({"ev": "finished", "time": clock()})
            events("client_finished", code=0)
        finally:
            records.close()
            events.close()
            if decisions is not None:
                decisions.close()
        wall = time.monotonic() - wall0
        meta["end_time"] = clock()
        meta["sim"] = {"wall_s": round(wall, 3), "cpu_s": round(time.process_time() - cpu0, 3),
                       "events": loop.events, "virtual_s": round(loop.now(), 6),
                       "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                            / 1024, 1),
                       "requests_per_wall_s": round(len(workload) / wall, 1) if wall else None,
                       "per_token_records": tokens, "decisions": decisions is not None,
                       "terms": dataclasses.asdict(self.terms),
                       "controllers_since_s": self.controllers_since_s,
                       "not_finished": cluster.active}
        meta["phases_s"] = {"simulate": round(wall, 3)}
        rundir.write_metadata(d, meta)
