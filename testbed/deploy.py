"""Deploy: an `Experiment` compiled once into a `Deployment`, what a backend runs.

    describe (config.Experiment, real-world) -> deploy (Deployment, emulated) -> backend
    (testbed.backend: build, place, shape, count) -> analyse -> plot

`compile(exp)` (or `Deployment.of(exp)`) is the only place where real-world values become
emulated ones: every conversion goes through the run's `testbed.scale.Scale`. The result is
frozen and says what runs where, in which units:

- `instances`: every process to place (name, role, datacenter, accelerator, worker module,
  address); the topology (topologies/two_dc.py) is built from it;
- `links`: the WAN's two directions (`kv`: PrfaaS -> local, `request`: local -> PrfaaS),
  emulated, made by the link model's checker (`testbed.net.linkmodel.Link`, what the shaper
  accepts) and checked here once against what one machine can shape (`links_real` keeps the
  real-world values beside them for deployment.json);
- `schedule`: one time-ordered list, emulated seconds after the first arrival, of link changes
  (`network.wan.changes`, every row of `network.wan.rate_trace`, link faults and their ends)
  and instance fault actions (pause, kill, restart, slow);
- `runtime`: the typed `testbed.runtime.WorkerRuntime` every worker reads (runtime.json).

The run directory keeps it as `deployment.json` (`to_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from testbed import config, faultspec, loadgen, units, vllmenv, vllmspec
from testbed import profile as profiles
from testbed.errors import ConfigError
from testbed.experiment import AUTO, AUTO_START, cache_capacity
from testbed.net import spec as netspec
from testbed.net.linkmodel import (DIRECTIONS, MIN_BURST_BYTES, Link, check_params,
                                   default_police_burst, drops_frames,
                                   needs_per_frame_packets)
from testbed.net.ratetrace import read_rate_trace
from testbed.runtime import (KV_PORT, AdaptiveRuntime, CacheRuntime, DecodeRuntime,
                             InstanceRuntime, RolesRuntime, SchedulerRuntime, VllmRuntime,
                             WorkerRuntime)
from testbed.scale import Scale

# Address plan: one /16 per datacenter; the topology puts each instance on its DC's bridge.
DC_NET = {"prfaas": "10.1", "local": "10.2"}

# The emulated WAN must stay within what one 2-core machine can shape and carry. The userspace
# delay line carried 0.94-0.956 of 8 Gbit/s (TCP payload; 0.956 is the most) at 5 ms with
# segmentation offload on (benchmarks/link_fidelity.py --rate-sweep, docs/link_fidelity.md);
# the cap keeps a 1.6x margin for a shared machine. With loss configured (offload off, one
# delay-line packet per frame) it keeps up only to ~2 Gbit/s, and releases come late by ms.
MAX_EMULATED_RATE_BPS = 5e9
MIN_EMULATED_RATE_BPS = 8e3
MIN_EMULATED_QUEUE_BYTES = 64 * 1024     # one TSO burst: a smaller drop-tail queue drops most


@dataclasses.dataclass(frozen=True)
class LinkChange:
    """A change of the live link at `at_s` (emulated) in `direction` (None: both); `changes`
    in the shaper's keys, emulated; `source`: change | trace | fault; `fault`: a link fault's
    note (logged as fault_inject / fault_end)."""

    at_s: float
    direction: str | None
    changes: dict
    source: str = "change"
    fault: dict | None = None

    def item(self):
        """`testbed.net.schedule.LinkSchedule`'s (t_s, direction, changes[, note]) form."""
        base = (self.at_s, self.direction, dict(self.changes))
        return base + (dict(self.fault),) if self.fault else base


@dataclasses.dataclass(frozen=True)
class FaultAction:
    """An instance fault's injection or end at `at_s` (emulated): what `inject.Injector` does."""

    at_s: float
    phase: str                  # inject | end
    fault: int                  # index in `faults:`
    occurrence: int
    kind: str                   # pause | kill | restart | slow
    targets: tuple
    factor: float | None = None

    @property
    def target(self):
        return ",".join(self.targets)


@dataclasses.dataclass(frozen=True)
class Deployment:
    """What runs where, in which units: everything a backend needs, emulated."""

    name: str
    label: str
    seed: int
    scale: Scale
    instances: tuple                    # InstanceRuntime, in start order
    links: dict                         # direction -> Link (emulated)
    links_real: dict                    # direction -> the experiment's real-world values
    shaping_backend: str                # auto | netem | userspace
    per_frame: bool                     # loss now or later: hosts send single frames
    schedule: tuple                     # LinkChange and FaultAction, by time
    runtime: WorkerRuntime

    @classmethod
    def of(cls, exp):
        return compile(exp)

    @property
    def link_changes(self):
        return [s for s in self.schedule if isinstance(s, LinkChange)]

    @property
    def fault_actions(self):
        return [s for s in self.schedule if isinstance(s, FaultAction)]

    def instance(self, name):
        return self.runtime.instances[name]

    def sets(self, key):
        """True when a direction's link or a scheduled link change sets the shaper's `key`
        to something other than off (0, False, None)."""
        return (any(getattr(lk, key) for lk in self.links.values())
                or any(c.changes.get(key) for c in self.link_changes))

    def workers(self):
        """Instances the backend starts with the run (the scheduler and client come later)."""
        return [i for i in self.instances if i.role in ("prefill", "decode", "cachepool")]

    def to_dict(self):
        def plain(x):
            d = dataclasses.asdict(x)
            d["type"] = type(x).__name__
            return d
        return {"name": self.name, "label": self.label, "seed": self.seed,
                "scale": self.scale.to_dict(),
                "instances": [dataclasses.asdict(i) for i in self.instances],
                "links": {d: dataclasses.asdict(v) for d, v in self.links.items()},
                "links_real": self.links_real, "shaping_backend": self.shaping_backend,
                "per_frame": self.per_frame, "schedule": [plain(s) for s in self.schedule]}

    def dump(self, path):
        pathlib.Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def compile(exp, path=None):     # noqa: A001 (the verb of this module)
    """The `Deployment` of one expanded run, the one cross-field check: raises ConfigError
    (naming `path`, the experiment file, and the key) for an emulated link this machine cannot
    shape (rate, queue) or a fault list that cannot be carried out on these instances.
    `scale.time: auto` is compiled at the pilot's first scale (`AUTO_START`); the runner
    compiles each scale the pilot tries again (testbed/autoscale.py)."""
    try:
        return _compile(exp.at_speed(AUTO_START) if exp.scale.time == AUTO else exp)
    except ConfigError as e:
        if e.path or path is None:
            raise
        err = ConfigError(str(e), path=str(path))   # str(e) names the key already
        err.key = e.key
        raise err from None


def _compile(exp):
    scale = Scale.of(exp)
    prof = profiles.load(exp.model.profile)
    instances = _instances(exp, lambda dc: int(scale.emulated_bytes(
        cache_capacity(exp, prof, dc))))
    links = {d: emulated_link(exp.network.wan.direction(d), scale, d) for d in DIRECTIONS}
    link_changes = _link_changes(exp, scale)
    _check_links(exp, scale, links, link_changes)
    faults = faultspec.check(exp, instances)
    schedule = tuple(sorted(link_changes + _link_fault_changes(exp, scale, links, faults,
                                                               link_changes)
                            + _fault_actions(scale, faults), key=lambda s: s.at_s))
    per_frame = (needs_per_frame_packets(links)
                 or any(drops_frames(c) for c in exp.network.wan.changes)
                 or any(o.spec.kind == "link" and drops_frames(o.spec) for o in faults))
    return Deployment(
        name=exp.name, label=exp.run_label, seed=exp.seed, scale=scale,
        instances=tuple(instances),
        links=links, links_real={d: _real(exp.network.wan.direction(d)) for d in DIRECTIONS},
        shaping_backend=exp.network.wan.backend, per_frame=per_frame, schedule=schedule,
        runtime=_runtime(exp, prof, scale, instances))


def load(path, overrides=()):
    """Read, expand, validate and compile one experiment file: [(Experiment, Deployment)] of
    its runs, everything that can be refused refused (ConfigError, exit 2) before anything is
    built. Each run is compiled here, once; the runner passes the Deployment on."""
    runs = config.load_experiment(path, overrides)
    return [(exp, compile(exp, path)) for exp in runs]


# ---------------------------------------------------------------- instances

def _ip(dc, first, stride, i):
    """The i-th address of a role: <dc>.<first>.<i+1> for the first 254 (what a host backend
    runs), then the next third octet of that role (`stride` roles share a datacenter)."""
    return f"{DC_NET[dc]}.{first + stride * (i // 254)}.{i % 254 + 1}"


def _instances(exp, pool_bytes):
    """Every placed process with its address, in start order: PrfaaS prefill, local prefill,
    local decode, scheduler, client, then a cache pool per datacenter (`pool_bytes(dc)`
    emulated bytes)."""
    c = exp.clusters
    worker = "dualrole" if exp.scheduler.roles.enabled else None   # role: the starting one
    out = []

    def add(name, role, dc, ip, accelerator="", local_worker=None, **kw):
        out.append(InstanceRuntime(name=name, role=role, dc=dc, accelerator=accelerator,
                                   worker=local_worker or role, ip=ip, **kw))
    for i in range(c.prfaas.instances):
        add(f"rp{i}", "prefill", "prfaas", _ip("prfaas", 1, 1, i), c.prfaas.accelerator)
    for i in range(c.local.prefill):
        add(f"lp{i}", "prefill", "local", _ip("local", 1, 2, i), c.local.accelerator, worker)
    for i in range(c.local.decode):
        add(f"ld{i}", "decode", "local", _ip("local", 2, 2, i), c.local.accelerator, worker)
    add("scheduler", "scheduler", "local", f"{DC_NET['local']}.0.2")
    add("client", "client", "local", f"{DC_NET['local']}.0.3")
    if exp.cache.enabled:
        for dc in ("prfaas", "local"):
            add(f"pool_{dc}", "cachepool", dc, f"{DC_NET[dc]}.0.5",
                cache_capacity_bytes=pool_bytes(dc))
    return out


# ---------------------------------------------------------------- links

def emulated_link(real, scale, direction) -> Link:
    """One direction's real-world parameters (`WanSpec.direction`) as the shaper runs them,
    checked by the link model's one checker (`testbed.net.linkmodel.check_params`).

    A queue given in bytes is scaled by `scale.bytes`, which keeps its drain time (queue /
    rate) in step with everything else; a queue in packets is taken as emulated packets."""
    q = real["queue"]
    if q and "bytes" in q:
        q = {"bytes": int(scale.emulated_bytes(q["bytes"]))}
    rate = scale.emulated_rate(real["rate"])
    _check_rate(rate, "scale", f"network.wan.rate {units.fmt_rate(real['rate'])} x scale.bytes "
                               f"{scale.bytes:g} x scale.time {scale.time:g}")
    return check_params({"rate": rate,
                         "delay": scale.emulated_s(real["delay"]),
                         "jitter": scale.emulated_s(real["jitter"]),
                         "jitter_dist": real["jitter_dist"], "reorder": real["reorder"],
                         "loss": real["loss"], "loss_burst": real["loss_burst"],
                         "queue": dict(q) if q else None, "up": real["up"],
                         **_emulated_steady(real, scale)}, direction)


def _emulated_steady(real, scale):
    """The steady faults and path limits that are set in `real` (real-world), emulated: the
    policer's rate as a rate, its bucket as bytes. A policer given without a bucket gets
    `default_police_burst` of its real-world rate (10 ms of it), scaled, at least two frames."""
    out = {k: real[k] for k in netspec.STEADY_KEYS if real.get(k) is not None}
    if out.get("police"):
        burst = out.get("police_burst")
        out["police_burst"] = (int(scale.emulated_bytes(burst)) if burst else
                               max(int(scale.emulated_bytes(default_police_burst(out["police"]))),
                                   MIN_BURST_BYTES))
        out["police"] = scale.emulated_rate(out["police"])
    elif out.get("police_burst"):
        out["police_burst"] = int(scale.emulated_bytes(out["police_burst"]))
    return out


def _real(d):
    return {"rate_real_bps": d["rate"], "delay_real_s": d["delay"], "jitter_real_s": d["jitter"],
            "jitter_dist": d["jitter_dist"], "reorder": d["reorder"], "loss": d["loss"],
            "loss_burst": d["loss_burst"], "queue_real": d["queue"], "up": d["up"],
            **{k: d[k] for k in netspec.STEADY_KEYS}}


def _changes(spec, scale):
    """The shaper's keys of a change or link fault (`rate`, `delay`, `jitter`, `loss`, `up`
    that are set), emulated."""
    out = {}
    for k in ("rate", "delay", "jitter", "loss", "up"):
        v = getattr(spec, k, None)
        if v is None:
            continue
        out[k] = (scale.emulated_rate(v) if k == "rate" else
                  scale.emulated_s(v) if k in ("delay", "jitter") else v)
    return {**out, **_emulated_steady({k: getattr(spec, k, None)
                                       for k in netspec.STEADY_KEYS}, scale)}


def _direction(d):
    return None if d == "both" else d


def rate_trace_rows(exp):
    """The rate trace's (t_real_s, rate_real_bps) rows, repeated to cover the longest the run
    may last (4 x drain_timeout) when it loops; [] without a trace."""
    trace = exp.network.wan.rate_trace
    if trace is None:
        return []
    rows = read_rate_trace(trace.path)
    if trace.loop and rows:
        period, horizon = rows[-1][0], exp.run.drain_timeout * 4
        if period > 0:
            n = int(horizon / period) + 1
            rows = [(t + k * period, r) for k in range(n) for t, r in rows]
    return rows


def _link_changes(exp, scale):
    """`network.wan.changes` and the rate trace's rows, emulated, by time."""
    out = [LinkChange(scale.emulated_s(c.at), _direction(c.direction), _changes(c, scale))
           for c in exp.network.wan.changes]
    trace = exp.network.wan.rate_trace
    for t, rate in rate_trace_rows(exp):
        out.append(LinkChange(scale.emulated_s(t), _direction(trace.direction),
                              {"rate": scale.emulated_rate(rate)}, "trace"))
    return sorted(out, key=lambda c: c.at_s)


def in_force(links, changes, direction, t_s):
    """The shaper's parameters of one direction in force at emulated time `t_s`: the built
    link, then every change up to then."""
    p = links[direction].params()
    for c in sorted(changes, key=lambda c: c.at_s):
        if c.at_s <= t_s and c.direction in (None, direction):
            p.update(c.changes)
    return p


def _check_rate(rate, key, what):
    """An emulated rate within what this machine can shape (`what` names the real value)."""
    if rate > MAX_EMULATED_RATE_BPS:
        raise ConfigError(f"{what} scales to {units.fmt_rate(rate)} emulated, above what this "
                          f"machine can shape ({units.fmt_rate(MAX_EMULATED_RATE_BPS)}, "
                          f"docs/link_fidelity.md); lower scale.bytes or scale.time", key=key)
    if rate < MIN_EMULATED_RATE_BPS:
        raise ConfigError(f"{what} scales to {units.fmt_rate(rate)} emulated, below 8 kbit/s; "
                          f"raise scale.bytes (a link that is down is `up: false`)", key=key)


def _check_links(exp, scale, links, changes):
    """Everything about the emulated WAN, checked once: each direction's rate and queue, every
    scheduled change's and rate-trace row's rate, every link fault's rate."""
    wan = exp.network.wan
    for d in DIRECTIONS:
        q, real = links[d].queue, wan.direction(d)
        if q and "bytes" in q and q["bytes"] < MIN_EMULATED_QUEUE_BYTES:
            raise ConfigError(
                f"queue {real['queue']['bytes']} bytes x scale.bytes {scale.bytes:g} = "
                f"{q['bytes']} emulated bytes, less than one 64 KiB TSO burst; raise scale.bytes "
                f"or give the queue in packets (emulated packets, not scaled)",
                key="network.wan.queue")
    for i, c in enumerate(wan.changes):
        if c.rate is not None:
            _check_rate(scale.emulated_rate(c.rate), f"network.wan.changes[{i}].rate",
                        f"rate {units.fmt_rate(c.rate)}")
    for c in changes:
        if c.source == "trace":
            _check_rate(c.changes["rate"], "network.wan.rate_trace",
                        f"a row of {wan.rate_trace.path} "
                        f"({units.fmt_rate(scale.real_rate(c.changes['rate']))})")
    for i, f in enumerate(exp.faults):
        if f.kind == "link" and f.rate is not None:
            _check_rate(scale.emulated_rate(f.rate), f"faults[{i}].rate",
                        f"rate {units.fmt_rate(f.rate)}")
    rtt = sum(links[d].delay_s for d in DIRECTIONS)
    for d in DIRECTIONS:
        rates = [links[d].rate_bps] + [scale.emulated_rate(c.rate) for c in wan.changes
                                       if c.rate and c.direction in (d, "both")]
        netspec.check_queue(links[d].queue, max(rates), rtt, f"network.wan.{d}.queue")


# ---------------------------------------------------------------- faults

def _link_fault_changes(exp, scale, links, occurrences, base):
    """Each WAN fault's changes: at injection and, after `duration`, the values in force before
    it (the built link, then every entry of `base` -- changes and the rate trace -- up to
    that moment); a flap's cuts and returns between; an event's on and off."""
    out = []
    for o in occurrences:
        f = o.spec
        if f.kind not in faultspec.WAN_KINDS:
            continue
        d = _direction(f.direction)
        note = {"fault": o.index, "occurrence": o.n, "fault_kind": f.kind, "target": o.target}
        at = scale.emulated_s(o.at_s)
        if f.kind in faultspec.EVENTS:
            on = {"event": f.kind, "port": KV_PORT}
            out.append(LinkChange(at, d, on, "fault", {**note, "phase": "inject"}))
            if not math.isinf(o.end_s):
                out.append(LinkChange(scale.emulated_s(o.end_s), d, {"event": None}, "fault",
                                      {**note, "phase": "end"}))
            continue
        ch = {"up": False} if f.kind == "flap" else _changes(f, scale)
        out.append(LinkChange(at, d, ch, "fault", {**note, "phase": "inject"}))
        if f.kind == "flap":        # the cuts after the first, each with its return
            for k, (s0, s1) in enumerate(f.flaps()):
                if k:
                    out.append(LinkChange(scale.emulated_s(o.at_s + s0), d, ch, "fault"))
                if s1 < f.duration:
                    out.append(LinkChange(scale.emulated_s(o.at_s + s1), d, {"up": True},
                                          "fault"))
        if not math.isinf(o.end_s):
            for dd in (DIRECTIONS if d is None else (d,)):
                before = in_force(links, base, dd, at)
                out.append(LinkChange(scale.emulated_s(o.end_s), dd,
                                      {k: before[k] for k in ch}, "fault",
                                      {**note, "phase": "end"}))
    return out


def _fault_actions(scale, occurrences):
    """Injections and ends of the instance faults, by (time, injection before end)."""
    out = []
    for o in occurrences:
        k = o.spec.kind
        if k in faultspec.WAN_KINDS:
            continue
        phases = [(o.at_s, 0, "inject")]
        if k in ("pause", "slow", "restart"):
            phases.append((o.end_s, 1, "end"))
        for t, order, phase in phases:
            out.append((t, order, FaultAction(scale.emulated_s(t), phase, o.index, o.n, k,
                                              tuple(o.targets), o.spec.factor)))
    return [a for *_, a in sorted(out, key=lambda x: (x[0], x[1]))]


# ---------------------------------------------------------------- the workers' runtime

def _scheduler(exp, scale):
    s = exp.scheduler
    a, r, f = s.adaptive, s.roles, s.failover
    adaptive = None
    if a.enabled and s.policy == "prfaas":
        adaptive = AdaptiveRuntime(
            interval_s=scale.emulated_s(a.interval), window_s=scale.emulated_s(a.window),
            dwell_s=scale.emulated_s(a.dwell), egress_high=a.egress_high, egress_low=a.egress_low,
            queue_ratio=a.queue_ratio, step=a.step, min=a.min, max=a.max)
    roles = None
    if r.enabled:
        roles = RolesRuntime(
            interval_s=scale.emulated_s(r.interval), window_s=scale.emulated_s(r.window),
            min_requests=r.min_requests, cost_s=scale.emulated_s(r.cost), gain=r.gain,
            retune=r.retune, wan_rate_real_bps=float(exp.network.wan.direction("kv")["rate"]))
    return SchedulerRuntime(
        policy=s.policy, threshold=s.threshold, placement=s.placement, failover=f.enabled,
        health_interval_s=scale.emulated_s(f.interval),
        health_timeout_s=scale.emulated_s(f.timeout), failover_max_local=f.max_local,
        adaptive=adaptive, roles=roles)


def _vllm(exp):
    """engine vllm: the servers' settings (the model directory made absolute), else None."""
    if exp.model.engine != "vllm":
        return None
    v = exp.model.vllm
    path = v.path if v.path is not None else vllmspec.default_model_dir()
    return VllmRuntime(python=vllmenv.find_python() or "", model_dir=str(
        pathlib.Path(path).expanduser().resolve()), dtype=v.dtype, max_model_len=v.max_model_len,
        max_num_seqs=v.max_num_seqs, kv_cache_space_gib=v.kv_cache_space_gib, cpus=v.cpus,
        connector=v.connector, nixl_progress_delay_us=v.nixl_progress_delay_us,
        shm_busy_loop_s=v.shm_busy_loop_s, start_timeout_s=v.start_timeout)


def _runtime(exp, prof, scale, instances):
    step_real = exp.model.decode_step if exp.model.decode_step is not None else prof.decode_step_s
    c = exp.cache
    cache = CacheRuntime(enabled=True, block=c.block, snapshot_every=c.snapshot_every,
                         transfer=c.transfer, headroom=c.headroom,
                         s_kv_real=tuple(prof.kv_size.coeffs)) if c.enabled else CacheRuntime()
    return WorkerRuntime(
        name=exp.name, label=exp.run_label, seed=exp.seed, scale=scale,
        profile=exp.model.profile, engine=exp.model.engine, device=exp.model.device,
        torch={"seed": exp.seed, **exp.model.torch},
        decode=DecodeRuntime(step_s=scale.emulated_s(step_real), step_real_s=step_real,
                             bs_max=exp.model.bs_max or prof.bs_max,
                             model_real=dataclasses.asdict(exp.decode_model())),
        scheduler=_scheduler(exp, scale), cache=cache,
        frontdoor=loadgen.runtime(exp), vllm=_vllm(exp),
        kv_deadline_s=scale.emulated_s(exp.run.kv_deadline),
        token_flush_s=scale.emulated_s(exp.run.token_flush),
        request_timeout_s=scale.emulated_s(exp.run.request_timeout),
        drain_timeout_s=scale.emulated_s(exp.run.drain_timeout),
        instances={i.name: i for i in instances})


__all__ = ["Deployment", "Link", "LinkChange", "FaultAction", "compile", "load", "in_force",
           "rate_trace_rows", "DC_NET", "MAX_EMULATED_RATE_BPS"]
