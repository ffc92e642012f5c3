"""The worker contract: `WorkerRuntime`, what every worker process of a run reads.

`testbed.deploy.compile` builds it from an `Experiment` (the only place real-world values become
emulated ones, through `testbed.scale.Scale`); the runner writes it as `runtime.json` in the run
directory and each worker loads it back with `WorkerRuntime.load(path)`. The dataclasses are
frozen and typed; workers read attributes, never keys.

Units follow `testbed.scale`: a field suffixed `_s`, `_bytes` or `_bps` is *emulated*; a
real-world value says `real` in its name (`step_real_s`, `model_real`, `wan_rate_real_bps`).
Everything else is unitless (tokens, ratios, counts, names).

This module imports neither Mininet nor torch nor the experiment schema, so a worker (or any
other host of a multi-host backend) can load its runtime with nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import types
import typing

from testbed.profile import DecodeModel
from testbed.scale import Scale

GRPC_PORT, KV_PORT, CACHE_PORT, TOKEN_PORT, RPC_PORT = 50051, 50052, 50053, 50054, 50055


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstanceRuntime:
    """One placed process: its name, role, datacenter (`dc`: prfaas | local), accelerator,
    worker module (`workers.<worker>`), address and ports."""

    name: str
    role: str                       # prefill | decode | cachepool | scheduler | client
    dc: str
    accelerator: str = ""
    worker: str = ""                # module under workers/: the role, or dualrole
    ip: str = ""
    grpc_port: int = GRPC_PORT
    kv_port: int = KV_PORT
    cache_port: int = CACHE_PORT
    token_port: int = TOKEN_PORT    # a decode worker's token streams to clients (workers/tokens.py)
    # framed calls off gRPC (workers/framedrpc.py): the scheduler's Submit from the client,
    # a worker's Prefill and Decode from the scheduler
    rpc_port: int = RPC_PORT
    cache_capacity_bytes: int = 0   # a cache pool's capacity (emulated bytes)

    @property
    def module(self):
        return f"workers.{self.worker or self.role}"

    @property
    def addr(self):
        """host:port of its gRPC server."""
        return f"{self.ip}:{self.grpc_port}"

    @property
    def kv_addr(self):
        return f"{self.ip}:{self.kv_port}"

    @property
    def may_decode(self):
        """Decodes now, or may after a role conversion (a dual-role worker)."""
        return self.role == "decode" or self.worker == "dualrole"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeRuntime:
    step_s: float = 0.0             # T_decode, emulated
    step_real_s: float = 0.0        # T_decode, real-world
    bs_max: int = 1
    model_real: dict = dataclasses.field(default_factory=dict)   # testbed.profile.DecodeModel

    def model(self):
        """The decode step model (`testbed.profile.DecodeModel`), real-world seconds and bytes."""
        return DecodeModel(**self.model_real)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveRuntime:
    """The threshold controller (workers/adaptive.py), emulated seconds."""

    interval_s: float
    window_s: float
    dwell_s: float
    egress_high: float
    egress_low: float
    queue_ratio: float
    step: float
    min: int
    max: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolesRuntime:
    """The long timescale (workers/roles.py): emulated seconds; the planner's input real-world."""

    interval_s: float
    window_s: float
    min_requests: int
    cost_s: float
    gain: float
    retune: bool
    wan_rate_real_bps: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerRuntime:
    policy: str = "prfaas"
    threshold: int = 0
    placement: str = "least_loaded"
    failover: bool = False
    health_interval_s: float = 1.0
    health_timeout_s: float = 0.5
    failover_max_local: int | None = None
    adaptive: AdaptiveRuntime | None = None
    roles: RolesRuntime | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheRuntime:
    enabled: bool = False
    block: int = 512
    snapshot_every: int = 0
    transfer: str = "auto"
    headroom: float = 0.5
    s_kv_real: tuple = ()           # S_kv(l) = a + b*l coefficients, real-world bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontdoorRuntime:
    port: int = 8000
    max_context: int = 0
    model: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmRuntime:
    """engine vllm (workers/vllm_engine.py): how each server starts; real-world (scale 1)."""

    python: str = ""                # the vLLM venv's Python
    model_dir: str = ""
    dtype: str = "float32"
    max_model_len: int = 8192
    max_num_seqs: int = 8
    kv_cache_space_gib: float = 1.0
    cpus: str = "auto"
    connector: str = "NixlConnector"
    nixl_progress_delay_us: int = 1000
    shm_busy_loop_s: float = 0.0
    start_timeout_s: float = 600.0
    http_port: int = 8100           # on the instance's own IP
    side_port: int = 5600           # the connector's side channel (NIXL handshake)
    kv_events_port: int = 5557      # KV-event publisher (the scheduler's view subscribes)
    kv_replay_port: int = 5558      # its replay endpoint


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerRuntime:
    """runtime.json: every process of the run reads it; times emulated unless named `real`."""

    name: str = ""
    label: str = ""
    seed: int = 0
    scale: Scale = dataclasses.field(default_factory=Scale)
    profile: str = ""
    engine: str = "profile"
    device: str = "auto"
    torch: dict = dataclasses.field(default_factory=dict)     # HybridConfig keys (and seed)
    decode: DecodeRuntime = dataclasses.field(default_factory=DecodeRuntime)
    scheduler: SchedulerRuntime = dataclasses.field(default_factory=SchedulerRuntime)
    cache: CacheRuntime = dataclasses.field(default_factory=CacheRuntime)
    frontdoor: FrontdoorRuntime = dataclasses.field(default_factory=FrontdoorRuntime)
    vllm: VllmRuntime | None = None
    kv_deadline_s: float = 300.0
    token_flush_s: float = 0.05
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 600.0
    instances: dict = dataclasses.field(default_factory=dict)  # name -> InstanceRuntime
    run_dir: str = dataclasses.field(default="", compare=False)   # set by load(), not saved

    def instance(self, name):
        try:
            return self.instances[name]
        except KeyError:
            raise SystemExit(f"{name}: not in runtime.json") from None

    def of_role(self, *roles):
        return [i for i in self.instances.values() if i.role in roles]

    def pool(self, dc):
        """The cache pool of datacenter `dc`, or None (the cache is off)."""
        return next((i for i in self.of_role("cachepool") if i.dc == dc), None)

    @property
    def dir(self):
        return pathlib.Path(self.run_dir)

    # -- JSON
    def to_dict(self):
        d = dataclasses.asdict(self)
        d.pop("run_dir")
        return d

    def dump(self, path):
        pathlib.Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, d, run_dir=""):
        rt = build(cls, d)
        return dataclasses.replace(rt, run_dir=str(run_dir))

    @classmethod
    def load(cls, path):
        """runtime.json -> WorkerRuntime; `run_dir` is the file's folder."""
        p = pathlib.Path(path)
        return cls.from_dict(json.loads(p.read_text()), p.parent)


_INSTANCE_MAPS = {(WorkerRuntime, "instances"): InstanceRuntime}


@functools.cache
def _shape(cls):
    """(type hints, field names) of a dataclass: resolved once per class, not per instance
    (a 96-instance runtime.json built 104 dataclasses, and `typing.get_type_hints` for each
    took 17 of a worker's ~50 ms of start-up CPU)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls))


def build(cls, d):
    """A dataclass from plain data (JSON), nested dataclasses, optionals and the instance map
    included; unknown keys are refused so a stale runtime.json fails at load, not mid-run."""
    hints, names = _shape(cls)
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {', '.join(sorted(unknown))}")
    kw = {}
    for k, v in d.items():
        item = _INSTANCE_MAPS.get((cls, k))
        if item is not None:
            kw[k] = {n: v2 if isinstance(v2, item) else build(item, {"name": n, **v2})
                     for n, v2 in v.items()}
        else:
            kw[k] = _value(hints[k], v)
    return cls(**kw)


def _value(tp, v):
    if v is None:
        return None
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp) and isinstance(v, dict):
        return build(tp, v)
    if tp is tuple and isinstance(v, list):
        return tuple(v)
    return v
