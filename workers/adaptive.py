"""Short-timescale threshold control: the paper's bandwidth- and queue-aware routing threshold.

PRFAAS.md: "watch PrfaaS egress utilisation and queue depths; when the link nears saturation or
queues surge, raise t (offload less); when the link idles and PrfaaS has spare compute, lower t".
The paper gives no numbers; these are the testbed's, set in `scheduler.adaptive`:

- egress utilisation = the WAN's measured KV-direction egress over the last `window` divided by
  the link rate in force, both read from the run's own kernel counters (`timeseries.csv`, which
  the runner writes at 20 Hz; the scheduler does not guess it from what it routed);
- PrfaaS queue = seconds of prefill work queued per PrfaaS instance (`Instance.outstanding_s`,
  the router's own book), and its growth over the same `window` (the trend);
- queue pressure = PrfaaS queue over the local prefill queue per instance.

The law (`Control.observe`, pure, unit-tested on synthetic inputs):

- raise t (x(1+step)) only when the PrfaaS queue is *growing* AND either the utilisation is above
  `egress_high` (the link is the cause) or the pressure is above `queue_ratio` (PrfaaS compute is
  the cause). A busy link whose queue drains holds: utilisation alone never raises t.
- lower t (/(1+step)) when the utilisation is below `egress_low`, the PrfaaS queue is not growing,
  the pressure is below 1/`queue_ratio` and local prefill has work PrfaaS could take.
- hysteresis: a raise or lower signal must hold without a break for `dwell` before t moves (a
  single burst does not move it), the egress band [low, high] holds, and t moves at most once per
  `interval`; it stays within [min, max].

It is evaluated at every request the scheduler receives (per request: the request is routed with
the threshold in force after this evaluation) and every `interval` when no request comes. Every
evaluation is a row of `scheduler.csv` in the run directory: time, threshold, utilisation,
backlogs, trend and the reason (`raise:link`, `raise:compute`, `lower:idle`, `dwell:raise`, ...),
so analysis and figures can show each decision.
"""

import asyncio
import collections
import csv
import pathlib

from testbed.records import RunDir
from workers.clock import WALL

COLUMNS = ["time", "threshold", "egress_utilisation", "backlog_remote_s", "backlog_local_s",
           "remote_trend_s", "reason", "trigger"]


def read_last_row(path):
    """The last complete row of a CSV as a dict, reading only the file's tail."""
    p = pathlib.Path(path)
    try:
        with open(p, "rb") as f:
            header = f.readline().decode().strip().split(",")
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = tail.splitlines()
    if not tail.endswith("\n"):
        lines = lines[:-1]          # the writer is mid-line
    for line in reversed(lines[1:] if len(lines) > 1 else []):
        cells = line.split(",")
        if len(cells) == len(header):
            return dict(zip(header, cells))
    return None


class Control:
    """The control law with its memory (windows, dwell, last change); no I/O.

    cfg: a `testbed.runtime.AdaptiveRuntime` (step, egress_high, egress_low, queue_ratio, min,
    max, and window_s, dwell_s, interval_s in the caller's clock: emulated seconds in a run).
    """

    def __init__(self, t, cfg):
        self.t, self.cfg = int(t), cfg
        self.tx = collections.deque()       # (time, cumulative KV egress bytes)
        self.queue = collections.deque()    # (time, PrfaaS backlog s)
        self.pending = None                 # ("raise"|"lower", since)
        self.changed = None                 # time of the last change

    @staticmethod
    def _trim(dq, now, window):
        while len(dq) > 1 and dq[1][0] <= now - window:
            dq.popleft()

    def utilisation(self, now, tx_bytes, link_bps):
        """Egress over the last window / link rate; None until a window's worth is known."""
        if tx_bytes is None or not link_bps or link_bps <= 0:
            return None
        if not self.tx or now > self.tx[-1][0]:
            self.tx.append((now, tx_bytes))
        self._trim(self.tx, now, self.cfg.window_s)
        t0, b0 = self.tx[0]
        if now - t0 <= 0:
            return None
        return (tx_bytes - b0) * 8 / (now - t0) / link_bps

    def trend(self, now, remote_s):
        """Growth of the PrfaaS backlog over the window (seconds of work; > 0: growing)."""
        self.queue.append((now, remote_s))
        self._trim(self.queue, now, self.cfg.window_s)
        return remote_s - self.queue[0][1]

    def signal(self, util, remote_s, local_s, trend):
        """'raise:link' | 'raise:compute' | 'lower:idle' | None, from one set of inputs."""
        c = self.cfg
        pressure = remote_s / local_s if local_s > 0 else (float("inf") if remote_s > 0 else 1.0)
        growing = trend > 0 and remote_s > 0
        if growing and util is not None and util > c.egress_high:
            return "raise:link"
        if growing and pressure > c.queue_ratio:
            return "raise:compute"
        if (util is None or util < c.egress_low) and trend <= 0 and local_s > 0 \
                and pressure < 1.0 / c.queue_ratio:
            return "lower:idle"
        return None

    def observe(self, now, tx_bytes, link_bps, remote_s, local_s):
        """Feed one set of measurements; returns (threshold, utilisation, trend, reason)."""
        c = self.cfg
        util = self.utilisation(now, tx_bytes, link_bps)
        trend = self.trend(now, remote_s)
        sig = self.signal(util, remote_s, local_s, trend)
        if sig is None:
            self.pending = None
            return self.t, util, trend, "hold"
        direction = sig.split(":")[0]
        if self.pending is None or self.pending[0] != direction:
            self.pending = (direction, now)
        if now - self.pending[1] < c.dwell_s:
            return self.t, util, trend, f"dwell:{direction}"
        if self.changed is not None and now - self.changed < c.interval_s:
            return self.t, util, trend, f"wait:{direction}"
        grow = 1.0 + c.step
        t = self.t * grow if direction == "raise" else self.t / grow
        t = int(min(max(t, c.min), c.max))
        if t == self.t:
            return self.t, util, trend, f"bound:{direction}"
        self.t, self.changed = t, now
        return t, util, trend, sig


class ThresholdDecider:
    """One evaluation of the law against the router's own book: the decision part of the
    controller, with no clock and no I/O (the emulation's `ThresholdController` and the
    simulator, testbed/sim/cluster.py, both drive it). Sets `router.threshold`."""

    def __init__(self, router, cfg):
        self.router, self.cfg = router, cfg
        self.law = Control(router.threshold, cfg)

    @staticmethod
    def _backlog(instances):
        up = [i for i in instances if not i.down]
        return sum(i.outstanding_s for i in up) / len(up) if up else 0.0

    def decide(self, now, tx, link_bps):
        """Evaluate at `now` with the KV egress counter `tx` (bytes) and the link rate in force
        (`link_bps`, emulated; None when unknown); returns (old threshold, the row of
        scheduler.csv without its trigger)."""
        remote, local = self._backlog(self.router.remote), self._backlog(self.router.local)
        old = self.router.threshold
        self.law.t = old            # the long timescale may have re-planned it
        t, util, trend, reason = self.law.observe(now, tx, link_bps, remote, local)
        self.router.threshold = t
        return old, [f"{now:.6f}", t, "" if util is None else f"{util:.4f}",
                     f"{remote:.6f}", f"{local:.6f}", f"{trend:.6f}", reason]


class ThresholdController:
    """Drives a `ThresholdDecider` from the run's measurements (timeseries.csv, the wall
    clock) and writes its decisions to scheduler.csv."""

    def __init__(self, router, cfg, run_dir, log, clock=WALL):
        self.router, self.cfg, self.log, self.clock = router, cfg, log, clock
        self.timeseries = RunDir(run_dir).timeseries
        self.decider = ThresholdDecider(router, cfg)
        self.law = self.decider.law
        self.last_eval = 0.0
        self.out = open(RunDir(run_dir).scheduler, "w", newline="", buffering=1)
        self.w = csv.writer(self.out)
        self.w.writerow(COLUMNS)

    def link(self):
        """(cumulative KV egress bytes, link rate in force in emulated bit/s), timeseries.csv
        (`kv_link_bps`: emulated, as the byte counter, so nothing is converted here)."""
        row = read_last_row(self.timeseries)
        try:
            return int(row["kv_tx_bytes"]), float(row["kv_link_bps"])
        except (TypeError, KeyError, ValueError):
            return None, None

    def step(self, trigger="timer"):
        now = self.clock.now()
        self.last_eval = now
        old, row = self.decider.decide(now, *self.link())
        t = self.router.threshold
        if t != old:
            self.log.info("threshold %d -> %d (%s; egress %s, backlog remote %ss local %ss, "
                          "trend %ss)", old, t, row[6], row[2] or "?", row[3], row[4], row[5])
        self.w.writerow([*row, trigger])

    def on_request(self):
        """Per request: evaluate before the request is routed."""
        self.step("request")

    async def run(self):
        try:
            while True:
                await asyncio.sleep(self.cfg.interval_s)
                if self.clock.now() - self.last_eval >= self.cfg.interval_s:
                    self.step()
        finally:
            self.out.close()
