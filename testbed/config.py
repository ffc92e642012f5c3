"""Describe: the experiment YAML, validated into immutable `Experiment` objects.

`load_experiment(path, overrides)` is the only place an experiment file is read. It

1. loads the YAML with a safe loader,
2. applies `--set key=value` overrides (dotted keys),
3. expands `variants:` (a list of dotted-key overrides, one run each) and `sweep:` (a grid of
   dotted key -> list of values; every combination is one run, crossed with the variants),
4. validates each expanded mapping against the schema and returns one `Experiment` per run.

Everything downstream (builder, runner, planner, analysis) reads only these objects.

Scaling (`scale:`): the emulation runs `time` times faster than the real world and moves `bytes`
times the real KV bytes. Compute times are divided by `time`, arrival rates multiplied by it, KV
payloads multiplied by `bytes`, the WAN rate becomes `rate * bytes * time` and delays are divided by
`time`, so every ratio of transfer time to compute time is preserved. Reports convert back.
"""

import copy
import dataclasses
import itertools
import pathlib

import yaml

from testbed import profile as profiles
from testbed import units
from testbed.errors import ConfigError
from testbed.net.spec import NetworkSpec
from testbed.schema import (boolean, build, choice, integer, optional, positive, section, spec,
                            string, to_dict)
from testbed.workload.spec import WorkloadSpec

# The emulated WAN must stay within what one 2-core machine can shape and carry.
MAX_EMULATED_RATE_BPS = 2e9
MIN_EMULATED_DELAY_S = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleSpec:
    time: float = spec(positive(units.number), 1.0,
                       "emulate this many times faster than real time")
    bytes: float = spec(positive(units.number), 1.0,
                        "move this fraction of the real KV bytes (1e-3 = 1/1000)")
    tokens: float = spec(positive(units.number), 1.0,
                         "torch engine: divide prompt lengths by this (tiny model, long traces)")


def _torch_config(value):
    """The torch engine's model shape, checked against the model's own config class."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of model config keys, got {value!r}")
    from workers.model.config import HybridConfig   # imports torch: only when the key is given
    try:
        HybridConfig.from_dict(value)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    return dict(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    profile: str = spec(string, "kimi-linear-1t", "accelerator profile, testbed/profiles/NAME.yaml")
    engine: str = spec(choice("profile", "torch"), "profile",
                       "profile: workers wait the profiled time and send profiled KV bytes | "
                       "torch: a real tiny KDA+MLA hybrid computes and ships its real state")
    device: str = spec(choice("auto", "cpu", "cuda"), "auto",
                       "torch engine: where the model runs (auto = cuda when available)")
    torch: dict = spec(_torch_config, factory=dict,
                       doc="torch engine: model shape (HybridConfig keys: n_layers, d_model, ratio "
                           "'3:1', vocab, kda_heads, mla_latent, dtype float32|bfloat16, ...)")
    decode_step: float = spec(optional(units.duration_s), None,
                              "T_decode per decode step (real-world); default from the profile")
    bs_max: int = spec(optional(integer(1)), None, "BS_max, largest decode batch; default from profile")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrfaasClusterSpec:
    instances: int = spec(integer(0, 32), 0, "PrfaaS prefill instances (remote datacenter)")
    accelerator: str = spec(string, "h200", "accelerator name in the profile")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalClusterSpec:
    instances: int = spec(integer(1, 64), 1, "local PD instances (N_p + N_d)")
    accelerator: str = spec(string, "h20", "accelerator name in the profile")
    prefill: int = spec(integer(0, 64), 0, "N_p: local instances that prefill")
    decode: int = spec(integer(1, 64), 1, "N_d: local instances that decode")

    def check(self):
        if self.prefill + self.decode != self.instances:
            raise ValueError(f"prefill ({self.prefill}) + decode ({self.decode}) must equal "
                             f"instances ({self.instances})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClustersSpec:
    prfaas: PrfaasClusterSpec = spec(section(PrfaasClusterSpec), factory=PrfaasClusterSpec,
                                     doc="the remote prefill-only cluster")
    local: LocalClusterSpec = spec(section(LocalClusterSpec), factory=LocalClusterSpec,
                                   doc="the local PD cluster")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailoverSpec:
    enabled: bool = spec(boolean, False,
                         "health-check prefill instances; route around those that do not answer")
    interval: float = spec(positive(units.duration_s), 1.0,
                           "time between health checks of each prefill instance (real-world)")
    timeout: float = spec(positive(units.duration_s), 0.5,
                          "an instance that has not answered within this (real-world) is down")
    max_local: int = spec(optional(units.tokens), None,
                          "while PrfaaS is down, prefill locally only requests up to this long; "
                          "longer ones still go to PrfaaS and wait for it (null: all go local)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveSpec:
    enabled: bool = spec(boolean, False,
                         "prfaas: adapt the threshold to WAN egress and queue depths (short "
                         "timescale); `threshold` is the starting value")
    interval: float = spec(positive(units.duration_s), 2.0, "control period (real-world)")
    egress_high: float = spec(units.probability, 0.8,
                              "raise the threshold when measured egress / link rate is above this")
    egress_low: float = spec(units.probability, 0.3,
                             "lower it when egress is below this and PrfaaS queues are short")
    queue_ratio: float = spec(positive(units.number), 1.5,
                              "raise when PrfaaS queued work per instance exceeds local's by this "
                              "factor; lower when it is below 1/this")
    step: float = spec(positive(units.number), 0.1, "multiplicative step of each change")
    min: int = spec(units.tokens, 1024, "lowest threshold")
    max: int = spec(units.tokens, 131072, "highest threshold")

    def check(self):
        if self.egress_low >= self.egress_high:
            raise ValueError("egress_low must be below egress_high")
        if self.min > self.max:
            raise ValueError("min must not exceed max")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerSpec:
    policy: str = spec(choice("homogeneous", "naive", "prfaas"), "prfaas",
                       "homogeneous: all local | naive: all prefill on PrfaaS | prfaas: threshold")
    threshold: int = spec(units.tokens, 19866, "prfaas: offload requests longer than this (tokens)")
    adaptive: AdaptiveSpec = spec(section(AdaptiveSpec), factory=AdaptiveSpec,
                                  doc="short-timescale threshold control (docs in workers/adaptive.py)")
    failover: FailoverSpec = spec(section(FailoverSpec), factory=FailoverSpec,
                                  doc="fall back to the other cluster when instances stop answering")
    placement: str = spec(choice("least_loaded", "cache_aware"), "least_loaded",
                          "least_loaded: threshold on the input length, least outstanding work "
                          "within a cluster | cache_aware: threshold on the uncached length, the "
                          "paper's bandwidth-scarce/abundant rules and an estimated-TTFT cost "
                          "per instance (needs cache.enabled; docs/cache.md)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheSpec:
    enabled: bool = spec(boolean, False,
                         "a hybrid prefix cache pool per cluster (docs/cache.md)")
    block: int = spec(integer(1), 512, "tokens per cache block (Mooncake hash_ids granularity)")
    capacity: float = spec(optional(positive(units.size_bytes)), None,
                           "bytes per cluster pool, real-world (scaled by scale.bytes); null: "
                           "accelerator memory left after weights x instances (profile)")
    snapshot_every: int = spec(integer(0), 8,
                               "keep a KDA state snapshot every this many blocks (0: none), "
                               "besides the one after each prompt's last whole block")
    transfer: str = spec(choice("auto", "never", "always"), "auto",
                         "cache_aware: the bandwidth-abundant rule (move a longer prefix from "
                         "the other cluster when it pays) while the WAN's measured egress is "
                         "below headroom (auto), never (always the bandwidth-scarce rule) or "
                         "always")
    headroom: float = spec(units.probability, 0.5,
                           "auto: the WAN counts as bandwidth-abundant while its measured KV "
                           "egress / link rate is below this")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    drain_timeout: float = spec(units.duration_s, 600.0,
                                "after the last send, wait at most this long (real-world) for replies")
    request_timeout: float = spec(units.duration_s, 600.0,
                                  "a request not finished after this long (real-world) fails")
    token_flush: float = spec(positive(units.duration_s), 0.5,
                              "decode workers send tokens after the first in chunks this often "
                              "(real-world); first and last tokens go at once, every token keeps "
                              "its own time stamp")
    kv_deadline: float = spec(units.duration_s, 300.0,
                              "a KV transfer not finished this long (real-world) after prefill fails")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
    name: str = spec(string, doc="experiment name; results go to results/<name>/")
    seed: int = spec(integer(0), 1, "seed of every random choice (workload, jitter, loss)")
    requests: int = spec(optional(integer(1, 1_000_000)), None, "number of requests to send")
    duration: float = spec(optional(positive(units.duration_s)), None,
                           "or: send for this long (real-world)")
    scale: ScaleSpec = spec(section(ScaleSpec), factory=ScaleSpec, doc="time and byte scaling")
    model: ModelSpec = spec(section(ModelSpec), factory=ModelSpec, doc="the served model")
    clusters: ClustersSpec = spec(section(ClustersSpec), factory=ClustersSpec, doc="instances")
    network: NetworkSpec = spec(section(NetworkSpec), factory=NetworkSpec, doc="WAN and LAN links")
    scheduler: SchedulerSpec = spec(section(SchedulerSpec), factory=SchedulerSpec,
                                    doc="request routing")
    workload: WorkloadSpec = spec(section(WorkloadSpec), doc="what requests are sent")
    run: RunSpec = spec(section(RunSpec), factory=RunSpec, doc="timeouts of the run itself")
    cache: CacheSpec = spec(section(CacheSpec), factory=CacheSpec,
                            doc="hybrid prefix cache pool (docs/cache.md)")
    label: str = spec(optional(string), None, "name of this run in tables (default: the policy)")

    def check(self):
        if self.requests is not None and self.duration is not None:
            raise ValueError("give at most one of 'requests' or 'duration'")
        w = self.workload
        if self.requests is None and self.duration is None and w.arrival.process != "trace" \
                and "trace" not in (w.input.dist, w.output.dist):
            raise ValueError("give 'requests' or 'duration' (only a trace replay may omit both)")
        c, pol = self.clusters, self.scheduler.policy
        if pol == "homogeneous" and c.local.prefill < 1:
            raise ValueError("policy homogeneous needs clusters.local.prefill >= 1")
        if pol == "naive" and c.prfaas.instances < 1:
            raise ValueError("policy naive needs clusters.prfaas.instances >= 1")
        if pol == "prfaas" and (c.prfaas.instances < 1 or c.local.prefill < 1):
            raise ValueError("policy prfaas needs clusters.prfaas.instances >= 1 and "
                             "clusters.local.prefill >= 1")

    # ---- derived, emulated quantities (real-world value -> what the emulator runs) ----
    @property
    def run_label(self):
        return self.label or self.scheduler.policy

    def emulated_direction(self, name):
        """The WAN link parameters of one direction, scaled to emulation units.

        A queue given in bytes is scaled by `scale.bytes`, which keeps its drain time (queue /
        rate) in step with everything else; a queue in packets is taken as emulated packets.
        """
        d = self.network.wan.direction(name)
        s = self.scale
        d["rate"] = d["rate"] * s.bytes * s.time
        d["delay"] = d["delay"] / s.time
        d["jitter"] = d["jitter"] / s.time
        if d["queue"] and "bytes" in d["queue"]:
            d["queue"] = {"bytes": int(d["queue"]["bytes"] * s.bytes)}
        return d

    def emulated_changes(self, trace_rows=()):
        """Scheduled link changes in emulation units, sorted: [(t_s, direction|None, changes)].

        `trace_rows` are the rate trace's (t_s, rate_bps) rows, real-world.
        """
        s = self.scale
        out = []
        for c in self.network.wan.changes:
            ch = {k: getattr(c, k) for k in ("rate", "delay", "jitter", "loss", "up")
                  if getattr(c, k) is not None}
            if "rate" in ch:
                ch["rate"] *= s.bytes * s.time
            for k in ("delay", "jitter"):
                if k in ch:
                    ch[k] /= s.time
            out.append((c.at / s.time, None if c.direction == "both" else c.direction, ch))
        trace = self.network.wan.rate_trace
        for t, rate in trace_rows:
            d = None if trace is None or trace.direction == "both" else trace.direction
            out.append((t / s.time, d, {"rate": rate * s.bytes * s.time}))
        return sorted(out, key=lambda x: x[0])


MIN_EMULATED_QUEUE_BYTES = 64 * 1024     # one TSO burst: a smaller drop-tail queue drops most


def _check_scale(exp, path):
    rates = [(c.rate, "network.wan.changes") for c in exp.network.wan.changes if c.rate]
    for rate_real, key in rates:
        rate = rate_real * exp.scale.bytes * exp.scale.time
        if rate > MAX_EMULATED_RATE_BPS:
            raise ConfigError(f"rate {units.fmt_rate(rate_real)} scales to {units.fmt_rate(rate)} "
                              f"emulated, above {units.fmt_rate(MAX_EMULATED_RATE_BPS)}",
                              path=path, key=key)
    emulated = {d: exp.emulated_direction(d) for d in ("kv", "request")}
    for direction in ("kv", "request"):
        q = emulated[direction]["queue"]
        if q and "bytes" in q and q["bytes"] < MIN_EMULATED_QUEUE_BYTES:
            real = exp.network.wan.direction(direction)["queue"]["bytes"]
            raise ConfigError(
                f"queue {real} bytes x scale.bytes {exp.scale.bytes:g} = {q['bytes']} emulated "
                f"bytes, less than one 64 KiB TSO burst; raise scale.bytes or give the queue in "
                f"packets (emulated packets, not scaled)", path=path, key="network.wan.queue")
    for direction in ("kv", "request"):
        rate = emulated[direction]["rate"]
        if rate > MAX_EMULATED_RATE_BPS:
            real = exp.network.wan.direction(direction)["rate"]
            raise ConfigError(
                f"network.wan.rate {units.fmt_rate(real)} x scale.bytes {exp.scale.bytes:g} x "
                f"scale.time {exp.scale.time:g} = {units.fmt_rate(rate)} emulated, above what this "
                f"machine can shape ({units.fmt_rate(MAX_EMULATED_RATE_BPS)}); lower scale.bytes "
                f"or scale.time", path=path, key="scale")
        if rate < 8e3:
            raise ConfigError(
                f"emulated WAN rate {units.fmt_rate(rate)} is below 8 kbit/s; raise scale.bytes",
                path=path, key="scale")


TRACE_BLOCK_TOKENS = {"mooncake": 512}     # the granularity of each trace format's block ids


def cache_capacity(exp, prof, cluster):
    """Real-world bytes of one cluster's pool: `cache.capacity`, else the accelerator memory
    left after the weights on each instance x the cluster's instances (profile `memory`)."""
    if exp.cache.capacity is not None:
        return exp.cache.capacity
    c = getattr(exp.clusters, cluster)
    return prof.free_memory(c.accelerator) * c.instances


def _check_cache(exp, prof, path):
    c = exp.cache
    if exp.scheduler.placement == "cache_aware" and not c.enabled:
        raise ConfigError("cache_aware placement needs cache.enabled: true", path=path,
                          key="scheduler.placement")
    if not c.enabled:
        return
    if exp.model.engine != "profile":
        raise ConfigError("the prefix cache pool needs model.engine: profile (the torch engine "
                          "does not continue from pooled state yet)", path=path,
                          key="cache.enabled")
    if exp.scheduler.policy == "naive" and exp.scheduler.placement == "cache_aware":
        raise ConfigError("cache_aware placement cannot place anything under policy naive (all "
                          "prefill on PrfaaS); use least_loaded or policy prfaas", path=path,
                          key="scheduler.placement")
    tr = exp.workload.trace
    gran = TRACE_BLOCK_TOKENS.get(tr.format) if tr is not None else 512
    if gran is not None and (c.block > gran or gran % c.block):
        raise ConfigError(f"block {c.block} tokens does not divide the workload's block id "
                          f"granularity ({gran} tokens)", path=path, key="cache.block")
    if gran is not None and c.block != gran:
        raise ConfigError(f"block {c.block} tokens: the workload names its prefixes in "
                          f"{gran}-token blocks; only block: {gran} can be matched",
                          path=path, key="cache.block")
    one = prof.s_kv(c.block) * exp.scale.bytes
    for cluster in ("prfaas", "local"):
        if getattr(exp.clusters, cluster).instances < 1:
            continue
        cap = cache_capacity(exp, prof, cluster)
        if cap * exp.scale.bytes < one:
            raise ConfigError(f"capacity {cap:.4g} bytes holds less than one block with its "
                              f"snapshot ({prof.s_kv(c.block):.4g} bytes real-world)",
                              path=path, key="cache.capacity")


def read_rate_trace(path):
    """Rows (t_s, rate_bps), real-world, of a bandwidth trace CSV: `time,rate` per line with units
    ('60s,20Gbit'); '#' comments and one header line allowed; times must not decrease."""
    rows, header_seen = [], False
    with open(path, newline="") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            cells = [c.strip() for c in line.split(",")]
            try:
                if len(cells) != 2:
                    raise ValueError(f"expected 2 columns, got {len(cells)}")
                t, r = units.duration_s(cells[0]), units.rate_bps(cells[1])
            except ValueError as e:
                if not rows and not header_seen:
                    header_seen = True       # the header line
                    continue
                raise ConfigError(f"line {n}: expected time,rate ({e})", path=str(path)) from None
            if rows and t < rows[-1][0]:
                raise ConfigError(f"line {n}: time goes backwards", path=str(path))
            rows.append((t, r))
    if not rows:
        raise ConfigError("no time,rate rows", path=str(path))
    return rows


def _resolve_rate_trace(exp, base):
    """Make the rate trace's path absolute and check the file parses (before anything starts)."""
    trace = exp.network.wan.rate_trace
    if trace is None:
        return exp
    p = pathlib.Path(trace.path).expanduser()
    for cand in ([p] if p.is_absolute() else [base / p, pathlib.Path.cwd() / p]):
        if cand.is_file():
            rows = read_rate_trace(cand)
            peak = max(r for _, r in rows) * exp.scale.bytes * exp.scale.time
            if peak > MAX_EMULATED_RATE_BPS:
                raise ConfigError(f"peak rate scales to {units.fmt_rate(peak)} emulated, above "
                                  f"{units.fmt_rate(MAX_EMULATED_RATE_BPS)}",
                                  key="network.wan.rate_trace")
            wan = dataclasses.replace(exp.network.wan, rate_trace=dataclasses.replace(
                trace, path=str(cand.resolve())))
            return dataclasses.replace(exp, network=dataclasses.replace(exp.network, wan=wan))
    raise ConfigError(f"no such rate trace file {trace.path!r}", key="network.wan.rate_trace.path")


def set_dotted(d, dotted, value, path=None):
    """d['a']['b'] = value for dotted 'a.b', creating mappings on the way."""
    keys = dotted.split(".")
    cur = d
    for i, k in enumerate(keys[:-1]):
        nxt = cur.get(k)
        if nxt is None:
            nxt = cur[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set {dotted!r}: {'.'.join(keys[:i + 1])} is not a mapping",
                              path=path, key=dotted)
        cur = nxt
    cur[keys[-1]] = value


def parse_override(text, path=None):
    """'key.path=value' from `--set`; the value is read as YAML (so 3, 1e-3, true, [1, 2] work)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}", path=path)
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def expand(raw, path=None):
    """The list of (label, mapping) runs described by one YAML mapping (variants x sweep)."""
    raw = dict(raw)
    variants = raw.pop("variants", None) or [{}]
    sweep = raw.pop("sweep", None) or {}
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        raise ConfigError("expected a list of mappings (dotted key: value)", path=path,
                          key="variants")
    if not isinstance(sweep, dict) or not all(isinstance(v, list) and v for v in sweep.values()):
        raise ConfigError("expected a mapping of dotted key -> non-empty list of values",
                          path=path, key="sweep")
    keys = list(sweep)
    runs = []
    for variant in variants:
        for combo in itertools.product(*(sweep[k] for k in keys)) if keys else [()]:
            d = copy.deepcopy(raw)
            for k, v in variant.items():
                set_dotted(d, str(k), copy.deepcopy(v), path)
            for k, v in zip(keys, combo):
                set_dotted(d, k, copy.deepcopy(v), path)
            runs.append((d, dict(zip(keys, combo))))
    return runs


def _label(exp, sweep_point):
    base = exp.run_label
    if sweep_point:
        base += "," + ",".join(f"{k.split('.')[-1]}={v}" for k, v in sweep_point.items())
    return base


def validate(raw, path=None, sweep_point=None):
    """One expanded mapping -> Experiment (raises ConfigError naming file and key)."""
    try:
        exp = build(Experiment, raw)
        if path is not None:   # trace paths are relative to the experiment file
            base = pathlib.Path(path).parent
            exp = dataclasses.replace(exp, workload=exp.workload.resolve_paths(base))
            exp = _resolve_rate_trace(exp, base)
    except ConfigError as e:
        raise ConfigError(str(e), path=path) from None
    prof = profiles.load(exp.model.profile)
    for where, acc in (("clusters.prfaas.accelerator", exp.clusters.prfaas.accelerator),
                       ("clusters.local.accelerator", exp.clusters.local.accelerator)):
        if acc not in prof.prefill:
            raise ConfigError(f"profile {prof.name!r} has no accelerator {acc!r}; it has "
                              f"{', '.join(prof.prefill)}", path=path, key=where)
    _check_scale(exp, path)
    _check_cache(exp, prof, path)
    return dataclasses.replace(exp, label=_label(exp, sweep_point or {}))


def read_yaml(path):
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError("no such experiment file", path=str(path))
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"not valid YAML{where}: {getattr(e, 'problem', e)}", path=str(path))
    if not isinstance(raw, dict):
        raise ConfigError("expected a mapping at the top level", path=str(path))
    return raw


def load_experiment(path, overrides=()):
    """Read, override, expand and validate: the list of runs of one experiment file."""
    raw = read_yaml(path)
    for text in overrides:
        key, value = parse_override(text, path)
        set_dotted(raw, key, value, path)
    runs = [validate(d, str(path), point) for d, point in expand(raw, str(path))]
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        runs = [dataclasses.replace(r, label=f"{r.label}#{i}") for i, r in enumerate(runs)]
    return runs


def resolved(exp):
    """Plain-data form of an Experiment (written as config.yaml in the run directory)."""
    return to_dict(exp)


__all__ = ["Experiment", "load_experiment", "resolved", "expand", "validate", "set_dotted",
           "parse_override", "MAX_EMULATED_RATE_BPS"]
