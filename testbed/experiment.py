"""The experiment description: the typed, immutable `Experiment` and its sections.

Place in the architecture: the description floor, above units/records and the sections other
modules own (`testbed.net.spec.NetworkSpec`, `testbed.workload.spec.WorkloadSpec`,
`testbed.faultspec.FaultSpec`), below `testbed.config` (which reads, expands and validates YAML
into these objects) and `testbed.deploy` (which compiles one into a `Deployment`). Nothing here
reads a file but the accelerator profile a section names.

Every value is real-world; `testbed.deploy` (through `testbed.scale.Scale`) is the one place
they become emulated. The resource caps below are hard limits (experiments/README.md lists
them); a key raises a few of them.
"""

import dataclasses
import importlib.metadata
import importlib.util
import math
import pathlib

from testbed import profile as profiles
from testbed import units, vllmspec
from testbed.faultspec import FaultSpec
from testbed.net.spec import NetworkSpec
from testbed.schema import (at_most, boolean, choice, integer, list_of, optional, path_component,
                            positive, section, spec, string)
from testbed.workload.spec import WorkloadSpec

# Resource caps (hard limits unless a key raises them; experiments/README.md lists them).
DAY_S = units.DAY_S
MAX_DURATION_S = units.MAX_DURATION_S   # `duration`, the span of arrivals, scheduled changes
MAX_TIMEOUT_S = DAY_S            # run.* timeouts
MAX_INTERVAL_S = 3600.0          # control and health-check periods
MAX_RUNS = 100                   # variants x sweep points of one file
MAX_REPLICATES = 50              # replicates of each of them
MAX_TOTAL_RUNS = 1000            # variants x sweep points x replicates
MAX_REQUESTS_DEFAULT = 100_000   # run.max_requests
MAX_PREFIX_BLOCK_IDS = 50_000_000  # synthetic prefix block ids of one workload (~400 MB)
MAX_ONOFF_CYCLES = 2_000_000     # on/off periods the generator may have to draw
MAX_TORCH_PARAMS = 100_000_000   # the torch engine's tiny model (~400 MB in float32)
MAX_HOST_PER_ROLE = 64           # instances per role on mininet and ray hosts
MAX_SIM_PER_ROLE = 32_000        # in the simulator (the address plan: deploy._ip)


def _duration(hi, what):
    return at_most(units.duration_s, hi, what)


AUTO = "auto"           # scale.time chosen by a pilot before the run (testbed/autoscale.py)
AUTO_START = 10.0       # the pilot's first scale.time; also what `auto` is compiled at beforehand


def _speedup(value):
    """scale.time: a number in [1e-3, 1000], or `auto`."""
    if value == AUTO:
        return AUTO
    return at_most(positive(units.number), 1000, "1000")(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleSpec:
    time: float | str = spec(_speedup, 1.0,
                             "emulate this many times faster than real time (at most 1000); "
                             "`auto`: a short pilot picks the largest faithful one on this "
                             "machine now (backend mininet, profile engine)")
    bytes: float = spec(at_most(positive(units.number), 1, "1"), 1.0,
                        "move this fraction of the real KV bytes (1e-3 = 1/1000; at most 1)")
    tokens: float = spec(at_most(positive(units.number), 1e6, "1e6"), 1.0,
                         "torch engine: divide prompt lengths by this (tiny model, long traces)")

    def check(self):
        if (self.time != AUTO and self.time < 1e-3) or self.bytes < 1e-9:
            raise ValueError("time must be at least 1e-3 and bytes at least 1e-9")


def _torch_config(value):
    """The torch engine's model shape, checked against the model's own config class: every key
    of the type of its default, integers in [1, 65536], at most MAX_TORCH_PARAMS weights."""
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of model config keys, got {value!r}")
    try:
        if importlib.util.find_spec("torch") is None:   # found without importing it (fast)
            raise ModuleNotFoundError("No module named 'torch'")
        from workers.model.config import HybridConfig   # torch engine only (optional torch)
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


def _profile_ref(value):
    """A shipped profile's name, or the path of a profile file (checked once resolved)."""
    if isinstance(value, str) and profiles.is_path(value):
        return value
    return path_component(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    profile: str = spec(_profile_ref, "kimi-linear-1t",
                        "accelerator profile: a name (testbed/profiles/NAME.yaml) or a profile "
                        "file's path ending .yaml (e.g. `testbed calibrate`'s --out; relative "
                        "to the experiment file's folder)")
    engine: str = spec(choice("profile", "torch", "vllm"), "profile",
                       "profile: workers wait the profiled time and send profiled KV bytes | "
                       "torch: a real tiny KDA+MLA hybrid computes and ships its real state | "
                       "vllm: real vLLM servers, KV through a KV connector (docs/vllm.md)")
    device: str = spec(choice("auto", "cpu", "cuda"), "auto",
                       "torch engine: where the model runs (auto = cuda when available)")
    torch: dict = spec(_torch_config, factory=dict,
                       doc="torch engine: model shape (HybridConfig keys: n_layers, d_model, ratio "
                           "'3:1', vocab, kda_heads, mla_latent, dtype float32|bfloat16, ...)")
    vllm: vllmspec.VllmSpec = spec(section(vllmspec.VllmSpec), factory=vllmspec.VllmSpec,
                                   doc="vllm engine: how each server starts")
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
        if not profiles.is_path(self.profile) and self.profile not in profiles.available():
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
                         "20s}, ...] (testbed/faultspec.py; keys below)")
    cache: CacheSpec = spec(section(CacheSpec), factory=CacheSpec,
                            doc="hybrid prefix cache pool (docs/cache.md)")
    backend: BackendSpec = spec(section(BackendSpec), factory=BackendSpec,
                                doc="where the deployment runs: mininet (one machine) or ray "
                                    "(several hosts; docs/cluster.md)")
    label: str = spec(optional(path_component), None,
                      "name of this run in tables and its directory (default: the policy)")
    replicates: int = spec(integer(1, MAX_REPLICATES), 1,
                           "runs of every variant and sweep point, each with its own seed (seed, "
                           "seed + 1, ... or `seeds`); tables then show the median and a 95% "
                           "confidence interval (t below 5 replicates, bootstrap from 5)")
    seeds: tuple = spec(optional(list_of(integer(0, 2**32 - 1))), None,
                        "the replicates' seeds, one per replicate (instead of seed + i)")
    load: float = spec(optional(at_most(positive(units.number), 5, "5")), None,
                       "offered load as a fraction of this run's predicted Lambda_max (E[T] "
                       "form): sets workload.arrival.rate (poisson, gamma or constant); sweep it "
                       "(`sweep: {load: [0.2, 0.4, ...]}`) for a load-latency curve")
    replicate: int = spec(integer(0, MAX_REPLICATES - 1), 0,
                          "which replicate this run is (0-based): written by the expansion of "
                          "`replicates`, read back from a run's config.yaml; not for files")

    def check(self):
        if self.seeds is not None and len(self.seeds) != self.replicates:
            raise ValueError(f"seeds: {len(self.seeds)} seeds for {self.replicates} replicates")
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds: two replicates with the same seed are one replicate twice")
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

        why = _auto_unsupported(self) or vllmspec.check(self)
        if why:
            raise ValueError(why)

    def decode_model(self):
        """The decode step model (testbed.profile.DecodeModel) with this experiment's overrides,
        real-world seconds."""
        m = profiles.load(self.model.profile).decode.with_step(
            self.model.decode_step, self.model.bs_max, self.model.decode_kv_capacity)
        return m.constant() if self.model.decode_model == "constant" else m

    def at_speed(self, time):
        """This experiment at `scale.time` `time` (a number: what `auto` resolves to)."""
        return dataclasses.replace(self, scale=dataclasses.replace(self.scale, time=time))

    @property
    def run_label(self):
        return self.label or self.scheduler.policy


def _auto_unsupported(exp):
    """Why `scale.time: auto` cannot apply to `exp` (one line), or ''."""
    kind, why = exp.backend.kind, {"sim": "runs in virtual time, where scale.time changes "
                                   "nothing", "ray": "has no pilot yet"}
    if exp.scale.time == AUTO and (kind != "mininet" or exp.model.engine == "vllm"):
        return ("scale.time auto: " + (f"backend {kind} {why.get(kind)}: give a number" if
                kind != "mininet" else "engine vllm computes at real speed: scale.time 1"))
    return ""


def cache_capacity(exp, prof, cluster):
    """Real-world bytes of one cluster's pool: `cache.capacity`, else the accelerator memory
    left after the weights on each instance x the cluster's instances (profile `memory`)."""
    if exp.cache.capacity is not None:
        return exp.cache.capacity
    c = getattr(exp.clusters, cluster)
    return prof.free_memory(c.accelerator) * c.instances
