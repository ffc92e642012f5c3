"""Long-timescale control: re-plan the local prefill/decode split and convert instances.

PRFAAS.md: "if Theta_prfaas + Theta_pdp << Theta_pdd prefill is the bottleneck, if >> decode is;
convert local instances between prefill and decode roles to restore the balance, then
re-optimise t". With `scheduler.roles.enabled` every local instance is a dual-role worker
(workers/dualrole.py) and, every `interval`, `RoleManager`:

1. takes the requests that arrived within the last `window` (input and output lengths, recorded
   by the scheduler as they come) -- fewer than `min_requests`: no re-plan;
2. evaluates the planner's equations (testbed/plan.py: Theta_prfaas, Theta_pdp, Theta_pdd,
   Lambda_max, `expected` latency mode) on that measured mix for every split N_p + N_d of the
   local instances and every threshold (`replan`, pure, unit-tested);
3. if the best split's Lambda_max beats the split in force by more than `gain` (hysteresis),
   converts ONE instance toward it: the router stops sending it work of its old role at once,
   the scheduler waits until its own book shows no request of that role on it, then
   `Role.SetRole` drains it on the worker and waits the conversion cost; the router then sends
   it work of the new role. One conversion at a time; at least one instance keeps each role;
4. with `retune`, sets the threshold to the planner's best t for the split in force (after a
   conversion, for the new split); the short timescale (workers/adaptive.py), if on, moves t
   from there between re-plans.

Every re-plan is a `replan` row and every conversion a `role` row (state draining, then done
with the measured drain and conversion times) in the run's events.csv.
"""

import asyncio
import collections
import time

import numpy as np

from testbed import plan
from testbed import profile as profiles
from testbed.proto import testbed_pb2 as pb
from testbed.proto import testbed_pb2_grpc as pbg
from workers.clock import WALL


def planner_inputs(rt, lengths, outputs):
    """The planner's Inputs for the measured mix (real-world lengths) of this run."""
    prof = profiles.load(rt.profile)
    acc = {i.dc: i.accelerator for i in rt.of_role("prefill", "decode")}
    dist = plan.LengthDistribution.from_lengths(lengths, "window")
    l_out = float(np.mean(outputs))
    decode = rt.decode.model()
    return plan.Inputs(
        profile=prof, remote=acc["prfaas"], local=acc["local"], lengths=dist, l_out=l_out,
        t_decode_s=decode.step_time(decode.bs_max, decode.bs_max * (dist.mean + l_out / 2)),
        bs_max=decode.bs_max, b_out_Bps=rt.scheduler.roles.wan_rate_real_bps / 8.0,
        wan_rate_bps=rt.scheduler.roles.wan_rate_real_bps)


def replan(inp, n_prfaas, n_local, n_p_now, gain):
    """The decision for one measured mix: a dict with the best split and threshold, Lambda_max
    of the split in force (at its best t) and of the best, and `target` = the N_p to move
    toward (n_p_now when the gain is below `gain`)."""
    ts = inp.lengths.values[:-1] if inp.lengths.values.size > 1 else inp.lengths.values
    sp = plan.split(inp, ts, "expected")
    g = {k: np.asarray(v)[None, :] for k, v in sp.items()}
    n_p = np.arange(1, n_local, dtype=float)[:, None]
    q = plan.evaluate(inp, n_prfaas, n_p, n_local - n_p, g["p"], g["l_long"], g["l_short"], g)
    lam = np.where(np.isfinite(q["lambda_max"]), q["lambda_max"], -np.inf)
    best_t = lam.argmax(axis=1)                     # per split
    per_split = lam[np.arange(lam.shape[0]), best_t]
    s_best = int(per_split.argmax())
    s_now = int(min(max(n_p_now, 1), n_local - 1)) - 1
    better = per_split[s_best] > per_split[s_now] * (1.0 + gain)
    target = s_best + 1 if better else n_p_now
    binding = ("pdd" if q["bound_pdd"][s_now, best_t[s_now]] <= lam[s_now, best_t[s_now]]
               else "prefill")
    return {"n_p_best": s_best + 1, "target": int(target),
            "lambda_now": float(per_split[s_now]), "lambda_best": float(per_split[s_best]),
            "threshold": {s + 1: int(ts[best_t[s]]) for s in range(lam.shape[0])},
            "binding_now": binding}


class RolePlanner:
    """The long timescale's decisions, with no clock, no asyncio and no RPC: the requests seen
    (`on_request(now, ...)`), the re-plan (`decide(now, busy)`), and which instance to convert
    to which role. The emulation's `RoleManager` and the simulator both drive it."""

    def __init__(self, rt, router):
        self.rt, self.router = rt, router
        self.cfg = rt.scheduler.roles
        self.seen = collections.deque()          # (time, input_len, output_len)
        self.local = [i for i in router.local + router.decode if i.dc == "local"]
        self.last = None

    def on_request(self, now, input_len, output_len):
        self.seen.append((now, input_len, output_len))
        self._trim(now)

    def _trim(self, now):
        while self.seen and self.seen[0][0] < now - self.cfg.window_s:
            self.seen.popleft()

    def n_prefill(self):
        return len(self.router.local)

    def decide(self, now, busy=False):
        """One re-plan at `now`: None (too few requests, or a conversion in progress: `busy`),
        else (decision, the `replan` event's fields, the instance to convert or None, its new
        role). With `retune`, sets the router's threshold for the split in force."""
        self._trim(now)
        if len(self.seen) < self.cfg.min_requests or busy:
            return None
        _, lens, outs = zip(*self.seen)
        inp = planner_inputs(self.rt, lens, outs)
        n_p = self.n_prefill()
        d = replan(inp, len(self.router.remote), len(self.local), n_p, self.cfg.gain)
        self.last = d
        fields = dict(window=len(lens), mean_input=round(inp.lengths.mean),
                      n_p=n_p, n_d=len(self.local) - n_p, n_p_best=d["n_p_best"],
                      target=d["target"], lambda_now=f"{d['lambda_now']:.4f}",
                      lambda_best=f"{d['lambda_best']:.4f}", binding=d["binding_now"],
                      threshold=d["threshold"][n_p])
        if self.cfg.retune:
            self.retune(n_p)
        pick, role = None, None
        if d["target"] > n_p:
            pick = min((i for i in self.router.decode if i.dc == "local" and not i.down),
                       key=lambda i: (i.inflight, i.name), default=None)
            role = "prefill" if pick is not None and len(self.router.decode) > 1 else None
        elif d["target"] < n_p:
            pick = min((i for i in self.router.local if not i.down),
                       key=lambda i: (i.outstanding_s, i.name), default=None)
            role = "decode" if pick is not None and len(self.router.local) > 1 else None
        return d, fields, pick if role else None, role

    def retune(self, n_p):
        """Set the router's threshold to the last re-plan's best t for `n_p` prefill instances;
        the (old, new) pair when it changed, else None."""
        t = self.last["threshold"].get(n_p)
        if t is not None and t != self.router.threshold:
            old, self.router.threshold = self.router.threshold, t
            return old, t
        return None

    def lists(self, inst, role):
        """(the router's list of `inst`'s role in force, the list of `role`)."""
        src = self.router.local if inst.role == "prefill" else self.router.decode
        dst = self.router.local if role == "prefill" else self.router.decode
        return src, dst


class RoleManager:
    """Drives a `RolePlanner` on the wall clock and converts instances over `Role.SetRole`."""

    def __init__(self, svc, rt, log, clock=WALL):
        self.svc, self.rt, self.log, self.clock = svc, rt, log, clock
        self.cfg = rt.scheduler.roles
        self.events = svc.health.events
        self.router = svc.router
        self.planner = RolePlanner(rt, self.router)
        self.local = self.planner.local
        self.role_stub = {i.name: pbg.RoleStub(svc.channels[i.name]) for i in self.local}
        for i in self.local:        # a dual-role worker serves both services
            svc.add_stub(i, "prefill")
            svc.add_stub(i, "decode")
        self.converting = None

    @property
    def last(self):
        return self.planner.last

    def on_request(self, req):
        self.planner.on_request(self.clock.now(), req.input_len - req.cached_len, req.output_len)

    def n_prefill(self):
        return self.planner.n_prefill()

    def step(self):
        out = self.planner.decide(self.clock.now(), self.converting is not None)
        if out is None:
            return None
        d, fields, pick, role = out
        self.events("replan", **fields)
        if pick is not None:
            self.converting = asyncio.create_task(self.convert(pick, role))
        return d

    def _retune(self, n_p):
        changed = self.planner.retune(n_p)
        if changed:
            self.log.info("re-plan: threshold %d -> %d (N_p %d)", *changed, n_p)

    async def convert(self, inst, role):
        old = inst.role
        src, dst = self.planner.lists(inst, role)
        t0 = time.time()
        try:
            src.remove(inst)            # no new work of the old role from here on
            self.events("role", instance=inst.name, state="draining", **{"from": old, "to": role})
            self.log.info("role: %s %s -> %s: draining", inst.name, old, role)
            while inst.inflight > 0 or inst.outstanding_s > 1e-9:
                await asyncio.sleep(0.01)
            reply = await self.role_stub[inst.name].SetRole(
                pb.RoleRequest(role=role, cost_s=self.cfg.cost_s))
            inst.role = reply.role
            dst.append(inst)
            self.events("role", instance=inst.name, state="done", **{"from": old, "to": role},
                        drain_s=f"{time.time() - t0 - reply.convert_s:.4f}",
                        convert_s=f"{reply.convert_s:.4f}")
            self.log.info("role: %s is now %s (%.3fs)", inst.name, role, time.time() - t0)
            if self.cfg.retune and self.last is not None:
                self._retune(self.n_prefill())
        except Exception as e:      # noqa: BLE001 -- the instance keeps its old role
            self.log.warning("role: converting %s failed: %s", inst.name, e)
            self.events("role", instance=inst.name, state="failed", **{"from": old, "to": role},
                        reason=str(e).replace(" ", "_")[:120])
            if inst not in src and inst not in dst:
                src.append(inst)
        finally:
            self.converting = None

    async def run(self):
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                self.step()
            except Exception as e:      # noqa: BLE001 -- a failed re-plan keeps the split
                self.log.warning("re-plan failed: %s", e)
