"""The WAN as a flow-level (fluid) model: what the shaped link does to concurrent KV transfers.

    deploy (Deployment.links, .link_changes) -> wan (this) <- cluster (one flow per transfer)

One `LinkModel` per direction (`kv`: PrfaaS -> local, `request`: local -> PrfaaS) and one per
datacenter fabric (unshaped, `FABRIC_RATE_BPS`). Every value is emulated, as the Deployment
holds it, so the run directory reads as an emulated run's does. Terms (each can be turned off,
`Terms`, to show what it contributes; docs/sim.md):

- `share`: the transfers with bytes to send share the bottleneck rate max-min fairly
  (processor sharing: n backlogged flows get rate / n each, or their cap if lower). Each KV
  transfer is its own TCP connection in the emulation (workers/kvwire.SenderPool checks one
  out per request), so one flow per transfer.
- `propagation`: a byte leaving the sender arrives `delay_s` later.
- `jitter`: each transfer's last byte gets one draw of the configured jitter (normal, sigma =
  jitter; uniform in [-jitter, jitter]; pareto scaled to jitter), delay kept >= 0.
- `queue`: while the link is saturated, TCP keeps the drop-tail queue full: its drain time
  (queue bytes / rate) adds to the delivery delay and to the round trip.
- `framing`: the shaper counts and limits frames, not payload: each MSS of 1448 payload bytes
  is a 1514-byte Ethernet frame on the link, so a flow's payload moves at 1448/1514 of its
  rate, and the byte counter (timeseries.csv) counts frames' bytes, as the router's does.
- `loss_cap`: with random loss p, each flow's rate is capped by the Mathis et al. (1997)
  steady-state TCP rate, rate = MSS / (RTT * sqrt(2p/3)) (bytes/s; MSS 1448 bytes, RTT = both
  directions' delays plus the queue's drain time).

Not modelled (where the emulation will differ): slow start and the congestion window's growth
after idle, RTO timing and retransmission stalls, loss bursts (Gilbert), reordering, the
sender's socket buffer, packet-level burstiness of TSO and the HTB burst.
`up: false` stops every flow (rate 0) until the link comes back; a rate change reshapes every
flow at once.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

from testbed.net.linkmodel import FRAME_BYTES, queue_limit

MSS_BYTES = 1448
# Intra-datacenter: Mininet's unshaped veth pairs through a software bridge. Its rate on this
# machine is CPU-bound (several Gbit/s); emulated KV bytes within a datacenter are small, so the
# figure matters little; docs/sim.md.
FABRIC_RATE_BPS = 8e9
_EPS = 1e-9
DRAINED_S = 1e-9


@dataclasses.dataclass(frozen=True)
class Terms:
    """Which terms of the link model are on (all by default)."""
    share: bool = True
    propagation: bool = True
    jitter: bool = True
    queue: bool = True
    framing: bool = True
    loss_cap: bool = True

    @classmethod
    def parse(cls, off):
        """Terms with the names in `off` (iterable of str) turned off; ValueError for others."""
        names = {f.name for f in dataclasses.fields(cls)}
        bad = set(off) - names
        if bad:
            raise ValueError(f"unknown model term {', '.join(sorted(bad))}; expected "
                             f"{', '.join(sorted(names))}")
        return cls(**{n: False for n in off})


def mathis_rate_bps(rtt_s, loss, mss_bytes=MSS_BYTES):
    """Loss-limited TCP rate, Mathis et al. 1997: MSS / (RTT * sqrt(2p/3)), in bit/s; inf
    without loss."""
    if loss <= 0 or rtt_s <= 0:
        return math.inf
    return 8.0 * mss_bytes / (rtt_s * math.sqrt(2.0 * loss / 3.0))


class Flow:
    """One transfer: bytes handed to it arrive in pieces (`LinkModel.push`); once the last
    piece has left the sender, `on_done(first_arrival, last_sent, last_arrival)` is called
    (virtual times: the first byte's arrival, the last byte's departure and arrival)."""

    __slots__ = ("end", "active", "last", "first_sent", "on_done", "jitter_s")

    def __init__(self, on_done, jitter_s=0.0):
        self.end = 0.0              # the link's service count at which its backlog is sent
        self.active = False
        self.last = False
        self.first_sent = None
        self.on_done = on_done
        self.jitter_s = jitter_s


class LinkModel:
    """One direction of the WAN (or a fabric): a bottleneck of `rate_bps` shared by its flows.

    Every backlogged flow gets the same rate (one cap for all: the same round trip and loss),
    so the link keeps one service count `served` (payload bytes each backlogged flow has sent
    so far) and each flow the count at which its backlog will be gone (`Flow.end`): the next
    flow to drain is the least `end`, on a heap, and an event costs O(log n) whatever the
    number of concurrent transfers."""

    def __init__(self, loop, link, rng=None, terms=Terms(), reverse_delay_s=0.0):
        """`link`: a `testbed.net.linkmodel.Link` (emulated), or None for a fabric;
        `reverse_delay_s`: the other direction's one-way delay (the round trip's other half)."""
        self.loop, self.rng, self.terms = loop, rng, terms
        self.reverse_delay_s = reverse_delay_s
        self.rate_bps = link.rate_bps if link else FABRIC_RATE_BPS
        self.delay_s = link.delay_s if link else 0.0
        self.jitter_s = link.jitter_s if link else 0.0
        self.jitter_dist = link.jitter_dist if link else "normal"
        self.loss = link.loss if link else 0.0
        self.up = link.up if link else True
        self.queue = link.queue if link else None
        self.n = 0                  # flows with bytes to send
        self.heap = []              # (end, seq, flow); stale entries skipped
        self.served = 0.0
        self.flow_bps = 0.0         # each backlogged flow's rate on the wire
        self.tx_bytes = 0.0         # frame bytes that left the sender side (the router's count)
        # Payload bytes per byte on the wire (TCP/IP and Ethernet headers of a full frame).
        self.payload_share = MSS_BYTES / FRAME_BYTES if terms.framing else 1.0
        self.t = loop.now()
        self._seq = 0
        self._gen = 0
        self._unstarted = []        # flows pushed while the link carried nothing
        self._queue_bytes = None    # of the parameters in force (set() clears it)

    # ---- parameters ----
    def queue_bytes(self):
        # Asked at every drain; the parameters change only in set(): computed once per change
        if self._queue_bytes is None:
            kind, n = queue_limit(self.queue, self.rate_bps, self.delay_s + self.reverse_delay_s)
            self._queue_bytes = n * FRAME_BYTES if kind == "pfifo" else n
        return self._queue_bytes

    def saturated(self):
        """The flows together ask for the whole rate (TCP then keeps the queue full)."""
        return self.n > 0 and self.flow_bps * self.n >= self.rate_bps * (1 - 1e-6)

    def queue_delay_s(self):
        if not self.terms.queue or not self.saturated() or self.rate_bps <= 0:
            return 0.0
        return self.queue_bytes() * 8.0 / self.rate_bps

    def one_way_s(self):
        return (self.delay_s if self.terms.propagation else 0.0) + self.queue_delay_s()

    def rtt_s(self):
        return self.delay_s + self.reverse_delay_s + self.queue_delay_s()

    def flow_cap_bps(self):
        if not self.terms.loss_cap or self.loss <= 0:
            return math.inf         # mathis_rate_bps's without loss, the round trip not needed
        return mathis_rate_bps(self.rtt_s(), self.loss)

    def set(self, **changes):
        """A link change (the shaper's keys, emulated), in force from now."""
        self.advance()
        self._queue_bytes = None
        for k, v in changes.items():
            if k == "rate":
                self.rate_bps = float(v)
            elif k == "delay":
                self.delay_s = float(v)
            elif k == "jitter":
                self.jitter_s = float(v)
            elif k == "loss":
                self.loss = float(v)
            elif k == "up":
                self.up = bool(v)
            elif k == "queue":
                self.queue = v
        self._reschedule()

    def link_bps(self):
        return self.rate_bps if self.up else 0.0

    # ---- flows ----
    def open(self, on_done):
        return Flow(on_done, self._jitter_draw())

    def push(self, flow, nbytes, last):
        """`nbytes` more of `flow` are ready to send now (`last`: the transfer's final piece)."""
        self.advance()
        if last:
            flow.last = True
        if flow.active:
            flow.end += nbytes
        else:
            flow.active, flow.end = True, self.served + nbytes
            self.n += 1
            if flow.first_sent is None:
                self._unstarted.append(flow)
        self._seq += 1
        heapq.heappush(self.heap, (flow.end, self._seq, flow))
        self._reschedule()

    def abort(self, flow):
        """`flow`'s sender is gone (a killed worker): what it had not sent is lost."""
        self.advance()
        flow.on_done = lambda *a: None
        if flow.active:
            flow.active = False
            self.n -= 1
            if not self.n:
                self.served = 0.0
        self._reschedule()

    def _jitter_draw(self):
        j = self.jitter_s
        if not self.terms.jitter or j <= 0 or self.rng is None:
            return 0.0
        if self.jitter_dist == "uniform":
            return self.rng.uniform(-j, j)
        if self.jitter_dist == "pareto":
            return j * (self.rng.paretovariate(3.0) - 1.5)   # mean 0, scale ~ jitter
        return self.rng.gauss(0.0, j)

    def advance(self):
        """Bring the counters and every flow's progress up to now."""
        now = self.loop.now()
        dt = now - self.t
        if dt > 0 and self.n and self.flow_bps > 0:
            moved = self.flow_bps * dt / 8.0 * self.payload_share    # payload, per flow
            self.served += moved
            self.tx_bytes += moved * self.n / self.payload_share
        self.t = now

    def _rates(self):
        """Every flow on a link has the same round trip and loss, so the same cap: the max-min
        fair share is min(cap, rate / n) for each (`share` off: min(cap, rate), each as if
        alone). The cap depends on the round trip, which depends on saturation: with loss,
        one more pass."""
        if not self.n:
            self.flow_bps = 0.0
            return
        rate = self.rate_bps if self.up else 0.0
        share = rate / self.n if self.terms.share else rate
        if self.loss <= 0 or not self.terms.loss_cap:
            self.flow_bps = share       # min(inf, share): no cap without loss
            return
        for _ in range(2):
            self.flow_bps = min(self.flow_cap_bps(), share)

    def _reschedule(self):
        self._rates()
        self._gen += 1
        if self.flow_bps <= 0:
            return
        if self._unstarted:
            for f in self._unstarted:
                f.first_sent = self.t
            self._unstarted = []
        heap = self.heap        # stale entries off the top: the flow that drains first
        while heap and (not heap[0][2].active or heap[0][0] != heap[0][2].end):
            heapq.heappop(heap)
        if heap:
            left = heap[0][0] - self.served
            self.loop.at(self.t + (left if left > 0.0 else 0.0) * 8.0
                         / (self.flow_bps * self.payload_share), self._drained, self._gen)

    def _drained(self, gen):
        if gen != self._gen:
            return
        self.advance()
        now, done = self.t, []
        delay = self.one_way_s()    # as the last bytes crossed: before the drained flows leave
        heap, served = self.heap, self.served
        while True:
            while heap and (not heap[0][2].active or heap[0][0] != heap[0][2].end):
                heapq.heappop(heap)     # stale
            if not heap:
                break
            end = heap[0][0]
            # Drained: within a byte's rounding, or less than a nanosecond left to send (a
            # later event could not move the clock: the flow would never drain).
            if end > served + _EPS * (end if end > 1.0 else 1.0) and (
                    self.flow_bps <= 0 or (end - served) * 8.0
                    / (self.flow_bps * self.payload_share) > DRAINED_S):
                break
            f = heapq.heappop(heap)[2]
            f.active = False
            self.n -= 1
            if f.last:
                done.append(f)
        if not self.n:
            self.served = 0.0       # no flow holds a mark: restart the count (precision)
        self._reschedule()
        for f in done:
            f.on_done(f.first_sent + delay, now, now + max(0.0, delay + f.jitter_s))
