"""Measure: what the kernel counted, sampled while the run goes on; and the run's event log.

`CounterSampler` polls the WAN model's kernel counters (`Wan.stats()`: bytes and packets sent by
each router egress interface, queue backlog, drops, link state, and the configured link rate in
force) at `hz` (default 20 Hz) in a thread and writes `timeseries.csv`. Rates are differences of
kernel byte counters, never what the workers say they sent. Each rate is written twice: emulated
(`*_rate_bps`, `*_link_bps`: what the workers compare with their own byte counts, so they convert
nothing) and real-world (`*_egress_gbps`, `*_link_gbps`: what analysis and plots show), converted
back with the run's `Scale` (`real_rate`, `real_s`). `read_s` is how long the counter read took and
`<dir>_artifact` flags a rate above what the link carries (`testbed.fidelity`).

The run's event log (`events.csv`) is `testbed.records.EventLog`.

`LinkProbes` probes each distinct WAN of one `testbed run` once: the variants of an experiment
usually share one WAN definition, and a variant whose WAN is the same as one already probed
records that probe, marked as shared, instead of measuring it again (docs/link_fidelity.md).
"""

import csv
import json
import threading
import time

from testbed.fidelity import exceeds_link
from testbed.net.linkmodel import DIRECTIONS
from testbed.net.tcp import system_congestion_control


class CounterSampler:
    COLUMNS = ["time", "t_s", "t_real_s"] + [
        f"{d}_{k}" for d in DIRECTIONS for k in (
            "tx_bytes", "tx_packets", "rate_bps", "egress_gbps", "backlog_bytes",
            "backlog_packets", "drops", "up", "link_bps", "link_gbps")] + [
        "read_s"] + [f"{d}_artifact" for d in DIRECTIONS]     # testbed.fidelity

    def __init__(self, wan, path, scale, hz=20.0):
        """`scale`: the run's `testbed.scale.Scale` (real-world columns are converted back).
        Columns: `*_rate_bps` and `*_link_bps` emulated bit/s, `*_egress_gbps` and `*_link_gbps`
        real-world Gbit/s."""
        self.wan = wan
        self.path = path
        self.period = 1.0 / hz
        self.scale = scale
        self.thread = None
        self.stop_event = threading.Event()
        self.first = None
        self.last = None
        self.error = None

    def start(self):
        self.f = open(self.path, "w", newline="", buffering=1)
        self.w = csv.writer(self.f)
        self.w.writerow(self.COLUMNS)
        self.t0 = time.time()
        self.first = self._sample(None)
        self.thread = threading.Thread(target=self._loop, name="counters", daemon=True)
        self.thread.start()
        return self

    def _sample(self, prev):
        now = time.time()
        stats = self.wan.stats()
        read_s = time.time() - now
        row = [f"{now:.6f}", f"{now - self.t0:.6f}", f"{self.scale.real_s(now - self.t0):.6f}"]
        for d in DIRECTIONS:
            s = stats[d]
            rate = 0.0
            if prev is not None:
                dt = now - prev[0]
                rate = (s["tx_bytes"] - prev[1][d]["tx_bytes"]) * 8 / dt if dt > 0 else 0.0
            row += [s["tx_bytes"], s["tx_packets"], f"{rate:.1f}",
                    f"{self.scale.real_rate(rate) / 1e9:.6f}", s["backlog_bytes"],
                    s.get("backlog_packets", 0), s["drops"], int(bool(s["up"])),
                    f"{s.get('rate_bps', 0):.1f}",
                    f"{self.scale.real_rate(s.get('rate_bps', 0)) / 1e9:.6f}"]
        row += [f"{read_s:.6f}"] + [int(self._artifact(prev, now, read_s, stats, d))
                                    for d in DIRECTIONS]
        self.w.writerow(row)
        return (now, stats)

    @staticmethod
    def _artifact(prev, now, read_s, stats, d):
        """This sample's rate is more than the link carries (`fidelity.exceeds_link`)."""
        if prev is None or now <= prev[0]:
            return False
        link = max(stats[d].get("rate_bps", 0), prev[1][d].get("rate_bps", 0))
        rate = (stats[d]["tx_bytes"] - prev[1][d]["tx_bytes"]) * 8 / (now - prev[0])
        return bool(exceeds_link(rate, link, now - prev[0], read_s))

    def _loop(self):
        prev = self.first
        next_t = time.monotonic()
        while not self.stop_event.is_set():
            next_t += self.period
            self.stop_event.wait(max(0.0, next_t - time.monotonic()))
            try:
                prev = self._sample(prev)
            except Exception as e:  # the network may be going away; keep what we have
                self.error = e
                break
            self.last = prev

    def stop(self):
        """Stop sampling; returns kernel byte counts per direction over the sampled span."""
        if self.thread is None:
            return {}
        self.stop_event.set()
        self.thread.join(timeout=2.0)
        try:
            self.last = self._sample(self.last or self.first)
        except Exception as e:
            self.error = self.error or e
        self.f.close()
        self.thread = None
        last = (self.last or self.first)[1]
        first = self.first[1]
        return {d: {k: last[d][k] - first[d][k] for k in ("tx_bytes", "tx_packets", "drops")}
                for d in DIRECTIONS}


# Backends whose probe path is the same in every run with the same WAN (mininet: the two probe
# hosts either side of the WAN router). Elsewhere (ray: the path depends on the placement) every
# run is probed.
SHARED_PROBE_BACKENDS = ("mininet",)


def wan_key(meta):
    """What decides a link probe's result, from a run's metadata as described after the build
    (`backend`, `shaping`: the shaping backend and every link's emulated parameters before any
    scheduled change, `tcp`: congestion control, segmentation offload and TCP timers, and any
    correction of the link's calibration, `link_calibration.corrections_ms`); None
    where the backend's probe path is not the same from run to run."""
    if meta.get("backend") not in SHARED_PROBE_BACKENDS:
        return None
    tcp = meta.get("tcp") or {}
    timers = {k: v for k, v in (tcp.get("timers") or {}).items() if k != "hosts"}
    # a link whose calibration a probe corrected (the link check's) is not a fresh network's
    fixed = (meta.get("link_calibration") or {}).get("corrections_ms")
    return json.dumps({"backend": meta["backend"], "shaping": meta.get("shaping"),
                       "cc": tcp.get("congestion_control_kv"),
                       "segmentation_offload": tcp.get("segmentation_offload"),
                       "timers": timers, "corrections_ms": fixed}, sort_keys=True, default=str)


def wan_meta(kind, desc, congestion_control):
    """The metadata keys of a run that decide its link probe (`wan_key`), from its backend's
    kind, `describe()` and the KV senders' congestion control."""
    return {"backend": kind, "shaping": desc["shaping"],
            "link_calibration": desc.get("link_calibration"),
            "tcp": {"congestion_control_kv": congestion_control,
                    "congestion_control_default": system_congestion_control(),
                    "segmentation_offload": desc["segmentation_offload"],
                    "timers": desc.get("tcp_timers", {})}}


class LinkProbes:
    """The link probes of one `testbed run`, one per distinct WAN (`wan_key`).

    `fidelity(label, meta, probe)` returns the run's `link_fidelity`: the result of `probe()`
    (the backend's measurement) the first time a WAN is seen, the same result for a later run
    with the same WAN. Either is marked: `measured_in` (the run label that measured it),
    `shared` (false in that run, true in the runs that reuse it) and `measured_at`. With
    `enabled` false (`--no-probe`) nothing is measured. `adopt(meta, ...)`: a probe measured
    outside a run (`scale.time: auto`'s link check, on the pilot's network), which the runs
    with that WAN take as a shared one."""

    def __init__(self, enabled=True):
        self.enabled = enabled
        self.done = {}          # wan_key -> (label, measured_at, result)

    def adopt(self, meta, label, measured_at, result):
        """Keep `result` as the probe of `meta`'s WAN, in place of any earlier one: the check
        probes a WAN again after correcting its link's calibration, and the later probe is the
        one that describes the link the runs get."""
        key = wan_key(meta)
        if key is not None:
            self.done[key] = (label, measured_at, result)

    def fidelity(self, label, meta, probe):
        if not self.enabled:
            return {"skipped": "--no-probe"}
        key = wan_key(meta)
        if key is not None and key in self.done:
            first, at, result = self.done[key]
            return {**result, "measured_in": first, "shared": True, "measured_at": at}
        at = time.time()
        result = probe()
        if key is not None:
            self.done[key] = (label, at, result)
        return {**result, "measured_in": label, "shared": False, "measured_at": at}
