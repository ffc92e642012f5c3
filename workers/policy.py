"""Routing policies: which prefill instance and which decode instance serve a request.

`homogeneous`: every prefill on the local PD cluster. `naive`: every prefill on PrfaaS.
`prfaas`: the paper's length threshold on the *incremental* (uncached) length: longer than
`threshold` goes to PrfaaS, the rest to local prefill. Within a cluster the instance with the
least outstanding work (predicted prefill seconds queued) is chosen; decode goes to the instance
with the fewest requests in flight; ties go to the first name (`workers.pools.Least` finds the
same instance a scan would, in O(log n) a request). An instance whose RPC failed as unreachable is marked down
and skipped; if a whole cluster is down the other one takes the request (failover to the local
path, which the paper leaves to deployments), except that with `max_local` requests longer
than it keep going to PrfaaS and wait for it (local prefill of very long prompts can take longer
than an outage).

Each first routing of a request is recorded (`Router.route_recorded`: a
`testbed.records.DecisionRecord` with the book the decision read, in the run's decisions.jsonl),
by the emulation's scheduler and by the simulator alike; `Router.set_book` puts a router back in
a recorded state, so a decision can be replayed (testbed/sim/replay.py).
"""

import dataclasses

from testbed.records import DecisionRecord
from workers.pools import Least, Watched


def _load(i):
    return i.outstanding_s


def _inflight(i):
    return i.inflight


@dataclasses.dataclass
class Instance(Watched):
    name: str
    role: str            # "prefill" | "decode"
    dc: str              # "prfaas" | "local"
    accelerator: str
    addr: str            # host:grpc_port
    kv_addr: str = ""    # decode only: host:kv_port
    outstanding_s: float = 0.0
    inflight: int = 0
    down: bool = False


def _pool(attr):
    """A Router's list of instances (`remote`, `local`, `decode`): a `Pool` with its `Least`
    index; assigning a list replaces the pool."""
    def get(self):
        return getattr(self, attr).pool

    def put(self, items):
        getattr(self, attr).pool = items
    return property(get, put)


class Router:
    remote, local, decode = _pool("_remote_ix"), _pool("_local_ix"), _pool("_decode_ix")

    def __init__(self, policy, threshold, instances, predict_s, max_local=None):
        self._remote_ix, self._local_ix = Least(_load), Least(_load)
        self._decode_ix = Least(_inflight)
        self.policy = policy
        self.threshold = threshold
        self.max_local = max_local          # failover: longest request prefilled locally
        self.remote = [i for i in instances if i.role == "prefill" and i.dc == "prfaas"]
        self.local = [i for i in instances if i.role == "prefill" and i.dc == "local"]
        self.decode = [i for i in instances if i.role == "decode"]
        self.predict_s = predict_s          # (instance, uncached_len) -> predicted prefill seconds
        self.named = {i.name: i for i in instances}
        self.home = {i.name: i.role for i in instances}     # the role each started in

    @classmethod
    def of_runtime(cls, rt, profile):
        """The scheduler's router for a run (`testbed.runtime.WorkerRuntime`, emulated) and its
        model profile (`testbed.profile.Profile`): the emulation's scheduler and the simulator
        both build it here, so both route alike."""
        scale = rt.scale
        instances = [Instance(name=i.name, role=i.role, dc=i.dc, accelerator=i.accelerator,
                              addr=i.addr, kv_addr=i.kv_addr)
                     for i in rt.of_role("prefill", "decode")]
        return cls(rt.scheduler.policy, rt.scheduler.threshold, instances,
                   lambda inst, l: scale.emulated_s(profile.t_prefill(inst.accelerator,
                                                                      max(l, 1))),
                   max_local=rt.scheduler.failover_max_local)

    def wants_remote(self, uncached):
        if self.policy == "naive":
            return True
        if self.policy == "homogeneous":
            return False
        return uncached > self.threshold

    def route(self, uncached):
        """(kind, prefill Instance, decode Instance), or raise LookupError if nothing is up."""
        return self.route_to(self.wants_remote(uncached), uncached)

    def route_to(self, remote, uncached, cost=None):
        """Route to PrfaaS (`remote`) or local prefill, failing over as `route` does; within
        the cluster the instance of least `cost(instance)` (default: outstanding work)."""
        p = self._prefill(remote, uncached, cost)
        if p is None:
            raise LookupError("no prefill instance is up")
        d = self._decode_ix.best()
        if d is None:
            raise LookupError("no decode instance is up")
        kind = "remote" if p.dc == "prfaas" else "local"
        return kind, p, d

    def _prefill(self, remote, uncached, cost):
        """The prefill instance `route_to` picks, or None: the first cluster's up instance of
        least (cost, name), else the other's; the index answers unless `cost` is given."""
        first, second = (self._remote_ix, self._local_ix) if remote else \
            (self._local_ix, self._remote_ix)
        p = first.best()
        if p is None and remote and self.max_local is not None and uncached > self.max_local \
                and self.remote:
            up = self.remote        # too long for local prefill: wait for PrfaaS to come back
        elif cost is not None:      # another order than the index's: scan the up instances
            up = [i for i in first.pool if not i.down] or [i for i in second.pool if not i.down]
        else:
            return p if p is not None else second.best()
        return min(up, key=lambda i: (cost(i) if cost else i.outstanding_s, i.name), default=None)

    def book(self, rid, time, uncached):
        """The record of a decision about to be made on `uncached` tokens: the book it reads
        (threshold, the lists, outstanding work, in-flight decodes, which are down), sparse."""
        prefill = self.remote + self.local
        listed = {i.name: "prefill" for i in prefill} | {i.name: "decode" for i in self.decode}
        return DecisionRecord(
            id=rid, time=time, uncached_len=uncached, policy=self.policy,
            threshold=self.threshold,
            outstanding_s={i.name: i.outstanding_s for i in prefill if i.outstanding_s},
            inflight={i.name: i.inflight for i in self.decode if i.inflight},
            down=[i.name for i in prefill + self.decode if i.down],
            roles={n: listed.get(n, "") for n, r in self.home.items() if listed.get(n, "") != r})

    def route_recorded(self, rid, uncached, time, write):
        """`route`, with its `DecisionRecord` handed to `write` (the run's decisions.jsonl),
        whether it chose or raised LookupError."""
        rec = self.book(rid, time, uncached)
        try:
            out = self.route(uncached)
        except LookupError as e:
            rec.error = str(e)
            write(rec)
            raise
        rec.kind, rec.prefill, rec.decode = out[0], out[1].name, out[2].name
        write(rec)
        return out

    def set_book(self, rec):
        """Put this router in the state a `DecisionRecord` recorded (the replay): threshold,
        which instance is in which list, their outstanding work, in-flight decodes and health."""
        self.threshold = rec.threshold
        role = {**self.home, **rec.roles}
        for i in self.named.values():
            i.outstanding_s = rec.outstanding_s.get(i.name, 0.0)
            i.inflight = rec.inflight.get(i.name, 0)
            i.down = i.name in rec.down
        self.remote = [i for i in self.named.values() if role[i.name] == "prefill"
                       and i.dc == "prfaas"]
        self.local = [i for i in self.named.values() if role[i.name] == "prefill"
                      and i.dc == "local"]
        self.decode = [i for i in self.named.values() if role[i.name] == "decode"]
