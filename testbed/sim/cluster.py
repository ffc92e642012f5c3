"""The simulated cluster: the scheduler's own decisions over the engine and WAN models.

    deploy (Deployment) -> cluster (this): Router, ThresholdDecider <- engine, wan, loop -> records

Per request, in virtual time (emulated seconds after arrival 0), what workers/scheduler.py and
workers/recovery.Flight do without failures:

1. the scheduler receives it at its arrival (the client sits beside it: no delay); the adaptive
   threshold, if on, is evaluated first (`workers.adaptive.ThresholdDecider`, the emulation's
   law, fed the sampled KV egress counter as the emulation's scheduler reads timeseries.csv);
2. `workers.policy.Router.route` picks the prefill and decode instances from its own book
   (outstanding prefill seconds, decode requests in flight), the decode instance's count goes
   up, and the predicted prefill seconds are added to the prefill instance's book; the
   decision and the book it read are a line of decisions.jsonl (`Router.route_recorded`, as
   the emulation's scheduler writes it);
3. the Prefill call reaches a PrfaaS instance after the request direction's one-way delay (a
   local one at once); it queues FIFO and computes (`engine.PrefillInstance`), handing its KV
   pieces to one flow on the WAN's KV direction (PrfaaS) or the datacenter's fabric (local);
4. the decode instance takes the request once its last KV byte has arrived (or fails it past
   the KV deadline, or when its KV is larger than the decode memory, as the worker does; with
   failover the deadline is a timer per decode stream, and the recovery's decision
   `workers.redispatch.after_kv_timeout` waits again or prefills again, as Flight does),
   batches and steps it (`engine.DecodeInstance`); the
   prefill's reply reaches the scheduler after its last byte was sent plus the KV direction's
   delay, and the predicted seconds leave the book then;
5. at its last token the request's `done` line is written, built by the emulation's own client
   record (`workers.client.Tracker`) from the chunks the decode worker would have sent.

With `scheduler.roles` every local instance has both models (a dual-role worker) and the
long timescale re-plans every `interval` with `workers.roles.RolePlanner` (the emulation's
decisions); a conversion takes the instance out of its role's list, waits (polling as the
emulation does) until the router's book and the worker show nothing of the old role, then the
conversion cost, and puts it in the new role's list (`role` and `replan` rows in events.csv).

The link schedule (`Deployment.link_changes`: changes, rate trace, link faults) is applied to
the link models at its times; instance faults, the health checks and the re-dispatches are
`testbed.sim.faults` (workers/redispatch.py's decisions); the prefix cache is
`testbed.sim.cache.CachedCluster`. Not simulated yet: faults on dual-role instances and an
external client; `testbed.sim.unsupported` says which one a deployment asks for.
"""

from __future__ import annotations

import csv
import functools
import random

from testbed import profile as profiles
from testbed.measure import CounterSampler
from testbed.records import RunDir, SentRecord
from testbed.proto import testbed_pb2 as pb
from testbed.sim.controllers import Controllers
from testbed.sim.engine import DecodeInstance, PrefillInstance, Slot
from testbed.sim.faults import SimRecovery, redispatch_record
from testbed.sim.wan import LinkModel, Terms
from workers.adaptive import COLUMNS as SCHEDULER_COLUMNS
from workers.adaptive import ThresholdDecider
from workers.client import Tracker
from workers import redispatch
from workers.policy import Router
from workers.roles import RolePlanner

SAMPLE_HZ = 20.0          # timeseries.csv, as the emulation's counter sampler


def _first_tick(interval_s, since_s):
    """The first tick at or after arrival 0 of a timer started `since_s` before it."""
    return interval_s - (since_s % interval_s) if since_s > 0 else interval_s


class Request:
    """One request's state through the cluster (virtual times)."""

    __slots__ = ("id", "input_len", "output_len", "send", "kind", "p", "d", "predicted",
                 "queued", "start", "end", "kv_bytes", "send_start", "send_end",
                 "recv_start", "recv_end", "opened", "failover", "attempt", "tokens", "replied",
                 "failed", "flow", "moves", "kv_waits", "kv_in", "slot")

    def __init__(self, w, send, failover=False):
        self.id, self.input_len, self.output_len = int(w.id), int(w.input_len), int(w.output_len)
        self.send = send
        self.p = self.d = self.flow = self.slot = None
        self.failover, self.attempt, self.tokens = failover, 0, 0     # workers.redispatch's
        self.replied = self.failed = False      # FlightView: the attempt's reply, the end
        self.moves = []
        self.kv_waits = 0           # FlightView: KV deadlines waited out again
        self.kv_in = False          # the current decode stream has its KV (the deadline is off)


class SimCluster(Controllers):
    def __init__(self, dep, loop, records, events, run_dir, base_unix, terms=Terms(),
                 tokens=True, decisions=None):
        """`records`: requests.jsonl (a `testbed.records.RecordLog`); `events(kind, **fields)`: events.csv;
        `base_unix`: the Unix time arrival 0 is given in the run directory; `tokens`: write every
        token's time (off: first and last only, for very large runs); `decisions`:
        decisions.jsonl (a `RecordLog`; None: not written), each routing decision with its book."""
        self.dep, self.loop, self.records, self.events = dep, loop, records, events
        self.decisions = decisions
        self.base, self.tokens = base_unix, tokens
        rt = self.rt = dep.runtime
        self.router = Router.of_runtime(rt, profiles.load(rt.profile))
        self.prefill = {i.name: PrefillInstance(rt, i) for i in rt.of_role("prefill")}
        self.decode = {i.name: DecodeInstance(loop, rt, i) for i in rt.of_role("decode")}
        self.planner = self.converting = None
        if rt.scheduler.roles is not None:      # dual-role local instances: both models
            for i in rt.of_role("prefill", "decode"):
                if i.dc == "local":
                    self.prefill.setdefault(i.name, PrefillInstance(rt, i))
                    self.decode.setdefault(i.name, DecodeInstance(loop, rt, i))
            self.planner = RolePlanner(rt, self.router)
        rng = random.Random(dep.seed)
        kv, req = dep.links["kv"], dep.links["request"]
        self.links = {"kv": LinkModel(loop, kv, rng, terms, reverse_delay_s=req.delay_s),
                      "request": LinkModel(loop, req, rng, terms, reverse_delay_s=kv.delay_s)}
        self.fabric = {dc: LinkModel(loop, None, terms=terms) for dc in ("prfaas", "local")}
        self.active = 0               # requests sent and not finished
        self.to_send = 0
        self.completed = 0
        self.samples = None
        self.last_sample = None
        self.decider = self.sched_csv = None
        if rt.scheduler.adaptive is not None:
            self.decider = ThresholdDecider(self.router, rt.scheduler.adaptive)
            self._sched_file = open(RunDir(run_dir).scheduler, "w", newline="")
            self.sched_csv = csv.writer(self._sched_file)
            self.sched_csv.writerow(SCHEDULER_COLUMNS)
            self.last_eval = -float("inf")
        self.recovery = None
        if dep.fault_actions or rt.scheduler.failover:
            self.recovery = SimRecovery(self)

    def unix(self, t):
        return self.base + t

    # ---- start ----
    def start(self, workload, timeseries_path, controllers_since_s=0.0):
        """Schedule every arrival, the link schedule, the samplers and the periodic controllers
        (`controllers_since_s`: how long before arrival 0 they started; the emulation's start
        with the scheduler, before the client, so their ticks fall at that phase)."""
        self.to_send = len(workload)
        self.loop.series(len(workload), self._arrivals(workload))
        for c in self.dep.link_changes:
            self.loop.at(c.at_s, self._link_change, c)
        self.samples = open(timeseries_path, "w", newline="")
        self.sample_csv = csv.writer(self.samples)
        self.sample_csv.writerow(CounterSampler.COLUMNS)
        self._sample()
        if self.recovery is not None:
            self.recovery.start(self.dep.fault_actions, controllers_since_s)
        if self.decider is not None:
            self.loop.at(_first_tick(self.rt.scheduler.adaptive.interval_s, controllers_since_s),
                         self._adapt_timer)
        if self.planner is not None:
            self.loop.at(_first_tick(self.rt.scheduler.roles.interval_s, controllers_since_s),
                         self._replan_timer)

    def _arrivals(self, workload):
        """Every request's (time, row, submit, args) in time order (`Loop.series`)."""
        rows = workload.reset_index(drop=True)
        if not rows.arrival_s.is_monotonic_increasing:
            rows = rows.sort_values("arrival_s", kind="stable")
        for i, w in zip(rows.index.tolist(), rows.itertuples(index=False)):
            yield self.dep.scale.emulated_s(float(w.arrival_s)), i, self.submit, (w,)

    def busy(self):
        return self.active > 0 or self.to_send > 0

    def close(self):
        self._sample(again=False)
        self.samples.close()
        if self.sched_csv is not None:
            self._sched_file.close()

    # ---- the link schedule and the counters ----
    def _link_change(self, c):
        if c.fault:
            n = dict(c.fault)
            self.events(f"fault_{n.pop('phase')}", **n)
        for d in ((c.direction,) if c.direction else ("kv", "request")):
            self.links[d].set(**c.changes)

    def _sample(self, again=True):
        """One timeseries.csv row from the link models' byte counters (CounterSampler's
        columns; the model has no drops and no reading time)."""
        now = self.loop.now()
        row = [f"{self.unix(now):.6f}", f"{now:.6f}", f"{self.dep.scale.real_s(now):.6f}"]
        prev = self.last_sample
        counts = {}
        for d, link in self.links.items():
            link.advance()
            tx = int(link.tx_bytes)
            counts[d] = tx
            rate = 0.0
            if prev is not None and now > prev[0]:
                rate = (tx - prev[1][d]) * 8 / (now - prev[0])
            backlog = int(link.queue_bytes()) if link.saturated() and link.terms.queue else 0
            bps = link.link_bps()
            row += [tx, tx // 1514, f"{rate:.1f}", f"{self.dep.scale.real_rate(rate) / 1e9:.6f}",
                    backlog, backlog // 1514, 0, int(link.up), f"{bps:.1f}",
                    f"{self.dep.scale.real_rate(bps) / 1e9:.6f}"]
        row += ["0.000000", 0, 0]
        self.sample_csv.writerow(row)
        self.last_sample = (now, counts)
        if again and self.busy():
            self.loop.after(1.0 / SAMPLE_HZ, self._sample)

    # ---- one request ----
    def submit(self, w):
        now = self.loop.now()
        self.to_send -= 1
        r = Request(w, now, self.rt.scheduler.failover)
        self.records.write(SentRecord(id=r.id, send_time=self.unix(now),
                                      scheduled=self.unix(now), lateness_s=0.0))
        if self.decider is not None:
            self._adapt("request")
        if self.planner is not None:
            self.planner.on_request(self.unix(now), r.input_len, r.output_len)
        self.place(r, now)

    def place(self, r, now):        # the request's first routing
        try:
            r.kind, r.p, r.d = self._route(r, now)
        except LookupError as e:
            self._fail(r, f"scheduler: {e}")
            return
        self.routed(r)

    def routed(self, r):
        self.active += 1
        r.d.inflight += 1
        r.predicted = self.predict_s(r, r.p)
        r.p.outstanding_s += r.predicted
        self._open_decode(r)
        self._call_prefill(r)

    def predict_s(self, r, p):      # predicted prefill seconds of `r` on `p` (the scheduler's)
        return self.router.predict_s(p, r.input_len)

    def cached_lens(self, r):       # (tokens the prefill continues from, the decode side holds)
        return 0, 0

    def reroute(self, r):           # a re-dispatch's routing (the scheduler's `route(req, kind)`)
        return lambda: self.router.route(r.input_len)

    def _open_decode(self, r):
        """The decode stream (re)opens now: with failover its KV deadline is a timer, decided
        by the recovery when it fires (`_kv_deadline`)."""
        r.opened, r.kv_in, r.slot = self.loop.now(), False, None
        if self.recovery is not None:
            self.recovery.decode_on(r)
        if r.failover:
            self.loop.at(r.opened + self.rt.kv_deadline_s, self._kv_deadline, r, r.opened)

    def _kv_deadline(self, r, opened):
        if r.failed or r.kv_in or r.opened != opened:
            return
        error = (f"{r.d.name}: KV not complete after {self.rt.kv_deadline_s:.3g}s (emulated)")
        what, arg = redispatch.after_kv_timeout(r, self.reroute(r), error, not r.replied)
        if what == "fail":
            self.fail_flight(r, arg)
        elif what == "wait":
            r.kv_waits += 1
            self.events("kv_wait", id=r.id, instance=r.d.name, attempt=r.attempt,
                        waits=r.kv_waits)
            self._open_decode(r)
        else:
            p, d = arg
            self.move_prefill(r, p, f"{error}; prefill again for {d.name}", d)

    def _call_prefill(self, r):
        if self.recovery is not None:
            self.recovery.assign(r)
        delay = self.links["request"].one_way_s() if r.p.dc == "prfaas" else 0.0
        self.loop.after(delay, self.prefill_arrives, r, r.attempt)

    def move_prefill(self, r, p, reason, d=None):
        """Re-dispatch: the request's next prefill attempt on `p` (and, with `d`, its decode
        stream re-opened on `d`), as `workers.recovery.Flight` does on the decisions of
        workers/redispatch.py."""
        now = self.loop.now()
        old = r.p
        if not r.replied:           # the cancelled attempt leaves the router's book
            old.outstanding_s -= r.predicted
        role = "prefill" if d is None else "decode"
        src = old.name if d is None else r.d.name
        r.moves.append(redispatch_record(self.unix(now), role, src, p.name, reason))
        self.events("redispatch", id=r.id, role=role, **{"from": src, "to": p.name},
                    attempt=r.attempt + 1, reason=reason.replace(" ", "_"))
        if d is not None:
            self.recovery.decode_off(r, cancel=True)
            r.d.inflight -= 1
            d.inflight += 1
            r.d = d
            self._open_decode(r)
        r.p, r.kind = p, "remote" if p.dc == "prfaas" else "local"
        r.attempt += 1
        r.flow, r.replied = None, False
        r.predicted = self.predict_s(r, p)
        p.outstanding_s += r.predicted
        self._call_prefill(r)

    def fail_flight(self, r, error):
        """A routed request fails (the recovery's decision): out of the book, recorded."""
        if r.failed:
            return
        r.failed = True
        if not r.replied:
            r.p.outstanding_s -= r.predicted
        if self.recovery is not None:
            self.recovery.done(r, r.p)
        self._end(r)
        self._fail(r, error)

    def _route(self, r, now):
        """A request's first routing, recorded in decisions.jsonl as the scheduler records it."""
        if self.decisions is None:
            return self.router.route(r.input_len)
        return self.router.route_recorded(r.id, r.input_len, self.unix(now),
                                          self.decisions.write)

    def link_of(self, r):
        return self.links["kv"] if r.p.dc == "prfaas" else self.fabric[r.p.dc]

    def prefill_arrives(self, r, attempt=None):     # `attempt`: the call's (moved since: void)
        rec = self.recovery
        if r.failed or attempt not in (None, r.attempt) or (rec is not None
                                                            and not rec.arrives(r)):
            return
        r.queued = self.loop.now()
        r.start, r.end, pieces = self.prefill[r.p.name].schedule(r.queued, r.input_len,
                                                                *self.cached_lens(r))
        r.kv_bytes = sum(n for _, n, _ in pieces)
        r.send_start = pieces[0][0]
        link = self.link_of(r)
        flow = r.flow = link.open(functools.partial(self._kv_done, r, r.attempt, r.p,
                                                    r.predicted))
        if rec is None:
            for ready, nbytes, last in pieces:
                self.loop.at(ready, link.push, flow, nbytes, last)
            return
        st = rec.state[r.p.name]
        for ready, nbytes, last in pieces:
            self.loop.at(ready, rec.piece, r.p, st.kills, st.paused_total, r, r.attempt, ready,
                         link, flow, nbytes, last)

    def _kv_done(self, r, attempt, p, predicted, first_arrival, last_sent, last_arrival):
        if r.failed or r.attempt != attempt:
            return                  # a cancelled attempt's KV: the decode worker discards it
        r.recv_start, r.send_end, r.recv_end = first_arrival, last_sent, last_arrival
        reply_delay = self.links["kv"].one_way_s() if p.dc == "prfaas" else 0.0
        self.loop.at(last_sent + reply_delay, self._prefill_replied, r, attempt, p, predicted)
        if r.failover:      # the deadline is the stream's timer: the KV counts when it is in
            self.loop.at(last_arrival, self._kv_in, r, attempt, last_arrival)
            return
        if last_arrival - r.opened > self.rt.kv_deadline_s:
            self.loop.at(r.opened + self.rt.kv_deadline_s, self._kv_late, r)
            return
        self._decode(r, last_arrival)

    def _kv_in(self, r, attempt, last_arrival):
        if r.failed or r.attempt != attempt:
            return
        r.kv_in = True
        self._decode(r, last_arrival)

    def _decode(self, r, last_arrival):
        """The request's KV is in: the decode instance refuses it or batches it."""
        dec = self.decode[r.d.name]
        need = dec.engine.kv_need(r.input_len, r.output_len)
        refusal = dec.engine.refusal(need)
        if refusal:     # as workers/decode.py: failed once its KV is in, never batched
            self.loop.at(last_arrival, self._refused, r, f"{r.d.name}: {refusal}")
            return
        r.slot = Slot(r, r.input_len, r.output_len, need, self._finished)
        self.loop.at(last_arrival, self._arrive, r, r.slot)

    def _arrive(self, r, slot):
        if r.slot is slot and not r.failed:     # not moved off its decode instance since
            self.decode[r.d.name].arrive(slot)

    def _prefill_replied(self, r, attempt, p, predicted):
        if r.attempt != attempt or r.failed:
            return
        p.outstanding_s -= predicted
        r.replied = True
        if self.recovery is not None:
            self.recovery.done(r, p)

    def _kv_late(self, r):
        r.failed = True
        self._end(r)
        self._fail(r, f"{r.d.name}: KV not complete after {self.rt.kv_deadline_s:.3g}s "
                      f"(emulated); received {r.kv_bytes} bytes")

    def _refused(self, r, error):
        self._end(r)
        self._fail(r, error)

    def _end(self, r):
        self.active -= 1
        r.d.inflight -= 1
        if self.recovery is not None:
            self.recovery.decode_off(r)

    def _fail(self, r, error):
        t = Tracker(pb.Request(id=r.id, input_len=r.input_len, output_len=r.output_len),
                    self.unix(r.send))
        if r.p is not None:
            t.add(pb.TokenChunk(done=True, status="failed", error=error,
                                route=pb.Route(kind=r.kind, prefill=r.p.name, decode=r.d.name,
                                               threshold=self.router.threshold),
                                attempts=r.attempt + 1, redispatches=r.moves),
                  self.unix(self.loop.now()))
        out = t.finish(error, end=False)
        out.end_time = self.unix(self.loop.now())
        self.records.write(out, t.chunks)

    def _finished(self, slot):
        r = slot.req
        if r.slot is not slot or r.failed:
            return
        self._end(r)
        self.completed += 1
        dec = self.decode[r.d.name]
        u = self.base
        track = Tracker(pb.Request(id=r.id, input_len=r.input_len, output_len=r.output_len),
                        self.unix(r.send))
        if self.tokens:
            times, chunks = dec.tokens_of(slot)
            stamps = [u + t for t in times]
            for i, arrival, n in chunks[:-1]:
                track.add(pb.TokenChunk(times=stamps[i:i + n]), u + arrival)
            i, arrival, n = chunks[-1]
            stamps = stamps[i:]
        else:       # the first chunk (sent at once) and the last: no per-token list
            first, arrival = dec.first_last(slot)
            if r.output_len > 1:
                track.add(pb.TokenChunk(times=[u + first]), u + first)
            stamps = [u + arrival]
        track.add(self._last_chunk(r, slot, stamps), u + arrival)
        if not self.tokens:         # per-request record only: first and last token
            track.out.n_tokens = r.output_len
        out = track.finish(None, end=False)
        out.end_time = u + arrival
        if not self.tokens:
            out.token_times = None
        self.records.write(out, track.chunks if self.tokens else None)

    def _last_chunk(self, r, slot, times):
        u = self.base
        prefill = pb.PrefillReply(
            instance=r.p.name, queued=u + r.queued, start=u + r.start, end=u + r.end,
            status="ok", kv_bytes=r.kv_bytes, send_start=u + r.send_start,
            send_end=u + r.send_end,
            overlap_s=max(0.0, min(r.end, r.send_end) - r.send_start))
        return pb.TokenChunk(
            times=times, done=True, status="ok",
            route=pb.Route(kind=r.kind, prefill=r.p.name, decode=r.d.name,
                           threshold=self.router.threshold),
            prefill=prefill, kv_recv_start=u + r.recv_start, kv_recv_end=u + r.recv_end,
            kv_recv_bytes=r.kv_bytes, decode_instance=r.d.name,
            decode_join=u + slot.join_time, kv_attempt=r.attempt, attempts=r.attempt + 1,
            redispatches=r.moves)
