"""The `network:` section of an experiment: the WAN link model, in real-world units.

Direction names follow what crosses the link: `kv` is PrfaaS -> local (KV caches),
`request` is local -> PrfaaS (requests, ACKs). `network.wan` sets both; `network.wan.kv` and
`network.wan.request` override single keys for one direction. Scaling (`scale.time`,
`scale.bytes`) is applied by `testbed.deploy.compile` (the deployment's `links`), not here.
"""

import dataclasses
import glob
import gzip
import os
import platform

from testbed import units
from testbed.errors import ConfigError
from testbed.net.linkmodel import STEADY_KEYS, gilbert, path_mtu, queue_limit
from testbed.net.linkmodel import reorder_gap as _gap
from testbed.net.wan import probe_backend
from testbed.schema import boolean, choice, list_of, optional, section, spec, string

MAX_DELAY_S = 10.0                  # one-way delay or jitter, real-world (a hard limit)
MAX_QUEUE_BYTES = 256 * 1024**2     # emulated bottleneck queue: kernel memory (a hard limit)
MAX_QUEUE_PACKETS = 100_000         # emulated, in packets (~150 MB of full frames)


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
class SteadyFaults:
    """The steady faults and path limits of a direction, a change or the whole WAN (unset:
    none, gap 1, ICMP on)."""

    corrupt: float = spec(optional(units.probability), None,
                          "probability a packet gets a bit flipped (receiver's checksum drops it)")
    duplicate: float = spec(optional(units.probability), None, "probability a packet is sent twice")
    reorder_prob: float = spec(optional(units.probability), None,
                               "probability a packet is sent ahead of those held (netem's reorder)")
    reorder_gap: int = spec(optional(_gap), None, "netem's gap: packets delayed between reorders")
    mtu: int = spec(optional(path_mtu), None,
                    "path MTU at the WAN router, bytes 552..1500 (not scaled), e.g. 1280")
    mtu_icmp: bool = spec(optional(boolean), None,
                          "false: the router drops above mtu without ICMP fragmentation-needed "
                          "(the PMTU blackhole); default true")
    police: float = spec(optional(units.rate_bps), None,
                         "token-bucket policer: drops above this rate (IP bytes), e.g. 40Gbit")
    police_burst: int = spec(optional(units.size_bytes), None,
                             "the policer's bucket (bytes, real-world); default 10 ms of its rate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DirectionSpec(SteadyFaults):
    """Per-direction overrides; unset keys fall back to the `network.wan` values."""

    rate: float = spec(optional(units.rate_bps), None, "link rate, e.g. 100Gbit")
    delay: float = spec(optional(units.duration_s), None, "one-way propagation delay, e.g. 5ms")

    def check(self):
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate: expected a rate above 0 (a link that is down is up: false)")
    jitter: float = spec(optional(units.duration_s), None, "delay variation (std dev), e.g. 1ms")
    loss: float = spec(optional(units.probability), None, "random loss probability, e.g. 0.1%")
    loss_burst: float = spec(optional(_burst), None,
                             "mean loss burst in packets (Gilbert model), e.g. 4")
    queue: dict = spec(optional(_queue), None, "bottleneck drop-tail queue: bytes or '100p'")
    up: bool = spec(optional(boolean), None, "false starts the link down")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChangeSpec(SteadyFaults):
    """One scheduled change of the live link (failure injection, degradation)."""

    at: float = spec(units.duration_s, doc="when, real-world time after the first arrival, e.g. 30s")
    direction: str = spec(choice("kv", "request", "both"), "both", "which direction changes")
    rate: float = spec(optional(units.rate_bps), None, "new rate")
    delay: float = spec(optional(units.duration_s), None, "new one-way delay")
    jitter: float = spec(optional(units.duration_s), None, "new jitter")
    loss: float = spec(optional(units.probability), None, "new loss probability")
    up: bool = spec(optional(boolean), None, "false cuts the link, true restores it")

    def check(self):
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate 0 does not cut the link: write `up: false` to take it down "
                             "(and `up: true` later to restore it)")
        if all(getattr(self, k) is None for k in ("rate", "delay", "jitter", "loss", "up",
                                                  *STEADY_KEYS)):
            raise ValueError("a change needs at least one of rate, delay, jitter, loss, up, "
                             + ", ".join(STEADY_KEYS))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RateTraceSpec:
    """A bandwidth trace (CSV of time,rate in real-world units) replayed during the run."""

    path: str = spec(string, doc="CSV file with rows time,rate (e.g. 0s,100Gbit); relative "
                                 "paths resolve against the experiment file's folder")
    direction: str = spec(choice("kv", "request", "both"), "kv", "which direction follows it")
    loop: bool = spec(boolean, False, "start over at the end (period = last row's time)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WanSpec(SteadyFaults):
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

    def check(self):
        if self.rate <= 0:
            raise ValueError("rate: expected a rate above 0 (a link that starts down is "
                             "up: false)")

    def direction(self, name):
        """Resolved link parameters of one direction ('kv' or 'request') as a dict."""
        over = getattr(self, name)
        out = {}
        for key in ("rate", "delay", "jitter", "loss", "loss_burst", "queue", "up", *STEADY_KEYS):
            v = getattr(over, key)
            out[key] = getattr(self, key) if v is None else v
        out["reorder_gap"] = out["reorder_gap"] or 1
        out.update({k: out[k] or 0.0 for k in STEADY_KEYS[:3]})
        out.update(mtu=out["mtu"] or 0, police=out["police"] or 0.0,
                   mtu_icmp=True if out["mtu_icmp"] is None else out["mtu_icmp"])
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


# ---------------------------------------------------------------- checks on paper (config.validate)

def check_delay(delay, jitter, key):
    """Real-world one-way delay and jitter within MAX_DELAY_S."""
    for name, v in (("delay", delay), ("jitter", jitter)):
        if v > MAX_DELAY_S:
            raise ConfigError(f"{name} {units.fmt_duration(v)} is above {MAX_DELAY_S:g} s, the "
                              f"longest one-way {name} the link emulation holds (a hard limit)",
                              key=f"{key}.{name}")


def check_loss(loss, burst, key):
    """Loss in bursts must be reachable by a Gilbert chain: loss < 1, p(good->bad) <= 1."""
    if burst is None or not loss:
        return
    if loss >= 1 or gilbert(loss, burst)[0] > 1:
        raise ConfigError(f"loss {loss:.4g} in bursts of {burst:g} packets is impossible (the "
                          f"good->bad probability would exceed 1); use a lower loss or longer "
                          f"bursts (loss <= burst / (burst + 1))", key=f"{key}.loss_burst")


def check_queue(queue, rate_bps, rtt_s, key):
    """The emulated queue (given, or the default BDP) within what the kernel can hold.

    bfifo/pfifo limits and netem's `limit` are u32 in the kernel; the caps here are far below
    that and bound kernel memory."""
    kind, n = queue_limit(queue, rate_bps, rtt_s)
    given = "" if queue is not None else " (the default, one bandwidth-delay product)"
    if kind == "bfifo" and n > MAX_QUEUE_BYTES:
        raise ConfigError(f"emulated queue of {n:,} bytes{given} is above {MAX_QUEUE_BYTES:,} "
                          f"bytes (256 MiB, a hard limit); give a smaller network.wan.queue or "
                          f"lower scale.bytes", key=key)
    if kind == "pfifo" and n > MAX_QUEUE_PACKETS:
        raise ConfigError(f"queue of {n:,} packets is above {MAX_QUEUE_PACKETS:,} (a hard "
                          f"limit)", key=key)


def netem_in_kernel():
    """True/False when the running kernel's config says whether it has netem; None: unknown.

    Cheap and unprivileged: /proc/config.gz or /boot/config-RELEASE, then modules.builtin and
    the module tree. `testbed.net.wan.probe_backend` is the authoritative (root) probe."""
    release = platform.release()
    for path in ("/proc/config.gz", f"/boot/config-{release}"):
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt", errors="replace") as f:
                for line in f:
                    if line.startswith("CONFIG_NET_SCH_NETEM="):
                        value = line.strip().split("=", 1)[1]
                        # built in, or a module (absent only when the module tree says so)
                        return value == "y" or (value == "m"
                                                and _netem_module(release) is not False)
                    if line.startswith("# CONFIG_NET_SCH_NETEM is not set"):
                        return False
        except OSError:
            continue
    return _netem_module(release)


def _netem_module(release):
    base = f"/lib/modules/{release}"
    if not os.path.isdir(base):
        return None
    try:
        with open(f"{base}/modules.builtin") as f:
            if any("sch_netem" in line for line in f):
                return True
    except OSError:
        pass
    return bool(glob.glob(f"{base}/kernel/net/sched/sch_netem.ko*"))


def check_backend(wan):
    """A forced backend must exist here, and burst loss needs the userspace one."""
    bursts = [f"network.wan.{d}" for d in ("kv", "request")
              if wan.direction(d)["loss_burst"] is not None]
    if wan.backend == "netem":
        have = netem_in_kernel()
        if have is None and os.geteuid() == 0:
            have = probe_backend()[0] == "netem"
        if have is False:
            raise ConfigError(f"backend netem requested, but this kernel ({platform.release()}) "
                              f"has no netem qdisc; use backend: auto or userspace",
                              key="network.wan.backend")
    if bursts and (wan.backend == "netem" or (wan.backend == "auto" and netem_in_kernel())):
        raise ConfigError("burst loss (loss_burst) needs the userspace backend (pyroute2 cannot "
                          "encode netem's gemodel); set network.wan.backend: userspace",
                          key=f"{bursts[0]}.loss_burst")
