"""Describe: the experiment YAML, validated into immutable `Experiment` objects.

`load_experiment(path, overrides)` is the only place an experiment file is read. It

1. loads the YAML with a safe loader,
2. applies `--set key=value` overrides (dotted keys),
3. expands `variants:` (a list of dotted-key overrides, one run each) and `sweep:` (a grid of
   dotted key -> list of values; every combination is one run, crossed with the variants),
4. validates each expanded mapping against the schema and returns one `Experiment` per run.

Everything downstream reads only these objects; the runner compiles each into a
`testbed.deploy.Deployment` first.

Scaling (`scale:`): the emulation runs `time` times faster than the real world and moves `bytes`
times the real KV bytes. Every value here is real-world; `testbed.deploy` (through
`testbed.scale.Scale`) is the one place they become emulated, and where the emulated link is
checked against what this machine can shape (`validate` compiles each run once to check it).
"""

import copy
import dataclasses
import itertools
import importlib.metadata
import importlib.util
import math
import pathlib

from testbed import profile as profiles
from testbed import units, yamlload
from testbed.errors import ConfigError
from testbed.faults import FaultSpec
from testbed.net import spec as netspec
from testbed.net.spec import NetworkSpec
from testbed.schema import (at_most, boolean, build, choice, integer, list_of, optional, path_component,
                            positive, section, spec, string, to_dict)
from testbed.workload import spec as wlspec
from testbed.workload.spec import WorkloadSpec

# Resource caps (hard limits unless a key raises them; experiments/README.md lists them).
DAY_S = 86400.0
MAX_DURATION_S = 7 * DAY_S       # `duration`, the span of arrivals, scheduled changes
MAX_TIMEOUT_S = DAY_S            # run.* timeouts
MAX_INTERVAL_S = 3600.0          # control and health-check periods
MAX_RUNS = 100                   # variants x sweep points of one file
MAX_REQUESTS_DEFAULT = 100_000   # run.max_requests
MAX_PREFIX_BLOCK_IDS = 50_000_000  # synthetic prefix block ids of one workload (~400 MB)
MAX_ONOFF_CYCLES = 2_000_000     # on/off periods the generator may have to draw
MAX_TORCH_PARAMS = 100_000_000   # the torch engine's tiny model (~400 MB in float32)


def _duration(hi, what):
    return at_most(units.duration_s, hi, what)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleSpec:
    time: float = spec(at_most(positive(units.number), 1000, "1000"), 1.0,
                       "emulate this many times faster than real time (at most 1000)")
    bytes: float = spec(at_most(positive(units.number), 1, "1"), 1.0,
                        "move this fraction of the real KV bytes (1e-3 = 1/1000; at most 1)")
    tokens: float = spec(at_most(positive(units.number), 1e6, "1e6"), 1.0,
                         "torch engine: divide prompt lengths by this (tiny model, long traces)")

    def check(self):
        if self.time < 1e-3 or self.bytes < 1e-9:
            raise ValueError("time must be at least 1e-3 and bytes at least 1e-9")


def _torch_config(value):
    """The torch engine's model shape, checked against the model's own config class: every key
    of the type of its default, integers in [1, 65536], at most MAX_TORCH_PARAMS weights."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of model config keys, got {value!r}")
    try:
        if importlib.util.find_spec("torch") is None:   # found without importing it (fast)
            raise ModuleNotFoundError("No module named 'torch'")
        from workers.model.config import HybridConfig   # imports torch only for the dtype
    except ImportError as e:
        raise ValueError(f"the torch engine needs PyTorch ({e}): `make deps` installs it "
                         f"(TORCH=cpu or cuda), or pip install '.[torch]'") from None
    fields = {f.name: f.default for f in dataclasses.fields(HybridConfig)}
    for k, v in value.items():
        if k not in fields:
            raise ValueError(f"unknown model config key {k!r}; expected some of "
                             f"{', '.join(sorted(fields))}")
        want = type(fields[k])
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if type(v) is not want or (want is float and not math.isfinite(v)):
            raise ValueError(f"{k}: expected {want.__name__}, got {v!r}")
        if want is int and k != "seed" and not 1 <= v <= 65536:
            raise ValueError(f"{k}: expected an integer in [1, 65536], got {v}")
        if k == "seed" and not 0 <= v < 2**32:
            raise ValueError(f"seed: expected an integer in [0, 2^32), got {v}")
    try:
        cfg = HybridConfig.from_dict(value)
        kinds = cfg.layer_kinds
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None
    d, h = cfg.d_model, cfg.mlp_hidden
    kda = cfg.kda_heads * (cfg.kda_head_k * 2 + cfg.kda_head_v * 2) * d
    mla = cfg.mla_latent * d * 2 + cfg.mla_heads * (cfg.mla_nope + cfg.mla_rope + cfg.mla_v) \
        * (d + cfg.mla_latent)
    params = 2 * cfg.vocab * d + sum(kda if k == "kda" else mla for k in kinds) \
        + len(kinds) * 3 * d * h
    if params > MAX_TORCH_PARAMS:
        raise ValueError(f"about {params:,.0f} weights, more than the tiny model may have "
                         f"({MAX_TORCH_PARAMS:,}; a hard limit)")
    return dict(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    profile: str = spec(path_component, "kimi-linear-1t",
                        "accelerator profile, testbed/profiles/NAME.yaml (a name, not a path)")
    engine: str = spec(choice("profile", "torch"), "profile",
                       "profile: workers wait the profiled time and send profiled KV bytes | "
                       "torch: a real tiny KDA+MLA hybrid computes and ships its real state")
    device: str = spec(choice("auto", "cpu", "cuda"), "auto",
                       "torch engine: where the model runs (auto = cuda when available)")
    torch: dict = spec(_torch_config, factory=dict,
                       doc="torch engine: model shape (HybridConfig keys: n_layers, d_model, ratio "
                           "'3:1', vocab, kda_heads, mla_latent, dtype float32|bfloat16, ...)")
    decode_step: float = spec(optional(positive(_duration(60, "60s"))), None,
                              "T_decode per decode step (real-world); default from the profile")
    bs_max: int = spec(optional(integer(1, 4096)), None,
                       "BS_max, largest decode batch; default from profile")
    decode_model: str = spec(choice("profile", "constant"), "profile",
                             "profile: a decode step takes T_step(batch, context) from the profile "
                             "(T_decode for a full batch at the reference context) | constant: "
                             "T_decode whatever the batch, as the paper's model")
    decode_kv_capacity: float = spec(optional(positive(units.size_bytes)), None,
                                     "KV memory of one decode instance (real-world bytes); a "
                                     "request waits to join the batch until S_kv(input + output) "
                                     "fits; default from the profile")

    def check(self):
        if self.profile not in profiles.available():
            raise ValueError(f"profile: no profile {self.profile!r}; available: "
                             f"{', '.join(profiles.available())}")
        if self.engine == "torch" and self.device == "cuda":
            why = _no_cuda_reason()
            if why:
                raise ValueError(f"device: cuda, but {why}; use device: auto (CUDA when there "
                                 f"is one) or cpu")


def _no_cuda_reason(dev=pathlib.Path("/dev")):
    """Why the torch engine could not use CUDA here ('' if it may), found without importing
    torch: no NVIDIA device node, or a CPU-only PyTorch build."""
    if not any(dev.glob("nvidia[0-9]*")):
        return "this machine shows no NVIDIA GPU (no /dev/nvidia0)"
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""                      # the torch check says so
    if version.endswith("+cpu"):
        return f"the installed PyTorch {version} is a CPU-only build (make deps TORCH=cuda)"
    return ""


MAX_HOST_PER_ROLE = 64          # instances per role on mininet and ray hosts
MAX_SIM_PER_ROLE = 32_000       # in the simulator (the address plan: deploy._ip)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrfaasClusterSpec:
    # At most 64 per role on real hosts (`Experiment.check`): a host's interface is <run
    # prefix><node>-eth0 within the kernel's 15 characters up to index 99; docs/performance.md
    # "Many instances" runs 100 at once. The simulator (backend sim) takes up to MAX_SIM_PER_ROLE.
    instances: int = spec(integer(0, MAX_SIM_PER_ROLE), 0,
                          "PrfaaS prefill instances (remote datacenter)")
    accelerator: str = spec(string, "h200", "accelerator name in the profile")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalClusterSpec:
    instances: int = spec(integer(1, 2 * MAX_SIM_PER_ROLE), 1, "local PD instances (N_p + N_d)")
    accelerator: str = spec(string, "h20", "accelerator name in the profile")
    prefill: int = spec(integer(0, MAX_SIM_PER_ROLE), 0, "N_p: local instances that prefill")
    decode: int = spec(integer(1, MAX_SIM_PER_ROLE), 1, "N_d: local instances that decode")

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
                         "health-check prefill and decode instances; route around those that "
                         "do not answer, re-dispatch the requests on them (workers/recovery.py)")
    interval: float = spec(positive(_duration(MAX_INTERVAL_S, "1h")), 1.0,
                           "time between health checks of each instance (real-world)")
    timeout: float = spec(positive(_duration(MAX_INTERVAL_S, "1h")), 0.5,
                          "an instance that has not answered within this (real-world) is down")
    max_local: int = spec(optional(units.tokens), None,
                          "while PrfaaS is down, prefill locally only requests up to this long; "
                          "longer ones still go to PrfaaS and wait for it (null: all go local)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveSpec:
    enabled: bool = spec(boolean, False,
                         "prfaas: adapt the threshold to WAN egress and queue depths (short "
                         "timescale); `threshold` is the starting value")
    interval: float = spec(positive(_duration(MAX_INTERVAL_S, "1h")), 2.0,
                           "at most one threshold change per this (real-world); evaluated at "
                           "every request and every interval without one")
    window: float = spec(positive(_duration(MAX_INTERVAL_S, "1h")), 4.0,
                         "egress utilisation and PrfaaS queue growth are measured over this "
                         "(real-world)")
    dwell: float = spec(_duration(MAX_INTERVAL_S, "1h"), 2.0,
                        "hysteresis: a raise or lower signal must hold this long (real-world) "
                        "before the threshold moves")
    egress_high: float = spec(units.probability, 0.8,
                              "raise the threshold when measured egress / link rate is above this "
                              "and the PrfaaS queue grows")
    egress_low: float = spec(units.probability, 0.3,
                             "lower it when egress is below this and PrfaaS queues are short")
    queue_ratio: float = spec(at_most(positive(units.number), 1e6, "1e6"), 1.5,
                              "raise when the PrfaaS queue grows and its queued work per instance "
                              "exceeds local's by this factor; lower when below 1/this")
    step: float = spec(at_most(positive(units.number), 10, "10"), 0.1,
                       "multiplicative step of each change")
    min: int = spec(units.tokens, 1024, "lowest threshold")
    max: int = spec(units.tokens, 131072, "highest threshold (128Ki)")

    def check(self):
        if self.egress_low >= self.egress_high:
            raise ValueError("egress_low must be below egress_high")
        if self.min > self.max:
            raise ValueError("min must not exceed max")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolesSpec:
    enabled: bool = spec(boolean, False,
                         "prfaas: long timescale; every local instance is a dual-role worker and "
                         "the scheduler re-plans N_p/N_d and t from the measured length mix, "
                         "converting one instance at a time (workers/roles.py)")
    interval: float = spec(positive(_duration(MAX_INTERVAL_S, "1h")), 30.0,
                           "time between re-plans (real-world)")
    window: float = spec(positive(_duration(MAX_INTERVAL_S, "1h")), 60.0,
                         "re-plan from the requests that arrived within this (real-world)")
    min_requests: int = spec(integer(2, 1_000_000), 20,
                             "re-plan only when the window holds at least this many requests")
    cost: float = spec(_duration(MAX_INTERVAL_S, "1h"), 5.0,
                       "conversion delay after the drain (real-world): the instance serves "
                       "nothing meanwhile")
    gain: float = spec(units.probability, 0.05,
                       "convert only when the planner predicts at least this relative gain in "
                       "Lambda_max over the split in force (hysteresis)")
    retune: bool = spec(boolean, True,
                        "set the threshold to the planner's t for the measured mix at each "
                        "re-plan (the short timescale, if on, adapts from there)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerSpec:
    policy: str = spec(choice("homogeneous", "naive", "prfaas"), "prfaas",
                       "homogeneous: all local | naive: all prefill on PrfaaS | prfaas: threshold")
    threshold: int = spec(units.tokens, 19400,
                          "prfaas: offload requests longer than this (tokens; the paper's 19.4K)")
    adaptive: AdaptiveSpec = spec(section(AdaptiveSpec), factory=AdaptiveSpec,
                                  doc="short-timescale threshold control (docs in workers/adaptive.py)")
    roles: RolesSpec = spec(section(RolesSpec), factory=RolesSpec,
                            doc="long-timescale role conversion of local instances (workers/roles.py)")
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
    drain_timeout: float = spec(_duration(MAX_TIMEOUT_S, "1 day"), 600.0,
                                "after the last send, wait at most this long (real-world) for replies")
    request_timeout: float = spec(_duration(MAX_TIMEOUT_S, "1 day"), 600.0,
                                  "a request not finished after this long (real-world) fails")
    token_flush: float = spec(positive(_duration(60, "60s")), 0.5,
                              "decode workers send tokens after the first in chunks this often "
                              "(real-world); first and last tokens go at once, every token keeps "
                              "its own time stamp")
    kv_deadline: float = spec(_duration(MAX_TIMEOUT_S, "1 day"), 300.0,
                              "a KV transfer not finished this long (real-world) after prefill fails")
    max_requests: int = spec(integer(1, 10_000_000), MAX_REQUESTS_DEFAULT,
                             "refuse a workload of more requests than this (duration x rate, "
                             "requests, or trace rows); raise it for a long run on purpose")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SloSpec:
    """Service-level objectives, as `vllm bench serve --goodput` and aiperf define them: a request
    is good when it completed and meets every objective given (real-world times)."""
    ttft: float = spec(optional(positive(_duration(MAX_TIMEOUT_S, "1 day"))), None,
                       "time to first token at most this (real-world; at most 1 day)")
    tpot: float = spec(optional(positive(_duration(MAX_TIMEOUT_S, "1 day"))), None,
                       "time per output token after the first at most this (real-world)")
    e2el: float = spec(optional(positive(_duration(MAX_TIMEOUT_S, "1 day"))), None,
                       "end-to-end latency at most this (real-world; at most 1 day)")

    def objectives_ms(self):
        """{metric: limit in ms} of the objectives that are set."""
        return {k: getattr(self, k) * 1e3 for k in ("ttft", "tpot", "e2el")
                if getattr(self, k) is not None}


def _ray_address(value):
    """`host:port` of a Ray cluster's head (GCS), or `auto` (RAY_ADDRESS or a local cluster)."""
    v = string(value)
    if v == "auto":
        return v
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT of the Ray head (e.g. 10.0.0.1:6379) or auto, "
                         f"got {v!r}")
    return v


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """Where the deployment runs (testbed/backend/): one machine in Mininet hosts, or the hosts
    of a Ray cluster, placed by their `dc` node label (docs/cluster.md)."""
    kind: str = spec(choice("mininet", "ray", "sim"), "mininet",
                     "mininet: every instance in a Mininet host on this machine | ray: the hosts "
                     "of a Ray cluster labelled dc=prfaas / dc=local, the WAN shaped on their "
                     "NICs by a shaping agent per host (needs the [cluster] extra) | sim: virtual "
                     "time, the same decisions over models of the engines and the WAN "
                     "(docs/sim.md; no root)")
    address: str = spec(_ray_address, "auto", "ray: HOST:PORT of the Ray head, or auto")
    cpus: float = spec(at_most(positive(units.number), 1024, "1024"), 1.0,
                       "ray: logical CPUs requested per instance (prefill and decode on CUDA ask "
                       "for one GPU instead)")

    def check(self):
        if self.kind == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("kind: ray needs Ray, which is not installed: pip install "
                             "-e '.[cluster]'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Experiment:
    name: str = spec(path_component, doc="experiment name; results go to results/<name>/ (one "
                                         "directory name: no '/', '..' or control characters)")
    seed: int = spec(integer(0, 2**32 - 1), 1, "seed of every random choice (workload, jitter, loss)")
    requests: int = spec(optional(integer(1, 10_000_000)), None,
                         "number of requests to send (at most run.max_requests)")
    duration: float = spec(optional(positive(_duration(MAX_DURATION_S, "7 days"))), None,
                           "or: send for this long (real-world; at most 7 days)")
    scale: ScaleSpec = spec(section(ScaleSpec), factory=ScaleSpec, doc="time and byte scaling")
    model: ModelSpec = spec(section(ModelSpec), factory=ModelSpec, doc="the served model")
    clusters: ClustersSpec = spec(section(ClustersSpec), factory=ClustersSpec, doc="instances")
    network: NetworkSpec = spec(section(NetworkSpec), factory=NetworkSpec, doc="WAN and LAN links")
    scheduler: SchedulerSpec = spec(section(SchedulerSpec), factory=SchedulerSpec,
                                    doc="request routing")
    workload: WorkloadSpec = spec(section(WorkloadSpec), doc="what requests are sent")
    run: RunSpec = spec(section(RunSpec), factory=RunSpec, doc="timeouts of the run itself")
    slo: SloSpec = spec(section(SloSpec), factory=SloSpec,
                        doc="objectives for goodput and SLO attainment (none: no goodput)")
    faults: tuple = spec(list_of(section(FaultSpec)), (),
                         "injected failures: [{at: 30s, kind: pause, target: prfaas, duration: "
                         "20s}, ...] (testbed/faults.py; keys below)")
    cache: CacheSpec = spec(section(CacheSpec), factory=CacheSpec,
                            doc="hybrid prefix cache pool (docs/cache.md)")
    backend: BackendSpec = spec(section(BackendSpec), factory=BackendSpec,
                                doc="where the deployment runs: mininet (one machine) or ray "
                                    "(several hosts; docs/cluster.md)")
    label: str = spec(optional(path_component), None,
                      "name of this run in tables and its directory (default: the policy)")

    def check(self):
        if self.requests is not None and self.duration is not None:
            raise ValueError("give at most one of 'requests' or 'duration'")
        w = self.workload
        if self.requests is None and self.duration is None and w.arrival.process != "trace" \
                and "trace" not in (w.input.dist, w.output.dist):
            raise ValueError("give 'requests' or 'duration' (only a trace replay may omit both)")
        c, pol = self.clusters, self.scheduler.policy
        most = max(c.prfaas.instances, c.local.prefill, c.local.decode)
        if self.backend.kind != "sim" and most > MAX_HOST_PER_ROLE:
            raise ValueError(f"at most {MAX_HOST_PER_ROLE} instances per role on backend "
                             f"{self.backend.kind} (got {most}; interface names); backend sim "
                             f"takes up to {MAX_SIM_PER_ROLE}")
        if pol == "homogeneous" and c.local.prefill < 1:
            raise ValueError("policy homogeneous needs clusters.local.prefill >= 1")
        if pol == "naive" and c.prfaas.instances < 1:
            raise ValueError("policy naive needs clusters.prfaas.instances >= 1")
        if pol == "prfaas" and (c.prfaas.instances < 1 or c.local.prefill < 1):
            raise ValueError("policy prfaas needs clusters.prfaas.instances >= 1 and "
                             "clusters.local.prefill >= 1")
        if self.scheduler.roles.enabled:
            if pol != "prfaas" or c.local.instances < 2:
                raise ValueError("scheduler.roles needs policy prfaas and at least 2 local "
                                 "instances")
            if self.model.engine != "profile" or self.cache.enabled:
                raise ValueError("scheduler.roles needs model.engine profile and cache.enabled "
                                 "false (dual-role workers run the profile engines only)")

    def decode_model(self):
        """The decode step model (testbed.profile.DecodeModel) with this experiment's overrides,
        real-world seconds."""
        m = profiles.load(self.model.profile).decode.with_step(
            self.model.decode_step, self.model.bs_max, self.model.decode_kv_capacity)
        return m.constant() if self.model.decode_model == "constant" else m

    @property
    def run_label(self):
        return self.label or self.scheduler.policy


MAX_RATE_TRACE_BYTES = 1 << 20      # 1 MiB of time,rate rows
MIN_LOOP_PERIOD_S = 1.0              # a looped rate trace repeats at most once a second
MAX_LINK_CHANGES = 100_000           # scheduled changes + trace rows (after looping)


def read_rate_trace(path):
    """Rows (t_s, rate_bps), real-world, of a bandwidth trace CSV: `time,rate` per line with units
    ('60s,20Gbit'); '#' comments and one header line allowed; times must not decrease, rates
    must be above 0 (a link that is down is `up: false` in network.wan.changes)."""
    text = yamlload.read_text(path, "a rate trace (CSV of time,rate)", MAX_RATE_TRACE_BYTES,
                              key="network.wan.rate_trace.path")
    rows, header_seen = [], False
    for n, line in enumerate(text.splitlines(), 1):
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
        if t > MAX_DURATION_S:
            raise ConfigError(f"line {n}: time {cells[0]} is beyond 7 days (a hard limit)",
                              path=str(path))
        if r <= 0:
            raise ConfigError(f"line {n}: rate {cells[1]} is not above 0; a link that is down "
                              f"is network.wan.changes: [{{at: ..., up: false}}]", path=str(path))
        rows.append((t, r))
    if not rows:
        raise ConfigError("no time,rate rows", path=str(path))
    return rows


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


def _check_workload(exp, base, traces_read):
    """Request counts, spans and generator work within the caps; a workload trace's every line."""
    w, cap = exp.workload, exp.run.max_requests
    raise_cap = (f"run.max_requests ({cap:,}; raise it in the file if a run this long is "
                 f"meant)")
    trace = None
    if w.trace is not None:
        from testbed.workload import traces
        t = w.trace
        cache_key = (t.path, t.format, t.on_error, t.start, t.duration, t.max_requests,
                     t.max_input)
        if cache_key not in traces_read:
            traces_read[cache_key] = traces.load(t, base)
        trace = traces_read[cache_key]
    a = w.arrival
    if a.process == "trace":
        span = trace.span_s / w.trace.speedup
        n = len(trace) if exp.requests is None else exp.requests
        if exp.requests is not None and exp.requests > len(trace):
            raise ConfigError(f"{exp.requests} requests asked for, but workload.trace selects "
                              f"only {len(trace)} rows; lower 'requests' or widen the window",
                              key="requests")
    else:
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
            runs.append((d, dict(zip(keys, combo))))
    return runs


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
        exp, rate_rows = _resolve_rate_trace(exp, base)
        prof = profiles.load(exp.model.profile)
        for where, acc in (("clusters.prfaas.accelerator", exp.clusters.prfaas.accelerator),
                           ("clusters.local.accelerator", exp.clusters.local.accelerator)):
            if acc not in prof.prefill:
                raise ConfigError(f"profile {prof.name!r} has no accelerator {acc!r}; it has "
                                  f"{', '.join(prof.prefill)}", key=where)
        _check_link(exp, rate_rows)
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
    from testbed import deploy, faults, loadgen
    faults.check(exp, path)
    loadgen.check(exp, path)
    try:
        deploy.compile(exp)         # the emulated link, checked once where it is computed
    except ConfigError as e:
        if e.path:
            raise
        raise ConfigError(str(e), path=path) from None
    return dataclasses.replace(exp, label=label)


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
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        runs = [dataclasses.replace(r, label=f"{r.label}#{i}") for i, r in enumerate(runs)]
    return runs


def resolved(exp):
    """Plain-data form of an Experiment (written as config.yaml in the run directory)."""
    return to_dict(exp)


__all__ = ["Experiment", "load_experiment", "resolved", "expand", "validate", "set_dotted",
           "parse_override"]
