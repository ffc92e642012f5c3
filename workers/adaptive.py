"""Short-timescale threshold control: the paper's bandwidth- and queue-aware routing threshold.

PRFAAS.md: "watch PrfaaS egress utilisation and queue depths; when the link nears saturation or
queues surge, raise t (offload less); when the link idles and PrfaaS has spare compute, lower t".
The paper gives no numbers; these are the testbed's, set in `scheduler.adaptive`:

- egress utilisation = the WAN's measured KV-direction egress over the link rate in force, both
  read from the run's own kernel counters (the last row of `timeseries.csv`, which the runner
  writes at 20 Hz; the scheduler does not guess it from what it routed);
- queue pressure = seconds of prefill work queued per PrfaaS instance over the same per local
  prefill instance (`Instance.outstanding_s`, the router's own book).

Every `interval`: if utilisation > `egress_high` or pressure > `queue_ratio`, t grows by `step`
(x(1+step)); if utilisation < `egress_low`, local prefill has work queued and pressure <
1/`queue_ratio`, t shrinks by the same factor; otherwise it holds; t stays within [min, max]. Each decision is appended to `scheduler.csv` in the run
directory (time, threshold, utilisation, backlogs), so analysis and figures can show it.
"""

import asyncio
import csv
import pathlib
import time


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


def decide(t, util, remote_s, local_s, cfg):
    """The next threshold from the current one and the signals (pure; unit-tested).

    util: measured egress / link rate over the last period (None when unknown); remote_s,
    local_s: prefill work queued per PrfaaS / per local prefill instance, in seconds.
    """
    grow = 1.0 + cfg["step"]
    pressure = remote_s / local_s if local_s > 0 else (float("inf") if remote_s > 0 else 1.0)
    if (util is not None and util > cfg["egress_high"]) or pressure > cfg["queue_ratio"]:
        t *= grow
    elif (util is None or util < cfg["egress_low"]) and local_s > 0 \
            and pressure < 1.0 / cfg["queue_ratio"]:
        t /= grow     # only when local prefill has work that PrfaaS could take
    return int(min(max(t, cfg["min"]), cfg["max"]))


class ThresholdController:
    def __init__(self, router, cfg, run_dir, log):
        self.router, self.cfg, self.log = router, cfg, log
        self.timeseries = pathlib.Path(run_dir) / "timeseries.csv"
        self.last = None
        self.out = open(pathlib.Path(run_dir) / "scheduler.csv", "w", newline="", buffering=1)
        self.w = csv.writer(self.out)
        self.w.writerow(["time", "threshold", "egress_utilisation", "backlog_remote_s",
                         "backlog_local_s"])

    def utilisation(self):
        """KV-direction egress over the last period (kernel byte counter difference) divided by
        the link rate in force, from the runner's timeseries.csv."""
        row = read_last_row(self.timeseries)
        try:
            now = (float(row["time"]), int(row["kv_tx_bytes"]))
            link_bps = float(row["kv_link_gbps"]) * self.cfg["link_to_emulated_bps"]
        except (TypeError, KeyError, ValueError):
            return None
        prev, self.last = self.last, now
        if prev is None or now[0] <= prev[0] or link_bps <= 0:
            return None
        return (now[1] - prev[1]) * 8 / (now[0] - prev[0]) / link_bps

    @staticmethod
    def _backlog(instances):
        up = [i for i in instances if not i.down]
        return sum(i.outstanding_s for i in up) / len(up) if up else 0.0

    def step(self):
        util = self.utilisation()
        remote, local = self._backlog(self.router.remote), self._backlog(self.router.local)
        t = decide(self.router.threshold, util, remote, local, self.cfg)
        if t != self.router.threshold:
            self.log.info("threshold %d -> %d (egress %s, backlog remote %.3fs local %.3fs)",
                          self.router.threshold, t,
                          "?" if util is None else f"{util:.2f}", remote, local)
        self.router.threshold = t
        self.w.writerow([f"{time.time():.6f}", t, "" if util is None else f"{util:.4f}",
                         f"{remote:.6f}", f"{local:.6f}"])

    async def run(self):
        try:
            while True:
                await asyncio.sleep(self.cfg["interval_s"])
                self.step()
        finally:
            self.out.close()
