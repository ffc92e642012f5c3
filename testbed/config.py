"""Read and expand: the experiment YAML, validated into immutable `Experiment` objects.

`load_experiment(path, overrides)` is the only place an experiment file is read. It

1. loads the YAML with a safe loader,
2. applies `--set key=value` overrides (dotted keys),
3. expands `variants:` (a list of dotted-key overrides, one run each) and `sweep:` (a grid of
   dotted key -> list of values; every combination is one run, crossed with the variants),
4. validates each expanded mapping against the schema (`testbed.experiment`) and returns one
   `Experiment` per run.

Place in the architecture: above the description (`testbed.experiment`), below `testbed.deploy`.
Validation never compiles: what needs the compiled deployment (the emulated link against what
this machine can shape, fault targets by role and datacenter) is checked once, where it is
computed, by `testbed.deploy.compile`, which the runner calls for every run before anything is
built. Every value here is real-world.
"""

import copy
import dataclasses
import itertools
import math
import pathlib

from testbed import loadgen, plan, units, yamlload
from testbed import profile as profiles
from testbed.errors import ConfigError
from testbed.experiment import (  # noqa: F401  (re-exported: config.Experiment, ...)
    DAY_S, MAX_DURATION_S, MAX_ONOFF_CYCLES, MAX_PREFIX_BLOCK_IDS, MAX_REPLICATES, MAX_RUNS,
    MAX_TOTAL_RUNS, BackendSpec,
    Experiment, SloSpec, _no_cuda_reason, cache_capacity)
from testbed.net import spec as netspec
from testbed.net.ratetrace import MAX_LINK_CHANGES, MIN_LOOP_PERIOD_S, read_rate_trace
from testbed.schema import build, path_component, to_dict
from testbed.workload import spec as wlspec
from testbed.workload import traces

def _resolve_rate_trace(exp, base):
    """Make the rate trace's path absolute and check the file's rows (before anything starts)."""
    trace = exp.network.wan.rate_trace
    if trace is None:
        return exp, []
    p = pathlib.Path(trace.path).expanduser()
    for cand in ([p] if p.is_absolute() else [base / p, pathlib.Path.cwd() / p]):
        if cand.exists():
            rows = read_rate_trace(cand)
            wan = dataclasses.replace(exp.network.wan, rate_trace=dataclasses.replace(
                trace, path=str(cand.resolve())))
            exp = dataclasses.replace(exp, network=dataclasses.replace(exp.network, wan=wan))
            return exp, rows
    raise ConfigError(f"no such rate trace file {trace.path!r}", key="network.wan.rate_trace.path")


def _check_link(exp, rate_rows):
    """Everything about the WAN that can be checked on paper in real-world units: delays of
    every change, loss feasibility, the backend, looped traces. The emulated link (rates and
    queues this machine can shape) is checked where it is computed, `testbed.deploy.compile`."""
    wan = exp.network.wan
    for i, c in enumerate(wan.changes):
        key = f"network.wan.changes[{i}]"
        if c.rate is not None:
            if c.rate <= 0:
                raise ConfigError("rate 0 does not cut the link: write `up: false` to take it "
                                  "down (and `up: true` later to restore it)", key=f"{key}.rate")
        if c.at > MAX_DURATION_S:
            raise ConfigError("expected at most 7 days (a hard limit)", key=f"{key}.at")
        for d in ("kv", "request") if c.direction == "both" else (c.direction,):
            base = wan.direction(d)
            delay = base["delay"] if c.delay is None else c.delay
            jitter = base["jitter"] if c.jitter is None else c.jitter
            loss = base["loss"] if c.loss is None else c.loss
            netspec.check_delay(delay, jitter, key)
            netspec.check_loss(loss, base["loss_burst"], key)
    for d in ("kv", "request"):
        base = wan.direction(d)
        netspec.check_delay(base["delay"], base["jitter"], f"network.wan.{d}")
        netspec.check_loss(base["loss"], base["loss_burst"], f"network.wan.{d}")
    netspec.check_backend(wan)
    trace = wan.rate_trace
    if trace is not None and rate_rows:
        period = rate_rows[-1][0]
        n = len(rate_rows)
        if trace.loop:
            if period < MIN_LOOP_PERIOD_S:
                raise ConfigError(f"a looped rate trace repeats every {period:g} s (its last "
                                  f"row's time); the shortest period is {MIN_LOOP_PERIOD_S:g} s "
                                  f"(a hard limit): add a later row or set loop: false",
                                  key="network.wan.rate_trace.loop")
            n *= int(exp.run.drain_timeout * 4 / period) + 1
        if n + len(wan.changes) > MAX_LINK_CHANGES:
            raise ConfigError(f"{n + len(wan.changes):,} scheduled link changes (rate trace "
                              f"rows x loops + changes), more than {MAX_LINK_CHANGES:,} (a hard "
                              f"limit); use a longer period or fewer rows",
                              key="network.wan.rate_trace")


def _workload_trace(exp, base, traces_read):
    """The workload trace, every line checked (read once per distinct selection), or None."""
    t = exp.workload.trace
    if t is None:
        return None
    cache_key = (t.path, t.format, t.on_error, t.start, t.duration, t.max_requests, t.max_input)
    if cache_key not in traces_read:
        traces_read[cache_key] = traces.load(t, base)
    return traces_read[cache_key]


def _generated_size(exp, trace):
    """(requests, span of arrivals in s) of a generated workload; ConfigError beyond what the
    generator may draw or the trace it replays in order holds."""
    w = exp.workload
    a = w.arrival
    rate = max([a.mean_rate] + [w.phase_specs(p)[0].mean_rate for p in w.phases])
    if exp.requests is not None:
        n = exp.requests
    elif exp.duration is not None:
        n = exp.duration * rate
    else:
        n = len(trace)       # lengths replayed in order decide the count
    span = n / rate if rate > 0 else math.inf
    if exp.duration is not None:
        span = min(span, exp.duration)
    if a.process == "onoff":
        per_cycle = a.on_rate * a.on_duration + a.off_rate * a.off_duration
        cycles = max(n / per_cycle if per_cycle > 0 else math.inf,
                     (exp.duration or 0) / (a.on_duration + a.off_duration))
        if cycles > MAX_ONOFF_CYCLES:
            raise ConfigError(f"on/off periods this short need about {cycles:.3g} of them "
                              f"for this workload, more than {MAX_ONOFF_CYCLES:,} (a hard "
                              f"limit); lengthen on_duration/off_duration",
                              key="workload.arrival")
    in_order = "trace" in (w.input.dist, w.output.dist)
    if in_order and exp.requests is not None and exp.requests > len(trace):
        raise ConfigError(f"{exp.requests} requests, but the lengths replay "
                          f"workload.trace's rows in order and it selects only "
                          f"{len(trace)}; lower 'requests' or widen the trace window",
                          key="requests")
    return n, span


def _check_workload(exp, base, traces_read):
    """Request counts, spans and generator work within the caps; a workload trace's every line."""
    w, cap = exp.workload, exp.run.max_requests
    raise_cap = (f"run.max_requests ({cap:,}; raise it in the file if a run this long is "
                 f"meant)")
    trace = _workload_trace(exp, base, traces_read)
    _check_decode_memory(exp, trace)
    if w.arrival.process == "trace":
        span = trace.span_s / w.trace.speedup
        n = len(trace) if exp.requests is None else exp.requests
        if exp.requests is not None and exp.requests > len(trace):
            raise ConfigError(f"{exp.requests} requests asked for, but workload.trace selects "
                              f"only {len(trace)} rows; lower 'requests' or widen the window",
                              key="requests")
    else:
        n, span = _generated_size(exp, trace)
    if n > cap:
        raise ConfigError(f"about {n:,.0f} requests, more than {raise_cap}",
                          key="requests" if exp.requests is not None else
                          "duration" if exp.duration is not None else "workload.trace")
    if span > MAX_DURATION_S:
        raise ConfigError(f"sending this workload would take {span / DAY_S:,.3g} days of "
                          f"arrivals, more than 7 days (a hard limit); raise the arrival rate "
                          f"or send fewer requests", key="workload.arrival")
    if w.prefix.documents > 0 and not w.trace_prefixes():
        longest = w.input.tokens if w.input.dist == "fixed" else (
            int(trace.input_len.max()) if trace is not None and w.input.dist in
            ("trace", "empirical") else w.input.max)
        ids = n * -(-longest // wlspec.BLOCK_TOKENS)
        if ids > MAX_PREFIX_BLOCK_IDS:
            raise ConfigError(f"up to {ids:,.0f} prefix block ids ({n:,.0f} requests of up to "
                              f"{longest:,} tokens), more than {MAX_PREFIX_BLOCK_IDS:,} (a hard "
                              f"limit); send fewer or shorter requests", key="workload.prefix")


def _shortest(length, trace, column):
    """The fewest tokens a length spec can draw (the trace's column for trace/empirical)."""
    if length.dist == "fixed":
        return length.tokens
    if length.dist in ("trace", "empirical") and trace is not None:
        return int(getattr(trace, column).min())
    return length.min


def _check_decode_memory(exp, trace):
    """Decode memory too small for every request the workload can send: refused, as vLLM
    refuses a request whose KV cannot fit (a run of nothing but failures says nothing)."""
    cap = exp.decode_model().kv_capacity
    if cap is None or exp.model.engine != "profile":
        return
    w = exp.workload
    mixes = [(w.input, w.output)] + [w.phase_specs(ph)[1:] for ph in w.phases]
    fewest = min(_shortest(i, trace, "input_len") + _shortest(o, trace, "output_len")
                 for i, o in mixes)
    need = profiles.load(exp.model.profile).s_kv(fewest)
    if need > cap:
        key = ("model.decode_kv_capacity" if exp.model.decode_kv_capacity is not None
               else "model.profile")
        raise ConfigError(f"decode memory {units.fmt_bytes(cap)} holds no request of the "
                          f"workload: the shortest ({fewest:,} tokens of input + output) needs "
                          f"S_kv = {units.fmt_bytes(need)}", key=key)


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
    gran = wlspec.BLOCK_TOKENS     # every prefix block id: Mooncake hash_ids, generated prefixes
    if c.block > gran or gran % c.block:
        raise ConfigError(f"block {c.block} tokens does not divide the workload's block id "
                          f"granularity ({gran} tokens)", path=path, key="cache.block")
    if c.block != gran:
        raise ConfigError(f"block {c.block} tokens: the workload names its prefixes in "
                          f"{gran}-token blocks; only block: {gran} can be matched",
                          path=path, key="cache.block")
    one = prof.s_kv(c.block)        # scale.bytes scales both sides alike
    for cluster in ("prfaas", "local"):
        if getattr(exp.clusters, cluster).instances < 1:
            continue
        cap = cache_capacity(exp, prof, cluster)
        if cap < one:
            raise ConfigError(f"capacity {cap:.4g} bytes holds less than one block with its "
                              f"snapshot ({prof.s_kv(c.block):.4g} bytes real-world)",
                              path=path, key="cache.capacity")


def set_dotted(d, dotted, value, path=None):
    """d['a']['b'] = value for dotted 'a.b', creating mappings on the way."""
    if not isinstance(dotted, str) or not dotted or any(not k for k in dotted.split(".")):
        raise ConfigError(f"expected a dotted key such as network.wan.rate, got {dotted!r}",
                          path=path)
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
    """'key.path=value' from `--set`; the value is read as strict YAML (so 3, 1e-3, true, [1, 2]
    work, and `012` or `3:1` are refused as in the file)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}", path=path)
    key, raw = text.split("=", 1)
    key = key.strip()
    if len(raw) > yamlload.MAX_SCALAR_CHARS:
        raise ConfigError(f"--set value of {len(raw):,} characters (at most "
                          f"{yamlload.MAX_SCALAR_CHARS:,})", path=path, key=key)
    value = yamlload.load_text(raw, f"--set {key}", key=None) if raw.strip() else raw
    return key, value


def _check_mapping(value, key, path):
    """A mapping of dotted keys (a variant, the sweep), or ConfigError."""
    if not isinstance(value, dict):
        raise ConfigError(f"expected a mapping of dotted key: value, got {value!r}", path=path,
                          key=key)
    for k in value:
        if not isinstance(k, str) or not k or any(not part for part in k.split(".")):
            raise ConfigError(f"expected dotted keys such as network.wan.rate, got {k!r}",
                              path=path, key=key)


def expand(raw, path=None):
    """The list of (label, mapping) runs described by one YAML mapping (variants x sweep)."""
    raw = dict(raw)
    variants = raw.pop("variants", None)
    sweep = raw.pop("sweep", None)
    if variants is None or variants == []:
        variants = [{}]
    if not isinstance(variants, list):
        raise ConfigError(f"expected a list of mappings (dotted key: value), got {variants!r}",
                          path=path, key="variants")
    for i, v in enumerate(variants):
        _check_mapping(v, f"variants[{i}]", path)
    sweep = {} if sweep is None else sweep
    _check_mapping(sweep, "sweep", path)
    for k, v in sweep.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"expected a non-empty list of values, got {v!r}", path=path,
                              key=f"sweep.{k}")
    keys = list(sweep)
    total = len(variants) * math.prod(len(sweep[k]) for k in keys)
    if total > MAX_RUNS:
        raise ConfigError(f"{len(variants)} variants x {total // len(variants):,} sweep points "
                          f"= {total:,} runs, more than {MAX_RUNS} (a hard limit); split the "
                          f"sweep into several files", path=path, key="sweep" if keys else
                          "variants")
    runs = []
    for variant in variants:
        for combo in itertools.product(*(sweep[k] for k in keys)) if keys else [()]:
            d = copy.deepcopy(raw)
            for k, v in variant.items():
                set_dotted(d, k, copy.deepcopy(v), path)
            for k, v in zip(keys, combo):
                set_dotted(d, k, copy.deepcopy(v), path)
            runs += [(r, dict(zip(keys, combo))) for r in replicate(d)]
    if len(runs) > MAX_TOTAL_RUNS:
        raise ConfigError(f"{total:,} runs x replicates = {len(runs):,} runs, more than "
                          f"{MAX_TOTAL_RUNS} (a hard limit); split the file", path=path,
                          key="replicates")
    return runs


def replicate(d):
    """One mapping per replicate of run mapping `d`: `replicate` set to its index and `seed`
    to its own (`seeds[i]`, else seed + i). A `replicates` or `seeds` value of the wrong type
    expands to one run, and `validate` names the key."""
    n, seeds = d.get("replicates", 1), d.get("seeds")
    if isinstance(seeds, list) and "replicates" not in d:
        n = len(seeds)
        d["replicates"] = n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_REPLICATES:
        return [d]
    if "replicate" in d:
        raise ConfigError("set by the expansion of `replicates`, not in a file", key="replicate")
    base = d.get("seed", 1)
    out = []
    for i in range(n):
        r = copy.deepcopy(d)
        r["replicate"] = i
        if isinstance(seeds, list) and len(seeds) == n:
            r["seed"] = seeds[i]
        elif isinstance(base, int) and not isinstance(base, bool) and n > 1:
            r["seed"] = base + i
        out.append(r)
    return out


def _label(exp, sweep_point):
    base = exp.run_label
    if sweep_point:
        # a unit such as 1.2/s must not become a directory separator: '/' reads 'per'
        base += "," + ",".join(f"{k.split('.')[-1]}={v}".replace("/", "_per_")
                               for k, v in sweep_point.items())
    return base


def validate(raw, path=None, sweep_point=None, traces_read=None):
    """One expanded mapping -> Experiment (raises ConfigError naming file and key).

    Everything that can be checked on paper is checked here, before anything is built or
    written: units and ranges, the link (rates, delays, loss, queues, backend, every scheduled
    change, the rate trace's rows), the workload (request caps, the trace's every line), the
    profile and the run's directory name.
    """
    traces_read = {} if traces_read is None else traces_read
    try:
        exp = build(Experiment, raw)
        base = pathlib.Path(path).parent if path is not None else pathlib.Path.cwd()
        if path is not None:   # trace paths are relative to the experiment file
            exp = dataclasses.replace(exp, workload=exp.workload.resolve_paths(base))
        exp = dataclasses.replace(exp, model=dataclasses.replace(
            exp.model, profile=profiles.resolve(exp.model.profile, base)))
        exp, rate_rows = _resolve_rate_trace(exp, base)
        prof = profiles.load(exp.model.profile)
        for where, acc in (("clusters.prfaas.accelerator", exp.clusters.prfaas.accelerator),
                           ("clusters.local.accelerator", exp.clusters.local.accelerator)):
            if acc not in prof.prefill:
                raise ConfigError(f"profile {prof.name!r} has no accelerator {acc!r}; it has "
                                  f"{', '.join(prof.prefill)}", key=where)
        _check_link(exp, rate_rows)
        exp = _apply_load(exp, base)
        _check_workload(exp, base, traces_read)
        _check_cache(exp, prof, None)
        label = _label(exp, sweep_point or {})
        try:
            path_component(label)
        except ValueError as e:
            raise ConfigError(f"the run's label {e}", key="sweep" if sweep_point else "label")
    except ConfigError as e:
        if e.path:
            raise
        raise ConfigError(str(e), path=path) from None
    loadgen.check(exp, path)
    return dataclasses.replace(exp, label=label)


def _apply_load(exp, base):
    """`load`: the arrival rate becomes load x the planner's Lambda_max (E[T] form) of this
    very run (its policy, sizes, threshold, link and length mix)."""
    if exp.load is None:
        return exp
    a = exp.workload.arrival
    if a.process not in ("poisson", "gamma", "constant") or exp.workload.phases:
        raise ConfigError("load sets workload.arrival.rate: it needs a poisson, gamma or "
                          "constant arrival process without phases", key="load")
    pred = plan.predict(exp, base_dir=str(base), latency="expected")
    if not pred.get("lambda_max"):
        raise ConfigError(f"load: the planner has no Lambda_max for this run "
                          f"({'; '.join(pred.get('warnings') or []) or 'no prediction'})",
                          key="load")
    arrival = dataclasses.replace(a, rate=exp.load * pred["lambda_max"])
    return dataclasses.replace(exp, workload=dataclasses.replace(exp.workload, arrival=arrival))


def read_yaml(path):
    raw = yamlload.load_file(path, "an experiment file (YAML)")
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a mapping of keys at the top level, got "
                          f"{'an empty file' if raw is None else type(raw).__name__}",
                          path=str(path))
    return raw


def load_experiment(path, overrides=()):
    """Read, override, expand and validate: the list of runs of one experiment file."""
    raw = read_yaml(path)
    for text in overrides:
        key, value = parse_override(text, path)
        set_dotted(raw, key, value, path)
    traces_read = {}
    try:
        runs = [validate(d, str(path), point, traces_read) for d, point in expand(raw, str(path))]
    except RecursionError:
        raise ConfigError("too deeply nested to validate", path=str(path)) from None
    labels = [(r.label, r.replicate) for r in runs]
    if len(set(labels)) != len(labels):
        runs = [dataclasses.replace(r, label=f"{r.label}#{i // r.replicates}")
                for i, r in enumerate(runs)]
    return runs


def resolved(exp):
    """Plain-data form of an Experiment (written as config.yaml in the run directory)."""
    return to_dict(exp)


__all__ = ["Experiment", "load_experiment", "resolved", "expand", "validate", "set_dotted",
           "parse_override"]
