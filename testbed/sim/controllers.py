"""The simulated cluster's periodic controllers: the adaptive threshold and role conversion,
the emulation's decisions (workers/adaptive.py's `ThresholdDecider`, workers/roles.py's
`RolePlanner`) on virtual time.

Place in the architecture: a mixin of `testbed.sim.cluster.SimCluster`, which holds the state
these methods read (`loop`, `links`, `decider`, `planner`, `prefill`, `decode`, `rt`, `events`,
`sched_csv`, `last_sample`, `last_eval`, `converting`) and starts their timers.
"""

from __future__ import annotations

ROLE_POLL_S = 0.01        # the scheduler's and the worker's drain checks (workers/roles.py)


class Controllers:
    """The adaptive threshold's evaluations and the role planner's conversions."""

    # ---- the adaptive threshold ----
    def _adapt(self, trigger):
        now = self.loop.now()
        self.last_eval = now
        tx, link_bps = None, None
        if self.last_sample is not None:
            tx, link_bps = self.last_sample[1]["kv"], self.links["kv"].link_bps()
        _, row = self.decider.decide(self.unix(now), tx, link_bps)
        self.sched_csv.writerow([*row, trigger])

    def _adapt_timer(self):
        interval = self.rt.scheduler.adaptive.interval_s
        if self.loop.now() - self.last_eval >= interval:
            self._adapt("timer")
        if self.busy():
            self.loop.after(interval, self._adapt_timer)

    # ---- role conversion (workers/roles.py's RoleManager, in virtual time) ----
    def _replan_timer(self):
        out = self.planner.decide(self.unix(self.loop.now()), self.converting is not None)
        if out is not None:
            _, fields, pick, role = out
            self.events("replan", **fields)
            if pick is not None:
                self._convert(pick, role)
        if self.busy():
            self.loop.after(self.rt.scheduler.roles.interval_s, self._replan_timer)

    def _convert(self, inst, role):
        """No new work of the old role from now; once the scheduler's book shows none left on
        the instance and the worker has drained, the conversion cost, then the new role."""
        old = inst.role
        src, dst = self.planner.lists(inst, role)
        src.remove(inst)
        self.converting = (inst, old, role, dst, self.loop.now())
        self.events("role", instance=inst.name, state="draining", **{"from": old, "to": role})
        self._drain_poll()

    def _drain_poll(self):
        inst, old, role, dst, t0 = self.converting
        now = self.loop.now()
        dec = self.decode[inst.name]
        worker_busy = (self.prefill[inst.name].free_at > now if old == "prefill"
                       else bool(dec.batch or dec.waiting))
        if inst.inflight > 0 or inst.outstanding_s > 1e-9 or worker_busy:
            self.loop.after(ROLE_POLL_S, self._drain_poll)
            return
        self.loop.after(self.rt.scheduler.roles.cost_s, self._converted, now)

    def _converted(self, drained_at):
        inst, old, role, dst, t0 = self.converting
        inst.role = role
        dst.append(inst)
        self.events("role", instance=inst.name, state="done", **{"from": old, "to": role},
                    drain_s=f"{drained_at - t0:.4f}",
                    convert_s=f"{self.loop.now() - drained_at:.4f}")
        if self.rt.scheduler.roles.retune and self.planner.last is not None:
            self.planner.retune(self.planner.n_prefill())
        self.converting = None

