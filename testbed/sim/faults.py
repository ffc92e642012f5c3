"""Instance faults, health checks and re-dispatch in virtual time.

    cluster -> faults (this): workers.redispatch (the emulation's decisions) -> cluster's
    requests, prefill models and links

The deployment's `FaultAction`s (testbed/inject.py carries them out on real processes) act on
the prefill instances' models at their times, and the decisions are workers/redispatch.py's,
the code workers/recovery.py runs in the emulation:

- **pause** freezes an instance: its compute stops (a KV piece due while it is frozen is held,
  and every later one of its queue comes the pause's length later), a request reaching it waits
  for the resume, its health checks get no answer (a miss when the check's timeout expires);
- **kill** loses the worker's queue: every prefill on it fails at once (the emulation's
  Prefill RPC fails UNAVAILABLE: the instance is marked down at once), the bytes not yet on the
  wire are lost, checks miss; **restart** brings it back empty at the fault's end (the
  emulation's respawn time is not modelled), and the next answered check marks it up;
- **slow** multiplies its compute time by `factor` for prefills scheduled from then on.

With failover on, the health checks run every `health_interval_s` (the period grows by the
timeout while some check waits for it, as `Health.loop` awaits every check), judged by
`HealthBook.checked`; a transition is a `health` row in events.csv, and the requests on an
instance that went down move (`redispatch` rows, the request's `redispatches`) or fail exactly
as `Flight` decides. Faults on decode instances: `testbed.sim.decode_faults`; on dual-role
instances (`scheduler.roles`) they are not simulated (testbed.sim.unsupported).
"""

from __future__ import annotations

from testbed.proto import testbed_pb2 as pb
from testbed.sim.decode_faults import DecodeFaults
from workers import redispatch


class _State:
    """One prefill instance's fault state."""

    __slots__ = ("paused_at", "paused_total", "dead", "kills", "held", "arrivals", "on")

    def __init__(self):
        self.paused_at = None       # virtual time it froze (None: running)
        self.paused_total = 0.0     # seconds frozen so far (its compute shifted by as much)
        self.dead = False
        self.kills = 0              # its compute schedule before a kill is void
        self.held = []              # KV pieces due while frozen
        self.arrivals = []          # (request, attempt) that reached it while frozen
        self.on = set()             # requests whose current prefill attempt is on it


class SimRecovery(DecodeFaults):
    def __init__(self, cluster):
        self.c = cluster
        loop, rt = cluster.loop, cluster.rt
        self.loop, self.sched = loop, rt.scheduler
        r = cluster.router
        self.insts = r.remote + r.local + r.decode
        self.by_name = {i.name: i for i in self.insts}
        self.state = {i.name: _State() for i in r.remote + r.local}
        self.waiting = set()        # requests whose failed prefill waits for an instance
        self.book = redispatch.HealthBook([i.name for i in self.insts], cluster.events,
                                          loop.now, on_down=self._tell, on_up=self._wake)
        self._init_decode()

    def start(self, actions, since_s):
        for a in actions:
            self.loop.at(a.at_s, self._action, a)
        if self.sched.failover:
            iv = self.sched.health_interval_s
            self.loop.at(iv - (since_s % iv) if since_s > 0 else iv, self._checks)

    # ---- the requests' prefill attempts ----
    def assign(self, r):
        """`r`'s current attempt runs on `r.p` (routed or moved there)."""
        if r.p.name in self.state:
            self.state[r.p.name].on.add(r)

    def done(self, r, inst):
        st = self.state.get(inst.name)
        if st is not None:
            st.on.discard(r)

    def arrives(self, r):
        """The prefill call reached `r.p`: False when the cluster must not schedule it (the
        instance is frozen: it waits; dead: the call fails)."""
        p = r.p
        st = self.state[p.name]
        if st.dead:
            # The RPC has returned (failed) when the scheduler marks the instance down, so
            # the down does not move this request: its failure does (Flight's order).
            r.replied = True
            self.book.set(p, True, "UNAVAILABLE on an RPC")
            r.replied = False
            self._failed(r, f"prefill {p.name} unreachable: UNAVAILABLE")
            return False
        if st.paused_at is not None:
            st.arrivals.append((r, r.attempt))
            return False
        return True

    def piece(self, inst, kills, pt0, r, attempt, ready, link, flow, nbytes, last):
        """A KV piece of `inst`'s compute due now (scheduled when `inst` had been frozen
        `pt0` s in all): held while frozen, later by the pauses since, void after a kill."""
        st = self.state[inst.name]
        if st.kills != kills or r.attempt != attempt or r.failed:
            return
        if st.paused_at is not None:
            st.held.append((inst, kills, pt0, r, attempt, ready, link, flow, nbytes, last))
            return
        if st.paused_total > pt0:
            ready += st.paused_total - pt0
            self.loop.at(ready, self.piece, inst, kills, st.paused_total, r, attempt, ready,
                         link, flow, nbytes, last)
            return
        if self.decode_frozen(r, (inst, kills, pt0, r, attempt, ready, link, flow, nbytes,
                                  last)):
            return
        link.push(flow, nbytes, last)

    def _failed(self, r, error):
        """`Flight._on_prefill` on a failed attempt, through the shared decision."""
        self.done(r, r.p)
        what, arg = redispatch.after_prefill_failure(r, self.c.reroute(r), error)
        if what == "fail":
            self.c.fail_flight(r, arg)
        elif what == "decode":
            self._reroute_decode(r, error)
        elif what == "move":
            self.c.move_prefill(r, arg, error)
        else:
            self.waiting.add(r)
            self.loop.after(self.sched.health_interval_s, self._retry, r, r.attempt, error)

    def _retry(self, r, attempt, error):
        if r not in self.waiting or r.attempt != attempt:
            return
        p = redispatch.place_prefill(self.c.reroute(r))
        if p is None:
            self.loop.after(self.sched.health_interval_s, self._retry, r, attempt, error)
            return
        self.waiting.discard(r)
        self.c.move_prefill(r, p, error)

    def _reroute_decode(self, r, reason):
        error, to = redispatch.reroute_decode(r, self.c.reroute(r), reason)
        if error is not None:
            self.c.fail_flight(r, error)
        else:
            self.c.move_prefill(r, to[0], f"{reason}; decode now on {to[1].name}", to[1])

    # ---- health ----
    def _tell(self, inst, reason):
        """`inst` went down: every request on it, as `Flight._on_down` decides."""
        if inst.name in self.dstate:
            self._decode_down(inst, reason)
        st = self.state.get(inst.name)
        for r in sorted(st.on if st else (), key=lambda r: r.id):
            what = redispatch.on_instance_down(r, inst, r.replied)
            if what == "prefill":
                p = redispatch.move_prefill(r, self.c.reroute(r))
                if p is not None:
                    self.done(r, inst)
                    self.c.move_prefill(r, p, f"{inst.name} down: {reason}")

    def _wake(self, inst):
        """An instance is up: every waiting request retries at once, before any other
        instance's answer of the same check is judged (the emulation's waiting flights wake on
        the first `up`, and another instance's answer comes a check RPC later), so they all go
        where the first one came back."""
        for r in sorted(self.waiting, key=lambda r: r.id):
            self._retry(r, r.attempt, "an instance is up")

    def _answers(self, inst):
        if inst.name in self.dstate:
            return self._decode_answers(inst.name)
        st = self.state.get(inst.name)
        if st is None:
            return True, ""
        if st.dead:
            return False, "UNAVAILABLE"
        if inst.dc == "prfaas" and not (self.c.links["request"].up and self.c.links["kv"].up):
            return False, "DEADLINE_EXCEEDED"   # the check crosses the WAN both ways
        return st.paused_at is None, "DEADLINE_EXCEEDED"

    def _checks(self):
        now, timeout = self.loop.now(), self.sched.health_timeout_s
        waits = False
        for inst in self.insts:
            ok, why = self._answers(inst)
            if ok or why == "UNAVAILABLE":      # an answer, or a refused connection: at once
                self._judge(inst, ok, now, why)
            else:                               # no answer until the timeout
                waits = True
                self.loop.at(now + timeout, self._judge, inst, False, now, why)
        if self.c.busy():
            self.loop.at(now + self.sched.health_interval_s + (timeout if waits else 0.0),
                         self._checks)

    def _judge(self, inst, ok, asked, why):
        out = self.book.checked(inst, ok, asked, self.sched.health_timeout_s, why)
        if out is not None:
            self.book.set(inst, *out)

    # ---- the fault actions ----
    def _action(self, a):
        self.c.events(f"fault_{a.phase}", fault=a.fault, occurrence=a.occurrence,
                      fault_kind=a.kind, target=a.target)
        if a.kind in ("kill", "restart") and a.phase == "inject":
            for name in a.targets:          # every target dies before any RPC fails
                (self.state[name] if name in self.state else self.dstate[name]).dead = True
        for name in a.targets:
            side = "" if name in self.state else "_decode"
            getattr(self, f"{side}_{a.kind}")(name, a)

    def _pause(self, name, a):
        st, now = self.state[name], self.loop.now()
        if a.phase == "inject":
            if st.paused_at is None and not st.dead:
                st.paused_at = now
            return
        if st.paused_at is None:
            return
        frozen = now - st.paused_at
        model = self.c.prefill[name]
        if model.free_at > st.paused_at:
            model.free_at += frozen
        st.paused_at = None
        st.paused_total += frozen
        held, st.held = st.held, []
        for inst, kills, pt0, r, attempt, ready, link, flow, nbytes, last in held:
            self.piece(inst, kills, pt0, r, attempt, ready, link, flow, nbytes, last)
        arrivals, st.arrivals = st.arrivals, []
        for r, attempt in arrivals:     # not the ones moved (or failed) while it was frozen
            if r.attempt == attempt and not r.failed:
                self.c.prefill_arrives(r)

    def _kill(self, name, a):
        if a.phase != "inject":
            return
        st, model = self.state[name], self.c.prefill[name]
        st.dead, st.paused_at = True, None
        st.kills += 1
        st.held, lost = [], sorted(st.on | {r for r, attempt in st.arrivals
                                            if r.attempt == attempt and not r.failed},
                                   key=lambda r: r.id)
        st.arrivals = []
        model.free_at = self.loop.now()
        inst = self.by_name[name] if lost else None
        for r in lost:
            r.replied = True                    # the RPC returned (failed): nothing to move
            if r.flow is not None:
                self.c.link_of(r).abort(r.flow)
        if inst is not None:
            self.book.set(inst, True, "UNAVAILABLE on an RPC")
        for r in lost:
            r.replied = False
            self._failed(r, f"prefill {name} unreachable: UNAVAILABLE")

    def _restart(self, name, a):
        if a.phase == "inject":
            self._kill(name, a)
        else:
            self.state[name].dead = False

    def _slow(self, name, a):
        self.c.prefill[name].engine.clock_factor = a.factor if a.phase == "inject" else 1.0


def redispatch_record(t, role, old, new, reason):
    return pb.Redispatch(time=t, role=role, from_instance=old, to_instance=new, reason=reason)
