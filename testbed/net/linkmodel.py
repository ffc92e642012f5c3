"""The WAN link model: one direction's parameters, checked once, and the arithmetic of the
queues that carry it. Pure: no kernel objects, no processes (unit-tested without root).

Place in the architecture: `testbed.deploy.compile` turns the experiment's real-world `network:`
section into one emulated `Link` per direction through `check_params`, the one checker; the
shaper (`testbed.net.wan.Wan`) accepts only `Link`s and builds them as

    random loss (independent, or in bursts from a Gilbert chain when `loss_burst` is set)
    -> delay line (delay + jitter, FIFO unless `reorder`)
    -> bottleneck: an HTB class at `rate` whose child is a drop-tail queue of `queue` bytes
       or packets (default one bandwidth-delay product).

HTB's burst is computed from the rate (`htb_burst_bytes`): pyroute2's default (rate/HZ + MTU)
is far too small above 1 Gbit/s.
"""

from __future__ import annotations

import dataclasses
import math

from testbed import units
from testbed.errors import ConfigError

DIRECTIONS = ("kv", "request")
FRAME_BYTES = 1514          # Ethernet frame of a full-MTU packet, what the qdiscs count
BURST_S = 0.001             # HTB burst = 1 ms of line rate (enough for the 10 Gbit/s ceiling here)
MIN_BURST_BYTES = 2 * FRAME_BYTES
# The default queue never drops below 96 KiB: senders with TSO hand the router 64 KiB GSO
# bursts at once (veth does not pace them), and a queue smaller than one burst drops all of it
# (measured: 12 KiB at 1 Gbit/s, 0 ms gave 0.3% of the rate; 96 KiB gave 95%).
MIN_QUEUE_BYTES = 96 * 1024
STEADY_FAULTS = ("corrupt", "duplicate", "reorder_prob")   # probabilities (docs/link.md)
# the router's path limits (testbed.net.pathlimit): a path MTU, with or without ICMP
# "fragmentation needed", and a token-bucket policer (rate bit/s, burst bytes)
PATH_KEYS = ("mtu", "mtu_icmp", "police", "police_burst")
STEADY_KEYS = (*STEADY_FAULTS, "reorder_gap", *PATH_KEYS)  # the YAML's and the shaper's keys
SETTABLE = ("rate", "delay", "jitter", "loss", "loss_burst", "up", "queue", *STEADY_KEYS)
MTU_RANGE = (552, 1500)     # Linux's min_pmtu .. the hosts' own MTU (packets: not scaled)
POLICE_BURST_S = 0.010      # default policer burst: 10 ms of its rate, at least two frames
MAX_REORDER_GAP = 1_000_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """One WAN direction as the shaper runs it (emulated), made by `check_params` only."""

    rate_bps: float
    delay_s: float = 0.0
    jitter_s: float = 0.0
    jitter_dist: str = "normal"
    reorder: bool = False
    loss: float = 0.0
    loss_burst: float | None = None      # packets: not scaled
    queue: dict | None = None            # {"bytes": emulated} or {"packets": n}; None: one BDP
    up: bool = True
    corrupt: float = 0.0                 # a bit flipped (the receiver's checksum drops it)
    duplicate: float = 0.0
    reorder_prob: float = 0.0            # netem's reorder P gap G: sent at once, overtaking
    reorder_gap: int = 1
    mtu: int = 0                         # path MTU at the router (0: the interfaces' own)
    mtu_icmp: bool = True                # false: no ICMP "fragmentation needed" (PMTU blackhole)
    police: float = 0.0                  # policer rate, bit/s (0: none)
    police_burst: int = 0                # policer bucket, bytes

    def params(self) -> dict:
        """The shaper's keyword form (the keys of `Wan.set` and of scheduled changes)."""
        return {"rate": self.rate_bps, "delay": self.delay_s, "jitter": self.jitter_s,
                "loss": self.loss, "loss_burst": self.loss_burst,
                "queue": dict(self.queue) if self.queue else None, "up": self.up,
                "jitter_dist": self.jitter_dist, "reorder": self.reorder,
                "corrupt": self.corrupt, "duplicate": self.duplicate,
                "reorder_prob": self.reorder_prob, "reorder_gap": self.reorder_gap,
                "mtu": self.mtu, "mtu_icmp": self.mtu_icmp, "police": self.police,
                "police_burst": self.police_burst}

    def changed(self, direction: str, **changes) -> Link:
        """This link with `changes` (the shaper's keys) applied, checked like any other."""
        return check_params({**self.params(), **changes}, direction)


# ---------------------------------------------------------------- checking

def check_params(p: dict, direction: str = "wan") -> Link:
    """The checked `Link` of one direction's emulated parameters in the shaper's keys (`rate`,
    `delay`, ...; numbers or unit strings such as '50Mbit'). The one checker of a link.

    Raises ConfigError naming the key; fills `jitter_dist`, `reorder`, `up`, `queue` defaults.
    """
    out = {"delay": 0.0, "jitter": 0.0, "loss": 0.0, "queue": None, "up": True,
           "jitter_dist": "normal", "reorder": False, "loss_burst": None, "corrupt": 0.0,
           "duplicate": 0.0, "reorder_prob": 0.0, "reorder_gap": 1, "mtu": 0, "mtu_icmp": True,
           "police": 0.0, "police_burst": 0}
    out.update(p or {})
    key = f"network.wan.{direction}"
    if "rate" not in out or out["rate"] is None:
        raise ConfigError("expected a rate in bit/s", key=f"{key}.rate")
    for name, parse in (("rate", units.rate_bps), ("delay", units.duration_s),
                        ("jitter", units.duration_s), ("loss", units.probability),
                        *((k, units.probability) for k in STEADY_FAULTS)):
        try:
            out[name] = float(parse(out[name]))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e), key=f"{key}.{name}") from None
    if out["rate"] < 8e3:
        raise ConfigError(f"expected a rate of at least 8 kbit/s, got {out['rate']:g}",
                          key=f"{key}.rate")
    if out["delay"] < 0 or out["jitter"] < 0:
        raise ConfigError("expected a delay and jitter of at least 0", key=key)
    q = out["queue"]
    if q is not None and not (isinstance(q, dict) and len(q) == 1
                              and next(iter(q)) in ("bytes", "packets")
                              and int(next(iter(q.values()))) >= 1):
        raise ConfigError(f"expected {{'bytes': N}} or {{'packets': N}}, got {q!r}",
                          key=f"{key}.queue")
    if out["jitter_dist"] not in ("normal", "pareto", "uniform"):
        raise ConfigError(f"expected normal, pareto or uniform, got {out['jitter_dist']!r}",
                          key=f"{key}.jitter_dist")
    if out["loss_burst"] is not None:
        try:
            out["loss_burst"] = float(units.number(out["loss_burst"]))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e), key=f"{key}.loss_burst") from None
        if out["loss_burst"] < 1:
            raise ConfigError(f"expected a mean burst of at least 1 packet, got "
                              f"{out['loss_burst']:g}", key=f"{key}.loss_burst")
        if out["loss"] > 0 and (out["loss"] >= 1
                                or gilbert(out["loss"], out["loss_burst"])[0] > 1):
            raise ConfigError(f"loss {out['loss']:g} with bursts of {out['loss_burst']:g} "
                              f"packets needs a good->bad probability above 1; use longer bursts",
                              key=f"{key}.loss_burst")
    out["reorder_gap"] = _gap(out["reorder_gap"], key)
    _check_path_limits(out, key)
    return Link(mtu=out["mtu"], mtu_icmp=out["mtu_icmp"], police=out["police"],
                police_burst=out["police_burst"], corrupt=out["corrupt"], duplicate=out["duplicate"],
                reorder_prob=out["reorder_prob"], reorder_gap=out["reorder_gap"],
                rate_bps=out["rate"], delay_s=out["delay"], jitter_s=out["jitter"],
                jitter_dist=out["jitter_dist"], reorder=bool(out["reorder"]), loss=out["loss"],
                loss_burst=out["loss_burst"], queue=dict(q) if q else None, up=bool(out["up"]))


def path_mtu(value):
    """A path MTU in bytes (YAML), MTU_RANGE[0]..MTU_RANGE[1] (a packet size: not scaled)."""
    n = float(units.number(value))
    lo, hi = MTU_RANGE
    if not n.is_integer() or not lo <= n <= hi:
        raise ValueError(f"expected a whole number of bytes {lo}..{hi} (Linux's smallest path "
                         f"MTU .. the hosts' own), got {value!r}")
    return int(n)


def default_police_burst(rate_bps):
    """The policer's bucket when none is given: POLICE_BURST_S of its rate, at least two
    full frames (bytes)."""
    return int(max(rate_bps / 8 * POLICE_BURST_S, MIN_BURST_BYTES))


def _check_path_limits(out, key):
    """mtu (0: none), mtu_icmp, police (bit/s, 0: none) and police_burst (bytes, 0: the
    default) of `check_params`'s dict, in place."""
    try:
        out["mtu"] = path_mtu(out["mtu"]) if out["mtu"] else 0
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), key=f"{key}.mtu") from None
    if not isinstance(out["mtu_icmp"], bool):
        raise ConfigError(f"expected true or false, got {out['mtu_icmp']!r}", key=f"{key}.mtu_icmp")
    try:
        out["police"] = float(units.rate_bps(out["police"])) if out["police"] else 0.0
        burst = int(units.size_bytes(out["police_burst"])) if out["police_burst"] else 0
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), key=f"{key}.police") from None
    if out["police"] and out["police"] < 8e3:
        raise ConfigError(f"expected a policer rate of at least 8 kbit/s, got "
                          f"{out['police']:g}", key=f"{key}.police")
    if out["police"] and burst and burst < FRAME_BYTES:
        raise ConfigError(f"a policer bucket of {burst} bytes (emulated) passes no full frame "
                          f"({FRAME_BYTES} bytes); raise police_burst (or scale.bytes)",
                          key=f"{key}.police_burst")
    out["police_burst"] = (burst or default_police_burst(out["police"])) if out["police"] else 0


def reorder_gap(value):
    """netem's reorder gap (YAML): a whole number of packets, 1..MAX_REORDER_GAP (not scaled)."""
    n = float(units.number(value))
    if not n.is_integer() or not 1 <= n <= MAX_REORDER_GAP:
        raise ValueError(f"expected a whole number of packets 1..{MAX_REORDER_GAP}, got "
                         f"{value!r}")
    return int(n)


def _gap(value, key):
    """netem's reorder gap: a whole number of packets, 1..MAX_REORDER_GAP."""
    try:
        return reorder_gap(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), key=f"{key}.reorder_gap") from None


def steady_faults(link: Link) -> bool:
    """True when `link` corrupts, duplicates or reorders packets."""
    return any(getattr(link, k) > 0 for k in STEADY_FAULTS)


# ---------------------------------------------------------------- queue arithmetic

def htb_burst_bytes(rate_bps):
    """HTB burst (= cburst) in bytes for `rate_bps`: 1 ms of line rate, at least two frames."""
    return int(max(rate_bps / 8 * BURST_S, MIN_BURST_BYTES))


def htb_quantum_bytes(rate_bps):
    """DRR quantum of the one HTB class: rate/r2q clamped to what HTB accepts without warning."""
    return int(min(max(rate_bps / 8 / 10, FRAME_BYTES), 200_000))


def default_queue_bytes(rate_bps, rtt_s):
    """One bandwidth-delay product (rate x round-trip propagation delay), at least 96 KiB."""
    return int(max(rate_bps / 8 * rtt_s, MIN_QUEUE_BYTES))


def queue_limit(queue, rate_bps, rtt_s):
    """('bfifo', bytes) or ('pfifo', packets) for a queue spec ({'bytes'|'packets': n} or None)."""
    if queue is None:
        return "bfifo", default_queue_bytes(rate_bps, rtt_s)
    if "packets" in queue:
        return "pfifo", int(queue["packets"])
    return "bfifo", int(queue["bytes"])


def queue_packets(queue, rate_bps, rtt_s):
    """The queue limit expressed in full-size packets (netem's `limit` and delay-line sizing)."""
    kind, n = queue_limit(queue, rate_bps, rtt_s)
    return n if kind == "pfifo" else max(1, math.ceil(n / FRAME_BYTES))


def gilbert(loss, burst):
    """(p_gb, p_bg) of a Gilbert chain (good state never drops, bad state always does) whose
    stationary loss is `loss` and whose loss bursts last `burst` packets on average.

    Bursts are geometric: each bad packet stays bad with 1 - p_bg, so the mean is 1 / p_bg; the
    bad state's share is p_gb / (p_gb + p_bg) = loss."""
    p_bg = 1.0 / burst
    return loss * p_bg / (1.0 - loss), p_bg


def burst_loss(link: Link) -> bool:
    """True when `link` asks for Gilbert burst loss (a loss_burst and a loss above 0)."""
    return link.loss_burst is not None and link.loss > 0


def other_direction(direction):
    """The WAN's other direction (kv <-> request)."""
    return DIRECTIONS[1 - DIRECTIONS.index(direction)]


def needs_delayline(link: Link) -> bool:
    """True when the userspace backend needs the delay line: delay, jitter or burst loss."""
    return link.delay_s > 0 or link.jitter_s > 0 or burst_loss(link) or steady_faults(link)


def needs_per_frame_packets(links: dict) -> bool:
    """True when loss (or a policer, which drops too) is configured in any direction (`links`:
    direction -> Link): drops must hit single frames.

    Senders with TSO/GSO hand the router 64 KiB bursts that the loss rule (and the delay line)
    see as one packet; dropping a whole burst is one loss event for TCP where a real link drops
    single frames, so TCP under loss would look far better than it is. With loss configured the
    builders turn segmentation offload off on the end hosts (`ns.disable_offloads`), at the price
    of per-frame work in the delay line (about 0.6 Gbit/s at most here instead of ~1).
    """
    return any(drops_frames(lk) for lk in links.values())


def drops_frames(x) -> bool:
    """Whether a Link, a scheduled change or a link fault's spec sets anything that drops or
    alters single frames (loss, burst loss, corruption, duplication, a policer)."""
    return any(getattr(x, k, None) for k in ("loss", "loss_burst", "corrupt", "duplicate",
                                             "police"))


def needs_checksums(links: dict) -> bool:
    """True when any direction corrupts or duplicates packets: the end hosts then compute
    checksums themselves (tx offload off: a duplicate sent again from the router carries what
    the sender wrote, which with offload is only the pseudo-header's part) and check them (rx
    offload off: a corrupted packet is dropped, not taken as good)
    (`testbed.net.ns.disable_checksum_offload`)."""
    return any(lk.corrupt or lk.duplicate for lk in links.values())
