"""The `network:` section of an experiment: the WAN link model, in real-world units.

Direction names follow what crosses the link: `kv` is PrfaaS -> local (KV caches),
`request` is local -> PrfaaS (requests, ACKs). `network.wan` sets both; `network.wan.kv` and
`network.wan.request` override single keys for one direction. Scaling (`scale.time`,
`scale.bytes`) is applied by `testbed.config.Experiment.emulated_wan`, not here.
"""

import dataclasses

from testbed import units
from testbed.schema import boolean, choice, list_of, optional, section, spec, string


def _queue(value):
    """Queue limit: bytes ('256KiB') or packets ('100p', '100 packets'); None = one BDP."""
    if isinstance(value, str) and value.strip().rstrip("s").endswith(("p", "packet")):
        n = units.number(value.strip().rstrip("s").removesuffix("packet").removesuffix("p"))
        if n < 1 or not float(n).is_integer():
            raise ValueError(f"expected a whole number of packets, got {value!r}")
        return {"packets": int(n)}
    b = units.size_bytes(value)
    if b < 1500:
        raise ValueError(f"expected a queue of at least one 1500-byte packet, got {value!r}")
    return {"bytes": int(b)}


def _burst(value):
    """Mean loss burst length in packets, at least 1 (packets, so not scaled)."""
    n = units.number(value)
    if n < 1:
        raise ValueError(f"expected a mean burst of at least 1 packet, got {value!r}")
    return float(n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DirectionSpec:
    """Per-direction overrides; unset keys fall back to the `network.wan` values."""

    rate: float = spec(optional(units.rate_bps), None, "link rate, e.g. 100Gbit")
    delay: float = spec(optional(units.duration_s), None, "one-way propagation delay, e.g. 5ms")
    jitter: float = spec(optional(units.duration_s), None, "delay variation (std dev), e.g. 1ms")
    loss: float = spec(optional(units.probability), None, "random loss probability, e.g. 0.1%")
    loss_burst: float = spec(optional(_burst), None,
                             "mean loss burst in packets (Gilbert model), e.g. 4")
    queue: dict = spec(optional(_queue), None, "bottleneck drop-tail queue: bytes or '100p'")
    up: bool = spec(optional(boolean), None, "false starts the link down")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChangeSpec:
    """One scheduled change of the live link (failure injection, degradation)."""

    at: float = spec(units.duration_s, doc="when, real-world time after the first arrival, e.g. 30s")
    direction: str = spec(choice("kv", "request", "both"), "both", "which direction changes")
    rate: float = spec(optional(units.rate_bps), None, "new rate")
    delay: float = spec(optional(units.duration_s), None, "new one-way delay")
    jitter: float = spec(optional(units.duration_s), None, "new jitter")
    loss: float = spec(optional(units.probability), None, "new loss probability")
    up: bool = spec(optional(boolean), None, "false cuts the link, true restores it")

    def check(self):
        if all(getattr(self, k) is None for k in ("rate", "delay", "jitter", "loss", "up")):
            raise ValueError("a change needs at least one of rate, delay, jitter, loss, up")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RateTraceSpec:
    """A bandwidth trace (CSV of time,rate in real-world units) replayed during the run."""

    path: str = spec(string, doc="CSV file with rows time,rate (e.g. 0s,100Gbit); relative "
                                 "paths resolve against the experiment file's folder")
    direction: str = spec(choice("kv", "request", "both"), "kv", "which direction follows it")
    loop: bool = spec(boolean, False, "start over at the end (period = last row's time)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WanSpec:
    rate: float = spec(units.rate_bps, 100e9, "link rate in each direction (real-world), e.g. 100Gbit")
    delay: float = spec(units.duration_s, 0.0, "one-way propagation delay (real-world), e.g. 5ms")
    jitter: float = spec(units.duration_s, 0.0, "delay variation, standard deviation, e.g. 1ms")
    jitter_dist: str = spec(choice("normal", "pareto", "uniform"), "normal",
                            "distribution of the delay variation")
    reorder: bool = spec(boolean, False,
                         "let jittered packets overtake each other (false keeps FIFO order)")
    loss: float = spec(units.probability, 0.0, "random loss probability, e.g. 0.1%")
    loss_burst: float = spec(optional(_burst), None,
                             "losses come in bursts of this many packets on average (Gilbert "
                             "model, stationary loss = loss); null = independent losses")
    queue: dict = spec(optional(_queue), None,
                       "bottleneck drop-tail queue (bytes, or '100p' packets); default one BDP")
    up: bool = spec(boolean, True, "false starts the link down")
    backend: str = spec(choice("auto", "netem", "userspace"), "auto",
                        "auto: netem where the kernel has it, else the userspace delay line")
    kv: DirectionSpec = spec(section(DirectionSpec), factory=DirectionSpec,
                             doc="overrides for the PrfaaS -> local direction (KV cache)")
    request: DirectionSpec = spec(section(DirectionSpec), factory=DirectionSpec,
                                  doc="overrides for the local -> PrfaaS direction (requests, ACKs)")
    changes: tuple = spec(list_of(section(ChangeSpec)), (),
                          "scheduled link changes: [{at: 30s, up: false}, {at: 40s, up: true}]")
    rate_trace: RateTraceSpec = spec(optional(section(RateTraceSpec)), None,
                                     "a time,rate CSV replayed on the link during the run")

    def direction(self, name):
        """Resolved link parameters of one direction ('kv' or 'request') as a dict."""
        over = getattr(self, name)
        out = {}
        for key in ("rate", "delay", "jitter", "loss", "loss_burst", "queue", "up"):
            v = getattr(over, key)
            out[key] = getattr(self, key) if v is None else v
        out["jitter_dist"] = self.jitter_dist
        out["reorder"] = self.reorder
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class NetworkSpec:
    wan: WanSpec = spec(section(WanSpec), factory=WanSpec, doc="the cross-datacenter link")
    congestion_control: str = spec(choice("system", "cubic", "bbr", "reno"), "system",
                                   "TCP congestion control of the KV transfers and the link probe "
                                   "(system: the machine's default; metadata.json records it); "
                                   "BBR shrugs off random loss that collapses CUBIC")
